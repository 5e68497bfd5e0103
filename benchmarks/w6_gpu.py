"""W6 (GPU) qwen2-0.5b shapes: policy-update MFU and decode HBM bandwidth on one accelerator.

Workload (benchmarks/README.md, W6): Qwen2-0.5B shapes with random weights in
bfloat16: vocab 151936, hidden 896, 24 layers, 14 heads / 2 KV heads (head dim 64),
intermediate 4864, q/k/v biases, tied embeddings, rope theta 1e6 (weights N(0, 0.02),
norm scales 1, drawn with the 'unsafe_rbg' PRNG: quick to compile). One prepared run,
meant for one NVIDIA GPU in under 10 minutes (`benchmarks/run_w6_gpu.sh` is the
command line; sized on an H200's 141 GB); `--small` runs the same code paths on a tiny
model on CPU (< 60 s). `benchmarks/device_check.py` (`jaxagent bench device`) runs it as
one part of the accelerator check, inside that check's time budget.

Parts, in this order (`--parts`), each in its own try/except and each skipped (with a
`skipped` record) once the time budget (`--budget-s`, default 540) would be exceeded:

calib   The chip's measured peaks, in the same process:
        * matmul: `a @ b` for n x n x n in the update's `--dtype` (bf16 by default; for
          float32, at JAX's default matmul precision, which is what the update runs at),
          n in `--matmul-sizes` (default 8192 and 16384), `--calib-reps` timings of
          `--calib-inner` back-to-back calls; TFLOP/s = 2 n^3 / seconds per call. The
          measured peak = the best timing of any size (the largest rate the chip showed
          on a plain dense matmul).
        * memory bandwidth on a 2^30-element float32 array (4 GiB): "copy" `x + 1`
          (bytes = read + write = 8 n) and "read" `sum(x)` (bytes = 4 n); best timing.
        MFU and the decode's bandwidth are reported against these measured peaks of the
        same process. A datasheet figure is added only where the device kind is one of
        `NOMINAL_PEAKS` (H100, H200) and the dtype bf16, in fields named `nominal_*` /
        `*_vs_nominal` with `nominal_source`; on any other device they are null.
update  Policy update on 64 x 2048 tokens (`--batch`, `--seq`; loss on the tokens after
        `--prompt-len` 512) with `jaxagent.train.update.train_step` (`init_train_state`, an
        `UpdateBatch`; PPO clip 0.2, k3 KL to a reference, beta 0.04, AdamW lr 1e-5,
        global-norm clip 1.0): log-probs through the chunked `jaxagent.models.token_logprobs`
        (never the whole [B, T, 151936] logits). Memory settings (`StepConfig.remat`,
        `num_micro_batches`) are tried in order from `--update-configs`
        ("remat:micro_batches", default "dots:4,full:4,full:8,full:16"): each is compiled
        ahead of time against the state's shapes (timed as `compile_s`), dropped when XLA's
        compiled memory (arguments + outputs - aliased + temporaries) exceeds the device's
        memory limit, else its state is built and run; a failure (OOM) moves on to the next
        one. One warm-up step, then the median of `--steps` timed steps.

          tokens/s   = B T / median step seconds
          model FLOPs per step = 6 P B T + A
            P = all parameters (494,032,768 for Qwen2-0.5B; the tied embedding counted
                once, as the LM-head matmul; norms and biases included, < 0.01 %)
            A = 12 L H d_h B T (T + 1) / 2    attention, causal, forward + backward:
                QK^T and PV are 2 d_h FLOPs each per (query, allowed key) pair and head,
                T (T + 1) / 2 such pairs per row and layer, backward = 2 x forward.
          MFU = model FLOPs / (step seconds x measured matmul peak of the same run, in
                the update's dtype); `mfu_vs_nominal` against the datasheet's dense bf16
                peak only where the device is known (else null).
        Not counted (so MFU, not hardware utilisation): recomputation under remat, the
        masked upper triangle the implementation also computes (`attention_flops_executed`
        = 12 L H d_h B T^2), the softmax / norm / optimizer elementwise work.
decode  Batch 256, 512-token random prompts, 512 new tokens (no early stop), greedy by
        default (`--sampling`), with `jaxagent.rollout.Sampler` (bf16 KV cache of 1024
        slots, its default 3 attention-window segments). Timed separately: prefill
        (`Sampler.append`) and decode (`Sampler.decode`, the on-device loop); the first
        round (compilation) apart, then the median of `--decode-repeats` rounds.

          decode tokens/s = B N / median decode seconds;  step seconds = that / N
          bytes per step  = W + KV
            W  = P x 2            every weight read once (bf16; the tied embedding as LM head)
            KV = 2 L B K d_h x 2 x (S0 + (N + 1) / 2)
                 keys and values (bf16) of every layer, at the average attended length:
                 step i (0-based) attends over S0 + i + 1 slots, S0 = prompt length
          achieved HBM bandwidth = bytes per step / step seconds, against the measured
          "read" and "copy" bandwidths of the same run (`fraction_of_measured_copy`,
          `fraction_of_measured_read`); `fraction_of_nominal_hbm` only on a known device.
        Also recorded, not in the formula: the KV bytes the windowed loop actually reads
        (`kv_bytes_per_step_windowed`: each step reads its whole window) and the float32
        logits written per step (B V x 4 bytes; sampling reads them again).

recipe  Iterations of the SmolLM2 FrozenLake recipe (`configs/smollm2_frozenlake.yaml`: LoRA
        rank 8 on SmolLM2-135M-Instruct, GRPO, the packaged GGUF weights) at a GPU-sized
        batch, through the trainer itself (`jaxagent.train.trainer.Trainer`, as `jaxagent train`
        runs it): no warm start, no evaluation, `--recipe-tasks` maps x 4 episodes an
        iteration (default 64 x 4 = 256 episodes), `--recipe-micro-batches` (default 16),
        compute in `--dtype`. `--recipe-iterations` (default 2): the first compiles; the
        record gives every iteration's phases (rollout, log-probs, update) and episodes/s.
        Where the packaged model is not installed (the device image has no internet), the
        same architecture with random weights and the byte tokenizer stands in
        (`weights: random`: the phases' shapes, not the trained policy's episode lengths).
        `--small`: a tiny model trained from scratch, 2 maps x 4.

Output: JSON lines (one per measurement, `_jsonl.emit`: stdout and appended to `--out`,
flushed per record, so a killed run keeps what it had). Every record carries the jax
version, backend, device kind, UTC date and all settings. Progress goes to stderr.
A watchdog ends the process (after writing an `aborted` record) `--grace-s` seconds after
the budget, should one compilation or step overrun it.

    python benchmarks/w6_gpu.py [--small] [--budget-s 540] [--parts calib,update,decode,recipe]
                                [--out benchmarks/results/w6_gpu.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

_T0 = time.monotonic()  # process start (before importing jax): the budget counts from here when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jsonl import emit  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.rollout import GREEDY, Sampler, SamplingConfig  # noqa: E402
from jaxagent.rollout.kernels import attention_windows  # noqa: E402
from jaxagent.train.config import TrainerConfig  # noqa: E402
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig  # noqa: E402
from jaxagent.train.trainer import Trainer  # noqa: E402
from jaxagent.train.update import train_step  # noqa: E402
from jaxagent.train.update.batch import UpdateBatch  # noqa: E402
from jaxagent.train.update.state import init_train_state  # noqa: E402

#: datasheet figures (dense bf16 TFLOP/s without sparsity, HBM GB/s) by a substring of
#: `device_kind`, most specific first: labelled `nominal_*` in the records, never used for MFU
NOMINAL_PEAKS = (
    ("H200 NVL", 835.0, 4800.0),
    ("H200", 989.0, 4800.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.0, 3350.0),
)


def nominal_peaks(device_kind: str, dtype: str = "bfloat16") -> dict:
    """The datasheet peaks of `device_kind` (`nominal_bf16_tflops`, `nominal_hbm_gbps`,
    `nominal_source`), all None for a device not in `NOMINAL_PEAKS`; the matmul figure
    also None unless `dtype` is bfloat16 (the datasheet's figure is bf16's)."""
    for key, tflops, gbps in NOMINAL_PEAKS:
        if key.lower() in (device_kind or "").lower():
            return {
                "nominal_bf16_tflops": tflops if dtype == "bfloat16" else None,
                "nominal_hbm_gbps": gbps,
                "nominal_source": f"NVIDIA datasheet for {key} (not measured)",
            }
    return {"nominal_bf16_tflops": None, "nominal_hbm_gbps": None, "nominal_source": None}


def _ratio(x, peak):
    return x / peak if peak else None


PARTS = ("calib", "update", "decode", "recipe")
DEFAULT_BUDGET_S = 540.0

QWEN2_0_5B = M.DecoderConfig(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qkv_bias=True,
    model_type="qwen2",
)
SMALL = QWEN2_0_5B.replace(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int
    prompt_len: int
    decode_batch: int
    decode_prompt: int
    decode_new: int
    matmul_sizes: tuple[int, ...]
    bw_elems: int
    update_configs: str
    min_update_s: float  # do not start the update part with less budget left
    min_decode_s: float
    decode_reserve_s: float  # budget the update part leaves for a pending decode part
    recipe_tasks: int = 64
    recipe_micro_batches: int = 16
    min_recipe_s: float = 150.0


FULL_SIZES = Sizes(
    64, 2048, 512, 256, 512, 512, (8192, 16384), 1 << 30, "dots:4,full:4,full:8,full:16", 90.0, 60.0, 120.0
)
SMALL_SIZES = Sizes(4, 128, 32, 4, 32, 32, (256,), 1 << 22, "dots:2", 1.0, 1.0, 0.0, 2, 2, 1.0)


# ============================================================================ formulas
def param_count(cfg: M.DecoderConfig) -> int:
    """All parameters of `init_params(cfg)` (embedding once when tied)."""
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.q_size, cfg.kv_size
    per_layer = D * q + 2 * D * kv + q * D + 3 * D * F + 2 * D
    if cfg.qkv_bias:
        per_layer += q + 2 * kv
    if cfg.o_bias:
        per_layer += D
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    return V * D + L * per_layer + D + (0 if cfg.tie_word_embeddings else D * V)


def update_flops(cfg: M.DecoderConfig, batch: int, seq: int) -> dict:
    """Model FLOPs of one policy update (forward + backward) on `batch` rows of `seq` tokens."""
    P = param_count(cfg)
    L, H, hd = cfg.num_layers, cfg.num_heads, cfg.head_dim
    dense = 6.0 * P * batch * seq
    attn = 12.0 * L * H * hd * batch * seq * (seq + 1) / 2.0
    executed = 12.0 * L * H * hd * batch * seq * seq
    return {
        "params": P,
        "dense_flops": dense,
        "attention_flops": attn,
        "model_flops": dense + attn,
        "attention_flops_executed": executed,
    }


def decode_bytes(
    cfg: M.DecoderConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    param_bytes: int = 2,
    kv_bytes: int = 2,
    window_segments: int | None = None,
) -> dict:
    """HBM bytes one decode step must read: every weight once + the KV cache at the average
    attended length `prompt_len + (new_tokens + 1) / 2`. With `window_segments`, also the KV
    bytes the sampler's windowed loop reads (each step its whole window)."""
    P = param_count(cfg)
    weights = P * param_bytes
    per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * kv_bytes  # K and V, all layers
    avg_len = prompt_len + (new_tokens + 1) / 2.0
    kv = per_slot * avg_len
    out = {
        "params": P,
        "weight_bytes": weights,
        "kv_bytes_per_slot": per_slot,
        "avg_kv_len": avg_len,
        "kv_bytes_per_step": kv,
        "bytes_per_step": weights + kv,
    }
    if window_segments is not None:
        windows = attention_windows(prompt_len + new_tokens, window_segments)
        # step i writes slot prompt_len + i; the loop runs it in the smallest window above that slot
        read = [min(w for w in windows if prompt_len + i < w) for i in range(new_tokens)]
        out["avg_window"] = sum(read) / len(read)
        out["kv_bytes_per_step_windowed"] = per_slot * out["avg_window"]
    return out


