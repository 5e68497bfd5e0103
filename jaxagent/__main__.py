import sys

from jaxagent.cli import main

sys.exit(main())
