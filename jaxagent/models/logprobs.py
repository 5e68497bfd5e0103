"""Log-probabilities and entropy of given tokens, straight from hidden states.

For hidden states `h [B, T, D]`, output kernel `W [D, V]` and temperature `tau`, the
logits are `l = (h W) / tau` and

    log p(y_t) = l_t[y_t] - logZ_t,           logZ_t = log sum_v exp(l_t[v])
    H_t        = logZ_t - sum_v p_t[v] l_t[v]  (entropy of the softmax, in nats)

Materialising `l` costs `B*T*V*4` bytes (32 x 2048 x 151936 floats = 40 GB). Here the
sequence is cut into chunks of `seq_chunk` tokens (a `lax.scan`) and, inside each,
the vocabulary into chunks of `vocab_chunk` columns (an inner `lax.scan`) that carry
an online (streaming) softmax: with running max `m`, `s = sum exp(l - m)` and
`u = sum exp(l - m) l`, each new block rescales `s, u` by `exp(m_old - m_new)`; at the
end `logZ = m + log s` and `sum p l = u / s`. The inner step is rematerialised
(`jax.checkpoint`), so the backward pass recomputes each `[B, seq_chunk, vocab_chunk]`
block instead of storing it: the logits never exist whole, forward or backward; what
remains is O(B T D) for hidden states and their gradient plus a few `[D, V]` copies
of the kernel (its chunked layout and gradient). Measured by
`benchmarks/w2_model_step.py` (compiled temporary memory, forward + backward): at
B=8, T=2048, D=896, V=151936 the plain computation needs 29.9 GB, this 2.0 GB.
The numbers are the plain computation's up to float32 rounding. Targets must lie in
`[0, V)` (an out-of-range id gets logit 0, not an error: values are not checked
under jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxagent.models.config import DecoderConfig
from jaxagent.models.decoder import Params, forward_hidden, lm_head_kernel


def plain_logprobs_and_entropy(hidden_BxTxD, kernel_DxV, targets_BxT, temperature: float = 1.0):
    """Reference: materialises `[B, T, V]` float32 logits (for tests and benchmarks)."""
    logits = jnp.einsum("btd,dv->btv", hidden_BxTxD, kernel_DxV, preferred_element_type=jnp.float32)
    logits = logits / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_BxT[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, ent


def chunked_logprobs_and_entropy(
    hidden_BxTxD: jax.Array,
    kernel_DxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    temperature: float = 1.0,
    seq_chunk: int = 128,
    vocab_chunk: int = 8192,
) -> tuple[jax.Array, jax.Array]:
    """`(logp_BxT, entropy_BxT)` float32 of `targets` under `softmax(h W / tau)`.

    hidden_BxTxD: hidden states aligned with `targets` (h_t predicts y_t).
    kernel_DxV: the output projection (`lm_head_kernel(params, config)`).
    Never holds more than `[B, seq_chunk, vocab_chunk]` logits at once.
    """
    B, T, D = hidden_BxTxD.shape
    V = kernel_DxV.shape[1]
    if kernel_DxV.shape[0] != D:
        raise ValueError(f"kernel_DxV has shape {kernel_DxV.shape}, expected ({D}, V)")
    if targets_BxT.shape != (B, T):
        raise ValueError(f"targets_BxT has shape {targets_BxT.shape}, expected {(B, T)}")
    tc = max(1, min(seq_chunk, T))
    vc = max(1, min(vocab_chunk, V))
    n_t = -(-T // tc)
    n_v = -(-V // vc)
    h = jnp.pad(hidden_BxTxD, ((0, 0), (0, n_t * tc - T), (0, 0)))
    y = jnp.pad(targets_BxT.astype(jnp.int32), ((0, 0), (0, n_t * tc - T)))
    h = jnp.moveaxis(h.reshape(B, n_t, tc, D), 1, 0)  # [n_t, B, tc, D]
    y = jnp.moveaxis(y.reshape(B, n_t, tc), 1, 0)  # [n_t, B, tc]
    w = jnp.pad(kernel_DxV, ((0, 0), (0, n_v * vc - V)))
    w = jnp.moveaxis(w.reshape(D, n_v, vc), 1, 0)  # [n_v, D, vc]
    inv_tau = 1.0 / temperature

    def seq_step(_, inp):
        h_c, y_c = inp  # [B, tc, D], [B, tc]

        @jax.checkpoint
        def vocab_step(carry, inp):
            m, s, u, tgt_logit = carry
            w_c, j = inp
            logits_c = jnp.matmul(h_c.reshape(B * tc, D), w_c, preferred_element_type=jnp.float32)
            logits_c = logits_c.reshape(B, tc, vc) * inv_tau  # 2-D matmul: its XLA:CPU backward is fast
            col = j * vc + jnp.arange(vc)
            valid = (col < V)[None, None, :]  # [1, 1, vc]
            logits_c = jnp.where(valid, logits_c, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits_c, axis=-1))
            e = jnp.exp(logits_c - m_new[..., None])
            scale = jnp.exp(m - m_new)
            s = s * scale + jnp.sum(e, axis=-1)
            u = u * scale + jnp.sum(e * jnp.where(valid, logits_c, 0.0), axis=-1)
            hit = col[None, None, :] == y_c[..., None]
            tgt_logit = tgt_logit + jnp.sum(jnp.where(hit, logits_c, 0.0), axis=-1)
            return (m_new, s, u, tgt_logit), None

        z = jnp.zeros((B, tc), jnp.float32)
        init = (jnp.full((B, tc), -jnp.inf, jnp.float32), z, z, z)
        (m, s, u, tgt), _ = jax.lax.scan(vocab_step, init, (w, jnp.arange(n_v)))
        log_z = m + jnp.log(s)
        return None, (tgt - log_z, log_z - u / s)

    _, (logp, ent) = jax.lax.scan(seq_step, None, (h, y))
    logp = jnp.moveaxis(logp, 0, 1).reshape(B, n_t * tc)[:, :T]
    ent = jnp.moveaxis(ent, 0, 1).reshape(B, n_t * tc)[:, :T]
    return logp, ent


def token_logprobs(
    params: Params,
    config: DecoderConfig,
    tokens_BxT: jax.Array,
    *,
    attention_mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    temperature: float = 1.0,
    seq_chunk: int = 128,
    vocab_chunk: int = 8192,
    remat: bool | str = False,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of each token given its prefix, aligned with `tokens`.

    `logp[:, t] = log p(tokens[:, t] | tokens[:, :t])` and `entropy[:, t]` the entropy of
    that next-token distribution, for t >= 1; column 0 (no prefix) is 0. Mask the result
    with the loss mask (it is meaningless at padding and at segment starts).
    """
    hidden = forward_hidden(
        params,
        config,
        tokens_BxT,
        attention_mask_BxT=attention_mask_BxT,
        positions_BxT=positions_BxT,
        segment_ids_BxT=segment_ids_BxT,
        remat=remat,
    )
    logp, ent = chunked_logprobs_and_entropy(
        hidden[:, :-1],
        lm_head_kernel(params, config),
        tokens_BxT[:, 1:],
        temperature=temperature,
        seq_chunk=seq_chunk,
        vocab_chunk=vocab_chunk,
    )
    pad = ((0, 0), (1, 0))
    return jnp.pad(logp, pad), jnp.pad(ent, pad)