# ============================================================================ plumbing
class Recorder:
    """JSON lines with the common fields, a lock (the watchdog writes too) and a stderr log."""

    def __init__(self, out: str | None, common: dict, t0: float | None = None):
        self.out, self.common, self.lock = out, common, threading.Lock()
        self.t0 = time.monotonic() if t0 is None else t0
        self.current = None  # the part running now (for the watchdog's record)

    def emit(self, kind: str, **fields):
        with self.lock:
            emit({**self.common, "kind": kind, "elapsed_s": round(time.monotonic() - self.t0, 2), **fields}, self.out)

    def log(self, msg: str):
        print(f"[w6 +{time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Budget:
    """Wall-clock budget from process start; a watchdog ends the process `grace` s after it."""

    def __init__(self, seconds: float, grace: float, rec: Recorder):
        self.seconds, self.rec = seconds, rec
        self.deadline = rec.t0 + seconds
        if grace >= 0:
            threading.Thread(target=self._watchdog, args=(seconds + grace,), daemon=True).start()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def _watchdog(self, limit: float):
        time.sleep(max(0.0, self.rec.t0 + limit - time.monotonic()))
        try:
            if self.rec.lock.acquire(timeout=5):
                self.rec.lock.release()
            self.rec.emit(
                "aborted",
                part=self.rec.current,
                reason=f"hard time limit: budget {self.seconds}s + grace exceeded "
                "(a compilation or step overran); later parts not run",
            )
            self.rec.log("hard time limit reached: exiting")
        finally:
            os._exit(3)


def _block(x):
    return jax.block_until_ready(x)


def _err(e: BaseException) -> dict:
    msg = f"{type(e).__name__}: {e}"
    oom = any(s in msg for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM", "PredictedOOM"))
    return {"error": msg[:2000], "oom": oom, "traceback": traceback.format_exc()[-3000:]}


def _device_memory_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without stats)
        return None
    return None if not stats else stats.get("bytes_limit")


def _peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def _best_time(fn, args, reps: int, inner: int) -> tuple[float, float]:
    """(best, median) seconds per call over `reps` timings of `inner` back-to-back calls."""
    _block(fn(*args))
    per = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            y = fn(*args)
        _block(y)
        per.append((time.perf_counter() - t) / inner)
        del y
    return min(per), statistics.median(per)


# ============================================================================ parts
def part_calib(args, sizes: Sizes, rec: Recorder, state: dict):
    best = 0.0
    nominal = nominal_peaks(jax.devices()[0].device_kind, args.dtype)
    mm = jax.jit(lambda a, b: a @ b)
    dtype = jnp.dtype(args.dtype)
    for n in sizes.matmul_sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), dtype)
        b = jax.random.normal(kb, (n, n), dtype)
        t_best, t_med = _best_time(mm, (a, b), args.calib_reps, args.calib_inner)
        del a, b
        flop = 2.0 * n**3
        best = max(best, flop / t_best / 1e12)
        rec.emit(
            "matmul_peak",
            n=n,
            dtype=args.dtype,
            best_s=t_best,
            median_s=t_med,
            best_tflops=flop / t_best / 1e12,
            median_tflops=flop / t_med / 1e12,
            fraction_of_nominal=_ratio(flop / t_best / 1e12, nominal["nominal_bf16_tflops"]),
            **nominal,
        )
        rec.log(f"matmul {n}^3 {args.dtype}: best {flop / t_best / 1e12:.1f} TFLOP/s, median {flop / t_med / 1e12:.1f}")
    state["peak_tflops"] = best

    n = sizes.bw_elems
    x = jnp.ones((n,), jnp.float32)
    copy_best, copy_med = _best_time(jax.jit(lambda x: x + 1.0), (x,), args.calib_reps, args.calib_inner)
    read_best, read_med = _best_time(jax.jit(jnp.sum), (x,), args.calib_reps, args.calib_inner)
    del x
    copy_gbps = 8.0 * n / copy_best / 1e9
    read_gbps = 4.0 * n / read_best / 1e9
    state["copy_gbps"], state["read_gbps"] = copy_gbps, read_gbps
    rec.emit(
        "hbm_bandwidth",
        elements=n,
        dtype="float32",
        copy_bytes=8 * n,
        read_bytes=4 * n,
        copy_best_s=copy_best,
        copy_median_s=copy_med,
        read_best_s=read_best,
        read_median_s=read_med,
        copy_gbps=copy_gbps,
        read_gbps=read_gbps,
        copy_fraction_of_nominal=_ratio(copy_gbps, nominal["nominal_hbm_gbps"]),
        read_fraction_of_nominal=_ratio(read_gbps, nominal["nominal_hbm_gbps"]),
        **nominal,
    )
    rec.log(f"bandwidth: copy {copy_gbps:.0f} GB/s (read+write), read {read_gbps:.0f} GB/s")
    rec.emit(
        "calib", measured_peak_tflops=best, matmul_dtype=args.dtype, copy_gbps=copy_gbps, read_gbps=read_gbps, **nominal
    )


