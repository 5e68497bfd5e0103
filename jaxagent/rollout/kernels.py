"""The sampler's jitted kernels on a `SamplerState` (`jaxagent.rollout.sampler` is the
host side that pads, buckets and calls them): `append_kernel` (prefill / continuation,
in `APPEND_CHUNK`-token pieces), `decode_kernel` (the on-device decode loop, one
`decode_step` or `decode_step_layers` a token) and the row kernels (select, put,
reset). Pure functions of arrays and static configs.

Finish reasons (`FINISH_REASONS[finish_reason]`): `none` (row not decoded),
`stop_token`, `stop_sequence`, `max_new_tokens`, `cache_full` (the row's cache has
no free slot for another token: the episode cannot go on).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax
import jax.numpy as jnp

from jaxagent.models import decoder
from jaxagent.models.config import DecoderConfig
from jaxagent.rollout.sampling import SamplingConfig, sample_tokens

FINISH_NONE, FINISH_STOP_TOKEN, FINISH_STOP_SEQUENCE, FINISH_LENGTH, FINISH_CACHE_FULL = range(5)
FINISH_REASONS = ("none", "stop_token", "stop_sequence", "max_new_tokens", "cache_full")


@flax.struct.dataclass
class SamplerState:
    """Everything the device keeps between calls for one batch of rows.

    cache:          the decoder KV cache (`cache.lengths [B]` = tokens seen per row).
    next_logits_BxV: float32 logits of each row's next token.
    keys_B:         one typed PRNG key per row.
    """

    cache: decoder.KVCache
    next_logits_BxV: jax.Array
    keys_B: jax.Array

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    @property
    def batch_size(self) -> int:
        return self.next_logits_BxV.shape[0]


@flax.struct.dataclass
class Generation:
    """Result of one `decode` call.

    tokens_BxN:      sampled token ids; entries at `n >= num_tokens[b]` are `pad_id`.
    logprobs_BxN:    log-prob of each sampled token (see the module docstring); 0 beyond.
    num_tokens_B:    tokens sampled per row.
    finish_reason_B: index into `FINISH_REASONS`.
    """

    tokens_BxN: jax.Array
    logprobs_BxN: jax.Array
    num_tokens_B: jax.Array
    finish_reason_B: jax.Array


# ---------------------------------------------------------------- kernels
def _one_query_attention(q_BxHxd, k_BxKxSxd, v_BxKxSxd, allowed_BxS, *, form: str | None = None) -> jax.Array:
    """Attention of one query per row over the cache, `[B, H, hd]`, in float32.

    form: "matmul" = the `G = H / K` query heads of a kv group as the rows of one matmul
      against their keys and values, so each K/V slot is read once per group (the form
      for GPUs and TPUs: the cache read is what bounds decode); "fused" = broadcast,
      multiply and reduce, which XLA:CPU fuses into one loop (faster there for one query
      per row). None = "fused" when `jaxagent.code_platform()` is "cpu", else "matmul".
      Both form each score and output as the same float32 sums.
    """
    if form is None:
        from jaxagent import code_platform

        form = "fused" if code_platform() == "cpu" else "matmul"
    B, H, hd = q_BxHxd.shape
    K = k_BxKxSxd.shape[1]
    k, v = k_BxKxSxd.astype(jnp.float32), v_BxKxSxd.astype(jnp.float32)
    if form == "matmul":
        q = q_BxHxd.reshape(B, K, H // K, hd).astype(jnp.float32)
        s = jnp.einsum("bkgd,bksd->bkgs", q, k) * (1.0 / math.sqrt(hd))
    elif form == "fused":
        q = q_BxHxd.reshape(B, K, H // K, 1, hd).astype(jnp.float32)
        s = jnp.sum(q * k[:, :, None, :, :], axis=-1) * (1.0 / math.sqrt(hd))
    else:
        raise ValueError(f"form must be 'matmul', 'fused' or None, got {form!r}")
    s = jnp.where(allowed_BxS[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)  # the row's own slot is always allowed: never all -inf
    if form == "matmul":
        o = jnp.einsum("bkgs,bksd->bkgd", p, v)
    else:
        o = jnp.sum(p[:, :, :, :, None] * v[:, :, None, :, :], axis=3)
    return o.reshape(B, H, hd).astype(q_BxHxd.dtype)


def _step_inputs(params, config: DecoderConfig, tok_B, write_B, slot_B, max_len: int, width: int):
    """A decode step's embedded tokens `[B, 1, D]`, write slots (`max_len` = dropped),
    attention mask over `width` slots and RoPE tables."""
    write_slot_B = jnp.where(write_B, slot_B, max_len)  # out of range -> dropped
    allowed_BxW = jnp.arange(width)[None, :] <= slot_B[:, None]
    cos, sin = decoder.rope_cos_sin(jnp.minimum(slot_B, max_len - 1)[:, None], config)
    # layout hook (identity unless a sharded sampler traces): rows over the batch axes
    x = decoder.constrain_activation(params["embed"]["embedding"][tok_B[:, None]], decoder.ACTIVATION_AXES["hidden"])
    return x, write_slot_B, allowed_BxW, cos, sin


def _step_logits(params, config: DecoderConfig, x, write_B, slot_B, max_len: int):
    """A decode step's next-token logits `[B, V]` and new cache lengths."""
    h = decoder.rms_norm(x[:, 0], params["final_norm"]["scale"], config.rms_norm_eps)
    lengths = jnp.where(write_B, jnp.minimum(slot_B + 1, max_len), slot_B).astype(jnp.int32)
    return decoder.logits_from_hidden(params, config, h), lengths


