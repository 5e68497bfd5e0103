"""Per-device memory estimate of a training run, checked before anything is compiled.

`estimate_memory` returns bytes **per device** (the largest shard; shards are equal
when dimensions divide)::

    params       the policy (+ critic) parameters, sharded by the logical-axis rules: exact
    opt_state    AdamW mu, nu (+ counts), sharded like the params: exact (built with
                 `jax.eval_shape` from the run's optimizer; LoRA: adapters only)
    grads        float32 gradients of the trainable leaves, sharded like the params;
                 x2 with micro-batches (the accumulator and one micro-batch's gradient)
    activations  what the backward pass keeps, for one micro-batch of
                 b = ceil(B / (num_micro_batches * data * fsdp)) rows of T tokens (rough):
    kv_cache     2 * L * ceil(B_s / (data * fsdp)) * K_t * S * hd * bytes, when a sampling
                 batch B_s and context S are given (K_t = kv heads per tensor shard)

With `StepConfig.compute_dtype` (mixed precision) the activations and the KV cache are
in the compute dtype; the trainer adds `compute_params`, two copies of the policy cast to
it (the update's inside its step, and the sampler's). The sampler's params are laid out
by its own rules (`jaxagent.parallel.ROLLOUT_AXIS_RULES`: whole over data and fsdp, split
over tensor), so the trainer sizes them with `estimate_memory(..., rules=ROLLOUT_AXIS_RULES)`
on the sampler's mesh: under fsdp they cost `fsdp` times the update's shard, counted as
`sampler_params` (or inside `compute_params` when cast) whenever the sampler cannot use
the state's own buffers.

Activation formula (bytes; `a` = the compute dtype's size, 4 for float32 parts;
heads, kv heads, MLP width and vocabulary divided by `tensor` where it divides)::

    per_token_layer = 4 D a + 2 D 4                 residual stream, norms (norms in f32)
                    + 2 (H + 2 K) hd a              q, k, v before and after RoPE
                    + H T (4 + a)                   attention probabilities (f32 + cast)
                    + H hd a + 4 F a                attention output; gate, up, silu, product
    saved_layer     = per_token_layer                        remat=False
                    = D a                                    remat=True / "full" (layer input)
                    = (H + 2K) hd a + 2 D a + 2 F a          remat="dots" (matmul outputs)
    trunk           = b T (L saved_layer + per_token_layer)        remat=False
                    = b T (L saved_layer + 1.5 per_token_layer'    remat (a layer recomputed
                          + H T (3 4 + a))                         and differentiated: its
                                                                   scores, softmax and their
                                                                   gradients live at once)
    (per_token_layer' is per_token_layer without the attention term)
    head            = b T D (a + 4) * 2 + 3 b min(T, seq_chunk) min(V, vocab_chunk) 4
    activations     = trunk + head                    (critic: plus its own trunk and value
                                                       head; XLA keeps both live in the step)

XLA's fusion and scheduling change the real peak by tens of percent either way; the
estimate is for telling "fits easily" from "cannot fit", not for packing to the byte.
`check_fits` keeps a margin (`usable_fraction`, default 0.9) for XLA's own buffers.
`forward_activation_bytes` is the forward-only log-prob pass (one layer live at a time,
its MLP as `2 F a`, nothing kept for a backward pass; the attention's scores as
`jaxagent.models.attention.live_bytes` counts them: three times over the whole sequence
when dense, one block when blocked); it runs before the update, so a run needs the
larger of the two activation figures. The episode store's entropy pass runs in passes of
the log-prob pass's rows, so this figure bounds it too. `prefill_bytes` is the sampler's
append of a prompt or an observation (in `APPEND_CHUNK`-token pieces, attending to the whole
cache), `decode_bytes` its decode of a turn (with the layers unrolled, the CPU default, one
more copy of the KV cache and of the params), and the trainer adds the warm start's SFT
step (`warm_start`: its activations, gradients and optimizer state); it counts the largest
of these passes, which never overlap. `jaxagent.train.compiled` compiles each of them at a
run's shapes for comparison (`tests/test_train_compiled.py`: every shipped config within
1.5x). `check_memory` makes this estimate for a run's config and placement, logs it and
compares it with the device's memory before anything is compiled.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxagent.models.attention import live_bytes
from jaxagent.parallel.mesh import (
    LOGICAL_AXIS_RULES,
    ROLLOUT_AXIS_RULES,
    MeshConfig,
    Rules,
    axis_sizes,
    like_params_specs,
    param_specs,
    rules_dict,
)

COMPONENTS = ("params", "opt_state", "grads", "activations", "kv_cache")


class DoesNotFitError(MemoryError):
    """The estimated per-device memory of a run exceeds the device's."""


