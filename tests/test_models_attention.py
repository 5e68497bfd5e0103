"""The attention implementations (`jaxagent.models.attention`) against a float64 NumPy
attention written from the formula: dense, blocked (flash-style, many small blocks) and
the cuDNN path's argument handling (run with `jax.nn.dot_product_attention`'s XLA kernel:
there is no GPU here); GQA, left and right padding, packed segments, the KV cache's
layout, float32 and bfloat16; the blocked version's hand-written backward against the
dense version's autodiff; and the memory they compile to: the blocked scores never exist
whole, and a prefill at Qwen2.5-1.5B layer shapes stays under 2 GiB of temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.models import attention as A
from jaxagent.models import decoder
from jaxagent.rollout import kernels as S
from jaxagent.train import memory


def reference(q, k, v, allowed):
    """float64 `softmax(q k^T / sqrt(hd) masked) v` with K/V repeated over each group;
    rows with no allowed key are NaN (they are padding: compared nowhere)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, hd = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
    s = np.where(np.asarray(allowed)[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def allowed_np(am, seg=None):
    am = np.asarray(am, bool)
    T = am.shape[1]
    ok = np.tril(np.ones((T, T), bool))[None] & am[:, None, :]
    if seg is not None:
        seg = np.asarray(seg)
        ok &= seg[:, :, None] == seg[:, None, :]
    return ok


def inputs(B=2, T=37, H=6, K=2, hd=16, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, H, hd)).astype(dtype),
        jax.random.normal(ks[1], (B, T, K, hd)).astype(dtype),
        jax.random.normal(ks[2], (B, T, K, hd)).astype(dtype),
    )


PADDING = {"right": [[1] * 30 + [0] * 7, [1] * 37], "left": [[0] * 5 + [1] * 32, [0] * 11 + [1] * 26]}
SEGMENTS = [[1] * 10 + [2] * 20 + [0] * 7, [1] * 20 + [2] * 17]


def run(impl, q, k, v, mask):
    if impl == "cudnn-args":  # the cuDNN path's layout and mask handling on XLA's kernel
        return A._cudnn(q, k, v, mask, implementation="xla")
    return A.attend(q, k, v, mask, impl=impl, block_q=8, block_k=16)


def _parity_cases():
    """Every combination; in the default run float32 with each padding for dense and
    blocked, and one case each for the cuDNN path and bfloat16 (the rest slow: ~1 s each)."""
    default = {
        ("dense", "left", "float32"),
        ("blocked", "left", "float32"),
        ("blocked", "segments", "float32"),
        ("blocked", "right", "float32"),
        ("cudnn-args", "segments", "float32"),
        ("blocked", "left", "bfloat16"),
    }
    return [
        pytest.param(i, p, d, id=f"{i}-{p}-{d}", marks=() if (i, p, d) in default else (pytest.mark.slow,))
        for i in ("dense", "blocked", "cudnn-args")
        for p in ("right", "left", "segments")
        for d in ("float32", "bfloat16")
    ]


@pytest.mark.parametrize("impl, padding, dtype", _parity_cases())
def test_each_implementation_matches_the_float64_formula(impl, padding, dtype):
    q, k, v = inputs(dtype=jnp.dtype(dtype))
    am = np.asarray(PADDING["right" if padding == "segments" else padding])
    seg = np.asarray(SEGMENTS) if padding == "segments" else None
    mask = A.AttentionMask.causal(jnp.asarray(am), None if seg is None else jnp.asarray(seg))
    got = np.asarray(run(impl, q, k, v, mask), np.float64)
    want = reference(q, k, v, allowed_np(am, seg))
    real = am.astype(bool)
    tol = 2e-6 if dtype == "float32" else 3e-2  # bfloat16: the probabilities are cast before p @ v
    np.testing.assert_allclose(got[real], want[real], atol=tol, rtol=tol)
    assert np.isfinite(got).all()  # padding queries: finite, never NaN


