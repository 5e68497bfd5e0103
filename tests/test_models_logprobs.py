"""Chunked log-probs / entropy against a float64 NumPy reference written from the formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models as M


def np_reference(h, w, y, tau=1.0):
    """float64: logp, entropy, and the gradients of sum(a*logp + b*H) w.r.t. h and w."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    logits = np.einsum("btd,dv->btv", h, w) / tau
    logits = logits - logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    logp = np.take_along_axis(logp_all, y[..., None], -1)[..., 0]
    ent = -(p * logp_all).sum(-1)
    return logp, ent, p, logp_all


def np_grads(h, w, y, a, b, tau=1.0):
    """d/dl of a*logp_y + b*H:  a (onehot - p)  +  b * (-p (log p + H))."""
    logp, ent, p, logp_all = np_reference(h, w, y, tau)
    onehot = np.eye(w.shape[1])[y]
    dl = a[..., None] * (onehot - p) + b[..., None] * (-p * (logp_all + ent[..., None]))
    dl = dl / tau
    dh = np.einsum("btv,dv->btd", dl, w.astype(np.float64))
    dw = np.einsum("btd,btv->dv", h.astype(np.float64), dl)
    return dh, dw


@pytest.mark.parametrize("seq_chunk,vocab_chunk", [(4, 64), (7, 50), (64, 1000)])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_chunked_matches_float64_reference(seq_chunk, vocab_chunk, tau):
    rng = np.random.RandomState(0)
    B, T, D, V = 3, 13, 16, 301  # T and V not multiples of the chunks
    h = rng.randn(B, T, D).astype(np.float32)
    w = rng.randn(D, V).astype(np.float32) * 0.7
    y = rng.randint(0, V, (B, T))
    logp, ent = jax.jit(M.chunked_logprobs_and_entropy, static_argnames=("temperature", "seq_chunk", "vocab_chunk"))(
        jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), temperature=tau, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk
    )
    ref_logp, ref_ent, _, _ = np_reference(h, w, y, tau)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=1e-5)


def test_chunked_gradients_match_float64_formula():
    rng = np.random.RandomState(1)
    B, T, D, V = 2, 9, 8, 130
    h = rng.randn(B, T, D).astype(np.float32)
    w = rng.randn(D, V).astype(np.float32) * 0.5
    y = rng.randint(0, V, (B, T))
    a = rng.randn(B, T).astype(np.float32)
    b = rng.randn(B, T).astype(np.float32)

    def loss(h, w):
        logp, ent = M.chunked_logprobs_and_entropy(h, w, jnp.asarray(y), seq_chunk=4, vocab_chunk=32, temperature=0.9)
        return jnp.sum(logp * a + ent * b)

    dh, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    ref_dh, ref_dw = np_grads(h, w, y, a, b, tau=0.9)
    np.testing.assert_allclose(np.asarray(dh), ref_dh, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), ref_dw, atol=1e-4, rtol=1e-4)


def test_chunked_never_materialises_full_logits():
    """Compiled temp memory of forward+backward stays far below the [B, T, V] float32 logits."""
    B, T, D, V = 4, 256, 64, 16384
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    y = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def make(fn):
        def loss(h, w, y):
            logp, ent = fn(h, w, y)
            return jnp.sum(logp) + jnp.sum(ent)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    chunked = make(lambda h, w, y: M.chunked_logprobs_and_entropy(h, w, y, seq_chunk=32, vocab_chunk=2048))
    mem = chunked.lower(h, w, y).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = B * T * V * 4
    assert mem < logits_bytes / 4, (mem, logits_bytes)


def test_token_logprobs_align_with_tokens():
    """token_logprobs[:, t] = log p(x_t | x_<t) from an explicit log_softmax of the logits."""
    cfg = M.DecoderConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        model_type="llama",
    )
    params = M.init_params(jax.random.key(0), cfg, std=0.2)
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, 97)
    logp, ent = M.token_logprobs(params, cfg, tokens, seq_chunk=4, vocab_chunk=40)
    logits = np.asarray(M.forward(params, cfg, tokens), np.float64)
    la = logits - logits.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    ref = np.take_along_axis(la[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    ref_ent = -(np.exp(la) * la).sum(-1)[:, :-1]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:], ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent)[:, 1:], ref_ent, atol=2e-5)
    assert np.all(np.asarray(logp)[:, 0] == 0)