def shard_bytes(tree, specs, mesh) -> int:
    """Bytes of the largest shard of every leaf of `tree` (arrays or ShapeDtypeStructs),
    summed: the per-device size of `tree` laid out by `specs` on `mesh`."""
    sizes = axis_sizes(mesh)
    total = 0
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for x, spec in zip(leaves, spec_leaves, strict=True):
        dims = list(np.shape(x))
        for i, part in enumerate(tuple(spec)):
            if part is None:
                continue
            n = math.prod(sizes[a] for a in ((part,) if isinstance(part, str) else part))
            dims[i] = -(-dims[i] // n)
        total += math.prod(dims) * _itemsize(x.dtype)
    return int(total)


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8
    return int(np.dtype(dtype).itemsize)


def _abstract_params(model_config, dtype, critic: bool):
    from jaxagent.models import add_lora, init_params, value_params_from_policy

    key = jax.random.key(0)
    base = model_config.replace(lora=None)

    def build():
        p = init_params(key, base, dtype)
        if model_config.lora is not None:
            p, _ = add_lora(key, p, base, model_config.lora)
        return p

    params = jax.eval_shape(build)
    critic_params = None
    if critic:
        critic_params = jax.eval_shape(lambda: value_params_from_policy(key, init_params(key, base, dtype), base))
    return params, critic_params


def _trainable(params):
    from jaxagent.models import has_lora, split_lora

    return split_lora(params)[0] if has_lora(params) else params


def estimate_memory(
    model_config,
    step_config=None,
    mesh=None,
    *,
    batch_size: int,
    seq_len: int,
    param_dtype: str = "float32",
    critic: bool = False,
    sample_batch: int | None = None,
    sample_len: int | None = None,
    kv_dtype: str | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
) -> dict[str, int]:
    """Per-device bytes of a run: {params, opt_state, grads, activations, kv_cache, total}.

    model_config: the policy's `DecoderConfig` (with `lora` for a LoRA run).
    step_config: the `StepConfig` (optimizer, micro-batches, remat, chunks); None = defaults.
    mesh: a `MeshConfig` (resolved), a `Mesh` or {axis: size}; None = one device.
    batch_size, seq_len: the global mini-batch `[B, T]` of one update.
    critic: a PPO critic with the policy's architecture (trunk + value head, full params).
    sample_batch, sample_len: rows and context of the sampler's KV cache (0 when None).
    The formulas are in the module docstring."""
    from jaxagent.train.config.step import StepConfig
    from jaxagent.train.update.state import make_optimizer

    cfg = model_config
    step_config = step_config if step_config is not None else StepConfig()
    if mesh is None:
        mesh = MeshConfig()
    if isinstance(mesh, MeshConfig) and -1 in mesh.shape.values():
        raise ValueError(f"estimate_memory: resolve {mesh} first (mesh.resolve(num_devices))")
    sizes = axis_sizes(mesh)
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"estimate_memory: {name} must be a positive int, got {v!r}")

    params, critic_params = _abstract_params(cfg, param_dtype, critic)
    out: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
    M = step_config.num_micro_batches
    grad_copies = 2 if M > 1 else 1
    for p, optim in ((params, step_config.optim), (critic_params, step_config.critic_optimizer)):
        if p is None:
            continue
        specs = param_specs(p, sizes, rules)
        out["params"] += shard_bytes(p, specs, sizes)
        opt = jax.eval_shape(make_optimizer(optim, p).init, p)
        out["opt_state"] += shard_bytes(opt, like_params_specs(opt, p, specs), sizes)
        trainable = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), _trainable(p))
        out["grads"] += grad_copies * shard_bytes(trainable, _subtree_specs(p, specs, trainable), sizes)

    act_dtype = step_config.compute_dtype or param_dtype  # mixed precision: the passes run in this
    out["activations"] = _activation_bytes(cfg, step_config, sizes, rules, batch_size, seq_len, act_dtype, critic)
    if sample_batch:
        if not sample_len:
            raise ValueError("estimate_memory: sample_len is required with sample_batch")
        out["kv_cache"] = _kv_bytes(cfg, sizes, rules, sample_batch, sample_len, kv_dtype or act_dtype)
    out["total"] = sum(out[k] for k in COMPONENTS)
    return out


