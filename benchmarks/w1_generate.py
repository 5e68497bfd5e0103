"""W1 generation (tiny-qwen2): jaxagent's sampler vs Tunix's sampler vs HF generate vs the matmul ceiling, one run.

Workload (benchmarks/README.md, W1): Qwen2 vocab 4096, hidden 256, 4 layers,
4 heads / 2 KV heads (head dim 64), intermediate 1024, untied, random N(0, 0.02)
weights (q/k/v biases too), float32. Batch 32 prompts of 64 random token ids, 128 new
tokens, no early stop (EOS outside the vocabulary), greedy and temperature 1.0.
Figure: generated tokens/s = 32 * 128 / median seconds of a whole generate call
(prefill + decode + host transfer), and the first call's seconds (compilation).

Systems, same weights and prompts, timed alternately (A B C A B C ...):
  jaxagent  jaxagent.rollout.Sampler: jitted prefill + on-device while-loop decode.
  tunix     tunix.generate.sampler.Sampler (package google-tunix) on tunix's Qwen2,
            weights loaded from the same safetensors; prompts passed as text through a
            trivial whitespace tokenizer (Tunix's sampler takes strings).
            temperature 1.0 is run with top_p=1.0 (without it Tunix decodes greedily).
  hf        transformers Qwen2ForCausalLM.generate on PyTorch CPU, use_cache=True.
  ceiling   the matmul-only decode loop of the same shapes: the FLOP floor any implementation
            pays, timed like the others (one whole call); see below.
Greedy tokens are compared across systems (`greedy_agree_with_jaxagent`: the fraction of
the 32 x 128 tokens equal to jaxagent's, and `greedy_rows_equal`).

The ceiling (`ceiling_system`) is one jitted call: prefill, then a `lax.fori_loop` of 128
decode steps, on the same weights, batch and prompts. It includes exactly the model's dense
matmuls, in float32, at the shapes jaxagent's sampler runs them:
  prefill  per layer, on all 32 x 64 prompt tokens at once ([2048, 256] rows): the q, k, v
           and o projections and the MLP gate, up and down projections; then the lm head on
           each row's last prompt token ([32, 256] @ [256, 4096]).
  decode   each of the 128 steps, per layer on [32, 256]: the same seven projections; then
           the lm head. 128 steps as jaxagent runs them: the first token comes from the
           prefill's logits and every sampled token, the last one too, is fed through the
           model (jaxagent's cache then holds every token; a loop that skips feeding the
           last token would do 127 steps, 0.8% fewer FLOPs).
Besides the matmuls it does only the glue that keeps every product live and the loop a
real chain, all elementwise on [rows, 256] or cheaper: the token embedding gather; q +
concat(k, v) as the o projection's input (it stands in for attention); the two residual
adds; gate * up as the down projection's input (no SiLU); the maximum of each row's logits
(which stands in for sampling; it is stored per step in a [32, 128] output); and the next
step's token id = a fixed random id + (that maximum > 0), so each step depends on the last.
It excludes: attention over the KV cache (and the cache, its writes and the attention in
the prefill), sampling, RMSNorms, RoPE, the q/k/v biases, SiLU, stop checks, and every
host transfer except the prompts in and the final [32, 128] block out. Its per-layer
weights are separate arrays (no per-step slicing of the stacked [L, ...] ones). Its
values stay finite (residual stream of 4 layers per step, fresh embedding each step).
`jaxagent_vs_ceiling` lines give `fraction` = jaxagent tokens/s / ceiling tokens/s in the
same run (same repeats, interleaved), per mode; the ceiling row also gives its achieved
GFLOP/s (`matmul_gflop_per_call` over its median).

    python benchmarks/w1_generate.py [--quick] [--repeats 5] [--systems jaxagent,ceiling,tunix,hf]
                                     [--out benchmarks/results/w1_generate.jsonl]
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from jaxagent import models as M  # noqa: E402
from jaxagent.rollout import GREEDY, Sampler, SamplingConfig  # noqa: E402

W1 = M.DecoderConfig(
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
MODES = {"greedy": GREEDY, "temperature_1.0": SamplingConfig(temperature=1.0)}


# ---------------------------------------------------------------- systems
def jaxagent_system(params, prompts, new_tokens):
    sampler = Sampler(params, W1, max_len=prompts.shape[1] + new_tokens, min_bucket=prompts.shape[1])
    plist = prompts.tolist()

    def run(mode, seed):
        _, gen = sampler.generate(plist, max_new_tokens=new_tokens, sampling=MODES[mode], seed=seed)
        return np.asarray(gen.tokens_BxN)

    return run


class _IdTokenizer:
    """Text <-> ids for Tunix's string API: token ids written as decimal words."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, **kw):
        return [int(w) for w in text.split()]

    def decode(self, ids, **kw):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None  # falsy: Tunix prepends no BOS

    def eos_id(self):
        return self.vocab + 1  # outside the vocabulary: no early stop

    def pad_id(self):
        return self.vocab  # outside the vocabulary: Tunix masks pad ids, so no real id may be one