def decode_step(
    params,
    config: DecoderConfig,
    tok_B: jax.Array,
    write_B: jax.Array,
    cache: decoder.KVCache,
    window: int | None = None,
) -> tuple[jax.Array, decoder.KVCache]:
    """Feed one token per row (rows with `write_B` False are left unchanged).

    The same maths as `decoder.forward_cached` with `T = 1` (its layer blocks are
    reused), specialised for decode: one scatter per layer into the carried cache and a
    one-query attention. Returns the next-token logits `[B, V]` float32 and the cache.

    window: attend over the first `window` cache slots only (a static size; the caller
      guarantees every written row's slot is below it). Decode is bound by reading the
      cache, so a short window early in a long cache saves most of that traffic.
    """
    c = config
    B = tok_B.shape[0]
    S = cache.max_len
    W = S if window is None else int(window)
    slot_B = cache.lengths
    x, write_slot_B, allowed_BxS, cos, sin = _step_inputs(params, c, tok_B, write_B, slot_B, S, W)
    rows_B = jnp.arange(B)
    hidden_axes, cache_axes = decoder.ACTIVATION_AXES["hidden"], decoder.ACTIVATION_AXES["cache_kv"]

    def layer(carry, inp):
        x, k_all, v_all = carry
        lp, i = inp
        q, k, v = decoder.layer_qkv(lp, x, cos, sin, c)
        layer_B = jnp.full((B,), i, jnp.int32)
        k_all = decoder.scatter_set(k_all, (layer_B, rows_B, slice(None), write_slot_B), k[:, 0])
        v_all = decoder.scatter_set(v_all, (layer_B, rows_B, slice(None), write_slot_B), v[:, 0])
        k_all, v_all = decoder.constrain_activation(k_all, cache_axes), decoder.constrain_activation(v_all, cache_axes)
        k_i, v_i = k_all[i], v_all[i]
        if W < S:
            k_i, v_i = k_i[:, :, :W], v_i[:, :, :W]
        o = _one_query_attention(q[:, 0], k_i, v_i, allowed_BxS)
        return (
            decoder.constrain_activation(decoder.layer_finish(lp, x, o[:, None], c), hidden_axes),
            k_all,
            v_all,
        ), None

    (x, k_all, v_all), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], jnp.arange(c.num_layers)))
    logits, lengths = _step_logits(params, c, x, write_B, slot_B, S)
    return logits, decoder.KVCache(k=k_all, v=v_all, lengths=lengths)