def _subtree_specs(params, specs, trainable):
    """The specs of the leaves of `trainable` (a subtree of `params` with None holes)."""
    flat = {
        jax.tree_util.keystr(path): s
        for (path, _), s in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)),
            strict=True,
        )
    }
    return jax.tree_util.tree_map_with_path(lambda path, _: flat[jax.tree_util.keystr(path)], trainable)


def _split(n: int, mesh_axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    """`n` divided by the longest prefix of `mesh_axes` that divides it (the rules' fallback)."""
    axes = [a for a in mesh_axes if sizes.get(a, 1) > 1]
    while axes and n % math.prod(sizes[a] for a in axes):
        axes.pop()
    return n // math.prod(sizes[a] for a in axes) if axes else n


def _activation_bytes(cfg, step_config, sizes, rules, B, T, dtype, critic) -> int:
    table = rules_dict(rules)
    a = int(np.dtype(dtype).itemsize)
    f = 4
    batch_shards = math.prod(sizes[x] for x in table["batch"] if x in sizes)
    b = -(-B // (step_config.num_micro_batches * batch_shards))
    L, D, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    H = _split(cfg.num_heads, table["heads"], sizes)
    K = _split(cfg.num_kv_heads, table["heads"], sizes)
    F = _split(cfg.intermediate_size, table["mlp"], sizes)
    V = _split(cfg.vocab_size, table["vocab"], sizes)
    base = 4 * D * a + 2 * D * f + 2 * (H + 2 * K) * hd * a + H * hd * a + 4 * F * a

    def scores(what):  # one layer's attention bytes over the micro-batch's b rows
        return live_bytes(
            cfg.attention, rows=b, heads=H, kv_heads=K, head_dim=hd, q_len=T, k_len=T, itemsize=a, what=what
        )

    per_tok = base + scores("saved") / (b * T)
    remat = step_config.remat
    if not remat:
        saved = per_tok
    elif remat in (True, "full"):
        saved = D * a
    else:  # "dots"
        saved = (H + 2 * K) * hd * a + 2 * D * a + 2 * F * a
    # the layer being differentiated is live whole; recomputed (remat), also its recomputation
    # remat: the recomputed layer's scores, softmax, their gradients and the cast are live
    # at once while it is differentiated (compiled: 15-17 bytes a score from 1,024 tokens on)
    trunk = b * T * (L * saved + per_tok) if not remat else int(b * T * (L * saved + 1.5 * base) + scores("backward"))
    head = 2 * b * T * D * (a + f) + 3 * b * min(T, step_config.seq_chunk) * min(V, step_config.vocab_chunk) * f
    policy = trunk + head
    # the critic's forward and backward are in the same compiled step as the policy's, and
    # XLA keeps both sets of saved activations live (compiled: 2.0x the policy's alone)
    return int(policy + trunk + b * T * D * (a + f) if critic else policy)


def _forward_layer(
    model_config, mesh, rules: Rules, *, rows: int, attended: int, a: int, queries: int = 1
) -> tuple[int, int, int]:
    """`(b, per_token, V)` of a forward-only pass on this device: its rows, one layer's
    bytes a token whose attention spans `attended` slots (dense: the scores counted three
    times, `H attended (2 4 + a)`: the float32 scores, their float32 softmax and the cast
    probabilities are live at once; `attention.live_bytes(what="forward")` for `queries`
    tokens a row, spread over them), and its share of the vocabulary."""
    sizes = axis_sizes(mesh if mesh is not None else MeshConfig())
    table = rules_dict(rules)
    cfg, f = model_config, 4
    b = -(-rows // math.prod(sizes[x] for x in table["batch"] if x in sizes))
    D, hd = cfg.hidden_size, cfg.head_dim
    H = _split(cfg.num_heads, table["heads"], sizes)
    K = _split(cfg.num_kv_heads, table["heads"], sizes)
    F = _split(cfg.intermediate_size, table["mlp"], sizes)
    V = _split(cfg.vocab_size, table["vocab"], sizes)
    attn = live_bytes(
        cfg.attention,
        rows=b,
        heads=H,
        kv_heads=K,
        head_dim=hd,
        q_len=queries,
        k_len=attended,
        itemsize=a,
        what="forward",
    ) / (b * queries)
    # the MLP's gate and up projections (their product replaces one of them): nothing is
    # kept for a backward pass, so XLA frees them as it goes
    per_tok = 4 * D * a + 2 * D * f + 2 * (H + 2 * K) * hd * a + attn + H * hd * a + 2 * F * a
    return b, int(per_tok), V


def forward_activation_bytes(
    model_config,
    step_config=None,
    mesh=None,
    *,
    rows: int,
    seq_len: int,
    param_dtype: str = "float32",
    rules: Rules = LOGICAL_AXIS_RULES,
) -> int:
    """Per-device bytes live in a forward-only pass (the log-prob pass) over `rows` rows of
    `seq_len` tokens: one layer's activations (nothing is kept for a backward pass) and
    one chunk of logits (module docstring's notation)::

        b T per_token_layer' + b min(T, seq_chunk) min(V, vocab_chunk) 4

    where `per_token_layer'` counts the attention scores three times, `H T (2 4 + a)`:
    the float32 scores, their float32 softmax and the cast probabilities are live at once,
    which dominates long sequences (compiled peaks 0.57-1.0x of this from 256 to 8,192
    tokens; with `H T (4 + a)`, as the update's saved layer counts them, 1.5x at 8,192).
    """
    from jaxagent.train.config.step import StepConfig

    step_config = step_config if step_config is not None else StepConfig()
    T = seq_len
    a = int(np.dtype(step_config.compute_dtype or param_dtype).itemsize)
    b, per_tok, V = _forward_layer(model_config, mesh, rules, rows=rows, attended=T, a=a, queries=T)
    head = b * min(T, step_config.seq_chunk) * min(V, step_config.vocab_chunk) * 4
    return int(b * T * per_tok + head)


def prefill_bytes(
    model_config,
    mesh=None,
    *,
    rows: int,
    max_len: int,
    chunk: int,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
) -> int:
    """Per-device bytes live while the sampler appends a prompt or an observation to
    `rows` cached rows of `max_len` slots, `chunk` tokens at a time
    (`jaxagent.rollout.kernels.APPEND_CHUNK`): one layer's activations of the piece, with
    attention scores over the whole cache (`H S (2 4 + a)` a token, as in the forward
    pass), and one row of logits a row::

        b c per_token_layer(T -> S) + b V 4
    """
    a = int(np.dtype(compute_dtype or param_dtype).itemsize)
    c = min(chunk, max_len)
    b, per_tok, V = _forward_layer(model_config, mesh, rules, rows=rows, attended=max_len, a=a, queries=c)
    return int(b * c * per_tok + b * V * 4 + _cpu_upcasts(model_config, mesh, rules, rows=rows, max_len=max_len, a=a))


def _cpu_upcasts(cfg, mesh, rules: Rules, *, rows: int, max_len: int, a: int) -> int:
    """XLA:CPU runs 16-bit matmuls on float32 copies of their operands: the sampler's
    passes then hold a float32 copy of the output projection (`D V 4`) and of one layer's
    keys and values (`2 b K S hd 4`). Zero in float32 and on accelerators."""
    from jaxagent import code_platform

    if a == 4 or code_platform() != "cpu":
        return 0
    sizes = axis_sizes(mesh if mesh is not None else MeshConfig())
    table = rules_dict(rules)
    b = -(-rows // math.prod(sizes[x] for x in table["batch"] if x in sizes))
    K = _split(cfg.num_kv_heads, table["heads"], sizes)
    V = _split(cfg.vocab_size, table["vocab"], sizes)
    return int(cfg.hidden_size * V * 4 + 2 * b * K * max_len * cfg.head_dim * 4)


def decode_bytes(
    model_config,
    mesh=None,
    *,
    rows: int,
    max_len: int,
    unroll_layers: bool,
    param_bytes: int = 0,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    kv_dtype: str | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
) -> int:
    """Per-device bytes live while the sampler decodes a turn for `rows` cached rows of
    `max_len` slots: one token's layer activations, with attention scores over the whole
    cache, and a few rows of logits (sampling: the logits, their processed copy, softmax
    and log-softmax); with the layers unrolled (`jaxagent.rollout.sampler.decode_kernel`,
    the CPU default) also each layer's window copied out of the cache, up to one more
    KV cache, and each layer's weights sliced out of the stacked ones, one more copy of
    the sampler's params (`param_bytes`, per device)::

        b per_token_layer(T -> S) + 4 b V 4 (+ kv_cache + param_bytes when unrolled)
    """
    a = int(np.dtype(compute_dtype or param_dtype).itemsize)
    b, per_tok, V = _forward_layer(model_config, mesh, rules, rows=rows, attended=max_len, a=a)
    copies = 0
    if unroll_layers:
        copies = _kv_bytes(
            model_config,
            axis_sizes(mesh if mesh is not None else MeshConfig()),
            rules,
            rows,
            max_len,
            kv_dtype or compute_dtype or param_dtype,
        ) + int(param_bytes)
    return int(
        copies + b * per_tok + 4 * b * V * 4 + _cpu_upcasts(model_config, mesh, rules, rows=rows, max_len=max_len, a=a)
    )


def host_memory_bytes() -> int | None:
    """The host's available RAM (Linux `MemAvailable`), for CPU devices; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _kv_bytes(cfg, sizes, rules, Bs, S, dtype) -> int:
    table = rules_dict(rules)
    kv_rule = table.get("kv_heads", table["heads"])
    rows = -(-Bs // math.prod(sizes[x] for x in table["batch"] if x in sizes))
    K = _split(cfg.num_kv_heads, kv_rule, sizes)
    return int(2 * cfg.num_layers * rows * K * S * cfg.head_dim * np.dtype(dtype).itemsize)


# ----------------------------------------------------------------------------- reporting
def _gib(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def _components(estimate: dict[str, int]) -> list[str]:
    """`COMPONENTS`, then any extra parts a caller added (e.g. the trainer's sampler copy)."""
    return list(COMPONENTS) + [k for k in estimate if k not in COMPONENTS and k != "total"]


def format_memory(estimate: dict[str, int], device_memory_bytes: int | None = None) -> str:
    """One line for the log before a run: each component (and any extra key a caller
    added), the total, the device's size."""
    parts = " | ".join(f"{k} {_gib(estimate.get(k, 0))}" for k in _components(estimate))
    total = estimate.get("total", sum(estimate.get(k, 0) for k in _components(estimate)))
    tail = f" of {_gib(device_memory_bytes)}" if device_memory_bytes else ""
    return f"memory per device: {parts} | total {_gib(total)}{tail}"


def device_memory_bytes(device: Any | None = None, default: int | None = None) -> int:
    """The device's memory (`memory_stats()["bytes_limit"]`: GPU/TPU); `default` where
    the backend does not say (CPU); an error when neither is known."""
    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if default is not None:
        return int(default)
    raise ValueError(
        f"device_memory_bytes: {device.platform} device {device.id} does not report its memory; pass default= (bytes)"
    )


def check_fits(estimate: dict[str, int], device_memory_bytes: int, *, usable_fraction: float = 0.9) -> None:
    """Raises `DoesNotFitError` (a `MemoryError`) naming every component when the
    estimate exceeds `usable_fraction` of the device's memory."""
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"check_fits: usable_fraction must be in (0, 1], got {usable_fraction!r}")
    total = estimate.get("total", sum(estimate.get(k, 0) for k in _components(estimate)))
    usable = int(device_memory_bytes * usable_fraction)
    if total <= usable:
        return
    parts = ", ".join(f"{k} {_gib(estimate.get(k, 0))}" for k in _components(estimate))
    raise DoesNotFitError(
        f"the run needs about {_gib(total)} per device but {_gib(usable)} is usable "
        f"({usable_fraction:.0%} of {_gib(device_memory_bytes)}): {parts}. To fit: more "
        "mesh.fsdp / mesh.tensor shards, model.remat or more update.micro_batches (activations), "
        "update.logprob_rows (the log-prob pass), a smaller batch (env.tasks_per_iteration, env.group_size: "
        "also the prefill) or context "
        "(rollout.max_context: every pass and the kv_cache)"
    )


def check_memory(config, model_config, mesh, sampler_mesh, *, rows: int, sampler_shares_params: bool, log) -> dict:
    """A run's per-device memory estimate, logged and returned; raises `DoesNotFitError`
    (naming every component) when it exceeds the device's memory (`memory_stats`, else
    `config.device_memory_gb`, else, on CPU devices, the host's available RAM shared by
    the local devices; else no check). Call before anything is compiled.

    config, model_config: the `TrainerConfig` and the policy's `DecoderConfig`.
    mesh: the update's mesh (None: one device); sampler_mesh: the sampler's (the run's
      mesh in one process, this process's devices with several; None: one device).
    rows: the rollout rows this process plays (`Placement.rows`).
    sampler_shares_params: the sampler runs on the state's own buffers
      (`Placement.sampler_params_shared`), so it costs no copy of the params.
    log: receives the estimate's line."""
    est = _run_estimate(
        config, model_config, mesh, sampler_mesh, rows=rows, sampler_shares_params=sampler_shares_params
    )
    device_bytes, where = _memory_available(config)
    log(
        format_memory(est, device_bytes)
        + ("" if where == "device" or device_bytes is None else f" ({where} / {jax.local_device_count()} devices)")
    )
    if device_bytes is None:
        log("memory check skipped: the device does not report its memory (set device_memory_gb)")
        return est
    try:
        check_fits(est, device_bytes)
    except DoesNotFitError as e:
        layout = "one device" if mesh is None else " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
        raise DoesNotFitError(f"this config does not fit ({layout}): {e}") from None
    return est


def _run_estimate(config, model_config, mesh, sampler_mesh, *, rows: int, sampler_shares_params: bool) -> dict:
    """`check_memory`'s estimate: what stays resident through the run, and the passes that
    run one at a time (the update's activations, the log-prob pass, the sampler's append
    and decode, the warm start's SFT step), of which the total counts the largest."""
    est, sampler_params = _resident_bytes(
        config, model_config, mesh, sampler_mesh, rows=rows, sampler_shares_params=sampler_shares_params
    )
    passes = _pass_bytes(config, model_config, mesh, sampler_mesh, rows=rows, sampler_params=sampler_params)
    est.update(passes)
    one_at_a_time = ["activations", *passes]
    est["total"] = sum(v for k, v in est.items() if k not in ("total", *one_at_a_time)) + max(
        est[k] for k in one_at_a_time
    )
    return est


def _resident_bytes(
    config, model_config, mesh, sampler_mesh, *, rows: int, sampler_shares_params: bool
) -> tuple[dict, int]:
    """The update's estimate (`estimate_memory`) with the sampler's KV cache and the
    params' other copies (cast to the compute dtype, the sampler's own, the KL
    reference); and the sampler's params' bytes per device (in the compute dtype)."""
    cfg, up = config, config.update
    common = dict(param_dtype=cfg.model.dtype)
    est = estimate_memory(
        model_config,
        cfg.step_config,
        mesh,
        batch_size=cfg.env.batch_size // up.mini_batches,
        seq_len=cfg.rollout.max_context,
        critic=cfg.algo.uses_critic,
        **common,
    )
    # the sampler on its own mesh (the run's in one process, this process's devices with
    # several), its params laid out by its own rules: whole over data and fsdp, so more
    # per device than the update's under fsdp; its rows and KV cache over the row axes
    sampler = estimate_memory(
        model_config,
        cfg.step_config,
        sampler_mesh,
        batch_size=1,
        seq_len=1,
        sample_batch=rows,
        sample_len=cfg.rollout.max_context,
        rules=ROLLOUT_AXIS_RULES,
        **common,
    )
    est["kv_cache"] = sampler["kv_cache"]

    def policy_params() -> int:  # the policy's alone (the estimate's params hold the critic's too)
        if not cfg.algo.uses_critic:
            return est["params"]
        return estimate_memory(model_config, cfg.step_config, mesh, batch_size=1, seq_len=1, **common)["params"]

    compute = cfg.model.compute_dtype
    cast = compute is not None and compute != cfg.model.dtype
    ratio = np.dtype(compute).itemsize / np.dtype(cfg.model.dtype).itemsize if cast else 1.0
    sampler_params = int(ratio * sampler["params"])  # the sampler's copy, in the compute dtype
    if cast:  # the update's cast copy (in the update's layout) and the sampler's (in its own)
        est["compute_params"] = int(ratio * policy_params()) + sampler_params
    elif not sampler_shares_params:  # a copy of its own (fsdp > 1, or several processes)
        est["sampler_params"] = sampler_params
    if cfg.loss.kl_coef > 0 or cfg.algo.kl_reward_coef > 0:
        if model_config.lora is not None:  # a copy of the adapters: the float32 trainable leaves
            est["reference"] = est["grads"] // (2 if up.micro_batches > 1 else 1)
        else:
            est["reference"] = policy_params()
    return est, sampler_params


def _pass_bytes(config, model_config, mesh, sampler_mesh, *, rows: int, sampler_params: int) -> dict[str, int]:
    """The passes besides the update that never overlap it or each other: the log-prob
    pass, the sampler's append and decode, and the warm start's SFT step (when enabled)."""
    from jaxagent.rollout.kernels import APPEND_CHUNK, unroll_layers_default

    cfg, up = config, config.update
    B, T = cfg.env.batch_size, cfg.rollout.max_context
    common = dict(param_dtype=cfg.model.dtype)
    out: dict[str, int] = {}
    # the log-prob passes (old policy, reference) run before the update, over the batch's
    # rows `logprob_rows` at a time: the run needs the larger of the two activation figures
    logprob_chunks = 1 if up.logprob_rows is None else B // up.logprob_rows
    pass_rows = (rows if jax.process_count() > 1 else B) // logprob_chunks
    out["logprob_pass"] = forward_activation_bytes(
        model_config, cfg.step_config, mesh, rows=pass_rows, seq_len=T, **common
    )
    # the sampler's appends (in pieces of APPEND_CHUNK tokens) and decodes run during the
    # rollout, on one pipeline group's rows (or the continuous scheduler's slots) at a time
    sampled = cfg.rollout.sampler_rows(rows)
    dtypes = dict(param_dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype, rules=ROLLOUT_AXIS_RULES)
    out["prefill"] = prefill_bytes(model_config, sampler_mesh, rows=sampled, max_len=T, chunk=APPEND_CHUNK, **dtypes)
    out["decode"] = decode_bytes(
        model_config,
        sampler_mesh,
        rows=sampled,
        max_len=T,
        unroll_layers=unroll_layers_default(),
        param_bytes=sampler_params,
        **dtypes,
    )
    if cfg.warm_start.enabled:  # the warm start's SFT steps, before RL, beside a second optimizer state
        from jaxagent.train.warmstart import sft_rows_at_most, sft_step_config

        sft = estimate_memory(
            model_config, sft_step_config(cfg), mesh, batch_size=sft_rows_at_most(cfg), seq_len=T, **common
        )
        out["warm_start"] = sft["activations"] + sft["grads"] + sft["opt_state"]
    return out


def _memory_available(config) -> tuple[int | None, str]:
    """The memory the estimate is compared with, and where that figure comes from:
    ("device": its `memory_stats`, else `config.device_memory_gb`) or, on CPU devices,
    "host RAM available" shared by the local devices; None when none is known."""
    try:
        return device_memory_bytes(), "device"
    except ValueError:
        pass
    if config.device_memory_gb is not None:
        return int(config.device_memory_gb * 2**30), "device"
    if jax.local_devices()[0].platform == "cpu":
        host = host_memory_bytes()  # CPU devices share the host's RAM
        if host is not None:
            return host // jax.local_device_count(), "host RAM available"
    return None, "device"
