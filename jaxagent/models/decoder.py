"""One pure-functional decoder for Llama 3.x / SmolLM2 / Qwen2 / Qwen3.

Parameters are a plain nested dict (a pytree); every function here is pure and runs
under `jax.jit` / `jax.grad`. The transformer layers are stacked on a leading `[L]`
axis and run with `lax.scan`, so compile time does not grow with depth.

Parameter tree (kernels are stored `[in, out]`, i.e. `y = x @ kernel`)::

    embed/embedding            [V, D]            ("vocab", "embed")
    layers/input_norm/scale    [L, D]            (None, "embed")
    layers/q_proj/kernel       [L, D, H*hd]      (None, "embed", "heads")   (+ bias [L, H*hd])
    layers/k_proj/kernel       [L, D, K*hd]      (None, "embed", "heads")   (+ bias)
    layers/v_proj/kernel       [L, D, K*hd]      (None, "embed", "heads")   (+ bias)
    layers/o_proj/kernel       [L, H*hd, D]      (None, "heads", "embed")   (+ bias [L, D])
    layers/q_norm/scale        [L, hd]           (None, None)               Qwen3 only
    layers/k_norm/scale        [L, hd]           (None, None)               Qwen3 only
    layers/post_attn_norm/scale[L, D]            (None, "embed")
    layers/gate_proj/kernel    [L, D, F]         (None, "embed", "mlp")
    layers/up_proj/kernel      [L, D, F]         (None, "embed", "mlp")
    layers/down_proj/kernel    [L, F, D]         (None, "mlp", "embed")
    final_norm/scale           [D]               ("embed",)
    lm_head/kernel             [D, V]            ("embed", "vocab")         absent when tied
    (LoRA)  <proj>/lora_a [L, in, r] (None, <in axis>, None); lora_b [L, r, out] (None, None, <out axis>)
    (value) value_head/kernel [D] ("embed",); value_head/bias [] ()

`param_axes(params)` returns the parallel pytree of these logical-axis tuples (one
tuple of `str | None` per leaf, same length as the leaf's rank). The layer axis is
`None` (never sharded). Activations use ("batch", "seq", "embed"); see
`ACTIVATION_AXES`.

Layer maths (pre-norm, HF conventions)::

    h   = x + Attn(RMSNorm(x))
    out = h + W_down (silu(W_gate n) * (W_up n)),  n = RMSNorm(h)
    RMSNorm(x) = scale * x / sqrt(mean(x^2) + eps)        (computed in float32)
    RoPE(x)_p  = x * cos(p f) + rotate_half(x) * sin(p f),
                 rotate_half([x1, x2]) = [-x2, x1],  f = config.inv_freq()
    Attn       = softmax(q k^T / sqrt(hd) + mask) v,  K kv heads shared by H / K q heads
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.attention import AttentionMask, attend
from jaxagent.models.config import DecoderConfig

Params = dict[str, Any]

#: logical axis names of activations and of the KV cache.
ACTIVATION_AXES = {
    "tokens": ("batch", "seq"),
    "hidden": ("batch", "seq", "embed"),
    "logits": ("batch", "seq", "vocab"),
    "cache_kv": (None, "batch", "heads", "seq", None),
    "cache_lengths": ("batch",),
    # the embedding table where tokens are looked up: rows (the vocabulary) over "tensor",
    # the model dimension whole, so the gather's result has the residual stream's layout
    # (an "embed" split would make XLA rematerialize the whole lookup on a mesh)
    "embed_table": ("vocab", None),
}

# An optional layout hook for activations: `constrain(x, logical_axes) -> x`, set while a
# sharded step is traced (`jaxagent.parallel.activation_constraint`). Without it the
# compiler may lay activations out like the FSDP-sharded weights instead of by rows.
_CONSTRAIN: contextvars.ContextVar = contextvars.ContextVar("jaxagent_activation_constraint", default=None)


@contextlib.contextmanager
def activation_constraint(fn):
    """While tracing inside this context, the residual stream is passed through
    `fn(x, ACTIVATION_AXES["hidden"])` after the embedding, each layer and the final norm
    (and `forward_hidden`'s embedding table through `fn(table, ACTIVATION_AXES["embed_table"])`
    before the lookup)."""
    token = _CONSTRAIN.set(fn)
    try:
        yield
    finally:
        _CONSTRAIN.reset(token)


def constrain_activation(x: jax.Array, axes: tuple) -> jax.Array:
    fn = _CONSTRAIN.get()
    return x if fn is None else fn(x, axes)


_PROJ_AXES = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "heads"),
    "v_proj": ("embed", "heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


def as_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return jnp.dtype(dtype)


# ---------------------------------------------------------------- parameters
def init_params(key: jax.Array, config: DecoderConfig, dtype="float32", std: float = 0.02) -> Params:
    """Fresh parameters: N(0, std) matrices, embeddings and biases; RMSNorm scales 1."""
    c = config
    dt = as_dtype(dtype)
    L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
    keys = iter(jax.random.split(key, 16))

    def normal(shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    def ones(shape):
        return jnp.ones(shape, dt)

    layers: dict[str, Any] = {
        "input_norm": {"scale": ones((L, D))},
        "q_proj": {"kernel": normal((L, D, c.q_size))},
        "k_proj": {"kernel": normal((L, D, c.kv_size))},
        "v_proj": {"kernel": normal((L, D, c.kv_size))},
        "o_proj": {"kernel": normal((L, c.q_size, D))},
        "post_attn_norm": {"scale": ones((L, D))},
        "gate_proj": {"kernel": normal((L, D, F))},
        "up_proj": {"kernel": normal((L, D, F))},
        "down_proj": {"kernel": normal((L, F, D))},
    }
    if c.qkv_bias:
        layers["q_proj"]["bias"] = normal((L, c.q_size))
        layers["k_proj"]["bias"] = normal((L, c.kv_size))
        layers["v_proj"]["bias"] = normal((L, c.kv_size))
    if c.o_bias:
        layers["o_proj"]["bias"] = normal((L, D))
    if c.qk_norm:
        layers["q_norm"] = {"scale": ones((L, c.head_dim))}
        layers["k_norm"] = {"scale": ones((L, c.head_dim))}
    params: Params = {
        "embed": {"embedding": normal((c.vocab_size, D))},
        "layers": layers,
        "final_norm": {"scale": ones((D,))},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = {"kernel": normal((D, c.vocab_size))}
    return params


def param_axes(params: Params) -> Any:
    """Logical axis names for every leaf of `params` (a parallel pytree of tuples).

    Use with `jax.tree.map(fn, params, param_axes(params))`; each tuple has one entry
    per array dimension, `None` for an axis that is never sharded.
    """

    def axes(path, leaf) -> tuple:
        names: list[Any] = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        top, last = names[0], names[-1]
        if top == "embed":
            ax: tuple = ("vocab", "embed")
        elif top == "lm_head":
            ax = ("embed", "vocab")
        elif top == "final_norm":
            ax = ("embed",)
        elif top == "value_head":
            ax = ("embed",) if last == "kernel" else ()
        elif top == "layers":
            mod = names[1]
            if mod in _PROJ_AXES:
                a_in, a_out = _PROJ_AXES[mod]
                ax = {
                    "kernel": (None, a_in, a_out),
                    "bias": (None, a_out),
                    "lora_a": (None, a_in, None),
                    "lora_b": (None, None, a_out),
                }[last]
            elif mod in ("q_norm", "k_norm"):
                ax = (None, None)
            else:  # input_norm / post_attn_norm
                ax = (None, "embed")
        else:
            raise ValueError(f"param_axes: unknown parameter {'/'.join(map(str, names))}")
        if len(ax) != np.ndim(leaf):
            raise ValueError(
                f"param_axes: parameter {'/'.join(map(str, names))} has rank {np.ndim(leaf)}, "
                f"expected {len(ax)} for axes {ax}"
            )
        return ax

    return jax.tree_util.tree_map_with_path(axes, params)


def cast_params(params: Params, dtype) -> Params:
    """All floating leaves cast to `dtype`."""
    dt = as_dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def lm_head_kernel(params: Params, config: DecoderConfig) -> jax.Array:
    """The output projection `[D, V]` (the transposed embedding when tied)."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


