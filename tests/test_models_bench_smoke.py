"""End-to-end smoke run of the W2 model benchmark, as a user calls it (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_w2_model_step_quick_writes_jsonl(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "w2.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "w2_model_step.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    steps = {r["system"]: r for r in rows if r["kind"] == "policy_update"}
    assert set(steps) == {"jax", "torch"}
    # same weights, same batch: both systems compute the same loss before their first update
    assert abs(steps["jax"]["first_loss"] - steps["torch"]["first_loss"]) < 1e-4
    # each throughput is the batch's tokens over the median of its timed steps
    for r in steps.values():
        assert len(r["step_s"]) >= 1 and min(r["step_s"]) > 0
        assert r["median_step_s"] == pytest.approx(float(np.median(r["step_s"])), rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["median_step_s"], rel=1e-12)
    ratio = [r for r in rows if r["kind"] == "ratio" and r["denominator"] == "torch"]
    assert len(ratio) == 1 and ratio[0]["jax_over_torch_tokens_per_s"] == pytest.approx(
        steps["jax"]["tokens_per_s"] / steps["torch"]["tokens_per_s"], rel=1e-9
    )
    mem = [r for r in rows if r["kind"] == "logprob_memory"]
    assert mem and all(r["chunked_temp_bytes"] < r["plain_temp_bytes"] for r in mem)