def layer_params(params, config: DecoderConfig) -> list:
    """The stacked `params["layers"]` as one pytree per layer (`[L, ...]` -> L x `[...]`)."""
    return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(config.num_layers)]


def decode_step_layers(
    params,
    layers: Sequence,
    config: DecoderConfig,
    tok_B: jax.Array,
    write_B: jax.Array,
    k_layers: Sequence[jax.Array],
    v_layers: Sequence[jax.Array],
    lengths_B: jax.Array,
    max_len: int,
) -> tuple[jax.Array, list, list, jax.Array]:
    """`decode_step` on per-layer buffers, with the layers unrolled (the same maths, op
    for op: the same results bit for bit).

    layers: `layer_params(params, config)`, sliced once outside the decode loop.
    k_layers, v_layers: per layer `[B, K, W, hd]`, slots `0 .. W - 1` of the cache
      (`W <= max_len`, the attention window; every written row's slot is below `W`).
    lengths_B: the cache lengths (`max_len` slots in all).
    Returns the logits `[B, V]`, the updated buffers and the new lengths.

    Why: XLA:CPU runs the attention and the projections as library fusions, which take
    whole buffers, so inside `decode_step`'s layer scan every step copies each layer's
    weights out of the stacked `[L, ...]` arrays and each layer's window out of the
    stacked cache before reading it. Here the weights are sliced once per call and each
    layer's window is its own loop-carried buffer, written in place and read directly.
    """
    c = config
    B = tok_B.shape[0]
    W = k_layers[0].shape[2]
    x, write_slot_B, allowed_BxW, cos, sin = _step_inputs(params, c, tok_B, write_B, lengths_B, max_len, W)
    rows_B = jnp.arange(B)
    hidden_axes, cache_axes = decoder.ACTIVATION_AXES["hidden"], decoder.ACTIVATION_AXES["cache_kv"][1:]
    ks, vs = list(k_layers), list(v_layers)
    for i, lp in enumerate(layers):
        q, k, v = decoder.layer_qkv(lp, x, cos, sin, c)
        # k[b] -> ks[i][b, :, write[b]] (dropped when write[b] >= W)
        ks[i] = decoder.constrain_activation(
            decoder.scatter_set(ks[i], (rows_B, slice(None), write_slot_B), k[:, 0]), cache_axes
        )
        vs[i] = decoder.constrain_activation(
            decoder.scatter_set(vs[i], (rows_B, slice(None), write_slot_B), v[:, 0]), cache_axes
        )
        o = _one_query_attention(q[:, 0], ks[i], vs[i], allowed_BxW)
        x = decoder.constrain_activation(decoder.layer_finish(lp, x, o[:, None], c), hidden_axes)
    logits, lengths = _step_logits(params, c, x, write_B, lengths_B, max_len)
    return logits, ks, vs, lengths


def _last_logits(params, config, hidden_BxTxD, mask_BxT, old_logits_BxV):
    """Logits at each row's last real token (old logits kept for rows with none)."""
    n_B = jnp.sum(mask_BxT.astype(jnp.int32), axis=1)
    T = mask_BxT.shape[1]
    # index of the last real token: tokens may be left- or right-padded
    idx_B = jnp.max(jnp.where(mask_BxT > 0, jnp.arange(T, dtype=jnp.int32)[None, :], 0), axis=1)
    h_BxD = jnp.take_along_axis(hidden_BxTxD, idx_B[:, None, None], axis=1)[:, 0]
    logits = decoder.logits_from_hidden(params, config, h_BxD)
    return jnp.where((n_B > 0)[:, None], logits, old_logits_BxV)