def _parse_update_configs(spec: str) -> list[tuple[bool | str, int]]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        remat, _, m = item.partition(":")
        remat = {"none": False, "false": False, "full": "full", "true": "full", "dots": "dots"}.get(remat.lower())
        if remat is None or not m.isdigit() or int(m) < 1:
            raise SystemExit(
                f"--update-configs: bad item {item!r}; want remat:micro_batches, remat in none|full|dots, e.g. dots:4"
            )
        out.append((remat, int(m)))
    if not out:
        raise SystemExit("--update-configs is empty")
    return out


def _update_batch(cfg: M.DecoderConfig, B: int, Tn: int, prompt_len: int) -> UpdateBatch:
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (B, Tn)).astype(np.int32)
    mask = np.broadcast_to((np.arange(Tn) >= prompt_len).astype(np.float32), (B, Tn)).copy()
    adv = np.broadcast_to(rng.randn(B, 1).astype(np.float32), (B, Tn)).copy()
    near = -math.log(cfg.vocab_size)  # random weights: log-probs are near -log V
    old = (near + 0.05 * rng.randn(B, Tn)).astype(np.float32)
    ref = (near + 0.05 * rng.randn(B, Tn)).astype(np.float32)
    return UpdateBatch(
        tokens=jnp.asarray(tokens),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(adv),
        old_logp=jnp.asarray(old),
        ref_logp=jnp.asarray(ref),
    )