@pytest.mark.parametrize("impl", [pytest.param("dense", marks=pytest.mark.slow), "blocked"])
def test_the_cache_layout_and_slot_limits(impl):
    """The prefill's form: keys in `[B, K, S, hd]`, query `t` of row `b` allowed slots
    `0 .. limit[b, t]` (rows at different fill levels, a stale tail past them)."""
    B, T, H, K, hd, Sx = 2, 5, 4, 2, 8, 40
    q, _, _ = inputs(B, T, H, K, hd, seed=1)
    kc, vc = (jax.random.normal(jax.random.key(s), (B, K, Sx, hd)) for s in (2, 3))
    limit = np.array([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]], np.int32)
    got = A.attend(
        q, kc, vc, A.AttentionMask(limit=jnp.asarray(limit)), kv_layout="bksd", impl=impl, block_q=2, block_k=8
    )
    allowed = np.arange(Sx)[None, None, :] <= limit[:, :, None]
    want = reference(q, kc.swapaxes(1, 2), vc.swapaxes(1, 2), allowed)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("padding", [pytest.param("left", marks=pytest.mark.slow), "segments"])
def test_the_blocked_backward_matches_the_dense_autodiff(padding):
    q, k, v = inputs()
    am = jnp.asarray(PADDING["right" if padding == "segments" else padding])
    mask = A.AttentionMask.causal(am, jnp.asarray(SEGMENTS) if padding == "segments" else None)
    w = jax.random.normal(jax.random.key(9), q.shape) * am[:, :, None, None]  # padding queries are masked

    def loss(impl):
        return lambda q, k, v: jnp.sum(A.attend(q, k, v, mask, impl=impl, block_q=8, block_k=16) * w)

    dense = jax.grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
    blocked = jax.jit(jax.grad(loss("blocked"), argnums=(0, 1, 2)))(q, k, v)
    for name, d, b in zip("qkv", dense, blocked, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(d), atol=5e-6, rtol=1e-5, err_msg=name)
    assert float(jnp.max(jnp.abs(dense[1]))) > 0.1  # the check compares real gradients


@pytest.mark.slow  # 7 s; the kernels' parity above is the check, this is the model's wiring
def test_a_model_forward_is_the_same_with_each_implementation():
    cfg = M.DecoderConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    params = M.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 37), 0, 64)
    am = jnp.asarray(PADDING["left"])
    dense = M.forward(params, cfg.replace(attention="dense"), tokens, attention_mask_BxT=am)
    blocked = M.forward(params, cfg.replace(attention="blocked"), tokens, attention_mask_BxT=am)
    real = np.asarray(am, bool)
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(dense)[real], atol=2e-5, rtol=2e-5)


def test_auto_choice_and_bad_names():
    assert A.choose("auto", batch=2, heads=4, q_len=128, k_len=128, dtype=jnp.float32) == "dense"
    assert A.choose("auto", batch=64, heads=12, q_len=256, k_len=4096, dtype=jnp.bfloat16) == "blocked"
    with pytest.raises(ValueError, match="attention implementation must be one of"):
        A.choose("flash", batch=1, heads=1, q_len=1, k_len=1, dtype=jnp.float32)
    with pytest.raises(ValueError, match="DecoderConfig.attention"):
        M.DecoderConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=4,
            attention="flash",
        )


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_blocked_scores_never_exist_whole():
    B, T, H, K, hd = 1, 2048, 8, 2, 32
    q, k, v = (jax.ShapeDtypeStruct((B, T, n, hd), jnp.float32) for n in (H, K, K))
    mask = A.AttentionMask.causal(jnp.ones((B, T), jnp.int32))
    scores = B * H * T * T * 4  # 128 MiB
    dense = temp_bytes(lambda q, k, v: A.attend(q, k, v, mask, impl="dense"), q, k, v)
    blocked = temp_bytes(lambda q, k, v: A.attend(q, k, v, mask, impl="blocked"), q, k, v)
    grad = temp_bytes(
        jax.grad(lambda q, k, v: jnp.sum(A.attend(q, k, v, mask, impl="blocked")), argnums=(0, 1, 2)), q, k, v
    )
    assert dense > scores
    assert blocked < scores / 8 and grad < scores / 4, (blocked, grad, scores)