# ---------------------------------------------------------------- building blocks
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """`scale * x / sqrt(mean(x^2, -1) + eps)`, statistics in float32 (as HF)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return _lead(scale, y.ndim) * y.astype(x.dtype)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """`v` with leading unit axes up to `ndim` (explicit broadcasting, rank-promotion clean)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def rope_cos_sin(positions_BxT: jax.Array, config: DecoderConfig) -> tuple[jax.Array, jax.Array]:
    """cos / sin tables `[B, T, hd]` float32 for integer positions."""
    inv = jnp.asarray(config.inv_freq())  # [hd/2]
    ang = positions_BxT.astype(jnp.float32)[..., None] * inv[None, None, :]  # [B, T, hd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_BxTxNxd: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`x cos + rotate_half(x) sin` with `rotate_half([x1, x2]) = [-x2, x1]`."""
    half = x_BxTxNxd.shape[-1] // 2
    x1, x2 = x_BxTxNxd[..., :half], x_BxTxNxd[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    c = cos[:, :, None, :].astype(x_BxTxNxd.dtype)
    s = sin[:, :, None, :].astype(x_BxTxNxd.dtype)
    return x_BxTxNxd * c + rot * s


def _proj(p: dict, x: jax.Array, config: DecoderConfig) -> jax.Array:
    """`x @ kernel (+ bias) (+ lora_scale * (x @ A) @ B)`.

    Leading dims are flattened so every product is a plain 2-D matmul: XLA:CPU runs the
    backward of a 2-D dot ~3x faster than that of a `bti,io->bto` einsum.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ p["kernel"]
    if "bias" in p:
        y = y + p["bias"][None, :]
    if "lora_a" in p:
        if config.lora is None:
            raise ValueError("params carry LoRA adapters but config.lora is None")
        y = y + (((x2 @ p["lora_a"]) @ p["lora_b"]) * config.lora.scale).astype(y.dtype)
    return y.reshape(*lead, y.shape[-1])


def attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask: AttentionMask, impl: str = "auto") -> jax.Array:
    """Grouped-query attention `softmax(q k^T / sqrt(hd) + mask) v` -> `[B, T, H, hd]`
    (`jaxagent.models.attention.attend`; `impl` as `DecoderConfig.attention`).

    Scores and softmax in float32. A query with no allowed key gets a finite output
    (never NaN); such rows are padding and are masked downstream.
    """
    return attend(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask, kv_layout="bskd", impl=impl)


def cached_attention(q_BxTxHxd, k_BxKxSxd, v_BxKxSxd, mask: AttentionMask, impl: str = "auto") -> jax.Array:
    """`attention` with keys/values in the cache layout `[B, K, S, hd]`."""
    return attend(q_BxTxHxd, k_BxKxSxd, v_BxKxSxd, mask, kv_layout="bksd", impl=impl)


def layer_qkv(lp: dict, x: jax.Array, cos, sin, config: DecoderConfig):
    """One layer's queries, keys and values for ``x [B, T, D]``: pre-attention RMSNorm,
    projections (with bias / q-k norm per family) and RoPE on q and k."""
    c = config
    B, T, _ = x.shape
    n = rms_norm(x, lp["input_norm"]["scale"], c.rms_norm_eps)
    q = _proj(lp["q_proj"], n, c).reshape(B, T, c.num_heads, c.head_dim)
    k = _proj(lp["k_proj"], n, c).reshape(B, T, c.num_kv_heads, c.head_dim)
    v = _proj(lp["v_proj"], n, c).reshape(B, T, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, lp["q_norm"]["scale"], c.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"]["scale"], c.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_finish(lp: dict, x: jax.Array, attn_BxTxHxd: jax.Array, config: DecoderConfig) -> jax.Array:
    """The rest of one layer given its attention output: output projection and
    residual, post-attention RMSNorm, SwiGLU MLP and residual."""
    c = config
    B, T, _ = x.shape
    h = x + _proj(lp["o_proj"], attn_BxTxHxd.reshape(B, T, c.q_size), c)
    n = rms_norm(h, lp["post_attn_norm"]["scale"], c.rms_norm_eps)
    mlp = jax.nn.silu(_proj(lp["gate_proj"], n, c)) * _proj(lp["up_proj"], n, c)
    return h + _proj(lp["down_proj"], mlp, c)


def _maybe_remat(fn, remat):
    if not remat:
        return fn
    policy = None
    if remat == "dots":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    elif remat not in (True, "full"):
        raise ValueError(f"remat must be False, True/'full' or 'dots', got {remat!r}")
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


# ---------------------------------------------------------------- masks / positions
def make_attention_mask(attention_mask_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    """`allowed[b, t, s]`: key `s` is a real token, `s <= t`, and (packed) same segment."""
    T = attention_mask_BxT.shape[1]
    valid = attention_mask_BxT.astype(bool)
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]  # [T, S]
    allowed = causal[None, :, :] & valid[:, None, :]
    if segment_ids_BxT is not None:
        allowed = allowed & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
    return allowed


def default_positions(attention_mask_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    """Position of each token = number of earlier real tokens (of its segment).

    Left padding therefore starts every row at position 0, as HF `generate` does. Packed
    rows: each segment is one contiguous run of a row (as `rollout.episode.pack` lays
    them out), and its first real token is at position 0. O(T) per row.
    """
    m = attention_mask_BxT.astype(jnp.int32)
    count = jnp.cumsum(m, axis=1)  # real tokens up to and including t
    if segment_ids_BxT is None:
        return jnp.maximum(count - 1, 0)
    seg = segment_ids_BxT.astype(jnp.int32)
    T = m.shape[1]
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts, jnp.arange(T, dtype=jnp.int32)[None, :], 0), axis=1)
    before = jnp.take_along_axis(count - m, start, axis=1)  # real tokens before the segment began
    return jnp.maximum(count - before - 1, 0)


# ---------------------------------------------------------------- forward
def forward_hidden(
    params: Params,
    config: DecoderConfig,
    tokens_BxT: jax.Array,
    *,
    attention_mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    remat: bool | str = False,
) -> jax.Array:
    """Final-normed hidden states `[B, T, D]` (params dtype) of a full sequence.

    attention_mask_BxT: 1 = real token, 0 = padding (left or right). Padding keys are
      never attended; outputs at padding queries are finite but meaningless.
    segment_ids_BxT: for packed rows, tokens attend only within their own segment.
    positions_BxT: RoPE positions; default `default_positions(mask, segments)`.
    remat: False, True/'full' (recompute each layer in the backward pass) or 'dots'.
    """
    B, T = tokens_BxT.shape
    if attention_mask_BxT is None:
        attention_mask_BxT = jnp.ones((B, T), jnp.int32)
    if positions_BxT is None:
        positions_BxT = default_positions(attention_mask_BxT, segment_ids_BxT)
    mask = AttentionMask.causal(attention_mask_BxT, segment_ids_BxT)
    cos, sin = rope_cos_sin(positions_BxT, config)
    hidden_axes = ACTIVATION_AXES["hidden"]
    table = constrain_activation(params["embed"]["embedding"], ACTIVATION_AXES["embed_table"])
    x = constrain_activation(table[tokens_BxT], hidden_axes)

    def layer(x, lp):
        q, k, v = layer_qkv(lp, x, cos, sin, config)
        return constrain_activation(
            layer_finish(lp, x, attention(q, k, v, mask, config.attention), config), hidden_axes
        ), None

    x, _ = jax.lax.scan(_maybe_remat(layer, remat), x, params["layers"])
    return constrain_activation(rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps), hidden_axes)


def logits_from_hidden(params: Params, config: DecoderConfig, hidden: jax.Array) -> jax.Array:
    """`hidden @ lm_head` in float32: `[..., V]`. Materialises all logits: prefer
    `jaxagent.models.logprobs` for training losses."""
    w = lm_head_kernel(params, config)
    out = jnp.matmul(hidden.reshape(-1, hidden.shape[-1]), w, preferred_element_type=jnp.float32)
    return out.reshape(*hidden.shape[:-1], w.shape[-1])


def forward(params: Params, config: DecoderConfig, tokens_BxT: jax.Array, **kw) -> jax.Array:
    """Logits `[B, T, V]` float32; keyword arguments as `forward_hidden`."""
    return logits_from_hidden(params, config, forward_hidden(params, config, tokens_BxT, **kw))


# ---------------------------------------------------------------- KV cache
@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values of the tokens seen so far, compacted per row.

    k, v:      [L, B, K, S, hd]  slot `s < lengths[b]` of row `b` holds its s-th real token
                                 (RoPE already applied to k; position = slot index). Heads
                                 before slots, so attention reads each head's keys as one
                                 contiguous `[S, hd]` matrix (no transpose per step).
    lengths:   [B] int32         real tokens cached per row (the next write slot).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def scatter_set(buffer: jax.Array, index, values: jax.Array) -> jax.Array:
    """`buffer.at[index].set(values cast to buffer's dtype, mode="drop")`, for a 16-bit
    float buffer (a bfloat16 KV cache) as the same bits in uint16: the same result, but
    XLA:CPU would otherwise scatter into a float32 copy of the whole buffer."""
    values = values.astype(buffer.dtype)
    if buffer.dtype.itemsize != 2 or not jnp.issubdtype(buffer.dtype, jnp.floating):
        return buffer.at[index].set(values, mode="drop")
    bits = (
        jax.lax.bitcast_convert_type(buffer, jnp.uint16)
        .at[index]
        .set(jax.lax.bitcast_convert_type(values, jnp.uint16), mode="drop")
    )
    return jax.lax.bitcast_convert_type(bits, buffer.dtype)


def init_cache(config: DecoderConfig, batch: int, max_len: int, dtype="float32") -> KVCache:
    """An empty cache of `max_len` slots per row."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    dt = as_dtype(dtype)
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch,), jnp.int32))