#: tokens an append feeds the cache at a time: its attention scores are `[B, H, chunk,
#: max_len]`, so a long prompt in one pass would need memory in proportion to its length
#: (16 rows of 1,024 tokens over an 8,192-token cache: 6 GiB on CPU); in chunks it is bounded
APPEND_CHUNK = 256


def _append_once(params, config: DecoderConfig, state: SamplerState, tokens_BxT, mask_BxT) -> SamplerState:
    hidden, cache = decoder.forward_cached(params, config, tokens_BxT, state.cache, attention_mask_BxT=mask_BxT)
    logits = _last_logits(params, config, hidden, mask_BxT, state.next_logits_BxV)
    return state.replace(cache=cache, next_logits_BxV=logits)


def append_kernel(
    params, config: DecoderConfig, state: SamplerState, tokens_BxT, mask_BxT, chunk: int = APPEND_CHUNK
) -> SamplerState:
    """Feed `tokens_BxT` (real where `mask_BxT` is 1) to each row's cache; see the module
    docstring. More than `chunk` tokens go in `chunk`-token pieces one after another (a
    scan: one piece's activations live at a time), each appended after the last; a row
    with no real token in a piece keeps its cache and next logits."""
    B, T = tokens_BxT.shape
    if T <= chunk:
        return _append_once(params, config, state, tokens_BxT, mask_BxT)
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        tokens_BxT = jnp.pad(tokens_BxT, ((0, 0), (0, pad)))
        mask_BxT = jnp.pad(mask_BxT, ((0, 0), (0, pad)))

    def pieces(x):
        return x.reshape(B, n, chunk).swapaxes(0, 1)

    def body(st, xs):
        return _append_once(params, config, st, *xs), None

    state, _ = jax.lax.scan(body, state, (pieces(tokens_BxT), pieces(mask_BxT)))
    return state


