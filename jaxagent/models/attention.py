"""Grouped-query attention: one entry point, three implementations.

`attend(q, k, v, mask)` is the attention of training, the log-prob pass and the
sampler's prefill/append (`jaxagent.models.decoder`). The mask is described, not
materialised (`AttentionMask`): key slot `s` is allowed for query `t` of row `b` when

    s <= limit[b, t]  and  key_valid[b, s]  and  q_segment[b, t] == k_segment[b, s]

(training: `limit = t`, the causal mask, with padding keys invalid and packed rows'
segments; the KV cache: `limit` = the query's own slot). Implementations:

``dense``    the scores `[B, K, G, T, S]` in float32 at once, softmax, `p @ v` (XLA
             fuses it; the fastest for short sequences on a CPU, and the reference).
``blocked``  flash-style: queries in blocks of `block_q`, keys in blocks of `block_k`,
             an online softmax in float32 carried over the key blocks, so at most one
             `[B, K, G, block_q, block_k]` block of scores is live; key blocks past a query
             block's largest `limit` are never read (a causal mask halves the work; a
             prefill reads only the filled part of its cache). The backward pass
             (`jax.custom_vjp`) recomputes each block's scores from the saved
             log-sum-exp instead of keeping `p`. Runs on every backend, exports to TPU.
``cudnn``    `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused
             (flash) attention on an NVIDIA GPU, half-precision inputs only, GQA without
             repeating K/V; the mask goes in as a boolean `[B, 1, T, S]`.
``auto``     (default) `cudnn` on a GPU backend for bfloat16/float16 inputs; otherwise
             `dense` while its scores would take at most `DENSE_SCORE_BYTES`, else `blocked`.

All three compute the scores and the softmax in float32 and cast the probabilities to
the value dtype before `p @ v`. A query with no allowed key gets a finite output (an
average over some values; such rows are padding and masked downstream), never NaN.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import flax
import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "dense", "blocked", "cudnn")
#: `auto` uses `dense` while one layer's float32 scores `B * H * T * S * 4` take at most this
DENSE_SCORE_BYTES = 256 << 20
#: default block sizes of `blocked` (cut to the sequence lengths)
BLOCK_Q = 256
BLOCK_K = 512
#: ... halved (the larger first, down to 64) while one block's float32 scores
#: `B * H * block_q * block_k * 4` would take more than this
BLOCK_SCORE_BYTES = 32 << 20

_NEG = float(np.finfo(np.float32).min)


@flax.struct.dataclass
class AttentionMask:
    """Which keys each query may attend to, as vectors (see the module docstring).

    limit:      [B, T] int32  the largest key slot query `t` may attend to (-1 = none)
    key_valid:  [B, S] bool   or None (every key valid)
    q_segment:  [B, T] int32  with `k_segment [B, S]`, or both None (no segments)
    """

    limit: jax.Array
    key_valid: jax.Array | None = None
    q_segment: jax.Array | None = None
    k_segment: jax.Array | None = None

    @classmethod
    def causal(cls, attention_mask_BxT, segment_ids_BxT=None) -> AttentionMask:
        """Self-attention over one sequence: `s <= t`, padding keys excluded, packed
        rows' tokens within their own segment."""
        B, T = attention_mask_BxT.shape
        limit = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        seg = None if segment_ids_BxT is None else segment_ids_BxT.astype(jnp.int32)
        return cls(limit=limit, key_valid=attention_mask_BxT.astype(bool), q_segment=seg, k_segment=seg)

    def block(self, q0: int | jax.Array, nq: int, k0: int | jax.Array, nk: int) -> jax.Array:
        """`allowed [B, nq, nk]` for queries `q0 .. q0+nq-1` and key slots `k0 .. k0+nk-1`."""
        lim = jax.lax.dynamic_slice_in_dim(self.limit, q0, nq, axis=1)
        slots = k0 + jnp.arange(nk, dtype=jnp.int32)
        allowed = slots[None, None, :] <= lim[:, :, None]
        if self.key_valid is not None:
            allowed = allowed & jax.lax.dynamic_slice_in_dim(self.key_valid, k0, nk, axis=1)[:, None, :]
        if self.q_segment is not None:
            assert self.k_segment is not None, "AttentionMask: q_segment without k_segment"
            qs = jax.lax.dynamic_slice_in_dim(self.q_segment, q0, nq, axis=1)
            ks = jax.lax.dynamic_slice_in_dim(self.k_segment, k0, nk, axis=1)
            allowed = allowed & (qs[:, :, None] == ks[:, None, :])
        return allowed

    def dense(self, S: int) -> jax.Array:
        """`allowed [B, T, S]` at once."""
        return self.block(0, self.limit.shape[1], 0, S)