def _weights_key(seed: int) -> jax.Array:
    """The key random weights are drawn with: N(0, 0.02) either way, but the 'unsafe_rbg'
    generator compiles in a fraction of threefry's time (seconds of a CPU test)."""
    return jax.random.key(seed, impl="unsafe_rbg")


def _state_builder(cfg, step_cfg, dtype):
    """`build() -> TrainState` (fresh random weights, step 0): jitted it is one compilation
    instead of one dispatch per leaf, and `jax.eval_shape(build)` gives its shapes for free."""

    def build():
        params = M.init_params(_weights_key(0), cfg, dtype=dtype)
        return init_train_state(jax.random.key(0), params, cfg, step_cfg)

    return build


def part_update(args, cfg, sizes: Sizes, rec: Recorder, budget: Budget, state: dict, decode_pending: bool) -> str:
    B, Tn = args.batch, args.seq
    reserve = sizes.decode_reserve_s if decode_pending else 0.0
    flops = update_flops(cfg, B, Tn)
    batch = _update_batch(cfg, B, Tn, args.prompt_len)
    limit = _device_memory_limit()
    nominal = nominal_peaks(jax.devices()[0].device_kind, args.dtype)
    loss = LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3")
    optim = OptimizerConfig(lr=1e-5, max_grad_norm=1.0)
    for remat, micro in _parse_update_configs(args.update_configs):
        setting = {
            "remat": remat if remat else "none",
            "num_micro_batches": micro,
            "micro_batch_rows": B // micro if B % micro == 0 else None,
            "seq_chunk": args.seq_chunk,
            "vocab_chunk": args.vocab_chunk,
        }
        if budget.left() - reserve < sizes.min_update_s:
            rec.emit(
                "skipped",
                part="update",
                **setting,
                reason=f"time budget: {budget.left():.0f}s left, {reserve:.0f}s reserved for decode",
            )
            return "skipped"
        rec.log(f"update: trying remat={setting['remat']} micro_batches={micro}")
        st = compiled = None
        try:
            step_cfg = StepConfig(
                loss=loss,
                optim=optim,
                num_micro_batches=micro,
                remat=remat,
                seq_chunk=args.seq_chunk,
                vocab_chunk=args.vocab_chunk,
            )
            build = _state_builder(cfg, step_cfg, args.dtype)
            # compile against the state's shapes first: a setting that cannot fit is dropped
            # before anything is allocated for it
            t = time.perf_counter()
            compiled = train_step.lower(jax.eval_shape(build), batch, config=step_cfg).compile()
            compile_s = time.perf_counter() - t
            mem = compiled.memory_analysis()
            need = None
            if mem is not None:
                need = (
                    mem.argument_size_in_bytes
                    + mem.output_size_in_bytes
                    - mem.alias_size_in_bytes
                    + mem.temp_size_in_bytes
                )
                setting.update(
                    temp_bytes=mem.temp_size_in_bytes,
                    argument_bytes=mem.argument_size_in_bytes,
                    compiled_need_bytes=need,
                )
            gib = lambda b: "?" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
            rec.log(f"update: compiled in {compile_s:.1f}s; needs {gib(need)} GiB of {gib(limit)} GiB")
            if limit and need and need > limit:
                raise MemoryError(
                    f"PredictedOOM: compiled step needs {need / 2**30:.1f} GiB, the device has {limit / 2**30:.1f} GiB"
                )
            t = time.perf_counter()
            st = _block(jax.jit(build)())
            init_s = time.perf_counter() - t
            n_state = sum(int(x.size) for x in jax.tree.leaves(st.params))
            t = time.perf_counter()
            st, metrics = compiled(st, batch)
            _block((st, metrics))
            first_step_s = time.perf_counter() - t
            times = []
            while len(times) < args.steps:
                if times and budget.left() - reserve < 1.5 * max(times) + 5.0:
                    rec.log("update: stopping early (time budget)")
                    break
                t = time.perf_counter()
                st, metrics = compiled(st, batch)
                _block((st, metrics))
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            peak = state.get("peak_tflops")
            achieved = flops["model_flops"] / med / 1e12
            m = jax.device_get(metrics)
            r = dict(
                **setting,
                batch=B,
                seq=Tn,
                tokens=B * Tn,
                prompt_len=args.prompt_len,
                dtype=args.dtype,
                params_in_state=n_state,
                init_s=init_s,
                compile_s=compile_s,
                first_step_s=first_step_s,
                steps=len(times),
                step_s=times,
                median_step_s=med,
                tokens_per_s=B * Tn / med,
                **flops,
                model_tflop=flops["model_flops"] / 1e12,
                achieved_tflops=achieved,
                measured_peak_tflops=peak,
                mfu=_ratio(achieved, peak),
                mfu_vs_nominal=_ratio(achieved, nominal["nominal_bf16_tflops"]),
                **nominal,
                peak_bytes_in_use=_peak_bytes(),
                device_memory_limit=limit,
                loss=float(m["loss"]),
                grad_norm=float(m["grad_norm"]),
                skipped_updates=float(m["skipped"]),
            )
            rec.emit("policy_update", **r)
            rec.log(
                f"update: {B * Tn / med:.0f} tokens/s, step {med:.3f}s, {achieved:.1f} TFLOP/s, "
                f"MFU {r['mfu'] if r['mfu'] is None else round(r['mfu'], 4)} (of the measured peak)"
            )
            return "ok"
        except Exception as e:  # noqa: BLE001  (an OOM here must not lose the other parts)
            info = _err(e)
            rec.emit("update_attempt_failed", **setting, **info)
            rec.log(f"update: remat={setting['remat']} micro={micro} failed: {info['error'][:300]}")
        finally:
            del st, compiled
            gc.collect()
    return "failed"


