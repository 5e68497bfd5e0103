"""W6 (GPU) benchmark script: its FLOP / byte formulas, its budget skip, and a `--small` CPU run."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_testlib import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "w6_gpu.py"


W6 = load_benchmark("w6_gpu.py", "w6_gpu_under_test")


def _tiny():
    # vocab 10, hidden 8, intermediate 12, 2 layers, 4 heads / 2 KV heads of dim 2, q/k/v biases, tied
    return W6.QWEN2_0_5B.replace(
        vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2
    )


# ---------------------------------------------------------------- formulas (independent arithmetic)
def test_param_count_qwen2_0_5b_and_tiny():
    # the published Qwen2-0.5B parameter count (tied embeddings)
    assert W6.param_count(W6.QWEN2_0_5B) == 494_032_768
    # tiny, by hand: embedding 10*8 = 80; per layer q 8*8 = 64, k and v 8*4 = 32 each, o 64,
    # mlp 3*8*12 = 288, norms 16, biases 8 + 4 + 4 = 16  -> 512; 2 layers = 1024; final norm 8
    assert W6.param_count(_tiny()) == 80 + 1024 + 8
    # untied adds the 8 x 10 head
    assert W6.param_count(_tiny().replace(tie_word_embeddings=False)) == 80 + 1024 + 8 + 80


def test_param_count_matches_init_params():
    import jax

    cfg = _tiny()
    for c in (cfg, cfg.replace(tie_word_embeddings=False), W6.SMALL, W6.QWEN2_0_5B):
        shapes = jax.eval_shape(lambda c=c: W6.M.init_params(jax.random.key(0), c))
        assert sum(x.size for x in jax.tree.leaves(shapes)) == W6.param_count(c)


def test_update_flops_tiny():
    f = W6.update_flops(_tiny(), 3, 5)
    P = 1112.0
    dense = 6.0 * P * 3 * 5  # 6 * params * tokens
    # causal pairs per row 1+2+3+4+5 = 15; per pair and head 2*d (QK^T) + 2*d (PV) = 8 FLOPs forward,
    # x3 with the backward; 2 layers, 4 heads, 3 rows
    attn = 15.0 * 8 * 3 * 2 * 4 * 3
    assert f["params"] == 1112
    assert f["dense_flops"] == pytest.approx(dense, rel=1e-15)
    assert f["attention_flops"] == pytest.approx(attn, rel=1e-15)
    assert f["model_flops"] == pytest.approx(dense + attn, rel=1e-15)
    assert f["attention_flops_executed"] == pytest.approx(25.0 * 8 * 3 * 2 * 4 * 3, rel=1e-15)  # all T*T pairs


def test_update_flops_w6_magnitude():
    f = W6.update_flops(W6.QWEN2_0_5B, 64, 2048)
    assert f["dense_flops"] == pytest.approx(6 * 494_032_768 * 131072, rel=1e-12)
    assert f["attention_flops"] == pytest.approx(12 * 24 * 14 * 64 * 64 * 2048 * 2049 / 2, rel=1e-12)
    assert 0.05 < f["attention_flops"] / f["dense_flops"] < 0.15  # ~9 % at T = 2048


def test_decode_bytes_tiny():
    d = W6.decode_bytes(_tiny(), 3, 4, 6, window_segments=2)
    weights = 1112.0 * 2  # bf16
    per_slot = 2 * 2 * 3 * 2 * 2 * 2.0  # K and V, 2 layers, 3 rows, 2 KV heads, dim 2, bf16
    avg = sum(4 + i + 1 for i in range(6)) / 6  # step i attends over prompt + i + 1 slots = 7.5
    assert avg == 7.5 and d["avg_kv_len"] == pytest.approx(avg, rel=1e-15)
    assert d["weight_bytes"] == weights
    assert d["kv_bytes_per_step"] == pytest.approx(per_slot * avg, rel=1e-15)
    assert d["bytes_per_step"] == pytest.approx(weights + per_slot * avg, rel=1e-15)
    # windows of a 10-slot cache in 2 segments: 8 and 10; steps write slots 4..9 -> 8,8,8,8,10,10
    assert d["avg_window"] == pytest.approx((4 * 8 + 2 * 10) / 6, rel=1e-15)
    assert d["kv_bytes_per_step_windowed"] == pytest.approx(per_slot * 52 / 6, rel=1e-15)


def test_decode_bytes_w6_magnitude():
    d = W6.decode_bytes(W6.QWEN2_0_5B, 256, 512, 512)
    assert d["weight_bytes"] == 2 * 494_032_768
    assert d["kv_bytes_per_step"] == pytest.approx(2 * 24 * 256 * 2 * 64 * 2 * 768.5, rel=1e-12)  # ~2.4 GB


def test_nominal_peaks_only_for_known_devices_and_labelled():
    h200 = W6.nominal_peaks("NVIDIA H200")
    assert h200["nominal_bf16_tflops"] == 989.0 and h200["nominal_hbm_gbps"] == 4800.0
    assert "H200" in h200["nominal_source"] and "not measured" in h200["nominal_source"]
    assert W6.nominal_peaks("NVIDIA H100 80GB HBM3")["nominal_hbm_gbps"] == 3350.0
    assert W6.nominal_peaks("NVIDIA H100 PCIe")["nominal_bf16_tflops"] == 756.0
    assert W6.nominal_peaks("NVIDIA H200", "float32")["nominal_bf16_tflops"] is None  # bf16's figure only
    for kind in ("cpu", "NVIDIA A100-SXM4-80GB", "TPU v5 lite", ""):
        assert set(W6.nominal_peaks(kind).values()) == {None}


def test_a_shorter_budget_scales_the_parts_minimum_times():
    _, full = W6.parse_args([])
    assert (full.min_update_s, full.min_decode_s, full.decode_reserve_s) == (90.0, 60.0, 120.0)
    _, third = W6.parse_args(["--budget-s", "180"])
    assert third.min_update_s == pytest.approx(30.0) and third.decode_reserve_s == pytest.approx(40.0)
    assert third.min_decode_s == pytest.approx(20.0) and third.min_recipe_s == pytest.approx(50.0)
    _, small = W6.parse_args(["--small", "--budget-s", "10"])
    assert small.min_update_s == W6.SMALL_SIZES.min_update_s


def test_parse_update_configs():
    assert W6._parse_update_configs("dots:4, full:8,none:2") == [("dots", 4), ("full", 8), (False, 2)]
    with pytest.raises(SystemExit):
        W6._parse_update_configs("fast:4")


# ---------------------------------------------------------------- budget: parts skipped and recorded
def test_zero_budget_skips_parts_and_records_it(tmp_path):
    out = tmp_path / "w6.jsonl"
    rc = W6.main(["--small", "--budget-s", "0", "--grace-s", "-1", "--parts", "update,decode", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds == ["env", "skipped", "skipped", "summary"]
    assert [r["part"] for r in rows if r["kind"] == "skipped"] == ["update", "decode"]
    assert all("time budget" in r["reason"] for r in rows if r["kind"] == "skipped")
    assert rows[-1]["parts"] == {"update": "skipped", "decode": "skipped"}


def _cpu_env():
    # LLVM optimisation off halves XLA:CPU compile time; the code paths are the same
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


@pytest.mark.slow  # a benchmark's watchdog (~16 s of waiting for it to fire)
def test_watchdog_ends_an_overrunning_part_and_records_it(tmp_path):
    out = tmp_path / "w6.jsonl"
    # a calibration of 10^6 timed 1024^3 matmuls cannot end within budget + grace (16 s from
    # process start) anywhere; the budget leaves room for the imports and the env record on a
    # loaded machine (at 6 s a CI run sharing 2 cores with training runs was aborted before it)
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--small",
            "--budget-s",
            "15",
            "--grace-s",
            "1",
            "--parts",
            "calib,update,decode",
            "--matmul-sizes",
            "1024",
            "--calib-reps",
            "1000000",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=_cpu_env(),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["env", "aborted"]
    assert rows[-1]["part"] == "calib" and 16.0 <= rows[-1]["elapsed_s"] < 30.0


# ---------------------------------------------------------------- the --small run, as a user calls it
def _positive_finite(rec, keys):
    for k in keys:
        v = rec[k]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (rec["kind"], k, v)


@pytest.mark.slow  # ~9 s on idle cores (suite budget): `make test-slow`
def test_small_run_writes_complete_jsonl(tmp_path):
    out = tmp_path / "w6.jsonl"
    env = _cpu_env()
    # the first update config cannot split 4 rows into 3 micro-batches: it must fail, be
    # recorded, and the next one run
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--small",
            "--out",
            str(out),
            "--steps",
            "3",
            "--decode-repeats",
            "2",
            "--update-configs",
            "full:3,dots:2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert proc.stdout.strip().splitlines() == out.read_text().strip().splitlines()
    by = {}
    for r in rows:
        by.setdefault(r["kind"], []).append(r)
        for k in ("workload", "small", "date_utc", "jax", "backend", "device_kind", "elapsed_s"):
            assert k in r, (r["kind"], k)
        assert r["workload"] == "W6" and r["small"] is True and r["backend"] == "cpu"
    assert set(by) == {
        "env",
        "matmul_peak",
        "hbm_bandwidth",
        "calib",
        "update_attempt_failed",
        "policy_update",
        "decode",
        "recipe_iteration",
        "summary",
    }
    assert by["summary"][0]["parts"] == {"calib": "ok", "update": "ok", "decode": "ok", "recipe": "ok"}
    env_rec = by["env"][0]
    assert env_rec["model"]["hidden_size"] == 64 and env_rec["settings"]["batch"] == 4

    failed = by["update_attempt_failed"][0]
    assert failed["remat"] == "full" and failed["num_micro_batches"] == 3 and "divisible" in failed["error"]

    _positive_finite(by["matmul_peak"][0], ["best_tflops", "median_tflops", "best_s"])
    _positive_finite(by["hbm_bandwidth"][0], ["copy_gbps", "read_gbps"])
    # the rates are the work (2 n^3 flops; 8 / 4 bytes per element) over the best / median call
    for mm in by["matmul_peak"]:
        flop = 2.0 * mm["n"] ** 3
        assert mm["best_s"] <= mm["median_s"]
        assert mm["best_tflops"] == pytest.approx(flop / mm["best_s"] / 1e12)
        assert mm["median_tflops"] == pytest.approx(flop / mm["median_s"] / 1e12)
    bw = by["hbm_bandwidth"][0]
    assert bw["copy_bytes"] == 8 * bw["elements"] and bw["read_bytes"] == 4 * bw["elements"]
    assert bw["copy_best_s"] <= bw["copy_median_s"] and bw["read_best_s"] <= bw["read_median_s"]
    assert bw["copy_gbps"] == pytest.approx(bw["copy_bytes"] / bw["copy_best_s"] / 1e9)
    assert bw["read_gbps"] == pytest.approx(bw["read_bytes"] / bw["read_best_s"] / 1e9)

    up = by["policy_update"][0]
    assert up["remat"] == "dots" and up["num_micro_batches"] == 2 and up["steps"] == 3
    assert up["params"] == up["params_in_state"]
    _positive_finite(
        up,
        [
            "tokens_per_s",
            "median_step_s",
            "compile_s",
            "first_step_s",
            "model_flops",
            "attention_flops",
            "achieved_tflops",
            "mfu",
            "measured_peak_tflops",
            "temp_bytes",
        ],
    )
    assert up["tokens_per_s"] == pytest.approx(4 * 128 / up["median_step_s"])
    assert len(up["step_s"]) == 3 and up["median_step_s"] == pytest.approx(float(np.median(up["step_s"])))
    assert up["achieved_tflops"] == pytest.approx(up["model_flops"] / up["median_step_s"] / 1e12)
    assert up["measured_peak_tflops"] == pytest.approx(max(mm["best_tflops"] for mm in by["matmul_peak"]))
    assert up["mfu"] == pytest.approx(up["model_flops"] / up["median_step_s"] / 1e12 / up["measured_peak_tflops"])
    # a CPU has no datasheet figure: the nominal fields are there, and null
    for r in (up, by["matmul_peak"][0], by["hbm_bandwidth"][0]):
        assert r["nominal_bf16_tflops"] is None and r["nominal_hbm_gbps"] is None and r["nominal_source"] is None
    assert up["mfu_vs_nominal"] is None
    assert math.isfinite(up["loss"]) and up["skipped_updates"] == 0

    dec = by["decode"][0]
    assert dec["rounds"] == 2 and dec["trace_counts"] == {"append": 1, "decode": 1}  # no recompilation
    _positive_finite(
        dec,
        [
            "decode_tokens_per_s",
            "decode_step_s",
            "prefill_tokens_per_s",
            "achieved_hbm_gbps",
            "bytes_per_step",
            "weight_bytes",
            "kv_bytes_per_step",
            "fraction_of_measured_read",
            "fraction_of_measured_copy",
            "first_decode_s",
        ],
    )
    assert dec["decode_tokens_per_s"] == pytest.approx(4 * 32 / dec["median_decode_s"])
    # the decode's bandwidth is a fraction of the copy and read peaks measured in this run
    bw = by["hbm_bandwidth"][0]
    assert dec["measured_copy_gbps"] == bw["copy_gbps"] and dec["measured_read_gbps"] == bw["read_gbps"]
    assert dec["fraction_of_measured_copy"] == pytest.approx(dec["achieved_hbm_gbps"] / bw["copy_gbps"])
    assert dec["fraction_of_nominal_hbm"] is None

    # one recipe run through the trainer: 2 iterations of 2 maps x 4 episodes, the tiny model
    rc = by["recipe_iteration"][0]
    assert rc["weights"] == "tiny" and rc["config"] == "configs/smollm2_frozenlake.yaml"
    assert rc["episodes_per_iteration"] == 8 and rc["micro_batches"] == 2 and rc["compute_dtype"] == "bfloat16"
    assert "warm_start=null" in rc["overrides"] and len(rc["iterations"]) == 2
    for it in rc["iterations"]:
        assert it["time_iteration_s"] > 0 and it["time_update_s"] > 0 and it["time_rollout_s"] >= 0
        assert it["time_iteration_s"] >= it["time_update_s"]
    assert rc["last_iteration_s"] == rc["iterations"][-1]["time_iteration_s"]
    assert rc["last_episodes_per_s"] == pytest.approx(8 / rc["last_iteration_s"])
    assert len(dec["decode_s"]) == len(dec["prefill_s"]) == 2
    assert dec["median_decode_s"] == pytest.approx(float(np.median(dec["decode_s"])))
    assert dec["decode_step_s"] == pytest.approx(dec["median_decode_s"] / dec["new_tokens"])
    assert dec["prefill_tokens_per_s"] == pytest.approx(
        dec["decode_batch"] * dec["prompt_len"] / float(np.median(dec["prefill_s"]))
    )
    assert dec["achieved_hbm_gbps"] == pytest.approx(dec["bytes_per_step"] / dec["decode_step_s"] / 1e9)


def test_recipe_overrides_load_as_the_recipe_config(tmp_path):
    """The recipe part's three weight sources give valid configs of the SmolLM2 recipe."""
    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train.config import TrainerConfig

    args, _ = W6.parse_args([])
    assert args.recipe_tasks == 64 and args.recipe_micro_batches == 16 and "recipe" in args.parts
    packaged, kind = W6.recipe_overrides(args, str(tmp_path / "r"), packaged=True)
    assert kind == "packaged"
    cfg = load_config(TrainerConfig, W6.RECIPE_CONFIG, packaged)
    assert cfg.model.path == "SmolLM2-135M-Instruct" and cfg.model.lora.rank == 8
    assert cfg.warm_start.episodes == 0 and cfg.iterations == 2 and cfg.eval.episodes == 0  # no warm start
    assert cfg.env.tasks_per_iteration * cfg.env.group_size == 256 and cfg.update.micro_batches == 16
    assert cfg.model.compute_dtype == "bfloat16"
    random_w, kind = W6.recipe_overrides(args, str(tmp_path / "r"), packaged=False)
    cfg = load_config(TrainerConfig, W6.RECIPE_CONFIG, random_w)
    assert kind == "random" and cfg.model.path is None and cfg.model.tokenizer == "byte"
    # SmolLM2-135M's shapes: 30 layers, hidden 576, 9 heads / 3 KV heads of 64, tied, llama
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.intermediate_size) == (30, 576, 1536)
    assert (cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.head_dim) == (9, 3, 64)
    assert cfg.model.tie_word_embeddings and cfg.model.model_type == "llama" and not cfg.model.qkv_bias
    small, _ = W6.parse_args(["--small"])
    tiny, kind = W6.recipe_overrides(small, str(tmp_path / "r"), packaged=True)
    cfg = load_config(TrainerConfig, W6.RECIPE_CONFIG, tiny)
    assert kind == "tiny" and cfg.model.path is None and cfg.model.num_layers == 2
    assert cfg.env.tasks_per_iteration == 2
