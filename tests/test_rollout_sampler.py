"""The KV-cache sampler against independent references: a plain full-forward loop
(no cache) for tokens and log-probs, float64 NumPy for the sampling distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.models import tiny_config
from jaxagent.rollout import GREEDY, Sampler, SamplingConfig, processed_logits, sample_tokens

CFG = tiny_config(vocab_size=97)
PARAMS = M.init_params(jax.random.key(0), CFG, std=0.3)  # peaked logits: distinct argmaxes


_REF_LEN = 64
_forward = jax.jit(lambda params, toks: M.forward(params, CFG, toks))


def full_logits(seq, params=None):
    """float64 logits of the last position of `seq` from a full forward pass (no cache).

    The sequence is right-padded to a fixed length (one compilation): with causal
    attention, padding after the last token cannot change its logits.
    """
    toks = np.zeros((1, _REF_LEN), np.int32)
    toks[0, : len(seq)] = seq
    out = _forward(PARAMS if params is None else params, jnp.asarray(toks))
    return np.asarray(out[0, len(seq) - 1], np.float64)


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference_greedy(prompt, n):
    """Greedy continuation and its log-probs by re-running the whole sequence each step."""
    seq, logps = list(prompt), []
    for _ in range(n):
        lg = full_logits(seq)
        t = int(np.argmax(lg))
        logps.append(log_softmax(lg)[t])
        seq.append(t)
    return seq[len(prompt) :], logps


def np_processed(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64 reference of the sampling distribution (log-probs; -inf outside the support)."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        p = np.exp(log_softmax(z))
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        kept = order[before < top_p]
        thr = z[kept].min()
        z = np.where(z >= thr, z, -np.inf)
    if min_p > 0.0:
        p = np.exp(log_softmax(z))
        z = np.where(p >= min_p * p.max(), z, -np.inf)
    return log_softmax(z)


PROMPTS = [[5, 17, 3, 9, 44, 2, 61], [8, 1], [90, 12, 33, 7]]


def test_greedy_matches_full_forward_loop_with_ragged_prompts():
    s = Sampler(PARAMS, CFG, max_len=32, min_bucket=4)
    _, gen = s.generate(PROMPTS, max_new_tokens=6)
    toks, logps, reasons = Sampler.to_lists(gen)
    for b, p in enumerate(PROMPTS):
        ref_toks, ref_logps = reference_greedy(p, 6)
        assert toks[b] == ref_toks
        np.testing.assert_allclose(logps[b], ref_logps, atol=2e-4)
    assert reasons == ["max_new_tokens"] * 3


def test_temperature_logprobs_are_those_of_the_scaled_distribution():
    s = Sampler(PARAMS, CFG, max_len=32, min_bucket=4)
    for sampling in (
        SamplingConfig(0.7),
        SamplingConfig(1.3, top_k=5),
        SamplingConfig(1.0, top_p=0.8),
        SamplingConfig(1.0, min_p=0.1),
        SamplingConfig(0.9, top_k=20, top_p=0.9, min_p=0.05),
    ):
        _, gen = s.generate(PROMPTS, max_new_tokens=5, sampling=sampling, seed=3)
        toks, logps, _ = Sampler.to_lists(gen)
        for b, p in enumerate(PROMPTS):
            seq = list(p)
            for t, lp in zip(toks[b], logps[b], strict=True):
                ref = np_processed(
                    full_logits(seq), sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
                )
                assert np.isfinite(ref[t]), f"{sampling}: sampled token {t} outside the support"
                np.testing.assert_allclose(lp, ref[t], atol=2e-4)
                seq.append(t)


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=7), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=30, top_p=0.95), dict(top_k=10, top_p=0.7, min_p=0.1)],
)
def test_processed_logits_match_numpy(kw):
    rng = np.random.RandomState(1)
    logits = (rng.randn(4, 97) * 2).astype(np.float32)
    sc = SamplingConfig(temperature=0.8, **kw)
    got = np.asarray(jax.nn.log_softmax(processed_logits(jnp.asarray(logits), sc), axis=-1), np.float64)
    for b in range(4):
        ref = np_processed(logits[b], 0.8, **kw)
        np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(ref))
        np.testing.assert_allclose(got[b][np.isfinite(ref)], ref[np.isfinite(ref)], atol=1e-5)


def test_sampled_frequencies_follow_the_numpy_distribution():
    rng = np.random.RandomState(2)
    logits = (rng.randn(1, 97) * 1.5).astype(np.float32)
    sc = SamplingConfig(temperature=1.2, top_k=12, top_p=0.85)
    n = 20000
    keys = jax.random.split(jax.random.key(7), n)
    toks, _ = jax.jit(lambda k, lg: sample_tokens(lg, k, jnp.zeros((n,), jnp.int32), sc))(
        keys, jnp.broadcast_to(jnp.asarray(logits), (n, 97))
    )
    freq = np.bincount(np.asarray(toks), minlength=97) / n
    p = np.exp(np_processed(logits[0], 1.2, top_k=12, top_p=0.85))
    assert np.all(freq[p == 0] == 0)
    # 5 standard errors of a binomial frequency
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_seeded_determinism_and_row_independence():
    s = Sampler(PARAMS, CFG, max_len=32, min_bucket=4)
    sc = SamplingConfig(1.0)
    a = Sampler.to_lists(s.generate(PROMPTS, max_new_tokens=8, sampling=sc, seed=11)[1])[0]
    b = Sampler.to_lists(s.generate(PROMPTS, max_new_tokens=8, sampling=sc, seed=11)[1])[0]
    c = Sampler.to_lists(s.generate(PROMPTS, max_new_tokens=8, sampling=sc, seed=12)[1])[0]
    assert a == b and a != c
    # row 2 alone, with its own row id, samples exactly what it sampled inside the batch
    st = s.append(s.init_state(1, seed=11, row_ids=[2]), [PROMPTS[2]])
    alone = Sampler.to_lists(s.decode(st, max_new_tokens=8, sampling=sc)[1])[0]
    assert alone[0] == a[2]


def test_stop_tokens_sequences_and_per_row_limits():
    ref = [reference_greedy(p, 8)[0] for p in PROMPTS]
    s = Sampler(PARAMS, CFG, max_len=32, min_bucket=4)
    # row 0 stops at the token it generates 4th; row 1 at a 3-token sequence ending at its 5th;
    # row 2 by its own max_new of 2
    stop_tokens = [[ref[0][3]], [-1], [-1]]
    stop_seqs = [[[96, 96]], [ref[1][2:5]], [[96]]]
    first0 = ref[0].index(ref[0][3])
    _, gen = s.generate(PROMPTS, max_new_tokens=8, stop_tokens=stop_tokens, stop_sequences=stop_seqs, max_new=[8, 8, 2])
    toks, _, reasons = Sampler.to_lists(gen)
    assert toks[0] == ref[0][: first0 + 1] and reasons[0] == "stop_token"
    end1 = next(i for i in range(2, 8) if ref[1][i - 2 : i + 1] == ref[1][2:5])
    assert toks[1] == ref[1][: end1 + 1] and reasons[1] == "stop_sequence"
    assert toks[2] == ref[2][:2] and reasons[2] == "max_new_tokens"
    pad = np.asarray(gen.tokens_BxN)[0, first0 + 1 :]
    assert np.all(pad == 0)


def test_continuation_equals_a_full_forward_of_the_concatenation():
    """prompt -> decode -> append observation -> decode, vs greedy on the whole history."""
    s = Sampler(PARAMS, CFG, max_len=48, min_bucket=4)
    st = s.append(s.init_state(3), PROMPTS)
    st, g1 = s.decode(st, max_new_tokens=4)
    t1 = Sampler.to_lists(g1)[0]
    obs = [[70, 71, 72], None, [5, 6, 7, 8, 9]]  # row 1 gets no observation: it just goes on
    st = s.append(st, obs)
    st, g2 = s.decode(st, max_new_tokens=5, active=[True, True, False])
    t2, l2, r2 = Sampler.to_lists(g2)
    for b in (0, 1):
        hist = PROMPTS[b] + t1[b] + (obs[b] or [])
        ref_t, ref_l = reference_greedy(hist, 5)
        assert t2[b] == ref_t
        np.testing.assert_allclose(l2[b], ref_l, atol=2e-4)
    assert t2[2] == [] and r2[2] == "none"
    np.testing.assert_array_equal(
        np.asarray(st.cache.lengths), [len(PROMPTS[0]) + 4 + 3 + 5, len(PROMPTS[1]) + 4 + 5, len(PROMPTS[2]) + 4 + 5]
    )


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param(GREEDY, marks=pytest.mark.slow),
        pytest.param(SamplingConfig(1.0), marks=pytest.mark.slow),
        SamplingConfig(0.8, top_k=20, top_p=0.9),
    ],
)
def test_unrolled_layers_equal_the_layer_scan_bit_for_bit(sampling):
    """decode_kernel's two paths (layers unrolled on per-layer window buffers, the CPU
    default; a layer scan on the stacked cache) give the same tokens, log-probs and cache,
    over windowed segments, a stop token, inactive rows, per-row limits and a continuation."""
    outs = []
    for unroll in (False, True):
        s = Sampler(PARAMS, CFG, max_len=40, min_bucket=4, window_segments=3, unroll_layers=unroll)
        st, g1 = s.generate(PROMPTS, max_new_tokens=9, sampling=sampling, seed=5, stop_tokens=[11])
        st = s.append(st, [[70, 71, 72], None, [5, 6]])
        st, g2 = s.decode(st, max_new_tokens=7, sampling=sampling, active=[True, False, True], max_new=[7, 7, 4])
        outs.append(jax.device_get((g1, g2, st.cache, st.next_logits_BxV)))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_full_cache_ends_rows_with_cache_full():
    s = Sampler(PARAMS, CFG, max_len=10, min_bucket=4)
    _, gen = s.generate(PROMPTS, max_new_tokens=8)
    toks, _, reasons = Sampler.to_lists(gen)
    assert [len(t) for t in toks] == [3, 8, 6]
    assert reasons == ["cache_full", "max_new_tokens", "cache_full"]
    assert toks[0] == reference_greedy(PROMPTS[0], 3)[0]
    with pytest.raises(ValueError, match="token ids"):
        s.append(s.init_state(1), [[CFG.vocab_size]])
    with pytest.raises(ValueError, match="row 1 gets 11 tokens but its cache has 10 free slots"):
        s.append(s.init_state(2), [[1], [2] * 11])


def test_select_rows_keeps_each_rows_history():
    s = Sampler(PARAMS, CFG, max_len=32, min_bucket=4)
    st = s.append(s.init_state(3), PROMPTS)
    st = s.select_rows(st, [2, 0])
    toks = Sampler.to_lists(s.decode(st, max_new_tokens=4)[1])[0]
    assert toks == [reference_greedy(PROMPTS[2], 4)[0], reference_greedy(PROMPTS[0], 4)[0]]


def test_compilations_are_bounded_over_a_multi_turn_rollout():
    """5 turns of decode + observations of varying lengths: one decode compilation, one
    append compilation per length bucket, nothing recompiled on later rollouts."""
    s = Sampler(PARAMS, CFG, max_len=128, min_bucket=8)
    rng = np.random.RandomState(0)

    def rollout(seed):
        st = s.append(s.init_state(3, seed=seed), PROMPTS)  # bucket 8
        for turn in range(5):
            st, _ = s.decode(st, max_new_tokens=4, sampling=SamplingConfig(1.0), max_new=[4, 3, 2])
            obs = [rng.randint(0, 97, rng.randint(1, 15)).tolist() for _ in range(3)]  # buckets 8, 16
            obs[0] = obs[0][:7]
            obs[1] = obs[1] + [1] * (9 - len(obs[1])) if turn == 0 else obs[1]
            st = s.append(st, obs)
        return st

    rollout(0)
    assert dict(s.trace_counts) == {"append": 2, "decode": 1}
    rollout(1)
    assert dict(s.trace_counts) == {"append": 2, "decode": 1}


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    s = Sampler(PARAMS, CFG, max_len=16, min_bucket=4)
    with pytest.raises(ValueError, match="rows"):
        s.append(s.init_state(2), [[1]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.decode(s.init_state(1), max_new_tokens=0)
    assert GREEDY.greedy


def test_an_append_in_pieces_equals_one_pass_and_a_full_forward():
    """Long appends go to the cache `APPEND_CHUNK` tokens at a time (bounded memory): fed in
    pieces of 8, ragged prompts (left- and right-padded, one row with nothing) give the
    same cache and next-token logits as one pass, and the logits those of a full forward
    pass of the sequence."""
    from jaxagent.rollout.kernels import append_kernel

    s = Sampler(PARAMS, CFG, max_len=64)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, CFG.vocab_size, n)) for n in (37, 20, 0, 9)]
    T = 40
    tokens, mask = np.zeros((4, T), np.int32), np.zeros((4, T), np.int32)
    for r, p in enumerate(prompts):
        lo = 0 if r % 2 == 0 else T - len(p)  # rows 1 and 3 left-padded
        tokens[r, lo : lo + len(p)], mask[r, lo : lo + len(p)] = p, 1
    state = s.init_state(4)
    one = jax.jit(lambda st, t, m: append_kernel(PARAMS, CFG, st, t, m, chunk=10**6))(state, tokens, mask)
    pieces = jax.jit(lambda st, t, m: append_kernel(PARAMS, CFG, st, t, m, chunk=8))(s.init_state(4), tokens, mask)
    np.testing.assert_array_equal(np.asarray(pieces.cache.lengths), [37, 20, 0, 9])
    for a, b in (
        (one.cache.k, pieces.cache.k),
        (one.cache.v, pieces.cache.v),
        (one.next_logits_BxV, pieces.next_logits_BxV),
    ):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    for r, p in enumerate(prompts):
        if p:
            np.testing.assert_allclose(
                np.asarray(pieces.next_logits_BxV[r], np.float64), full_logits(p), rtol=1e-4, atol=1e-4
            )


def test_prefill_shares_equal_prompts_and_gives_appends_state():
    """`Sampler.prefill`: equal prompts are prefilled once (2 distinct prompts of 6 rows:
    a prefill of 2 rows) and copied; the state is `append(init_state(...))`'s (lengths
    and keys exactly, logits to float32 rounding) and decodes the same tokens."""
    cfg = M.tiny_config(vocab_size=97)
    s = Sampler(M.init_params(jax.random.key(0), cfg, std=0.3), cfg, max_len=64)
    a, b = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22]
    prompts = [a, a, b, a, b, b]
    ids = [7, 8, 9, 10, 11, 12]
    seen = []
    append = s.append
    s.append = lambda state, tokens: seen.append(len(tokens)) or append(state, tokens)
    shared = s.prefill(prompts, seed=4, row_ids=ids)
    assert seen == [2]
    s.append = append
    plain = s.append(s.init_state(6, 4, row_ids=ids), prompts)
    np.testing.assert_array_equal(np.asarray(shared.cache.lengths), [7, 7, 3, 7, 3, 3])
    np.testing.assert_array_equal(np.asarray(shared.cache.lengths), np.asarray(plain.cache.lengths))
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(shared.keys_B)), np.asarray(jax.random.key_data(plain.keys_B))
    )
    np.testing.assert_allclose(np.asarray(shared.next_logits_BxV), np.asarray(plain.next_logits_BxV), atol=1e-5)
    for sampling in (SamplingConfig(0.0), SamplingConfig(1.0)):
        g1 = s.decode(s.prefill(prompts, seed=4, row_ids=ids), max_new_tokens=8, sampling=sampling)[1]
        g2 = s.decode(s.append(s.init_state(6, 4, row_ids=ids), prompts), max_new_tokens=8, sampling=sampling)[1]
        np.testing.assert_array_equal(np.asarray(g1.tokens_BxN), np.asarray(g2.tokens_BxN))
        np.testing.assert_allclose(np.asarray(g1.logprobs_BxN), np.asarray(g2.logprobs_BxN), atol=1e-5)
    # all distinct: a plain append of every row
    seen.clear()
    s.append = lambda state, tokens: seen.append(len(tokens)) or append(state, tokens)
    s.prefill([[1], [2], [3]], seed=0)
    assert seen == [3]