def part_decode(args, cfg, rec: Recorder, budget: Budget, state: dict) -> str:
    B, P, N = args.decode_batch, args.decode_prompt, args.decode_new
    sampling = GREEDY if args.sampling == "greedy" else SamplingConfig(temperature=1.0)
    itemsize = jnp.dtype(args.dtype).itemsize  # the weights and the KV cache are in --dtype
    est = decode_bytes(cfg, B, P, N, param_bytes=itemsize, kv_bytes=itemsize, window_segments=args.window_segments)
    nominal = nominal_peaks(jax.devices()[0].device_kind, args.dtype)
    params = jax.jit(lambda k: M.init_params(k, cfg, dtype=args.dtype))(_weights_key(1))
    sampler = Sampler(params, cfg, max_len=P + N, min_bucket=P, window_segments=args.window_segments)
    prompts = np.random.RandomState(1).randint(0, cfg.vocab_size, (B, P)).tolist()
    rounds = []
    for r in range(1 + args.decode_repeats):
        if r >= 2 and budget.left() < 1.5 * (rounds[-1]["prefill_s"] + rounds[-1]["decode_s"]) + 5.0:
            rec.log("decode: stopping early (time budget)")
            break
        st = _block(sampler.init_state(B, seed=r))
        t = time.perf_counter()
        st = _block(sampler.append(st, prompts))
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        st, gen = sampler.decode(st, max_new_tokens=N, sampling=sampling)
        _block((st, gen))
        decode_s = time.perf_counter() - t
        num = np.asarray(gen.num_tokens_B)
        if not np.all(num == N):
            raise RuntimeError(f"decode produced {num.min()}..{num.max()} tokens per row, expected {N}")
        rounds.append({"prefill_s": prefill_s, "decode_s": decode_s})
        rec.log(f"decode round {r}{' (compile)' if r == 0 else ''}: prefill {prefill_s:.3f}s, decode {decode_s:.3f}s")
        del st, gen
    timed = rounds[1:]
    if not timed:
        raise RuntimeError("no timed decode round (time budget)")
    dec = statistics.median(x["decode_s"] for x in timed)
    pre = statistics.median(x["prefill_s"] for x in timed)
    step = dec / N
    gbps = est["bytes_per_step"] / step / 1e9
    r = dict(
        decode_batch=B,
        prompt_len=P,
        new_tokens=N,
        max_len=P + N,
        sampling=args.sampling,
        window_segments=args.window_segments,
        dtype=args.dtype,
        kv_dtype=args.dtype,
        first_prefill_s=rounds[0]["prefill_s"],
        first_decode_s=rounds[0]["decode_s"],
        compile_s_est=(rounds[0]["prefill_s"] + rounds[0]["decode_s"]) - (pre + dec),
        rounds=len(timed),
        prefill_s=[x["prefill_s"] for x in timed],
        decode_s=[x["decode_s"] for x in timed],
        median_prefill_s=pre,
        median_decode_s=dec,
        decode_step_s=step,
        decode_tokens_per_s=B * N / dec,
        prefill_tokens_per_s=B * P / pre,
        end_to_end_tokens_per_s=B * N / (pre + dec),
        **est,
        logits_bytes_per_step=B * cfg.vocab_size * 4,
        achieved_hbm_gbps=gbps,
        achieved_hbm_gbps_windowed=(est["weight_bytes"] + est["kv_bytes_per_step_windowed"]) / step / 1e9,
        measured_read_gbps=state.get("read_gbps"),
        measured_copy_gbps=state.get("copy_gbps"),
        fraction_of_measured_read=_ratio(gbps, state.get("read_gbps")),
        fraction_of_measured_copy=_ratio(gbps, state.get("copy_gbps")),
        fraction_of_nominal_hbm=_ratio(gbps, nominal["nominal_hbm_gbps"]),
        **nominal,
        peak_bytes_in_use=_peak_bytes(),
        trace_counts=dict(sampler.trace_counts),
    )
    rec.emit("decode", **r)
    frac = r["fraction_of_measured_copy"]
    rec.log(
        f"decode: {B * N / dec:.0f} tokens/s, step {step * 1e3:.3f} ms, {gbps:.0f} GB/s "
        f"({'?' if frac is None else f'{frac:.3f}'} of the measured copy bandwidth)"
    )
    return "ok"


