"""W11 an update on episodes of uneven length: padded, trimmed batch, trimmed micro-batches.

Workload (benchmarks/README.md, W11): the intake recipe's update (`configs/intake.yaml`
with the long-interview RL command of the README):
  model     Qwen2-shaped, vocab 2048, hidden 128, 4 layers, 4 heads / 2 KV heads (head
            dim 32), intermediate 512, random N(0, 0.02) weights, float32 (1.5 M params).
  batch     one mini-batch of 32 episodes in a context of 1024 tokens, 4 micro-batches of
            8 rows (the recipe: 64 episodes an iteration, 2 mini-batches, 4 micro-batches).
            Episode lengths from `numpy.random.RandomState(0)`: uniform on 256..1024
            tokens (the recipe's episodes at context 1024 ran from about 270 to 1024
            tokens, mean about 500); `--lengths equal` puts every episode at 1024 (nothing
            to trim: the overhead of grouping). Right padding; the policy's tokens are a
            random 30% of each episode's positions; tokens uniform in the vocabulary,
            the padding too (a trimmed step must not depend on it).
  loss      PPO clip 0.2 with dual clip 3, each episode's token mean averaged over
            episodes (`seq-mean-token-mean`), k3 KL to a reference (coefficient 0.2),
            AdamW lr 5e-4, global-norm clip 1.0, one optimizer step per call.
  log-probs the old-policy pass over an iteration's 64 episodes (these 32 twice over),
            in one pass and in chunks of 8 rows.
Systems, each the same update (their first calls' parameters are checked to agree):
  padded          `train_step` on the batch at the full context (`update.trim_padding=0`)
  trimmed-batch   `train_step` on the batch cut to its longest episode rounded up to 64
                  (`update.trim_padding=64`)
  trimmed-chunks  `TrimmedTrainStep`: rows grouped by length, each micro-batch cut to its
                  own longest row rounded up to 64 (`update.trim_chunks=true`)
Timed interleaved (A B C A B C ...), medians of `--repeats` after two warm-up calls each
(the first compiles: `first_call_s`). Figure: seconds per update and the ratio to
trimmed-batch (what the recipe ran before); the same for the log-prob pass.

    python benchmarks/w11_ragged_update.py [--quick] [--repeats 5] [--lengths uniform|equal]
        [--out benchmarks/results/w11_ragged_update.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _jsonl import emit  # noqa: E402
from _timing import time_interleaved  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.placement import policy_logprobs  # noqa: E402
from jaxagent.train.update import train_step
from jaxagent.train.update.batch import UpdateBatch
from jaxagent.train.update.state import init_train_state
from jaxagent.train.update.trimmed import TrimmedTrainStep, length_groups, trimmed_logprobs

MULTIPLE = 64


def make_batch(rows: int, T: int, lengths: np.ndarray, vocab: int, seed: int = 0) -> UpdateBatch:
    r = np.random.RandomState(seed + 1)
    am = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    policy = ((r.rand(rows, T) < 0.3) & (am != 0)).astype(np.float32)
    policy[:, 0] = 0.0
    old = (-np.log(vocab) + 0.1 * r.randn(rows, T)).astype(np.float32)
    return UpdateBatch(
        tokens=jnp.asarray(r.randint(0, vocab, (rows, T)), jnp.int32),
        loss_mask=jnp.asarray(policy),
        advantages=jnp.asarray(np.repeat(r.randn(rows, 1), T, 1).astype(np.float32)),
        old_logp=jnp.asarray(old),
        attention_mask=jnp.asarray(am),
        ref_logp=jnp.asarray(old + 0.05 * r.randn(rows, T).astype(np.float32)),
    )


def trim(batch: UpdateBatch, multiple: int) -> UpdateBatch:
    longest = int(np.max(np.asarray(batch.attention_mask).sum(1)))
    L = min(batch.tokens.shape[1], -(-longest // multiple) * multiple)
    return jax.tree.map(lambda x: x[:, :L], batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 rows of at most 128 tokens, 2 layers")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per system (default 5; 3 with --quick)")
    ap.add_argument("--lengths", choices=("uniform", "equal"), default="uniform")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    rows, T, micro, layers = (8, 128, 4, 2) if args.quick else (32, 1024, 4, 4)
    cfg = M.DecoderConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=512,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        model_type="qwen2",
        qkv_bias=True,
    )
    r = np.random.RandomState(0)
    lengths = (np.full(rows, T) if args.lengths == "equal" else r.randint(T // 4, T + 1, rows)).astype(np.int64)
    batch = make_batch(rows, T, lengths, cfg.vocab_size)
    trimmed = trim(batch, MULTIPLE)
    step_cfg = StepConfig(
        loss=LossConfig(agg_mode="seq-mean-token-mean", kl_coef=0.2, clip_c=3.0),
        optim=OptimizerConfig(lr=5e-4, max_grad_norm=1.0),
        num_micro_batches=micro,
    )
    params = M.init_params(jax.random.key(0), cfg, std=0.02)
    chunked = TrimmedTrainStep(step_cfg, MULTIPLE)
    states, metrics = {}, {}

    def fresh():
        return init_train_state(jax.random.key(0), jax.tree.map(jnp.copy, params), cfg, step_cfg)

    def runner(name, fn, b):
        states[name] = fresh()

        def call():
            states[name], m = fn(states[name], b)
            metrics.setdefault(name, jax.device_get(m))  # the first call's: before any update

        return call

    systems = {
        "padded": runner("padded", lambda s, b: train_step(s, b, step_cfg), batch),
        "trimmed-batch": runner("trimmed-batch", lambda s, b: train_step(s, b, step_cfg), trimmed),
        "trimmed-chunks": runner("trimmed-chunks", chunked, batch),
    }
    first = {}
    for name, call in systems.items():
        t = time.perf_counter()
        call()
        first[name] = time.perf_counter() - t
    after_one = {k: jax.device_get(s.params) for k, s in states.items()}
    diff = {
        k: max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(after_one["padded"]), jax.tree.leaves(v), strict=True)
        )
        for k, v in after_one.items()
    }
    for name, m in metrics.items():  # the same loss and gradient before the first update
        for key in ("loss", "grad_norm", "num_tokens"):
            a, b = float(m[key]), float(metrics["padded"][key])
            if abs(a - b) > 1e-4 * abs(b) + 1e-7:
                raise SystemExit(f"W11: {name}'s first {key} {a} differs from padded's {b}")
    second, times, cpu = time_interleaved(systems, repeats)
    groups = length_groups(lengths, micro, MULTIPLE, T)
    computed = {
        "padded": rows * T,
        "trimmed-batch": rows * trimmed.tokens.shape[1],
        "trimmed-chunks": sum(len(g) * L for g, L in groups),
    }
    base = statistics.median(times["trimmed-batch"])
    common = dict(
        workload="W11",
        rows=rows,
        context=T,
        micro_batches=micro,
        layers=layers,
        lengths=args.lengths,
        mean_length=float(lengths.mean()),
        longest=int(lengths.max()),
        repeats=repeats,
        load_1min=os.getloadavg()[0],
    )
    for name in systems:
        med = statistics.median(times[name])
        emit(
            dict(
                common,
                part="update",
                system=name,
                median_s=round(med, 4),
                min_s=round(min(times[name]), 4),
                all_s=[round(x, 4) for x in times[name]],
                cpu_s=round(statistics.median(cpu[name]), 4),
                first_call_s=round(first[name], 3),
                second_call_s=round(second[name], 3),
                positions_computed=computed[name],
                first_loss=float(metrics[name]["loss"]),
                first_grad_norm=float(metrics[name]["grad_norm"]),
                max_param_diff_vs_padded=diff[name],
                speedup_vs_trimmed_batch=round(base / med, 3),
                micro_lengths=[L for _, L in groups] if name == "trimmed-chunks" else None,
            ),
            args.out,
        )

    # ---- the log-prob pass over an iteration's 2 x rows episodes
    tokens = jnp.concatenate([batch.tokens, batch.tokens])
    am = jnp.concatenate([batch.attention_mask, batch.attention_mask])
    all_lengths = np.concatenate([lengths, lengths])
    chunk = rows // micro
    kw = dict(temperature=1.0, seq_chunk=128, vocab_chunk=8192)

    def lp_batch():
        L = trimmed.tokens.shape[1]
        jax.block_until_ready(
            policy_logprobs(params, cfg, tokens_BxT=tokens[:, :L], attention_mask_BxT=am[:, :L], **kw)
        )

    def lp_chunks():
        jax.block_until_ready(
            trimmed_logprobs(params, cfg, tokens, am, all_lengths, chunk_rows=chunk, multiple=MULTIPLE, **kw)
        )

    lp = {"trimmed-batch": lp_batch, "trimmed-chunks": lp_chunks}
    lp_first = {}
    for name, call in lp.items():
        t = time.perf_counter()
        call()
        lp_first[name] = time.perf_counter() - t
    second, times, cpu = time_interleaved(lp, repeats)
    base = statistics.median(times["trimmed-batch"])
    for name in lp:
        med = statistics.median(times[name])
        emit(
            dict(
                common,
                part="logprobs",
                rows=2 * rows,
                chunk_rows=chunk if name == "trimmed-chunks" else 2 * rows,
                system=name,
                median_s=round(med, 4),
                min_s=round(min(times[name]), 4),
                all_s=[round(x, 4) for x in times[name]],
                cpu_s=round(statistics.median(cpu[name]), 4),
                first_call_s=round(lp_first[name], 3),
                speedup_vs_trimmed_batch=round(base / med, 3),
            ),
            args.out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