def attention_windows(max_len: int, segments: int) -> tuple[int, ...]:
    """Static attention widths of the decode loop's segments: `segments` equal steps up
    to `max_len`, rounded up to multiples of 8 (the last one is `max_len`)."""
    segments = max(1, int(segments))
    ws = set()
    for j in range(1, segments + 1):
        w = -(-(max_len * j) // segments)  # ceil
        ws.add(min(max_len, -(-w // 8) * 8))
    return tuple(sorted(ws | {max_len}))


def unroll_layers_default() -> bool:
    """Whether `decode_kernel` unrolls the layers by default: on the CPU backend, where it
    saves the per-step copies (`decode_step_layers`); `jaxagent.code_platform()`, so
    `JAXAGENT_CODE_PATHS=gpu` takes the accelerators' layer scan on a CPU."""
    from jaxagent import code_platform

    return code_platform() == "cpu"


def _feed(tok_B, run_B, kv, lengths_B, window: int, *, params, config: DecoderConfig, layers, max_len: int):
    """One decode step: (logits, kv, lengths). `kv` is what the loop carries: the stacked
    `(k, v)` for `decode_step`, or per-layer window buffers `(ks, vs)` when `layers` (then
    the layers are unrolled, `decode_step_layers`); the loop body is the same for both."""
    if layers is not None:
        ks, vs = kv
        logits, ks, vs, lengths_B = decode_step_layers(params, layers, config, tok_B, run_B, ks, vs, lengths_B, max_len)
        return logits, (ks, vs), lengths_B
    cache = decoder.KVCache(k=kv[0], v=kv[1], lengths=lengths_B)
    logits, cache = decode_step(params, config, tok_B, run_B, cache, window=window)
    return logits, (cache.k, cache.v), cache.lengths


def _decode_carry(state: SamplerState, active_B, max_new_B, max_new_tokens: int, stop_len: int, pad_id: int):
    """The decode loop's carry before its first step. A row given no tokens is done from
    the start, as if it had reached its length limit, so a call may ask for 0 tokens of
    some rows; `recent` starts as -2, never a token id, so a stop sequence matches only
    tokens generated in this call (not the end of the prompt)."""
    B, N = state.batch_size, max_new_tokens
    done0 = (~active_B) | (max_new_B <= 0)
    reason0 = jnp.where(active_B & (max_new_B <= 0), FINISH_LENGTH, FINISH_NONE).astype(jnp.int32)
    return dict(
        kv=None,  # set per segment: its window's buffers (`_layer_windows`) or the stacked cache
        lengths=state.cache.lengths,
        logits=state.next_logits_BxV,
        step=jnp.int32(0),
        done=done0,
        reason=reason0,
        num=jnp.zeros((B,), jnp.int32),
        toks=jnp.full((B, N), pad_id, jnp.int32),
        logps=jnp.zeros((B, N), jnp.float32),
        recent=jnp.full((B, stop_len), -2, jnp.int32),
    )


def _decode_cond(c, *, window: int, max_len: int, max_new_tokens: int):
    """Whether a segment's loop takes another step: a segment with a window shorter than
    the cache ends as soon as a running row's next slot falls outside it (the next
    segment, with a wider window, goes on from there)."""
    go = (c["step"] < max_new_tokens) & ~jnp.all(c["done"])
    if window < max_len:
        go = go & jnp.all(c["done"] | (c["lengths"] < window))
    return go


def _stop_reasons(tok_B, recent_BxL, num_B, stop_tokens_BxS, stop_seqs_BxQxL, seq_used_BxQ, max_new_B, max_new_tokens):
    """(whether the token just sampled ends each row, the finish reason if it does). A row
    that meets several conditions at once reports the most specific: a stop token, then a
    stop sequence, then the length limit."""
    hit_tok = jnp.any(tok_B[:, None] == stop_tokens_BxS, axis=-1)
    match = jnp.all((stop_seqs_BxQxL < 0) | (stop_seqs_BxQxL == recent_BxL[:, None, :]), axis=-1)
    hit_seq = jnp.any(match & seq_used_BxQ, axis=-1)
    hit_len = num_B >= jnp.minimum(max_new_B, max_new_tokens)
    reason = jnp.where(hit_tok, FINISH_STOP_TOKEN, jnp.where(hit_seq, FINISH_STOP_SEQUENCE, FINISH_LENGTH)).astype(
        jnp.int32
    )
    return hit_tok | hit_seq | hit_len, reason


def _decode_body(
    c,
    *,
    window: int,
    feed,
    keys_B,
    sampling: SamplingConfig,
    pad_id: int,
    stop_tokens_BxS,
    stop_seqs_BxQxL,
    seq_used_BxQ,
    max_new_B,
    max_new_tokens: int,
    max_len: int,
):
    """One step of the decode loop: a token sampled for each running row, written to the
    output and fed to the cache. Rows that are done (or whose cache just filled up) are
    carried along unchanged, as the loop runs every row until all are done."""
    full = c["lengths"] >= max_len
    newly_full = ~c["done"] & full
    run = ~c["done"] & ~full
    tok, logp = sample_tokens(c["logits"], keys_B, c["lengths"], sampling)
    tok = jnp.where(run, tok, pad_id)
    logp = jnp.where(run, logp, 0.0)
    toks = jax.lax.dynamic_update_slice(c["toks"], tok[:, None], (0, c["step"]))
    logps = jax.lax.dynamic_update_slice(c["logps"], logp[:, None], (0, c["step"]))
    logits, kv, lengths = feed(tok, run, c["kv"], c["lengths"], window)
    logits = jnp.where(run[:, None], logits, c["logits"])
    num = c["num"] + run.astype(jnp.int32)
    recent = jnp.where(run[:, None], jnp.concatenate([c["recent"][:, 1:], tok[:, None]], axis=1), c["recent"])
    hit, reason = _stop_reasons(
        tok, recent, num, stop_tokens_BxS, stop_seqs_BxQxL, seq_used_BxQ, max_new_B, max_new_tokens
    )
    stop = run & hit
    reason = jnp.where(stop, reason, jnp.where(newly_full, FINISH_CACHE_FULL, c["reason"]))
    return dict(
        kv=kv,
        lengths=lengths,
        logits=logits,
        step=c["step"] + 1,
        done=c["done"] | stop | newly_full,
        reason=reason,
        num=num,
        toks=toks,
        logps=logps,
        recent=recent,
    )


def _layer_windows(k, v, window: int, num_layers: int):
    """Slots `0 .. window - 1` of each layer's cache as its own buffer, `(ks, vs)`: the
    unrolled loop carries them apart so that a step writes and reads a layer's window in
    place instead of slicing the stacked cache every step (`decode_step_layers`)."""
    layer_axes = decoder.ACTIVATION_AXES["cache_kv"][1:]
    return tuple(
        [decoder.constrain_activation(a[i, :, :, :window], layer_axes) for i in range(num_layers)] for a in (k, v)
    )


def _write_back(k, v, ks, vs):
    """The stacked cache `k`, `v` with the per-layer windows `ks`, `vs` written back in
    place at slot 0; the slots from the window on are unchanged."""
    for i in range(len(ks)):
        k = jax.lax.dynamic_update_slice(k, ks[i][None], (i, 0, 0, 0, 0))
        v = jax.lax.dynamic_update_slice(v, vs[i][None], (i, 0, 0, 0, 0))
    return k, v


def decode_kernel(
    params,
    config: DecoderConfig,
    state: SamplerState,
    active_B,
    max_new_B,
    stop_tokens_BxS,
    stop_seqs_BxQxL,
    *,
    sampling: SamplingConfig,
    max_new_tokens: int,
    pad_id: int = 0,
    window_segments: int = 1,
    unroll_layers: bool | None = None,
) -> tuple[SamplerState, Generation]:
    """Sample up to `min(max_new_B[b], max_new_tokens)` tokens for each active row.

    stop_tokens_BxS: per-row stop token ids, -1 = unused slot. A sampled stop token is
      kept (it is the last token of the row's output and is fed to the cache).
    stop_seqs_BxQxL: per-row stop sequences of generated tokens, right-aligned, -1 on
      the left = padding (a sequence that is all -1 is unused).
    window_segments: the loop runs as consecutive while-loops over growing attention
      windows (`attention_windows`); a segment is left as soon as a running row's next
      slot is outside its window. 1 = always attend over the whole cache.
    unroll_layers: run each step with `decode_step_layers` (layers unrolled, weights sliced
      once per call, each segment's window of each layer's cache copied out once before
      the segment's loop and written back after it) instead of `decode_step` (a layer scan
      on the stacked cache, in place). Same results bit for bit. It costs compile time
      (the layer body is traced `L` times per segment) and memory (the window copies: up
      to one more KV cache in the last segment). None = `unroll_layers_default()`.
    """
    S = state.cache.max_len
    seq_used_BxQ = jnp.any(stop_seqs_BxQxL >= 0, axis=-1)
    unroll = unroll_layers_default() if unroll_layers is None else bool(unroll_layers)
    layers = layer_params(params, config) if unroll else None
    c = _decode_carry(state, active_B, max_new_B, max_new_tokens, stop_seqs_BxQxL.shape[2], pad_id)
    feed = functools.partial(_feed, params=params, config=config, layers=layers, max_len=S)
    body = functools.partial(
        _decode_body,
        feed=feed,
        keys_B=state.keys_B,
        sampling=sampling,
        pad_id=pad_id,
        stop_tokens_BxS=stop_tokens_BxS,
        stop_seqs_BxQxL=stop_seqs_BxQxL,
        seq_used_BxQ=seq_used_BxQ,
        max_new_B=max_new_B,
        max_new_tokens=max_new_tokens,
        max_len=S,
    )
    k, v = state.cache.k, state.cache.v
    for window in attention_windows(S, window_segments):
        c["kv"] = _layer_windows(k, v, window, config.num_layers) if unroll else (k, v)
        cond = functools.partial(_decode_cond, window=window, max_len=S, max_new_tokens=max_new_tokens)
        c = jax.lax.while_loop(cond, functools.partial(body, window=window), c)
        k, v = _write_back(k, v, *c["kv"]) if unroll else c["kv"]
    # rows still running when the loop ran out of steps (max_new_B > N cannot happen: clipped)
    reason = jnp.where(~c["done"], FINISH_LENGTH, c["reason"]).astype(jnp.int32)
    state = state.replace(cache=decoder.KVCache(k=k, v=v, lengths=c["lengths"]), next_logits_BxV=c["logits"])
    return state, Generation(c["toks"], c["logps"], c["num"], reason)


def select_rows_kernel(state: SamplerState, rows_R) -> SamplerState:
    """Rows `rows_R` of a state (a gather on the batch axis; the cache's axis 1)."""
    cache = state.cache
    return SamplerState(
        cache=decoder.KVCache(k=cache.k[:, rows_R], v=cache.v[:, rows_R], lengths=cache.lengths[rows_R]),
        next_logits_BxV=state.next_logits_BxV[rows_R],
        keys_B=state.keys_B[rows_R],
    )


def put_rows_kernel(state: SamplerState, rows_R, sub: SamplerState) -> SamplerState:
    """`state` with rows `rows_R` (distinct) replaced by the rows of `sub` (a scatter on the
    batch axis)."""
    cache, new = state.cache, sub.cache
    return SamplerState(
        cache=decoder.KVCache(
            k=cache.k.at[:, rows_R].set(new.k),
            v=cache.v.at[:, rows_R].set(new.v),
            lengths=cache.lengths.at[rows_R].set(new.lengths),
        ),
        next_logits_BxV=state.next_logits_BxV.at[rows_R].set(sub.next_logits_BxV),
        keys_B=state.keys_B.at[rows_R].set(sub.keys_B),
    )


def reset_rows_kernel(state: SamplerState, rows_R, keys_R) -> SamplerState:
    """Rows `rows_R` emptied (cache length 0) and given the keys `keys_R`; the other
    rows are untouched. A row's stale cache entries are never read: attention and
    appends go by `lengths`."""
    cache = state.cache
    return state.replace(
        cache=cache.replace(lengths=cache.lengths.at[rows_R].set(0)), keys_B=state.keys_B.at[rows_R].set(keys_R)
    )


def copy_rows_kernel(state: SamplerState, src_R, dst_R) -> SamplerState:
    """Rows `dst_R` given the cache and next-token logits of rows `src_R` (their keys kept):
    a prefix prefilled once serves several rows."""
    cache = state.cache
    return state.replace(
        cache=cache.replace(
            k=cache.k.at[:, dst_R].set(cache.k[:, src_R]),
            v=cache.v.at[:, dst_R].set(cache.v[:, src_R]),
            lengths=cache.lengths.at[dst_R].set(cache.lengths[src_R]),
        ),
        next_logits_BxV=state.next_logits_BxV.at[dst_R].set(state.next_logits_BxV[src_R]),
    )


def truncate_rows_kernel(state: SamplerState, rows_R, lengths_R) -> SamplerState:
    """Rows `rows_R` cut back to their first `lengths_R` cached tokens (at most what they
    hold); keys and other rows untouched. The rows' `next_logits_BxV` are stale until
    tokens are appended to them."""
    cache = state.cache
    kept = jnp.minimum(cache.lengths[rows_R], lengths_R)
    return state.replace(cache=cache.replace(lengths=cache.lengths.at[rows_R].set(kept)))