RECIPE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_frozenlake.yaml"
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    qkv_bias=False,
    tie_word_embeddings=True,
    model_type="llama",
)


def recipe_overrides(args, run_dir: str, packaged: bool) -> tuple[list[str], str]:
    """The overrides of the recipe part and what weights it runs (`packaged`, `random`, `tiny`)."""
    out = [
        f"run_dir={run_dir}",
        "warm_start=null",
        f"iterations={args.recipe_iterations}",
        "eval.episodes=0",
        "eval.every=0",
        f"env.tasks_per_iteration={args.recipe_tasks}",
        f"update.micro_batches={args.recipe_micro_batches}",
        f"checkpoint_every={args.recipe_iterations + 1}",
        "logging.tensorboard=false",
    ]
    if args.dtype == "bfloat16":
        out.append("model.compute_dtype=bfloat16")
    if args.small:
        return out + [
            "model.path=null",
            "model.tokenizer=byte",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.head_dim=8",
            "rollout.max_tokens_per_turn=8",
            "env.group_size=4",
        ], "tiny"
    if packaged:
        return out, "packaged"
    return out + ["model.path=null", "model.tokenizer=byte"] + [
        f"model.{k}={v}" for k, v in SMOLLM2_135M.items()
    ], "random"


def part_recipe(args, rec: Recorder, state: dict) -> str:
    import tempfile

    from jaxagent.dataclass_yaml import load_config
    from jaxagent.models.hf import packaged_model_path

    try:
        packaged_model_path("SmolLM2-135M-Instruct")
        packaged = True
    except Exception:  # noqa: BLE001  (not installed: the random-weight stand-in)
        packaged = False
    with tempfile.TemporaryDirectory(prefix="w6_recipe_") as tmp:
        overrides, weights = recipe_overrides(args, str(Path(tmp) / "run"), packaged)
        config = load_config(TrainerConfig, RECIPE_CONFIG, overrides)
        t = time.perf_counter()
        trainer = Trainer(config, log=rec.log)
        build_s = time.perf_counter() - t
        history = trainer.run()
    keys = ("time_rollout_s", "time_logprobs_s", "time_advantages_s", "time_update_s", "time_iteration_s")
    its = [
        {
            k: h.get(k)
            for k in keys
            + ("episodes", "policy_tokens", "episode_tokens_mean", "reward_mean", "success_rate", "tokens_per_s")
        }
        for h in history
    ]
    episodes = config.env.tasks_per_iteration * config.env.group_size
    last = history[-1]
    r = dict(
        config=str(RECIPE_CONFIG.relative_to(RECIPE_CONFIG.parents[1])),
        overrides=overrides,
        weights=weights,
        episodes_per_iteration=episodes,
        micro_batches=config.update.micro_batches,
        compute_dtype=config.model.compute_dtype,
        build_s=build_s,
        iterations=its,
        last_iteration_s=last.get("time_iteration_s"),
        last_episodes_per_s=episodes / last["time_iteration_s"] if last.get("time_iteration_s") else None,
        peak_bytes_in_use=_peak_bytes(),
    )
    rec.emit("recipe_iteration", **r)
    rec.log(
        f"recipe ({weights} weights): {episodes} episodes an iteration; last iteration "
        f"{last.get('time_iteration_s', float('nan')):.1f}s (rollout {last.get('time_rollout_s', float('nan')):.1f}s, "
        f"update {last.get('time_update_s', float('nan')):.1f}s)"
    )
    return "ok"