def forward_cached(
    params: Params,
    config: DecoderConfig,
    tokens_BxT: jax.Array,
    cache: KVCache,
    *,
    attention_mask_BxT: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Appends `T` new tokens per row to the cache and returns their hidden states.

    Prefill is a call with the whole (left- or right-padded) prompt on an empty cache;
    one-token decode is a call with `T = 1`; appending an observation to a live
    episode is a call with its tokens. Only real tokens (mask 1) are written, packed
    after the row's `lengths[b]` cached tokens, and a real token at slot `p` has RoPE
    position `p` and attends to slots `0..p`. Tokens beyond the cache's capacity are
    dropped (size the cache for prompt + new tokens).

    Returns hidden `[B, T, D]` (final-normed; padding rows meaningless) and the new cache.
    """
    c = config
    B, T = tokens_BxT.shape
    if attention_mask_BxT is None:
        attention_mask_BxT = jnp.ones((B, T), jnp.int32)
    m = attention_mask_BxT.astype(jnp.int32)
    S = cache.max_len
    slot_BxT = cache.lengths[:, None] + jnp.cumsum(m, axis=1) - 1
    write_BxT = jnp.where(m > 0, slot_BxT, S)  # out of range -> dropped by the scatter
    mask = AttentionMask(limit=slot_BxT.astype(jnp.int32))  # slot s <= the query's own slot
    cos, sin = rope_cos_sin(jnp.maximum(slot_BxT, 0), c)
    rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    hidden_axes = ACTIVATION_AXES["hidden"]
    x = constrain_activation(params["embed"]["embedding"][tokens_BxT], hidden_axes)

    def layer(carry, inp):
        x, k_cache, v_cache = carry
        lp, i = inp
        q, k, v = layer_qkv(lp, x, cos, sin, c)
        # scatter straight into the carried [L, ...] buffer (updated in place by XLA)
        layer_BxT = jnp.full((B, T), i, jnp.int32)
        # k[b, t] -> k_cache[i, b, :, write[b, t]]: advanced indices (layer, row, slot) with
        # the head slice in between put the update's dims as [B, T, K, hd].
        k_cache = scatter_set(k_cache, (layer_BxT, rows_BxT, slice(None), write_BxT), k)
        v_cache = scatter_set(v_cache, (layer_BxT, rows_BxT, slice(None), write_BxT), v)
        o = cached_attention(q, k_cache[i].astype(q.dtype), v_cache[i].astype(q.dtype), mask, c.attention)
        return (constrain_activation(layer_finish(lp, x, o, c), hidden_axes), k_cache, v_cache), None

    (x, k_new, v_new), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], jnp.arange(c.num_layers)))
    lengths = jnp.minimum(cache.lengths + jnp.sum(m, axis=1), S).astype(jnp.int32)
    hidden = constrain_activation(rms_norm(x, params["final_norm"]["scale"], c.rms_norm_eps), hidden_axes)
    return hidden, KVCache(k=k_new, v=v_new, lengths=lengths)