def tunix_system(params, prompts, new_tokens, tmp: Path, variable_prompts: bool = False):
    """`run(mode, seed)` on `prompts`; with `variable_prompts`, `run(mode, seed, prompts)` on
    any prompts of at most `prompts.shape[1]` tokens (left-padded by Tunix)."""
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen2 import model as tmodel
    from tunix.models.qwen2 import params as tparams

    M.save_pretrained(M.Model(params, W1), tmp / "w1", overwrite=True)
    cfg = tmodel.ModelConfig(
        num_layers=W1.num_layers,
        vocab_size=W1.vocab_size,
        embed_dim=W1.hidden_size,
        hidden_dim=W1.intermediate_size,
        num_heads=W1.num_heads,
        head_dim=W1.head_dim,
        num_kv_heads=W1.num_kv_heads,
        rope_theta=int(W1.rope_theta),
        norm_eps=W1.rms_norm_eps,
        use_tied_embedding=False,
    )
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    model = tparams.create_model_from_safe_tensors(str(tmp / "w1"), cfg, mesh=mesh, dtype=jnp.float32)
    P = prompts.shape[1]
    sampler = tsampler.Sampler(
        model,
        _IdTokenizer(W1.vocab_size),
        tsampler.CacheConfig(
            cache_size=P + new_tokens, num_layers=W1.num_layers, num_kv_heads=W1.num_kv_heads, head_dim=W1.head_dim
        ),
    )
    fixed_texts = [" ".join(map(str, row)) for row in prompts.tolist()]

    def run(mode, seed, new_prompts=None):
        texts = fixed_texts if new_prompts is None else [" ".join(map(str, row)) for row in new_prompts.tolist()]
        kw = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0, top_p=1.0)
        out = sampler(texts, max_generation_steps=new_tokens, max_prompt_length=P, seed=seed, pad_output=True, **kw)
        return np.asarray([[int(w) for w in t.split()] for t in out.text])

    return run


def hf_system(params, prompts, new_tokens, threads: int | None = None):
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    from jaxagent.models.hf import hf_tensors_from_params

    hf = transformers.Qwen2ForCausalLM(W1.to_hf())
    state = {k: torch.from_numpy(np.array(v)) for k, v in hf_tensors_from_params(params, W1).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.eval()
    ids = torch.from_numpy(prompts.astype(np.int64))
    attn = torch.ones_like(ids)

    def run(mode, seed):
        torch.manual_seed(seed)
        kw = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                use_cache=True,
                eos_token_id=None,
                pad_token_id=0,
                **kw,
            )
        return out[:, prompts.shape[1] :].numpy()

    return run


_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ceiling_matmul_flops(batch: int, prompt_len: int, new_tokens: int, c: M.DecoderConfig = W1) -> int:
    """FLOPs (2 per multiply-add) of the ceiling's matmuls (see the module docstring)."""
    D, F = c.hidden_size, c.intermediate_size
    layer = D * c.q_size + 2 * D * c.kv_size + c.q_size * D + 3 * D * F  # multiply-adds per token
    head = D * c.vocab_size
    prefill = batch * prompt_len * c.num_layers * layer + batch * head
    decode = new_tokens * batch * (c.num_layers * layer + head)
    return 2 * (prefill + decode)


