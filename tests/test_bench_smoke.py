"""End-to-end smoke runs of the kernel and environment benchmarks, as a user calls them."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    for r in rows:
        # the median of the timed calls is at least the fastest; the rates are per median call
        assert 0 < r["min_s"] <= r["median_s"], r
        if "elements_per_s" in r:
            assert r["elements_per_s"] * r["median_s"] == pytest.approx(math.prod(r["shape"]), rel=1e-9), r
        if r.get("bytes_moved") is not None and "gbytes_per_s" in r:
            assert r["gbytes_per_s"] == pytest.approx(r["bytes_moved"] / r["median_s"] / 1e9, rel=1e-9), r


@pytest.mark.slow
def test_w5_quick_reports_steps_per_second(tmp_path):
    rows = _run("w5_envpool.py", tmp_path)
    modes = {r["mode"] for r in rows if "steps_per_s" in r}
    assert {"workers=1", "workers=2"} <= modes, modes
    for r in (r for r in rows if "steps_per_s" in r):
        # median_s is the median of all_s (each rounded to 4 decimals) and steps_per_s the
        # batch's env steps over the unrounded median, within 5e-5 s of median_s
        assert len(r["all_s"]) == r["repeats"] and abs(r["median_s"] - float(np.median(r["all_s"]))) <= 1e-4 + 1e-9, r
        total = r["num_envs"] * r["steps_per_env"]
        assert total / (r["median_s"] + 5e-5) - 0.05 <= r["steps_per_s"], r
        if r["median_s"] > 5e-5:
            assert r["steps_per_s"] <= total / (r["median_s"] - 5e-5) + 0.05, r
        if r["mode"] == "in-process":
            assert r["speedup_vs_in_process"] == 1.0