QWEN25_15B_LAYER = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=1,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    qkv_bias=True,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("attention", ["auto", pytest.param("dense", marks=pytest.mark.slow)])
def test_a_prefill_at_qwen25_15b_layer_shapes_is_bounded_and_within_the_estimate(attention):
    """64 rows append 512 tokens to a 4,096-slot bfloat16 cache (compile only): the
    blocked attention reads only the filled key blocks and keeps one block of scores, so
    the temporaries stay under 2 GiB (dense: 10.4 GiB); within 1.5x of the estimate."""
    B, T, Sx = 64, 512, 4096
    cfg = M.DecoderConfig(**QWEN25_15B_LAYER, attention=attention)
    params = jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg, dtype="bfloat16"))
    state = S.SamplerState(
        cache=jax.eval_shape(lambda: decoder.init_cache(cfg, B, Sx, "bfloat16")),
        next_logits_BxV=jax.ShapeDtypeStruct((B, cfg.vocab_size), jnp.float32),
        keys_B=jax.eval_shape(lambda: jax.random.split(jax.random.key(0), B)),
    )
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    temp = temp_bytes(lambda p, st, t, m: S.append_kernel(p, cfg, st, t, m), params, state, tokens, tokens)
    est = memory.prefill_bytes(cfg, rows=B, max_len=Sx, chunk=S.APPEND_CHUNK, param_dtype="bfloat16")
    if attention == "auto":
        assert temp < 2 * 2**30, temp / 2**30
    else:
        assert temp > 8 * 2**30, temp / 2**30
    assert 1 / 1.5 < temp / est < 1.5, temp / est  # within 1.5x either way (auto: 0.73, dense: 1.04)


def test_the_decode_attentions_two_forms_agree_and_the_accelerator_form_reads_kv_once_per_group():
    """One query per row over the cache: the accelerators' form is a matmul of a kv
    group's query heads against its keys (each slot read once per group, 7x fewer reads
    for Qwen2-0.5B's 14 heads over 2), the CPU's a fused multiply-reduce; the same sums."""
    B, H, K, hd, Sx = 3, 14, 2, 16, 40
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (B, H, hd))
    kc, vc = (jax.random.normal(x, (B, K, Sx, hd)) for x in ks[1:])
    allowed = jnp.arange(Sx)[None, :] <= jnp.array([[5], [39], [17]])
    got = {f: np.asarray(S._one_query_attention(q, kc, vc, allowed, form=f)) for f in ("matmul", "fused")}
    want = reference(q[:, None], kc.swapaxes(1, 2), vc.swapaxes(1, 2), np.asarray(allowed)[:, None])[:, 0]
    for f, o in got.items():
        np.testing.assert_allclose(o, want, atol=2e-6, rtol=2e-6, err_msg=f)
    hlo = jax.jit(lambda *a: S._one_query_attention(*a, form="matmul")).lower(q, kc, vc, allowed).as_text()
    # the query heads of a group are the rows of the score matmul: q [B, K, G, hd] . k [B, K, S, hd]
    assert "dot_general" in hlo and f"tensor<{B}x{K}x{H // K}x{Sx}xf32>" in hlo
    with pytest.raises(ValueError, match="form must be"):
        S._one_query_attention(q, kc, vc, allowed, form="flash")


def test_a_16_bit_cache_is_written_bit_for_bit():
    """`decoder.scatter_set` writes a bfloat16 cache as uint16 bits (XLA:CPU would scatter
    into a float32 copy of it): the same bits as a plain scatter, out-of-range slots dropped."""
    cache = jax.random.normal(jax.random.key(0), (2, 3, 5, 8)).astype(jnp.bfloat16)  # [B, K, S, hd]
    values = jax.random.normal(jax.random.key(1), (2, 3, 3, 8))  # [B, T, K, hd]
    rows = jnp.broadcast_to(jnp.arange(2)[:, None], (2, 3))
    slots = jnp.array([[0, 1, 5], [3, 2, 1]])  # slot 5 is past the end: dropped
    want = cache.at[rows, :, slots].set(values.astype(jnp.bfloat16), mode="drop")
    got = decoder.scatter_set(cache, (rows, slice(None), slots), values)
    assert got.dtype == jnp.bfloat16 and not np.array_equal(np.asarray(got), np.asarray(cache))
    np.testing.assert_array_equal(np.asarray(got.view(jnp.uint16)), np.asarray(want.view(jnp.uint16)))