def ceiling_system(params, prompts, new_tokens):
    """The matmul-only decode loop of W1's shapes (see the module docstring)."""
    c = W1
    assert c.q_size == 2 * c.kv_size, "the o projection's stand-in input is q + concat(k, v)"
    B, P = prompts.shape
    N = new_tokens
    layers = [{n: jnp.array(params["layers"][n]["kernel"][i]) for n in _PROJ} for i in range(c.num_layers)]
    emb, head = params["embed"]["embedding"], params["lm_head"]["kernel"]
    feed_NxB = jax.random.randint(jax.random.key(1), (N, B), 0, c.vocab_size - 1)  # +1 stays in the vocab

    def block(w, x):  # x: [rows, D]
        q, k, v = x @ w["q_proj"], x @ w["k_proj"], x @ w["v_proj"]
        h = x + (q + jnp.concatenate([k, v], axis=-1)) @ w["o_proj"]
        return h + ((h @ w["gate_proj"]) * (h @ w["up_proj"])) @ w["down_proj"]

    @jax.jit
    def call(layers, emb, head, feed_NxB, prompts_BxP):
        x = emb[prompts_BxP].reshape(B * P, -1)
        for w in layers:
            x = block(w, x)
        top_B = jnp.max(x.reshape(B, P, -1)[:, -1] @ head, axis=-1)

        def step(t, carry):
            top_B, out_BxN = carry
            x = emb[feed_NxB[t] + (top_B > 0).astype(jnp.int32)]
            for w in layers:
                x = block(w, x)
            top_B = jnp.max(x @ head, axis=-1)
            return top_B, jax.lax.dynamic_update_slice(out_BxN, top_B[:, None], (0, t))

        return jax.lax.fori_loop(0, N, step, (top_B, jnp.zeros((B, N), jnp.float32)))[1]

    def run(mode, seed):  # the same work in every mode
        out = np.asarray(call(layers, emb, head, feed_NxB, jnp.asarray(prompts)))
        assert np.isfinite(out).all()
        return out

    return run


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, 32 new tokens, 2 repeats: a smoke run (< 40 s)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--systems", default="jaxagent,ceiling,tunix,hf")
    ap.add_argument("--modes", default="greedy,temperature_1.0")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds of idle before each timed call (XLA and OpenMP threads spin after work "
        "and would otherwise slow the next system down)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads for hf (default: torch's choice; 1 with --quick, because on a "
        "busy 2-core machine torch's OpenMP barriers can stall a call for seconds)",
    )
    args = ap.parse_args()
    if args.quick and args.torch_threads is None:
        args.torch_threads = 1
    B, P, N = (8, 64, 32) if args.quick else (32, 64, 128)
    repeats = args.repeats or (2 if args.quick else 5)
    common = {
        "workload": "W1",
        "batch": B,
        "prompt_len": P,
        "new_tokens": N,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": args.torch_threads,
    }

    params = M.init_params(jax.random.key(0), W1, std=0.02)
    prompts = np.random.RandomState(0).randint(1, W1.vocab_size, (B, P)).astype(np.int32)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    systems = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            t_setup = time.perf_counter()
            try:
                if name == "jaxagent":
                    systems[name] = jaxagent_system(params, prompts, N)
                elif name == "tunix":
                    systems[name] = tunix_system(params, prompts, N, Path(tmp))
                elif name == "hf":
                    systems[name] = hf_system(params, prompts, N, args.torch_threads)
                elif name == "ceiling":
                    systems[name] = ceiling_system(params, prompts, N)
                else:
                    raise SystemExit(f"unknown system {name!r}; choose from jaxagent, ceiling, tunix, hf")
            except ImportError as e:  # a peer that is not installed is skipped, not fatal
                emit({**common, "system": name, "skipped": f"not installed: {e}"}, args.out)
            print(f"# {name}: set up in {time.perf_counter() - t_setup:.1f}s", file=sys.stderr, flush=True)

        for mode in modes:
            first, times, outs = {}, {s: [] for s in systems}, {}
            for s, run in systems.items():
                t = time.perf_counter()
                outs[s] = run(mode, 0)
                first[s] = time.perf_counter() - t
            for r in range(repeats):
                for s, run in systems.items():
                    time.sleep(args.settle)  # let the previous system's worker threads go idle
                    t = time.perf_counter()
                    run(mode, r + 1)
                    times[s].append(time.perf_counter() - t)
            ref = outs.get("jaxagent")
            rates = {s: B * N / statistics.median(ts) for s, ts in times.items()}
            for s in systems:
                rec = {
                    **common,
                    "system": s,
                    "mode": mode,
                    "tokens_per_s": round(rates[s], 1),
                    "median_s": round(statistics.median(times[s]), 4),
                    "first_call_s": round(first[s], 3),
                    "repeats": repeats,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
                if mode == "greedy" and ref is not None and s != "ceiling":  # the ceiling samples no tokens
                    rec["greedy_agree_with_jaxagent"] = round(float(np.mean(outs[s] == ref)), 5)
                    rec["greedy_rows_equal"] = int(np.sum(np.all(outs[s] == ref, axis=1)))
                if s == "jaxagent":
                    for peer in ("tunix", "hf"):
                        if peer in rates:
                            rec[f"ratio_vs_{peer}"] = round(rates["jaxagent"] / rates[peer], 2)
                if s == "ceiling":
                    flops = ceiling_matmul_flops(B, P, N)
                    rec["matmul_gflop_per_call"] = round(flops / 1e9, 3)
                    rec["gflop_per_s"] = round(flops / 1e9 / statistics.median(times[s]), 1)
                emit(rec, args.out)
            if "jaxagent" in rates and "ceiling" in rates:
                emit(
                    {
                        **common,
                        "system": "jaxagent_vs_ceiling",
                        "mode": mode,
                        "jaxagent_tokens_per_s": round(rates["jaxagent"], 1),
                        "ceiling_tokens_per_s": round(rates["ceiling"], 1),
                        "fraction": round(rates["jaxagent"] / rates["ceiling"], 3),
                        "goal": 0.9,
                        "repeats": repeats,
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    },
                    args.out,
                )


if __name__ == "__main__":
    main()
