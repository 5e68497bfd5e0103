"""Imports point inward: `jaxagent.algos` imports nothing else of the package, and
`jaxagent.parallel` (meshes, rules, hosts) knows nothing of training."""
import json
import subprocess
import sys

import pytest


def loaded_after_import(module: str) -> list[str]:
    code = (f"import sys, json; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jaxagent', 'envs'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module, allowed", [
    ("jaxagent.algos", ("jaxagent", "jaxagent.algos")),
    ("jaxagent.parallel", ("jaxagent", "jaxagent.algos", "jaxagent.models", "jaxagent.parallel")),
    ("jaxagent.models", ("jaxagent", "jaxagent.models")),
])
def test_a_layer_imports_only_the_layers_below_it(module, allowed):
    loaded = loaded_after_import(module)
    assert module in loaded
    outside = [m for m in loaded if not any(m == a or m.startswith(a + ".") for a in allowed)]
    assert outside == [], f"importing {module} loaded {outside}"
