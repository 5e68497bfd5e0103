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
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
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


@pytest.mark.slow
def test_w11_quick_checks_the_systems_agree_and_reports_every_one(tmp_path):
    """W11 runs its three updates and two log-prob passes, after checking their first
    losses and gradient norms agree (the script exits non-zero otherwise)."""
    rows = _run("w11_ragged_update.py", tmp_path, "--repeats", "2")
    got = {(r["part"], r["system"]) for r in rows}
    assert got == {
        ("update", "padded"),
        ("update", "trimmed-batch"),
        ("update", "trimmed-chunks"),
        ("logprobs", "trimmed-batch"),
        ("logprobs", "trimmed-chunks"),
    }
    update = {r["system"]: r for r in rows if r["part"] == "update"}
    for r in update.values():
        assert r["first_loss"] == pytest.approx(update["padded"]["first_loss"], rel=1e-4, abs=1e-7)
        assert 0 < r["min_s"] <= r["median_s"] and len(r["all_s"]) == 2
    chunks = update["trimmed-chunks"]
    # the micro-batch lengths are multiples of 64 up to the context, and fewer positions are computed
    assert all(L % 64 == 0 and L <= r["context"] for L in chunks["micro_lengths"])
    assert chunks["positions_computed"] == 2 * sum(chunks["micro_lengths"])  # 8 rows in 4 micro-batches of 2
    assert chunks["positions_computed"] <= update["trimmed-batch"]["positions_computed"] <= 8 * 128
