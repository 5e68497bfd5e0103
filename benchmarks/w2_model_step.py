"""W2 policy update (tiny-qwen2): forward + backward + AdamW, JAX vs PyTorch vs Tunix, one run.

Workload (benchmarks/README.md, W2): Qwen2 vocab 4096, hidden 256, 4 layers,
4 heads / 2 KV heads (head dim 64), intermediate 1024, untied, random N(0, 0.02)
weights (q/k/v biases too), float32. Batch 32 x 192 tokens (64 prompt + 128
completion, loss on the completion), one advantage per sequence, GRPO/PPO clip 0.2,
k3 KL to a frozen reference (beta 0.04), AdamW lr 1e-5, global-norm clip 1.0, one
optimizer step. The rollout and reference log-probs are inputs (computed before the
update, as trainers do). Figure: trained tokens/s = 32 * 192 / median step seconds.

Systems (`--systems`, default jax,torch), same weights and batch, timed interleaved
(A B C A B C ...), medians of `--repeats` after two warm-up calls each (their times are
`first_call_s`, `second_call_s`; `first_loss` is the loss of that call, before any update,
so it must agree across systems):
  jax    jaxagent.models: scan over layers, chunked log-probs from hidden states,
         optax adamw, one jitted step with donated params / optimizer state.
  torch  transformers Qwen2ForCausalLM (PyTorch CPU, sdpa attention), log_softmax over
         the completion logits, torch.optim.AdamW + clip_grad_norm_.
  tunix  Tunix's (google-tunix) GRPO update as its learner runs it: its Qwen2 model
         loaded from the same weights (safetensors), `GRPOConfig(beta=0.04, epsilon=0.2,
         kl_loss_mode="low_var_kl")`, the registered "grpo" policy loss
         (`tunix.rl.algo_core.grpo_loss_fn`) installed on a `tunix.rl.trainer.Trainer`
         with `with_loss_fn` / `with_gen_model_input_fn` exactly as `GRPOLearner` does, and
         the trainer's own jitted step (`jit_train_and_eval_step`: nnx.value_and_grad, then
         `nnx.Optimizer.update`, optimizer donated) with optax clip_by_global_norm(1.0) +
         adamw(1e-5), called on a `TrainExample` holding the batch.
         What differs from the exact workload, because of Tunix's API:
         - loss aggregation "token-mean" (Tunix's default is sequence-mean-token-mean);
           with W2's full completion mask both equal the other systems' token mean.
         - Tunix's loss always computes the per-token entropy of the completion logits
           (a diagnostic, not in the loss) and materialises the full [B, 128, V] logits,
           and it clamps the log-ratio to +-20 (inactive here): that is its code path,
           so it is timed as is.
         - it builds positions and a [B, T, T] causal attention mask from a pad id each
           step (`process_ids`); the pad id is set outside the vocabulary so no token is
           masked, as in W1.
         - the learner's host loop around the step (metrics buffering, perf spans,
           input sharding on a one-device mesh) is not timed: only the jitted step.

Shared machines are noisy: each row records the 1-minute load average and the median
process CPU seconds per step next to the wall-clock median.

Also printed: the step's model FLOPs (2 * matmul params * tokens for the trunk, the
lm_head on the completion, and QK^T / PV attention, times 3 for forward + backward),
achieved GFLOP/s against a 2048^3 fp32 matmul measured in the same run (and against
the machine's nominal ~118 GFLOP/s), and the compiled temporary memory of plain vs
chunked log-probs (forward + backward) at W2 and at a Qwen2-0.5B-like vocabulary.

    python benchmarks/w2_model_step.py [--quick] [--one-cpu] [--repeats 5] [--systems jax,torch,tunix]
        [--out benchmarks/results/w2_model_step.jsonl]

A peer that is not installed is reported as a `{"kind": "skipped", ...}` line.
Ratio lines: `jax_over_torch_tokens_per_s`, `jax_over_tunix_tokens_per_s`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--one-cpu" in sys.argv:  # before jax / torch start their thread pools
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _timing import matmul_peak_gflops, time_interleaved  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.models.hf import hf_tensors_from_params  # noqa: E402

NOMINAL_PEAK_GFLOPS = 118.0
W2 = M.DecoderConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qkv_bias=True,
    model_type="qwen2",
)
PROMPT, COMPLETION = 64, 128
CLIP, BETA, LR = 0.2, 0.04, 1e-5
SYSTEMS = ("jax", "torch", "tunix")


def model_flops(cfg: M.DecoderConfig, B: int, T: int, n_loss: int) -> float:
    D = cfg.hidden_size
    per_layer = D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 3 * D * cfg.intermediate_size
    trunk = 2 * per_layer * cfg.num_layers * B * T
    attn = 2 * 2 * B * cfg.num_heads * T * T * cfg.head_dim * cfg.num_layers
    head = 2 * D * cfg.vocab_size * B * n_loss
    return 3.0 * (trunk + attn + head)


def make_batch(B: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    T = PROMPT + COMPLETION
    tokens = rng.randint(0, W2.vocab_size, (B, T)).astype(np.int32)
    adv = rng.randn(B).astype(np.float32)
    mask = np.ones((B, COMPLETION), np.float32)
    # rollout / reference log-probs near the current policy's (-log V ~ -8.3)
    old_logp = (-np.log(W2.vocab_size) + 0.05 * rng.randn(B, COMPLETION)).astype(np.float32)
    ref_logp = (-np.log(W2.vocab_size) + 0.05 * rng.randn(B, COMPLETION)).astype(np.float32)
    return tokens, adv, mask, old_logp, ref_logp


# ---------------------------------------------------------------- JAX
def jax_step_fn(cfg: M.DecoderConfig, tx):
    def loss_fn(params, tokens, adv, mask, old_logp, ref_logp):
        hidden = M.forward_hidden(params, cfg, tokens)
        logp, _ = M.chunked_logprobs_and_entropy(
            hidden[:, PROMPT - 1 : -1],
            M.lm_head_kernel(params, cfg),
            tokens[:, PROMPT:],
            seq_chunk=64,
            vocab_chunk=4096,
        )
        ratio = jnp.exp(logp - old_logp)
        a = adv[:, None]
        pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * a)
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        return jnp.sum((pg + BETA * kl) * mask) / jnp.sum(mask)

    def step(params, opt_state, tokens, adv, mask, old_logp, ref_logp):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, adv, mask, old_logp, ref_logp)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnames=("params", "opt_state"))


# ---------------------------------------------------------------- PyTorch
def torch_setup(params, cfg):
    import torch
    import transformers

    hf = transformers.Qwen2ForCausalLM(cfg.to_hf())
    state = {k: torch.from_numpy(np.array(v)) for k, v in hf_tensors_from_params(params, cfg).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR)

    def step(tokens, adv, mask, old_logp, ref_logp):
        logits = hf(input_ids=tokens, logits_to_keep=COMPLETION + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, PROMPT:, None])[..., 0]
        ratio = torch.exp(logp - old_logp)
        a = adv[:, None]
        pg = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * a)
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        loss = ((pg + BETA * kl) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    return step


# ---------------------------------------------------------------- Tunix
def tunix_setup(params, cfg: M.DecoderConfig, tmp: Path):
    """`step(example) -> loss`: Tunix's GRPO actor update (see the module docstring)."""
    from tunix.models.qwen2 import model as tmodel
    from tunix.models.qwen2 import params as tparams
    from tunix.rl import (
        algo_core,  # noqa: F401  (registers the "grpo" policy loss)
        function_registry,
    )
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    M.save_pretrained(M.Model(params, cfg), tmp / "w2", overwrite=True)
    tcfg = tmodel.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_word_embeddings,
    )
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    model = tparams.create_model_from_safe_tensors(str(tmp / "w2"), tcfg, mesh=mesh, dtype=jnp.float32)

    algo = grpo_learner.GRPOConfig(
        num_generations=2, beta=BETA, epsilon=CLIP, kl_loss_mode="low_var_kl", loss_agg_mode="token-mean"
    )
    algo.temperature = 1.0  # GRPOLearner sets it from the rollout config
    pad_id, eos_id = cfg.vocab_size, cfg.vocab_size + 1  # outside the vocabulary: nothing is masked
    policy_loss_fn = function_registry.get_policy_loss_fn(algo.policy_loss_fn)

    def loss_fn(model, train_example, algo_config):  # as GRPOLearner.__init__ builds it
        return policy_loss_fn(model, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id)

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))
    trainer = rl_trainer.Trainer(
        model, tx, peft_trainer.TrainingConfig(eval_every_n_steps=10**9), custom_checkpoint_metadata_fn=dict
    )
    trainer.with_loss_fn(loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

    def step(example):
        loss, _aux, _grad_norm = train_step(example)
        return float(jax.block_until_ready(loss))

    return step, grpo_learner.TrainExample


def tunix_example(example_cls, tokens, adv, mask, old_logp, ref_logp):
    t = jnp.asarray(tokens)
    return example_cls(
        prompt_ids=t[:, :PROMPT],
        prompt_mask=jnp.ones((t.shape[0], PROMPT), jnp.int32),
        completion_ids=t[:, PROMPT:],
        completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(adv),
        ref_per_token_logps=jnp.asarray(ref_logp),
        old_per_token_logps=jnp.asarray(old_logp),
    )


def logprob_memory(B, T, D, V, seq_chunk, vocab_chunk):
    """Compiled temp bytes of grad(sum logp + sum entropy) w.r.t. (hidden, kernel)."""
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    y = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def grad_of(fn):
        def loss(h, w, y):
            lp, ent = fn(h, w, y)
            return jnp.sum(lp) + jnp.sum(ent)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    plain = grad_of(M.plain_logprobs_and_entropy)
    chunked = grad_of(
        lambda h, w, y: M.chunked_logprobs_and_entropy(h, w, y, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
    )
    out = {}
    for name, f in (("plain", plain), ("chunked", chunked)):
        out[name] = f.lower(h, w, y).compile().memory_analysis().temp_size_in_bytes
    return out


def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"w2_model_step: unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 2, 3 repeats, W2 memory row only: a smoke run")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    ap.add_argument("--systems", default="jax,torch", help=f"comma list of {', '.join(SYSTEMS)} (default jax,torch)")
    ap.add_argument("--no-torch", action="store_true", help="drop torch from --systems")
    ap.add_argument(
        "--one-cpu",
        action="store_true",
        help="pin the process to one CPU (torch and XLA single-core): less sensitive to busy neighbours",
    )
    args = ap.parse_args(argv)
    wanted = parse_systems(args.systems)
    if args.no_torch and "torch" in wanted:
        wanted.remove("torch")
    if "jax" not in wanted:
        raise SystemExit("w2_model_step: --systems must include jax (the ratios are against it)")
    B = args.batch or (2 if args.quick else 32)
    repeats = args.repeats or (3 if args.quick else 5)
    T = PROMPT + COMPLETION
    common = {
        "workload": "W2",
        "batch": B,
        "seq": T,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
    }

    params = M.init_params(jax.random.key(0), W2, std=0.02)
    host_params = jax.tree.map(np.asarray, params)
    tokens, adv, mask, old_logp, ref_logp = make_batch(B)
    tmp = tempfile.TemporaryDirectory(prefix="w2_")

    systems = {}
    for name in wanted:
        if name == "jax":
            tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))
            jstep = jax_step_fn(W2, tx)
            # a copy: the jitted step donates its params, and host_params feeds the peers
            jstate = {"params": jax.tree.map(jnp.array, host_params)}
            jstate["opt"] = tx.init(jstate["params"])
            jargs = tuple(jnp.asarray(x) for x in (tokens, adv, mask, old_logp, ref_logp))

            def run_jax(jstep=jstep, jstate=jstate, jargs=jargs):
                p, o, loss = jstep(jstate["params"], jstate["opt"], *jargs)
                loss.block_until_ready()
                jstate["params"], jstate["opt"] = p, o
                return float(loss)

            systems["jax"] = run_jax
        elif name == "torch":
            try:
                import torch
                import transformers  # noqa: F401
            except ImportError as e:
                emit({**common, "kind": "skipped", "system": "torch", "reason": f"not installed: {e}"}, args.out)
                continue
            torch.manual_seed(0)
            if args.one_cpu:
                torch.set_num_threads(1)
            tstep = torch_setup(host_params, W2)
            targs = (
                torch.from_numpy(tokens.astype(np.int64)),
                torch.from_numpy(adv),
                torch.from_numpy(mask),
                torch.from_numpy(old_logp),
                torch.from_numpy(ref_logp),
            )
            systems["torch"] = lambda tstep=tstep, targs=targs: tstep(*targs)
            common["torch"] = torch.__version__
        elif name == "tunix":
            try:
                import tunix  # noqa: F401
            except ImportError as e:
                emit({**common, "kind": "skipped", "system": "tunix", "reason": f"not installed: {e}"}, args.out)
                continue
            from importlib.metadata import version

            xstep, example_cls = tunix_setup(host_params, W2, Path(tmp.name))
            example = tunix_example(example_cls, tokens, adv, mask, old_logp, ref_logp)
            systems["tunix"] = lambda xstep=xstep, example=example: xstep(example)
            common["tunix"] = version("google-tunix")

    # two warm-up calls each: Tunix's jitted step compiles again on its second call (its
    # optimizer's scalar counters come back from the first step sharded on the model's mesh)
    first, losses = {}, {}
    for name, fn in systems.items():
        t = time.perf_counter()
        losses[name] = fn()
        first[name] = time.perf_counter() - t
    second, times, cpu = time_interleaved(systems, repeats)

    peak = matmul_peak_gflops()
    flops = model_flops(W2, B, T, COMPLETION)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in systems:
        emit(
            {
                **common,
                "kind": "policy_update",
                "system": name,
                "median_step_s": med[name],
                "tokens_per_s": B * T / med[name],
                "first_call_s": first[name],
                "second_call_s": second[name],
                "first_loss": losses[name],
                "step_s": times[name],
                "median_process_cpu_s": statistics.median(cpu[name]),
                "loadavg_1m": os.getloadavg()[0],
                "model_gflop": flops / 1e9,
                "gflops_per_s": flops / med[name] / 1e9,
                "measured_matmul_peak_gflops": peak,
                "fraction_of_measured_peak": flops / med[name] / 1e9 / peak,
                "fraction_of_nominal_118_gflops": flops / med[name] / 1e9 / NOMINAL_PEAK_GFLOPS,
            },
            args.out,
        )
    for peer in ("torch", "tunix"):
        if peer in med:
            emit(
                {
                    **common,
                    "kind": "ratio",
                    "numerator": "jax",
                    "denominator": peer,
                    f"jax_over_{peer}_tokens_per_s": med[peer] / med["jax"],
                },
                args.out,
            )
    tmp.cleanup()

    shapes = [("W2", B, COMPLETION, W2.hidden_size, W2.vocab_size, 64, 1024)]
    if not args.quick:
        shapes.append(("qwen2-0.5b-vocab", 8, 2048, 896, 151936, 256, 8192))
    for label, b, t, d, v, sc, vc in shapes:
        mem = logprob_memory(b, t, d, v, sc, vc)
        emit(
            {
                **common,
                "kind": "logprob_memory",
                "shape": label,
                "B": b,
                "T": t,
                "D": d,
                "V": v,
                "seq_chunk": sc,
                "vocab_chunk": vc,
                "logits_f32_bytes": b * t * v * 4,
                "plain_temp_bytes": mem["plain"],
                "chunked_temp_bytes": mem["chunked"],
                "saved_fraction": 1 - mem["chunked"] / mem["plain"],
            },
            args.out,
        )


if __name__ == "__main__":
    main()
