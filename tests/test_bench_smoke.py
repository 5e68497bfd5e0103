"""End-to-end smoke runs of the kernel and environment benchmarks, as a user calls them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, tmp_path, *extra):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_w4_quick_checks_and_reports_every_system(tmp_path):
    rows = _run("w4_advantages.py", tmp_path)
    systems = {(r["kernel"], r["system"], r["method"]) for r in rows}
    assert ("gae", "jaxagent", "scan") in systems and ("grpo", "jaxagent", "jit") in systems
    assert all(r["median_s"] > 0 for r in rows)


@pytest.mark.slow
def test_w5_quick_reports_steps_per_second(tmp_path):
    rows = _run("w5_envpool.py", tmp_path)
    modes = {r["mode"] for r in rows if "steps_per_s" in r}
    assert {"workers=1", "workers=2"} <= modes, modes
    assert all(r["steps_per_s"] > 0 for r in rows if "steps_per_s" in r)