# ============================================================================ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny model and sizes, same code paths (CPU test, < 60 s)")
    ap.add_argument("--out", default="benchmarks/results/w6_gpu.jsonl", help="append JSON lines here ('' = none)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="skip the parts that would exceed this (a shorter budget scales the parts' minimum times down with it)",
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="the watchdog ends the process this long after the budget (negative = no watchdog)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of calib,update,decode")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g = ap.add_argument_group("update (defaults: the W6 sizes, or the --small ones)")
    g.add_argument("--batch", type=int)
    g.add_argument("--seq", type=int)
    g.add_argument("--prompt-len", type=int, help="tokens without loss at the start of each row")
    g.add_argument("--update-configs", help="remat:micro_batches list tried in order, e.g. dots:4,full:8")
    g.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    g.add_argument("--seq-chunk", type=int, default=128)
    g.add_argument("--vocab-chunk", type=int, default=8192)
    g = ap.add_argument_group("decode")
    g.add_argument("--decode-batch", type=int)
    g.add_argument("--decode-prompt", type=int)
    g.add_argument("--decode-new", type=int)
    g.add_argument("--decode-repeats", type=int, default=3, help="timed rounds after the compiling one")
    g.add_argument("--sampling", default="greedy", choices=("greedy", "temperature"))
    g.add_argument("--window-segments", type=int, default=3, help="Sampler's attention-window segments")
    g = ap.add_argument_group("recipe (defaults: the W6 sizes, or the --small ones)")
    g.add_argument("--recipe-tasks", type=int, help="maps an iteration (4 episodes each)")
    g.add_argument("--recipe-micro-batches", type=int, help="the update's micro-batches")
    g.add_argument("--recipe-iterations", type=int, default=2, help="RL iterations (the first compiles)")
    g = ap.add_argument_group("calibration")
    g.add_argument("--matmul-sizes", help="comma list of n for the n^3 bf16 matmul")
    g.add_argument("--bw-elems", type=int, help="float32 elements of the bandwidth array")
    g.add_argument("--calib-reps", type=int, default=5)
    g.add_argument("--calib-inner", type=int, default=10)
    args = ap.parse_args(argv)
    sizes = SMALL_SIZES if args.small else FULL_SIZES
    for name in (
        "batch",
        "seq",
        "prompt_len",
        "decode_batch",
        "decode_prompt",
        "decode_new",
        "bw_elems",
        "update_configs",
        "recipe_tasks",
        "recipe_micro_batches",
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(sizes, name))
    args.matmul_sizes = tuple(int(s) for s in args.matmul_sizes.split(",")) if args.matmul_sizes else sizes.matmul_sizes
    sizes = dataclasses.replace(sizes, matmul_sizes=args.matmul_sizes, bw_elems=args.bw_elems)
    if not args.small and args.budget_s < DEFAULT_BUDGET_S:
        # a shorter budget (the device check gives W6 a share of its 8 minutes): the parts'
        # minimum times and the update's reserve for the decode shrink with it, so each
        # part is still tried rather than skipped outright
        f = max(args.budget_s, 0.0) / DEFAULT_BUDGET_S
        sizes = dataclasses.replace(
            sizes,
            min_update_s=sizes.min_update_s * f,
            min_decode_s=sizes.min_decode_s * f,
            decode_reserve_s=sizes.decode_reserve_s * f,
            min_recipe_s=sizes.min_recipe_s * f,
        )
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {list(PARTS)}")
    _parse_update_configs(args.update_configs)
    return args, sizes


def main(argv=None, t0: float | None = None):
    """Run the benchmark; `t0` (a `time.monotonic()` reading) is when the budget started (default now)."""
    args, sizes = parse_args(argv)
    cfg = SMALL if args.small else QWEN2_0_5B
    dev = jax.devices()[0]
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "lora"}
    common = {
        "workload": "W6",
        "small": args.small,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
    }
    rec = Recorder(args.out or None, common, t0)
    budget = Budget(args.budget_s, args.grace_s, rec)
    rec.emit(
        "env",
        settings=settings,
        model=model,
        params=param_count(cfg),
        host=platform.node(),
        python=platform.python_version(),
        xla_flags=os.environ.get("XLA_FLAGS"),
        mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        device_memory_limit=_device_memory_limit(),
        devices=[str(d) for d in jax.devices()],
    )
    rec.log(
        f"jax {jax.__version__} on {jax.default_backend()} ({dev.device_kind}); parts {args.parts}; "
        f"budget {args.budget_s:.0f}s"
    )
    state: dict = {}
    status = {}
    for part in args.parts:
        need = {"calib": 1.0, "update": sizes.min_update_s, "decode": sizes.min_decode_s, "recipe": sizes.min_recipe_s}[
            part
        ]
        if budget.left() < need:
            status[part] = "skipped"
            rec.emit("skipped", part=part, reason=f"time budget: {budget.left():.0f}s left, need {need:.0f}s")
            rec.log(f"{part}: skipped (time budget)")
            continue
        rec.log(f"{part}: start")
        rec.current = part
        try:
            if part == "calib":
                part_calib(args, sizes, rec, state)
                status[part] = "ok"
            elif part == "update":
                status[part] = part_update(
                    args,
                    cfg,
                    sizes,
                    rec,
                    budget,
                    state,
                    decode_pending="decode" in args.parts[args.parts.index(part) :],
                )
            elif part == "decode":
                status[part] = part_decode(args, cfg, rec, budget, state)
            else:
                status[part] = part_recipe(args, rec, state)
        except Exception as e:  # noqa: BLE001  (one part's failure must not lose the others)
            status[part] = "failed"
            info = _err(e)
            rec.emit("part_failed", part=part, **info)
            rec.log(f"{part}: failed: {info['error'][:300]}")
        gc.collect()
    rec.emit("summary", parts=status, total_s=round(time.monotonic() - rec.t0, 2))
    rec.log(f"done: {status}")
    return 1 if "failed" in status.values() else 0


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main(t0=_T0))
