"""The one output format of every benchmark: a JSON line per measurement."""

import json
from pathlib import Path


def emit(rec: dict, out: str | None):
    """Print ``rec`` as one JSON line and, with ``out``, append it to that JSONL file."""
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")
