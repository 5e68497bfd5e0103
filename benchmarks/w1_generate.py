"""W1 generation (tiny-qwen2): jaxagent's sampler vs Tunix's sampler vs HF generate, one run.

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
Greedy tokens are compared across systems (`greedy_agree_with_jaxagent`: the fraction of
the 32 x 128 tokens equal to jaxagent's, and `greedy_rows_equal`).

    python benchmarks/w1_generate.py [--quick] [--repeats 5] [--systems jaxagent,tunix,hf]
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
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import numpy as np  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.rollout import GREEDY, Sampler, SamplingConfig  # noqa: E402

W1 = M.DecoderConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, qkv_bias=True, model_type="qwen2")
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
    cfg = tmodel.ModelConfig(num_layers=W1.num_layers, vocab_size=W1.vocab_size, embed_dim=W1.hidden_size,
                             hidden_dim=W1.intermediate_size, num_heads=W1.num_heads, head_dim=W1.head_dim,
                             num_kv_heads=W1.num_kv_heads, rope_theta=int(W1.rope_theta), norm_eps=W1.rms_norm_eps,
                             use_tied_embedding=False)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
    model = tparams.create_model_from_safe_tensors(str(tmp / "w1"), cfg, mesh=mesh, dtype=jnp.float32)
    P = prompts.shape[1]
    sampler = tsampler.Sampler(model, _IdTokenizer(W1.vocab_size),
                               tsampler.CacheConfig(cache_size=P + new_tokens, num_layers=W1.num_layers,
                                                    num_kv_heads=W1.num_kv_heads, head_dim=W1.head_dim))
    fixed_texts = [" ".join(map(str, row)) for row in prompts.tolist()]

    def run(mode, seed, new_prompts=None):
        texts = fixed_texts if new_prompts is None else [" ".join(map(str, row)) for row in new_prompts.tolist()]
        kw = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0, top_p=1.0)
        out = sampler(texts, max_generation_steps=new_tokens, max_prompt_length=P, seed=seed, pad_output=True,
                      **kw)
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
            out = hf.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              use_cache=True, eos_token_id=None, pad_token_id=0, **kw)
        return out[:, prompts.shape[1]:].numpy()

    return run


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, 32 new tokens, 2 repeats: a smoke run (< 40 s)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--systems", default="jaxagent,tunix,hf")
    ap.add_argument("--modes", default="greedy,temperature_1.0")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds of idle before each timed call (XLA and OpenMP threads spin after work "
                         "and would otherwise slow the next system down)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch intra-op threads for hf (default: torch's choice; 1 with --quick, because on a "
                         "busy 2-core machine torch's OpenMP barriers can stall a call for seconds)")
    args = ap.parse_args()
    if args.quick and args.torch_threads is None:
        args.torch_threads = 1
    B, P, N = (8, 64, 32) if args.quick else (32, 64, 128)
    repeats = args.repeats or (2 if args.quick else 5)
    common = {"workload": "W1", "batch": B, "prompt_len": P, "new_tokens": N, "quick": args.quick,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "jax": jax.__version__, "cpus": len(os.sched_getaffinity(0)),
              "torch_threads": args.torch_threads}

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
                else:
                    raise SystemExit(f"unknown system {name!r}; choose from jaxagent, tunix, hf")
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
                rec = {**common, "system": s, "mode": mode, "tokens_per_s": round(rates[s], 1),
                       "median_s": round(statistics.median(times[s]), 4), "first_call_s": round(first[s], 3),
                       "repeats": repeats, "load_avg_1m": round(os.getloadavg()[0], 2)}
                if mode == "greedy" and ref is not None:
                    rec["greedy_agree_with_jaxagent"] = round(float(np.mean(outs[s] == ref)), 5)
                    rec["greedy_rows_equal"] = int(np.sum(np.all(outs[s] == ref, axis=1)))
                if s == "jaxagent":
                    for peer in ("tunix", "hf"):
                        if peer in rates:
                            rec[f"ratio_vs_{peer}"] = round(rates["jaxagent"] / rates[peer], 2)
                emit(rec, args.out)


if __name__ == "__main__":
    main()