def choose(impl: str, *, batch: int, heads: int, q_len: int, k_len: int, dtype) -> str:
    """The implementation `attend` runs for `impl` at these shapes (module docstring).

    `cudnn` is chosen by `auto` only when JAX's default backend is a GPU (never under
    `JAXAGENT_CODE_PATHS=gpu` on a CPU: there is no cuDNN to lower it for)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {list(IMPLEMENTATIONS)}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "cudnn"
    return "dense" if batch * heads * q_len * k_len * 4 <= DENSE_SCORE_BYTES else "blocked"


def attend(
    q_BxTxHxd,
    k,
    v,
    mask: AttentionMask,
    *,
    kv_layout: str = "bskd",
    impl: str = "auto",
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """Grouped-query attention `softmax(q k^T / sqrt(hd) + mask) v` -> `[B, T, H, hd]`.

    k, v: `[B, S, K, hd]` (kv_layout "bskd") or the cache layout `[B, K, S, hd]` ("bksd").
    """
    if kv_layout not in ("bskd", "bksd"):
        raise ValueError(f"kv_layout must be 'bskd' or 'bksd', got {kv_layout!r}")
    B, T, H, hd = q_BxTxHxd.shape
    S = k.shape[kv_layout.index("s")]
    K = k.shape[kv_layout.index("k")]
    if H % K:
        raise ValueError(f"attention: {H} query heads are not a multiple of {K} key/value heads")
    which = choose(impl, batch=B, heads=H, q_len=T, k_len=S, dtype=q_BxTxHxd.dtype)
    if which == "dense":
        return _dense(q_BxTxHxd, k, v, mask.dense(S), kv_layout)
    if which == "cudnn":  # cuDNN takes [B, S, K, hd]
        if kv_layout == "bksd":
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        return _cudnn(q_BxTxHxd, k, v, mask)
    return _blocked(q_BxTxHxd, k, v, mask, kv_layout=kv_layout, block_q=block_q, block_k=block_k)


# ------------------------------------------------------------------------------- dense
def _dense(q_BxTxHxd, k, v, allowed_BxTxS, kv_layout: str) -> jax.Array:
    B, T, H, hd = q_BxTxHxd.shape
    K = k.shape[kv_layout.index("k")]
    q = q_BxTxHxd.reshape(B, T, K, H // K, hd)
    s = jnp.einsum(f"btkgd,{kv_layout}->bkgts", q, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(hd))
    s = jnp.where(allowed_BxTxS[:, None, None, :, :], s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum(f"bkgts,{kv_layout}->btkgd", p, v)
    return o.reshape(B, T, H, hd)


# ------------------------------------------------------------------------------- cuDNN
def _cudnn(
    q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask: AttentionMask, *, implementation: Literal["xla", "cudnn"] = "cudnn"
) -> jax.Array:
    """`jax.nn.dot_product_attention` with our mask; `implementation="xla"` runs the same
    argument handling on any backend (how the tests check it without a GPU)."""
    S = k_BxSxKxd.shape[1]
    allowed = mask.dense(S)[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask=allowed, implementation=implementation)


# ----------------------------------------------------------------------------- blocked
def _pad_to(x, axis: int, n: int, value=0):
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocked(q_BxTxHxd, k, v, mask: AttentionMask, *, kv_layout: str, block_q: int, block_k: int) -> jax.Array:
    B, T, H, hd = q_BxTxHxd.shape
    s_axis = kv_layout.index("s")
    S, K = k.shape[s_axis], k.shape[kv_layout.index("k")]
    bq, bk = block_sizes(B * H, T, S, block_q, block_k)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    q = _pad_to(q_BxTxHxd, 1, Tp).reshape(B, Tp, K, H // K, hd)
    k, v = _pad_to(k, s_axis, Sp), _pad_to(v, s_axis, Sp)
    B_ = mask.limit.shape[0]
    key_valid = mask.key_valid if mask.key_valid is not None else jnp.ones((B_, S), bool)
    m = AttentionMask(
        limit=_pad_to(mask.limit.astype(jnp.int32), 1, Tp, -1),
        key_valid=_pad_to(key_valid, 1, Sp, False),
        q_segment=None if mask.q_segment is None else _pad_to(mask.q_segment, 1, Tp),
        k_segment=None if mask.k_segment is None else _pad_to(mask.k_segment, 1, Sp),
    )
    o = _flash(q, k, v, m, kv_layout, bq, bk)
    return o.reshape(B, Tp, H, hd)[:, :T]


def block_sizes(rows_heads: int, T: int, S: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[int, int]:
    """`blocked`'s `(block_q, block_k)` for `rows_heads = B * H` query heads over `T`
    queries and `S` keys: the given sizes cut to the lengths, then halved while a block's
    scores exceed `BLOCK_SCORE_BYTES`."""
    bq, bk = max(1, min(int(block_q), T)), max(1, min(int(block_k), S))
    while rows_heads * bq * bk * 4 > BLOCK_SCORE_BYTES and max(bq, bk) > 64:
        if bk >= bq:
            bk = max(64, bk // 2)
        else:
            bq = max(64, bq // 2)
    return bq, bk


def _key_blocks(limit_Bxbq, bk: int, nk: int):
    """How many key blocks a query block reads: up to its largest limit (0 for none)."""
    return jnp.clip((jnp.max(limit_Bxbq) + bk) // bk, 0, nk).astype(jnp.int32)


def _up(x):
    return x


def _scores(qb, kb, allowed, scale, layout: str):
    s = jnp.einsum(f"btkgd,{layout}->bkgts", qb, kb, preferred_element_type=jnp.float32) * scale
    return jnp.where(allowed[:, None, None], s, _NEG)


def _flash_forward(q, k, v, mask: AttentionMask, layout: str, bq: int, bk: int):
    """`(o [B, Tp, K, G, hd], lse [B, K, G, Tp])` over padded inputs; k, v in `layout`."""
    B, Tp, K, G, hd = q.shape
    ax = layout.index("s")
    nq, nk = Tp // bq, k.shape[ax] // bk
    scale = 1.0 / math.sqrt(hd)

    def q_block(i):
        q0 = i * bq
        qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)
        lim = jax.lax.dynamic_slice_in_dim(mask.limit, q0, bq, axis=1)

        def k_block(j, carry):
            m_, l_, acc = carry
            k0 = j * bk
            kb = _up(jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=ax))
            vb = _up(jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=ax))
            s = _scores(qb, kb, mask.block(q0, bq, k0, bk), scale, layout)
            m_new = jnp.maximum(m_, jnp.max(s, axis=-1))
            corr = jnp.exp(m_ - m_new)
            p = jnp.exp(s - m_new[..., None])
            l_new = l_ * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum(f"bkgts,{layout}->bkgtd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, l_new, acc * corr[..., None] + pv

        init = (
            jnp.full((B, K, G, bq), _NEG, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, hd), jnp.float32),
        )
        m_, l_, acc = jax.lax.fori_loop(0, _key_blocks(lim, bk, nk), k_block, init)
        seen = l_ > 0
        o = jnp.where(seen[..., None], acc / jnp.where(seen, l_, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m_ + jnp.log(jnp.where(seen, l_, 1.0)), jnp.inf)
        return o.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse

    o, lse = jax.lax.map(q_block, jnp.arange(nq))  # [nq, B, bq, K, G, hd], [nq, B, K, G, bq]
    o = o.swapaxes(0, 1).reshape(B, Tp, K, G, hd)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(B, K, G, Tp)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, mask, layout, bq, bk):
    return _flash_forward(q, k, v, mask, layout, bq, bk)[0]


def _flash_fwd(q, k, v, mask, layout, bq, bk):
    o, lse = _flash_forward(q, k, v, mask, layout, bq, bk)
    return o, (q, k, v, mask, o, lse)


def _flash_bwd(layout, bq, bk, res, do):
    q, k, v, mask, o, lse = res
    B, Tp, K, G, hd = q.shape
    ax = layout.index("s")
    Sp = k.shape[ax]
    nq, nk = Tp // bq, Sp // bk
    scale = 1.0 / math.sqrt(hd)
    # D[t] = sum_d do[t, d] o[t, d]: the softmax's backward term, per query head
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 3, 1)  # [B, K, G, Tp]

    def q_block(carry, i):
        dk, dv = carry
        q0 = i * bq
        qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)
        dob = jax.lax.dynamic_slice_in_dim(do, q0, bq, axis=1)
        lse_b = jax.lax.dynamic_slice_in_dim(lse, q0, bq, axis=3)
        delta_b = jax.lax.dynamic_slice_in_dim(delta, q0, bq, axis=3)
        lim = jax.lax.dynamic_slice_in_dim(mask.limit, q0, bq, axis=1)

        def k_block(j, c):
            dq_b, dk, dv = c
            k0 = j * bk
            kb = jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=ax)
            vb = jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=ax)
            s = _scores(qb, kb, mask.block(q0, bq, k0, bk), scale, layout)
            p = jnp.exp(s - lse_b[..., None])  # [B, K, G, bq, bk]
            dv_j = jnp.einsum(f"bkgts,btkgd->{layout}", p.astype(do.dtype), dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum(f"btkgd,{layout}->bkgts", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_b[..., None]) * scale
            dq_b = dq_b + jnp.einsum(f"bkgts,{layout}->btkgd", ds, kb.astype(jnp.float32))
            dk_j = jnp.einsum(f"bkgts,btkgd->{layout}", ds, qb.astype(jnp.float32))
            dk = jax.lax.dynamic_update_slice_in_dim(dk, jax.lax.dynamic_slice_in_dim(dk, k0, bk, ax) + dk_j, k0, ax)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, jax.lax.dynamic_slice_in_dim(dv, k0, bk, ax) + dv_j, k0, ax)
            return dq_b, dk, dv

        dq_b = jnp.zeros((B, bq, K, G, hd), jnp.float32)
        dq_b, dk, dv = jax.lax.fori_loop(0, _key_blocks(lim, bk, nk), k_block, (dq_b, dk, dv))
        return (dk, dv), dq_b.astype(q.dtype)

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(nq))
    dq = dq.swapaxes(0, 1).reshape(q.shape)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------ memory
def live_bytes(
    impl: str, *, rows: int, heads: int, kv_heads: int, head_dim: int, q_len: int, k_len: int, itemsize: int, what: str
) -> int:
    """Bytes of attention scores (and the blocked version's accumulators) live in one
    layer of `rows` rows on one device, for the memory estimate (`jaxagent.train.memory`):

    ``forward``   a forward-only pass (log-prob pass, prefill): dense `R H T S (2 4 + a)`
                  (the float32 scores, their softmax and the cast probabilities);
                  blocked/cuDNN one block's `R H bq bk (2 4 + a)` and the running
                  output `R H bq hd 4`
    ``saved``     what the backward pass keeps of a layer: dense the probabilities
                  `R H T S (4 + a)`; blocked/cuDNN the log-sum-exp `R H T 4`
    ``backward``  a layer while it is differentiated: dense `R H T S (3 4 + a)`;
                  blocked/cuDNN one block's `R H bq bk (4 4 + a)` and float32
                  accumulators of dk and dv `2 R K S hd 4`
    (`a` = `itemsize`; `impl` is resolved by `choose` as `attend` would.)
    """
    dtype = jnp.float32 if itemsize == 4 else jnp.bfloat16
    which = choose(impl, batch=rows, heads=heads, q_len=q_len, k_len=k_len, dtype=dtype)
    R, H, T, S, a = rows, heads, q_len, k_len, itemsize
    if which == "dense":
        per_score = {"forward": 2 * 4 + a, "saved": 4 + a, "backward": 3 * 4 + a}[what]
        return int(R * H * T * S * per_score)
    bq, bk = block_sizes(R * H, T, S)
    if what == "forward":
        return int(R * H * bq * bk * (2 * 4 + a) + R * H * bq * head_dim * 4)
    if what == "saved":
        return int(R * H * T * 4)
    return int(R * H * bq * bk * (4 * 4 + a) + 2 * R * kv_heads * S * head_dim * 4)
