#!/usr/bin/env python
"""W4 advantage kernels (see benchmarks/README.md): GAE and GRPO.

Workload
  GAE : B x T = 512 x 4096 float32, random rewards and values, a ragged mask with
        interior holes (per row: a prompt span of 0, then alternating policy (1) /
        observation (0) spans, then right padding), gamma = 1.0, lam = 0.95, whitened.
  GRPO: 4096 rows x T = 1024, groups of 8 (group ids shuffled, so groups are not
        contiguous), one outcome reward per row at its last valid token.

Systems, timed in one run and interleaved (A B C A B C ...):
  jaxagent  `jaxagent.algos.gae` (method="scan", "associative", and "native" -- the
            C++ FFI kernel that the default method="auto" picks on CPU -- when the
            installed version has it) and `jaxagent.algos.grpo`, each under jax.jit,
            block_until_ready.
  torch     PyTorch CPU written the way verl 0.9.1 writes it
            (`compute_gae_advantage_return`: a Python loop over reversed(range(T)),
            torch.stack, masked_whiten with unbiased var;
            `compute_grpo_outcome_advantage`: a dict of lists per uid, torch.mean /
            torch.std per group). Skipped with a message if torch is not installed.
  numpy     GAE as a loop over T vectorised over B; GRPO vectorised with
            np.unique / np.bincount.

Before timing, the outputs of every system are checked against each other on the
valid (mask = 1) positions; a disagreement beyond float32 tolerance aborts the run.

Figures, one JSON line per measurement on stdout (and appended to --out PATH):
median and min seconds over --repeats timed calls after warm-up, compile seconds
(JAX, separately), elements/s (B*T / median), and for jaxagent the bytes the kernel
must move (inputs + outputs, a lower bound) / median time, next to the memory
bandwidth measured in the same run (a numpy copy and a jitted jnp elementwise op).

Usage:
  python benchmarks/w4_advantages.py [--repeats N] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib
import json
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

# --------------------------------------------------------------------------- config

GAMMA = 1.0
LAM = 0.95
GRPO_EPS = 1e-6
GROUP_SIZE = 8
# jaxagent.algos.gae methods to time; "scan" and "associative" are required, the
# others are timed when the installed version accepts them ("native": the C++ FFI
# kernel; "auto", the default, resolves to one of these and is not timed twice).
GAE_METHODS = ("scan", "associative", "native")

FULL = dict(gae=(512, 4096), grpo=(4096, 1024), membw_mb=256)
QUICK = dict(gae=(64, 512), grpo=(256, 128), membw_mb=32)

# Tolerances for the cross-system check (float32, valid positions only), relative
# to the largest magnitude of the reference output.
RTOL = 1e-4


def _log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data


def make_mask(rng: np.random.Generator, B: int, T: int) -> np.ndarray:
    """Ragged multi-turn mask [B, T] float32.

    Per row: a prompt span of zeros, then alternating policy (1) / observation (0)
    spans, ending with a policy span, then right padding (zeros).
    """
    m = np.zeros((B, T), np.float32)
    for b in range(B):
        prompt = int(rng.integers(max(1, T // 32), max(2, T // 8)))
        end = int(rng.integers(T // 2, T + 1))  # row content ends here; padding after
        t = prompt
        policy = True
        while t < end:
            if policy:
                n = int(rng.integers(max(1, T // 128), max(2, T // 16)))
                m[b, t : min(t + n, end)] = 1.0
            else:
                n = int(rng.integers(max(1, T // 256), max(2, T // 32)))
            t += n
            policy = not policy
    return m


def make_gae_inputs(B: int, T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T)
    rewards = rng.standard_normal((B, T), dtype=np.float32)
    values = rng.standard_normal((B, T), dtype=np.float32)
    return rewards, values, mask


def make_grpo_inputs(B: int, T: int, seed: int = 1):
    assert B % GROUP_SIZE == 0
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T)
    # Every row gets at least one valid token: its last one carries the outcome.
    empty = mask.sum(1) == 0
    mask[empty, T - 1] = 1.0
    last = T - 1 - np.argmax(mask[:, ::-1], axis=1)
    rewards = np.zeros((B, T), np.float32)
    rewards[np.arange(B), last] = rng.standard_normal(B, dtype=np.float32)
    group_ids = rng.permutation(np.arange(B, dtype=np.int32) // GROUP_SIZE).astype(np.int32)
    return rewards, mask, group_ids


# --------------------------------------------------------------------------- numpy peer


def np_masked_whiten(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    valid = m > 0
    n = m.sum(dtype=np.float64)
    xv = np.where(valid, x, 0)
    mean = xv.sum(dtype=np.float64) / (n + 1e-8)
    var = np.where(valid, (x - mean) ** 2, 0).sum(dtype=np.float64) / (n + 1e-8)
    var = var * n / (n - 1)
    return ((x - np.float32(mean)) * np.float32(1.0 / np.sqrt(var + 1e-8))).astype(np.float32)


def np_gae(rewards, values, mask, gamma=GAMMA, lam=LAM):
    """Loop over T, vectorised over B, on [T, B] copies (contiguous per step)."""
    B, T = rewards.shape
    r = np.ascontiguousarray(rewards.T)
    v = np.ascontiguousarray(values.T)
    valid = np.ascontiguousarray(mask.T) > 0
    out = np.empty((T, B), np.float32)
    nextv = np.zeros(B, np.float32)
    last = np.zeros(B, np.float32)
    g32, gl32 = np.float32(gamma), np.float32(gamma * lam)
    for t in range(T - 1, -1, -1):
        g = r[t] + g32 * nextv - v[t] + gl32 * last
        nextv = np.where(valid[t], v[t], nextv)
        last = np.where(valid[t], g, last)
        out[t] = last
    a_raw = out.T
    returns = a_raw + values
    return np_masked_whiten(a_raw, mask), returns


def np_grpo(rewards, mask, group_ids, eps=GRPO_EPS):
    scores = np.where(mask > 0, rewards, 0).sum(1, dtype=np.float64)
    _, inv, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=scores)
    mean = sums / counts
    sq = np.bincount(inv, weights=(scores - mean[inv]) ** 2)
    std = np.sqrt(sq / np.maximum(counts - 1, 1))
    single = counts == 1
    mean = np.where(single, 0.0, mean)
    std = np.where(single, 1.0, std)
    a = ((scores - mean[inv]) / (std[inv] + eps)).astype(np.float32)
    return a[:, None] * mask


# --------------------------------------------------------------------------- torch peer (verl 0.9.1 style)


def make_torch_peer():
    try:
        import torch
    except ImportError:
        return None

    def masked_sum(values, mask, axis=None):
        # If NaNs exist out of mask, replace NaNs in values with a value that won't
        # affect the sum (verl's guard).
        valid_values = torch.where(mask.bool(), values, 0.0)
        return (valid_values * mask).sum(axis=axis)

    def masked_mean(values, mask, axis=None):
        s = masked_sum(values, mask, axis)
        return s / (mask.sum(axis=axis) + 1e-8)

    def masked_var(values, mask, unbiased=True):
        mean = masked_mean(values, mask)
        centered_values = values - mean
        variance = masked_mean(centered_values**2, mask)
        if unbiased:
            mask_sum = mask.sum()
            if mask_sum == 0:
                raise ValueError("At least one element in the mask has to be 1.")
            if mask_sum == 1:
                raise ValueError("The sum of the mask is one, which can cause a division by zero.")
            bessel_correction = mask_sum / (mask_sum - 1)
            variance = variance * bessel_correction
        return variance

    def masked_whiten(values, mask, shift_mean=True):
        mean, var = masked_mean(values, mask), masked_var(values, mask)
        whitened = (values - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            whitened += mean
        return whitened

    def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
        with torch.no_grad():
            nextvalues = 0
            lastgaelam = 0
            advantages_reversed = []
            gen_len = token_level_rewards.shape[-1]
            for t in reversed(range(gen_len)):
                delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
                lastgaelam_ = delta + gamma * lam * lastgaelam
                # skip values and TD-error on observation tokens
                nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
                lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
                advantages_reversed.append(lastgaelam)
            advantages = torch.stack(advantages_reversed[::-1], dim=1)
            returns = advantages + values
            advantages = masked_whiten(advantages, response_mask)
        return advantages, returns

    def compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon=GRPO_EPS, norm_adv_by_std_in_grpo=True
    ):
        from collections import defaultdict

        scores = token_level_rewards.sum(dim=-1)
        id2score = defaultdict(list)
        id2mean = {}
        id2std = {}
        with torch.no_grad():
            bsz = scores.shape[0]
            for i in range(bsz):
                id2score[index[i]].append(scores[i])
            for idx in id2score:
                if len(id2score[idx]) == 1:
                    id2mean[idx] = torch.tensor(0.0)
                    id2std[idx] = torch.tensor(1.0)
                elif len(id2score[idx]) > 1:
                    scores_tensor = torch.stack(id2score[idx])
                    id2mean[idx] = torch.mean(scores_tensor)
                    id2std[idx] = torch.std(scores_tensor)
                else:
                    raise ValueError(f"no score in prompt index: {idx}")
            for i in range(bsz):
                if norm_adv_by_std_in_grpo:
                    scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
                else:
                    scores[i] = scores[i] - id2mean[index[i]]
            scores = scores.unsqueeze(-1) * response_mask
        return scores, scores

    return torch, compute_gae_advantage_return, compute_grpo_outcome_advantage


# --------------------------------------------------------------------------- harness


def _block(x):
    import jax

    return jax.block_until_ready(x)


def _time_once(fn, sync=None) -> float:
    t0 = time.perf_counter()
    out = fn()
    if sync is not None:
        sync(out)
    dt = time.perf_counter() - t0
    del out
    return dt


class System:
    def __init__(self, name, method, fn, sync=None, compile_s=None, first_call_s=None, bytes_moved=None, extra=None):
        self.name, self.method, self.fn, self.sync = name, method, fn, sync
        self.compile_s, self.first_call_s = compile_s, first_call_s
        self.bytes_moved = bytes_moved
        self.extra = extra or {}
        self.times: list[float] = []


def run_interleaved(systems: list[System], repeats: int, warmup: int = 1) -> None:
    for s in systems:
        for _ in range(warmup):
            _time_once(s.fn, s.sync)
    for _ in range(repeats):
        for s in systems:
            s.times.append(_time_once(s.fn, s.sync))


def _host_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    # glibc malloc settings change how often fresh output buffers page-fault; record them.
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "malloc_env": malloc_env,
    }


def _versions(torch_mod) -> dict:
    import jax

    v = {
        "jax": jax.__version__,
        "jaxlib": importlib.import_module("jaxlib").__version__,
        "numpy": np.__version__,
        "jax_backend": jax.default_backend(),
    }
    if torch_mod is not None:
        v["torch"] = torch_mod.__version__
        v["torch_threads"] = torch_mod.get_num_threads()
    return v


def check_close(name: str, ref: np.ndarray, got: np.ndarray, mask: np.ndarray, rtol: float = RTOL) -> float:
    valid = mask > 0
    ref = np.asarray(ref, np.float64)[valid]
    got = np.asarray(got, np.float64)[valid]
    if not np.all(np.isfinite(got)):
        raise SystemExit(f"CORRECTNESS FAILURE: {name}: non-finite values on valid positions")
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ref - got).max())
    if err > rtol * scale:
        i = int(np.argmax(np.abs(ref - got)))
        raise SystemExit(
            f"CORRECTNESS FAILURE: {name}: max |diff| = {err:.3e} > {rtol * scale:.3e} "
            f"(at valid index {i}: ref {ref[i]:.6g}, got {got[i]:.6g})"
        )
    _log(f"check ok: {name}: max |diff| {err:.2e} (tol {rtol * scale:.1e})")
    return err


# --------------------------------------------------------------------------- benchmarks


def bench_membw(mb: int, repeats: int) -> list[dict]:
    """Memory bandwidth, STREAM-style (bytes = read + write):

    numpy copyto (one thread, preallocated destination); jitted jnp `x + 1` with the
    input donated (in place, XLA's threads); jitted `x + 1` into a fresh output (what
    an XLA program with new output buffers pays, page faults included).
    """
    import jax

    n = mb * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    x = jax.device_put(src)
    add = jax.jit(lambda a: a + 1.0)
    add_donated = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = [jax.device_put(src)]

    def inplace():
        box[0] = add_donated(box[0])
        return box[0]

    _block(add(x))
    _block(inplace())
    nbytes = 2 * src.nbytes
    systems = [
        System("numpy", "copyto", lambda: np.copyto(dst, src), bytes_moved=nbytes),
        System("jax", "jit(x+1) donated", inplace, sync=_block, bytes_moved=nbytes),
        System("jax", "jit(x+1) new output", lambda: add(x), sync=_block, bytes_moved=nbytes),
    ]
    run_interleaved(systems, repeats)
    recs = []
    for s in systems:
        med, mn = statistics.median(s.times), min(s.times)
        recs.append(
            {
                "kernel": "membw",
                "system": s.name,
                "method": s.method,
                "shape": [n],
                "dtype": "float32",
                "bytes_moved": s.bytes_moved,
                "median_s": med,
                "min_s": mn,
                "repeats": len(s.times),
                "gbytes_per_s": s.bytes_moved / med / 1e9,
                "gbytes_per_s_best": s.bytes_moved / mn / 1e9,
            }
        )
    return recs


def _jit_system(name, method, fn, args, bytes_moved):
    import jax

    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    del compiled, lowered
    t0 = time.perf_counter()
    out = _block(jitted(*args))
    first_call_s = time.perf_counter() - t0
    return System(
        name,
        method,
        lambda: jitted(*args),
        sync=_block,
        compile_s=compile_s,
        first_call_s=first_call_s,
        bytes_moved=bytes_moved,
    ), out


def bench_gae(algos, torch_peer, B: int, T: int, repeats: int) -> list[dict]:
    import jax

    rewards, values, mask = make_gae_inputs(B, T)
    _log(f"GAE {B}x{T}: valid fraction {mask.mean():.3f}")
    outputs = {}
    systems = []

    # numpy (also the correctness reference)
    outputs["numpy"] = np_gae(rewards, values, mask)
    systems.append(System("numpy", "loop-over-T", lambda: np_gae(rewards, values, mask)))

    if torch_peer is not None:
        torch, t_gae, _ = torch_peer
        tr, tv, tm = (torch.from_numpy(a) for a in (rewards, values, mask))
        outputs["torch"] = tuple(o.numpy() for o in t_gae(tr, tv, tm, GAMMA, LAM))
        systems.append(System("torch", "verl-loop", lambda: t_gae(tr, tv, tm, GAMMA, LAM)))

    if algos is not None:
        jr, jv, jm = (jax.device_put(a) for a in (rewards, values, mask))
        nbytes = 5 * B * T * 4  # read r, v, mask; write advantages, returns
        for method in GAE_METHODS:
            fn = functools.partial(algos.gae, gamma=GAMMA, lam=LAM, method=method)
            try:
                sys_, out = _jit_system("jaxagent", method, fn, (jr, jv, jm), nbytes)
            except (ValueError, TypeError, RuntimeError) as e:
                if method in ("scan", "associative"):
                    raise
                _log(f"SKIP jaxagent gae method={method!r}: {str(e).splitlines()[0]}")
                continue
            if method == "native":
                sys_.extra["compile_note"] = (
                    "includes the one-time C++ kernel build when it is "
                    "not already cached (see jaxagent/algos/_native.py)"
                )
            outputs[f"jaxagent-{method}"] = tuple(np.asarray(o) for o in out)
            systems.append(sys_)

    # cross-system correctness, before any timing
    ref = outputs["numpy"]
    for key, out in outputs.items():
        if key == "numpy":
            continue
        check_close(f"gae advantages {key} vs numpy", ref[0], out[0], mask)
        check_close(f"gae returns {key} vs numpy", ref[1], out[1], mask)
    if "torch" in outputs:
        for key in [k for k in outputs if k.startswith("jaxagent-")]:
            check_close(f"gae advantages {key} vs torch", outputs["torch"][0], outputs[key][0], mask)
            check_close(f"gae returns {key} vs torch", outputs["torch"][1], outputs[key][1], mask)
    for key in [k for k in outputs if k.startswith("jaxagent-")]:
        if key in outputs and not np.all(np.stack(outputs[key])[:, mask == 0] == 0):
            _log(f"note: {key} outputs are not all 0 at masked positions")

    run_interleaved(systems, repeats)
    return _records("gae", systems, (B, T), B * T)


def bench_grpo(algos, torch_peer, B: int, T: int, repeats: int) -> list[dict]:
    import jax

    rewards, mask, group_ids = make_grpo_inputs(B, T)
    _log(f"GRPO {B}x{T}, groups of {GROUP_SIZE}: valid fraction {mask.mean():.3f}")
    outputs = {}
    systems = []

    outputs["numpy"] = np_grpo(rewards, mask, group_ids)
    systems.append(System("numpy", "unique-bincount", lambda: np_grpo(rewards, mask, group_ids)))

    if torch_peer is not None:
        torch, _, t_grpo = torch_peer
        tr, tm = torch.from_numpy(rewards), torch.from_numpy(mask)
        index = np.array([f"uid-{g}" for g in group_ids], dtype=object)  # verl: uid strings
        outputs["torch"] = t_grpo(tr, tm, index)[0].numpy()
        systems.append(System("torch", "verl-dict-loop", lambda: t_grpo(tr, tm, index)))

    if algos is not None:
        jr, jm, jg = (jax.device_put(a) for a in (rewards, mask, group_ids))
        nbytes = 3 * B * T * 4 + B * 4  # read rewards, mask, group_ids; write advantages
        fn = functools.partial(algos.grpo, eps=GRPO_EPS)
        sys_, out = _jit_system("jaxagent", "jit", fn, (jr, jm, jg), nbytes)
        out = out[0] if isinstance(out, tuple) else out
        outputs["jaxagent"] = np.asarray(out)
        systems.append(sys_)

    ref = outputs["numpy"]
    for key, out in outputs.items():
        if key != "numpy":
            check_close(f"grpo advantages {key} vs numpy", ref, out, mask)
    if "torch" in outputs and "jaxagent" in outputs:
        check_close("grpo advantages jaxagent vs torch", outputs["torch"], outputs["jaxagent"], mask)

    run_interleaved(systems, repeats)
    return _records("grpo", systems, (B, T), B * T)


def _records(kernel, systems, shape, elements) -> list[dict]:
    recs = []
    torch_med = next((statistics.median(s.times) for s in systems if s.name == "torch"), None)
    for s in systems:
        med, mn = statistics.median(s.times), min(s.times)
        r = {
            "kernel": kernel,
            "system": s.name,
            "method": s.method,
            "shape": list(shape),
            "dtype": "float32",
            "median_s": med,
            "min_s": mn,
            "repeats": len(s.times),
            "compile_s": s.compile_s,
            "first_call_s": s.first_call_s,
            "elements_per_s": elements / med,
        }
        if s.bytes_moved is not None:
            r["bytes_moved"] = s.bytes_moved
            r["gbytes_per_s"] = s.bytes_moved / med / 1e9
        if torch_med is not None and s.name != "torch":
            r["speedup_vs_torch"] = torch_med / med
        r.update(s.extra)
        recs.append(r)
    return recs


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=7, help="timed calls per system (>= 5 recommended)")
    p.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    p.add_argument("--out", help="append the JSON lines to this JSONL file")
    p.add_argument("--kernels", default="membw,gae,grpo", help="comma list of membw,gae,grpo")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    p.add_argument(
        "--algos-module", default="jaxagent.algos", help="module providing gae/grpo (for experiments with variants)"
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.repeats < 5:
        _log(f"warning: --repeats {args.repeats} < 5; benchmarks/README.md asks for medians of at least 5")

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: F401  (import after JAX_PLATFORMS is set, before any timing)

    cfg = QUICK if args.quick else FULL
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for k in kernels:
        if k not in ("membw", "gae", "grpo"):
            p.error(f"unknown kernel {k!r}")

    try:
        algos = importlib.import_module(args.algos_module)
        missing = [n for n in ("gae", "grpo") if not hasattr(algos, n)]
        if missing:
            _log(f"SKIP jaxagent: {args.algos_module} has no {', '.join(missing)}")
            algos = None
    except ImportError as e:
        _log(f"SKIP jaxagent: cannot import {args.algos_module}: {e}")
        algos = None

    torch_peer = None
    if not args.no_torch:
        torch_peer = make_torch_peer()
        if torch_peer is None:
            _log("SKIP torch peer: PyTorch is not installed (pip install torch==2.13.0, or `pip install -e .[bench]`)")

    common = {
        "workload": "W4",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "host": _host_info(),
        "versions": _versions(torch_peer[0] if torch_peer else None),
    }
    if algos is not None:
        common["algos_module"] = args.algos_module
        try:
            import inspect

            default = inspect.signature(algos.gae).parameters["method"].default
            common["gae_default_method"] = default
        except (TypeError, ValueError, KeyError):
            pass

    records: list[dict] = []
    bw = None
    if "membw" in kernels:
        recs = bench_membw(cfg["membw_mb"], args.repeats)
        bw = max(r["gbytes_per_s"] for r in recs)
        records += recs
    if "gae" in kernels:
        records += bench_gae(algos, torch_peer, *cfg["gae"], args.repeats)
    if "grpo" in kernels:
        records += bench_grpo(algos, torch_peer, *cfg["grpo"], args.repeats)

    lines = []
    for r in records:
        if bw is not None and "gbytes_per_s" in r and r["kernel"] != "membw":
            r["membw_gbytes_per_s"] = bw
            r["fraction_of_membw"] = r["gbytes_per_s"] / bw
        rec = {"workload": common["workload"], **r, **{k: v for k, v in common.items() if k != "workload"}}
        lines.append(json.dumps(rec, sort_keys=False))
    for line in lines:
        print(line, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            for line in lines:
                f.write(line + "\n")

    # human-readable summary on stderr
    _log("summary:")
    for r in records:
        s = (
            f"{r['kernel']:5s} {r['system']:9s} {r['method']:16s} median {r['median_s'] * 1e3:10.3f} ms"
            f"  min {r['min_s'] * 1e3:10.3f} ms"
        )
        if "elements_per_s" in r:
            s += f"  {r['elements_per_s'] / 1e6:9.1f} Melem/s"
        if "gbytes_per_s" in r:
            s += f"  {r['gbytes_per_s']:6.2f} GB/s"
        if "fraction_of_membw" in r:
            s += f" ({100 * r['fraction_of_membw']:.0f}% of membw)"
        if r.get("compile_s") is not None:
            s += f"  compile {r['compile_s']:.3f} s"
        if "speedup_vs_torch" in r:
            s += f"  x{r['speedup_vs_torch']:.1f} vs torch"
        _log(s)
    if algos is not None and torch_peer is not None:
        for k in ("gae", "grpo"):
            for r in records:
                if r["kernel"] == k and r["system"] == "jaxagent":
                    goal = (
                        "  (goal >= 50x: " + ("met)" if r["speedup_vs_torch"] >= 50 else "NOT met)")
                        if k == "gae"
                        else ""
                    )
                    _log(f"speedup ours/torch {k} {r['method']}: {r['speedup_vs_torch']:.1f}x{goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
