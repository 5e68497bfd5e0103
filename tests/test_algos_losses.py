"""Aggregation, policy/value losses, KL, entropy and truncated IS of ``jaxagent.algos``.

Values come from the float64 NumPy references; gradients are compared with
hand-derived per-token gradients (reference_numpy.*_per_token) times the
aggregation weights, never with the code under test.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_numpy as ref
from algos_testlib import (
    B,
    T,
    assert_close,
    assert_f32,
    assert_finite,
    assert_zero_where_masked,
    jitted,
    multiturn_mask,
    poison,
    randn,
    rng_for,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxagent import algos

# ALGOS_MAX_EXAMPLES=500 for a deeper (slow) property run
SETTINGS = settings(
    max_examples=int(os.environ.get("ALGOS_MAX_EXAMPLES", 15)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
seeds = st.integers(0, 2**31 - 1)
MODES = ref.AGG_MODES
GRTOL, GATOL = 1e-5, 1e-6  # gradients: per-token weights are ~1/N


def _loss(out):
    """Policy losses return (loss, metrics); accept a bare scalar too."""
    return out[0] if isinstance(out, tuple) else out


def _policy_data(seed, empty_rows=(3,), spread=0.3):
    rng = rng_for(seed)
    m = multiturn_mask(rng, empty_rows=empty_rows)
    logp = (-np.abs(randn(rng)) * 0.5 - 0.05).astype(np.float32)
    old = (logp + randn(rng, scale=spread)).astype(np.float32)
    adv = randn(rng)
    isw = rng.uniform(0.5, 2.0, size=(B, T)).astype(np.float32)
    return logp, old, adv, m, isw


SPLIT = (slice(0, 2), slice(2, B))  # uneven micro-batches


@functools.cache
def _accumulate_fn(name, mode, config_items=()):
    """One jitted program per (loss, mode): the full mini-batch value and gradient,
    and the sum over SPLIT micro-batches (each given the global denominators) of
    their values with their concatenated gradients.  ``algos.<name>`` is called as
    ``fn(x, *others, mask, mode=mode, ...)`` and differentiated wrt ``x``."""
    fn = getattr(algos, name)
    config = dict(config_items)

    def loss(x, others, m, **den):
        return _loss(fn(x, *others, m, mode=mode, **config, **den))

    def run(x, others, m, num_tokens, num_seqs):
        full, g_full = jax.value_and_grad(loss)(x, others, m)
        total, grads = 0.0, []
        for sl in SPLIT:
            v, g = jax.value_and_grad(loss)(
                x[sl], tuple(o[sl] for o in others), m[sl], num_tokens=num_tokens, num_seqs=num_seqs, seq_len=m.shape[1]
            )
            total = total + v
            grads.append(g)
        return full, g_full, total, jnp.concatenate(grads)

    return jax.jit(run)


def _check_accumulation(name, mode, x, others, m, **config):
    """Σ micro-batch losses (global denominators) == full loss; same for gradients."""
    n_tok, n_seq, _ = ref.local_counts(m)
    full, g_full, total, g_micro = _accumulate_fn(name, mode, tuple(sorted(config.items())))(
        jnp.asarray(x), tuple(jnp.asarray(o) for o in others), jnp.asarray(m), jnp.float32(n_tok), jnp.float32(n_seq)
    )
    assert_close(total, full, rtol=1e-5, atol=1e-6, err=f"{name} {mode} value")
    assert_close(g_micro, g_full, rtol=1e-5, atol=1e-7, err=f"{name} {mode} grad")
    return full, g_full


# ---------------------------------------------------------------- aggregate


class TestAggregate:
    @pytest.mark.parametrize("mode", MODES)
    def test_matches_reference_and_grad(self, mode):
        rng = rng_for(0)
        m = multiturn_mask(rng, empty_rows=(1, 4))
        L = randn(rng)
        fn = jitted(algos.aggregate, mode=mode)
        val, g = jax.value_and_grad(lambda x: fn(x, m))(jnp.asarray(poison(L, m)))
        assert_f32(val)
        assert_close(val, ref.aggregate(L, m, mode))
        assert_close(g, ref.aggregate_weights(m, mode), rtol=GRTOL, atol=GATOL)
        assert_finite(g)

    @pytest.mark.parametrize("mode", MODES)
    def test_explicit_denominators(self, mode):
        rng = rng_for(1)
        m = multiturn_mask(rng, empty_rows=(2,))
        L = randn(rng)
        got = algos.aggregate(poison(L, m), m, mode, num_tokens=100, num_seqs=13, seq_len=32)
        assert_close(got, ref.aggregate(L, m, mode, 100, 13, 32))

    @pytest.mark.parametrize("mode", MODES)
    def test_microbatch_sum_equals_full(self, mode):
        rng = rng_for(2)
        m = multiturn_mask(rng, empty_rows=(1, 3))
        L = randn(rng)
        full, g_full = _check_accumulation("aggregate", mode, poison(L, m), (), m)
        assert_close(full, ref.aggregate(L, m, mode))
        assert_close(g_full, ref.aggregate_weights(m, mode), rtol=GRTOL, atol=GATOL)

    @pytest.mark.parametrize("mode", MODES)
    def test_all_masked_is_zero_with_zero_grad(self, mode):
        m = np.zeros((B, T), np.float32)
        L = jnp.asarray(poison(np.zeros((B, T)), m))
        val, g = jax.value_and_grad(lambda x: algos.aggregate(x, m, mode))(L)
        assert float(val) == 0.0
        assert np.all(np.asarray(g) == 0)
        # an all-masked micro-batch of a non-empty mini-batch, and zero global counts
        v2 = algos.aggregate(L, m, mode, num_tokens=7, num_seqs=2, seq_len=T)
        v3 = algos.aggregate(L, m, mode, num_tokens=0, num_seqs=0, seq_len=T)
        assert float(v2) == 0.0 and float(v3) == 0.0

    def test_traced_denominators_under_jit(self):
        rng = rng_for(3)
        m = multiturn_mask(rng)
        L = randn(rng)

        @jax.jit
        def f(x, mm, n_tok, n_seq):
            return algos.aggregate(x, mm, "seq-mean-token-mean", num_tokens=n_tok, num_seqs=n_seq)

        assert_close(f(L, m, jnp.int32(40), jnp.int32(9)), ref.aggregate(L, m, "seq-mean-token-mean", 40, 9))

    def test_bool_mask(self):
        rng = rng_for(4)
        m = multiturn_mask(rng, empty_rows=(0,))
        L = randn(rng)
        for mode in MODES:
            assert_close(algos.aggregate(poison(L, m), m.astype(bool), mode), ref.aggregate(L, m, mode), err=mode)

    def test_unknown_mode(self):
        with pytest.raises(ValueError) as e:
            algos.aggregate(np.zeros((B, T), np.float32), np.ones((B, T)), "token-median")
        assert "mode" in str(e.value) or "token-median" in str(e.value)


# ---------------------------------------------------------------- PPO


@functools.cache
def _vg(name, has_aux=False, **config):
    """jit(value_and_grad wrt the first argument) of algos.<name>, one per config."""
    fn = getattr(algos, name)

    def f(x, *args, **kwargs):
        out = fn(x, *args, **config, **kwargs)
        return out if has_aux else _loss(out)

    return jax.jit(jax.value_and_grad(f, has_aux=has_aux))


def _ppo_grad_fn(mode, **kw):
    return _vg("ppo_loss", True, mode=mode, **kw)


def _check_metrics(metrics, ref_metrics):
    for k in ("clipfrac", "clipfrac_lower", "approx_kl"):
        assert k in metrics, k
        assert_f32(metrics[k], k)
        assert_close(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err=k)


class TestPPO:
    @SETTINGS
    @given(seed=seeds, mode=st.sampled_from(MODES))
    def test_matches_reference(self, seed, mode):
        lp, old, adv, m, _ = _policy_data(seed)
        (loss, metrics), g = _ppo_grad_fn(mode)(jnp.asarray(poison(lp, m)), poison(old, m), poison(adv, m), m)
        want, want_g, want_m = ref.ppo_loss(lp, old, adv, m, mode)
        assert_f32(loss)
        assert_close(loss, want, rtol=1e-5, atol=1e-6)
        assert_close(g, want_g, rtol=GRTOL, atol=GATOL)
        _check_metrics(metrics, want_m)

    @SETTINGS
    @given(seed=seeds)
    def test_asymmetric_clip_is_weights_no_dual_clip(self, seed):
        lp, old, adv, m, isw = _policy_data(seed, spread=0.6)
        kw = dict(clip_low=0.2, clip_high=0.28, clip_c=None)
        fn = _ppo_grad_fn("token-mean", **kw)
        (loss, metrics), g = fn(
            jnp.asarray(poison(lp, m)), poison(old, m), poison(adv, m), m, is_weights=poison(isw, m)
        )
        want, want_g, want_m = ref.ppo_loss(lp, old, adv, m, "token-mean", is_weights=isw, **kw)
        assert_close(loss, want, rtol=1e-5, atol=1e-6)
        assert_close(g, want_g, rtol=GRTOL, atol=GATOL)
        _check_metrics(metrics, want_m)

    @SETTINGS
    @given(seed=seeds)
    def test_dual_clip_reference(self, seed):
        lp, old, adv, m, _ = _policy_data(seed, spread=1.5)  # many ratios > 3
        (loss, metrics), g = _ppo_grad_fn("token-sum", clip_c=3.0)(jnp.asarray(lp), old, adv, m)
        want, want_g, want_m = ref.ppo_loss(lp, old, adv, m, "token-sum", clip_c=3.0)
        assert_close(loss, want, rtol=1e-5, atol=1e-5)
        assert_close(g, want_g, rtol=GRTOL, atol=GATOL)
        _check_metrics(metrics, want_m)

    def test_dual_clip_by_hand(self):
        # token-sum so each token's value and gradient can be read off directly
        ratio = np.array([[np.e**2, 2.0, np.e**2, np.e**2]], np.float32)
        adv = np.array([[-1.0, -1.0, 1.0, -1.0]], np.float32)
        old = np.full((1, 4), -1.0, np.float32)
        lp = old + np.log(ratio).astype(np.float32)
        m = np.array([[1, 1, 1, 0]], np.float32)
        f = lambda x: algos.ppo_loss(x, old, adv, m, "token-sum", clip_c=3.0)  # noqa: E731
        (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
        # token 0: A<0, ratio e^2 > c -> capped at -A*c = 3, no gradient
        # token 1: A<0, ratio 2 < c   -> -A*ratio = 2, gradient -A*ratio = 2
        # token 2: A>0, ratio e^2     -> clipped at 1.2: -1.2, no gradient
        assert_close(loss, 3.0 + 2.0 - 1.2)
        assert_close(g, [[0.0, 2.0, 0.0, 0.0]])
        assert_close(metrics["clipfrac_lower"], 1 / 3)
        assert_close(metrics["clipfrac"], 1 / 3)  # only token 2 has l2 > l1
        # without the dual clip token 0 costs e^2 and keeps its gradient
        (loss_nc, met_nc), g_nc = jax.value_and_grad(
            lambda x: algos.ppo_loss(x, old, adv, m, "token-sum", clip_c=None), has_aux=True
        )(jnp.asarray(lp))
        assert_close(loss_nc, np.e**2 + 2.0 - 1.2, rtol=1e-5)
        assert_close(g_nc, [[np.e**2, 2.0, 0.0, 0.0]], rtol=1e-5)
        assert float(met_nc["clipfrac_lower"]) == 0.0

    def test_clip_higher_asymmetry(self):
        ratio = np.array([[1.25, 1.30, 0.79, 0.85]], np.float32)
        adv = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
        old = np.full((1, 4), -2.0, np.float32)
        lp = old + np.log(ratio)
        m = np.ones((1, 4), np.float32)

        def run(lo, hi):
            def f(x):
                return algos.ppo_loss(x, old, adv, m, "token-sum", clip_low=lo, clip_high=hi)

            return jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))

        (loss, met), g = run(0.2, 0.28)
        # 1.25 is inside [0.8, 1.28] -> unclipped; 1.30 clipped at 1.28;
        # 0.79 (A<0) clipped at 0.8; 0.85 inside
        r = np.exp(lp - old)
        assert_close(loss, -r[0, 0] - 1.28 + 0.8 + r[0, 3], rtol=1e-6)
        assert_close(g, [[-r[0, 0], 0.0, 0.0, r[0, 3]]], rtol=1e-6)
        assert_close(met["clipfrac"], 0.5)
        (loss_s, _), g_s = run(0.2, 0.2)
        # symmetric clip: 1.25 is now clipped too
        assert_close(g_s, [[0.0, 0.0, 0.0, r[0, 3]]], rtol=1e-6)
        assert_close(loss_s, -1.2 - 1.2 + 0.8 + r[0, 3], rtol=1e-6)

    def test_log_ratio_clamped_at_20(self):
        lp = np.array([[0.0, -1.0]], np.float32)
        old = np.array([[-50.0, -1.0]], np.float32)
        adv = np.array([[-1.0, 1.0]], np.float32)
        m = np.ones((1, 2), np.float32)
        (loss, met), g = jax.value_and_grad(
            lambda x: algos.ppo_loss(x, old, adv, m, "token-sum", clip_c=None), has_aux=True
        )(jnp.asarray(lp))
        assert_close(loss, np.exp(20.0) - 1.0, rtol=1e-5)
        assert_finite(g)
        assert float(g[0, 0]) == 0.0  # beyond the clamp: no gradient

    @pytest.mark.parametrize("mode", MODES)
    def test_microbatch_accumulation(self, mode):
        lp, old, adv, m, isw = _policy_data(21, empty_rows=(1, 4))
        full, g_full = _check_accumulation(
            "ppo_loss", mode, poison(lp, m), (poison(old, m), poison(adv, m)), m, is_weights=None, clip_high=0.28
        )
        want, want_g, _ = ref.ppo_loss(lp, old, adv, m, mode, clip_high=0.28)
        assert_close(full, want, rtol=1e-5, atol=1e-6)
        assert_close(g_full, want_g, rtol=GRTOL, atol=GATOL)

    @pytest.mark.parametrize("mode", MODES)
    def test_all_masked_batch(self, mode):
        m = np.zeros((B, T), np.float32)
        nan = poison(np.zeros((B, T)), m)
        (loss, metrics), g = _ppo_grad_fn(mode)(jnp.asarray(nan), nan, nan, m)
        assert float(loss) == 0.0
        assert np.all(np.asarray(g) == 0)
        for k, v in metrics.items():
            assert_finite(v, k)

    def test_nan_at_masked_positions_never_leaks(self):
        lp, old, adv, m, isw = _policy_data(5, empty_rows=(0,))
        fn = _ppo_grad_fn("seq-mean-token-mean")
        (loss, metrics), g = fn(
            jnp.asarray(poison(lp, m)), poison(old, m), poison(adv, m), m, is_weights=poison(isw, m)
        )
        assert_finite(loss)
        assert_finite(g)
        assert_zero_where_masked(g, m, "grad")
        for k, v in metrics.items():
            assert_finite(v, k)

    def test_bfloat16_inputs(self):
        lp, old, adv, m, _ = _policy_data(6)
        bf = [jnp.asarray(x, jnp.bfloat16) for x in (lp, old, adv)]
        loss, metrics = algos.ppo_loss(*bf, m)
        assert_f32(loss)
        for k in ("clipfrac", "clipfrac_lower", "approx_kl"):
            assert_f32(metrics[k], k)
        want, _, want_m = ref.ppo_loss(*bf, m)
        assert_close(loss, want, rtol=1e-5, atol=1e-5)
        _check_metrics(metrics, want_m)

    def test_jit_equals_eager(self):
        lp, old, adv, m, isw = _policy_data(7)
        eager = algos.ppo_loss(lp, old, adv, m, "token-mean", 0.2, 0.28, 3.0, isw)
        jit = jax.jit(algos.ppo_loss, static_argnames=("mode", "clip_low", "clip_high", "clip_c"))(
            lp, old, adv, m, mode="token-mean", clip_low=0.2, clip_high=0.28, clip_c=3.0, is_weights=isw
        )
        assert_close(jit[0], eager[0], rtol=1e-6, atol=1e-7)
        for k in eager[1]:
            assert_close(jit[1][k], eager[1][k], rtol=1e-6, atol=1e-7, err=k)


# ---------------------------------------------------------------- GSPO / CISPO


class TestGSPO:
    @SETTINGS
    @given(
        seed=seeds,
        mode=st.sampled_from(["seq-mean-token-mean", "token-mean"]),
        clip=st.sampled_from([(3e-4, 4e-4), (0.2, 0.3)]),
    )
    def test_matches_reference(self, seed, mode, clip):
        lp, old, adv, m, isw = _policy_data(seed, spread=3e-3 if clip[0] < 1e-2 else 0.2)
        kw = dict(mode=mode, clip_low=clip[0], clip_high=clip[1])
        val, g = _vg("gspo_loss", **kw)(jnp.asarray(poison(lp, m)), poison(old, m), poison(adv, m), m)
        want, want_g = ref.gspo_loss(lp, old, adv, m, **kw)
        assert_f32(val)
        assert_close(val, want, rtol=1e-5, atol=1e-6)
        assert_close(g, want_g, rtol=1e-4, atol=GATOL)
        assert_finite(g)
        assert_zero_where_masked(g, m)

    def test_default_mode_and_is_weights(self):
        lp, old, adv, m, isw = _policy_data(8, spread=2e-3)
        got = _loss(algos.gspo_loss(lp, old, adv, m, is_weights=isw))
        want, _ = ref.gspo_loss(lp, old, adv, m, "seq-mean-token-mean", is_weights=isw)
        assert_close(got, want, rtol=1e-5, atol=1e-6)

    def test_sequence_ratio_capped(self):
        # d_seq = 11 > 10: s = e^10, no gradient through the capped ratio
        lp = np.zeros((1, 3), np.float32)
        old = np.full((1, 3), -11.0, np.float32)
        adv = np.full((1, 3), -1.0, np.float32)
        m = np.ones((1, 3), np.float32)
        val, g = jax.value_and_grad(lambda x: _loss(algos.gspo_loss(x, old, adv, m, "token-sum")))(jnp.asarray(lp))
        assert_close(val, 3 * np.exp(10.0), rtol=1e-5)
        assert np.all(np.asarray(g) == 0)

    @pytest.mark.parametrize("mode", MODES)
    def test_microbatch_accumulation(self, mode):
        lp, old, adv, m, _ = _policy_data(9, empty_rows=(1, 4), spread=0.1)
        kw = dict(clip_low=0.05, clip_high=0.08)
        full, g_full = _check_accumulation("gspo_loss", mode, lp, (old, adv), m, **kw)
        want, want_g = ref.gspo_loss(lp, old, adv, m, mode, **kw)
        assert_close(full, want, rtol=1e-5, atol=1e-6)
        assert_close(g_full, want_g, rtol=1e-4, atol=GATOL)

    def test_all_masked_batch(self):
        m = np.zeros((B, T), np.float32)
        nan = poison(np.zeros((B, T)), m)
        val, g = jax.value_and_grad(lambda x: _loss(algos.gspo_loss(x, nan, nan, m)))(jnp.asarray(nan))
        assert float(val) == 0.0
        assert np.all(np.asarray(g) == 0)


class TestCISPO:
    @SETTINGS
    @given(seed=seeds, mode=st.sampled_from(MODES))
    def test_matches_reference(self, seed, mode):
        lp, old, adv, m, isw = _policy_data(seed, spread=0.4)
        val, g = _vg("cispo_loss", mode=mode, clip_low=0.2, clip_high=0.25)(
            jnp.asarray(poison(lp, m)), poison(old, m), poison(adv, m), m, is_weights=poison(isw, m)
        )
        want, want_g = ref.cispo_loss(lp, old, adv, m, mode, 0.2, 0.25, isw)
        assert_f32(val)
        assert_close(val, want, rtol=1e-5, atol=1e-6)
        assert_close(g, want_g, rtol=GRTOL, atol=GATOL)
        assert_zero_where_masked(g, m)

    def test_ratio_is_stop_gradient(self):
        lp = np.array([[-1.0, -0.5]], np.float32)
        old = np.array([[-1.5, -0.5]], np.float32)  # ratio e^0.5 -> clipped to 1.2; ratio 1
        adv = np.array([[2.0, -3.0]], np.float32)
        m = np.ones((1, 2), np.float32)
        val, g = jax.value_and_grad(lambda x: _loss(algos.cispo_loss(x, old, adv, m, "token-sum")))(jnp.asarray(lp))
        assert_close(val, -1.2 * 2.0 * -1.0 + 1.0 * 3.0 * -0.5)
        assert_close(g, [[-1.2 * 2.0, 3.0]])

    @pytest.mark.parametrize("mode", MODES)
    def test_microbatch_accumulation(self, mode):
        lp, old, adv, m, _ = _policy_data(10, empty_rows=(0, 1))  # first micro-batch empty
        full, g_full = _check_accumulation("cispo_loss", mode, lp, (old, adv), m)
        want, want_g = ref.cispo_loss(lp, old, adv, m, mode)
        assert_close(full, want, rtol=1e-5, atol=1e-6)
        assert_close(g_full, want_g, rtol=GRTOL, atol=GATOL)


# ---------------------------------------------------------------- value loss


class TestValueLoss:
    @SETTINGS
    @given(seed=seeds, mode=st.sampled_from(MODES))
    def test_matches_reference(self, seed, mode):
        rng = rng_for(seed)
        m = multiturn_mask(rng, empty_rows=(2,))
        v, vo, ret = randn(rng), randn(rng), randn(rng)
        (val, met), g = _vg("value_loss", True, mode=mode, clip=0.5)(
            jnp.asarray(poison(v, m)), poison(vo, m), poison(ret, m), m
        )
        want, want_g, want_cf = ref.value_loss(v, vo, ret, m, mode, 0.5)
        assert_f32(val)
        assert_close(val, want, rtol=1e-5, atol=1e-6)
        assert_close(g, want_g, rtol=GRTOL, atol=GATOL)
        assert_f32(met["vf_clipfrac"], "vf_clipfrac")
        assert_close(met["vf_clipfrac"], want_cf, atol=1e-6)
        assert_zero_where_masked(g, m)

    @pytest.mark.parametrize("mode", MODES)
    def test_microbatch_and_all_masked(self, mode):
        rng = rng_for(12)
        m = multiturn_mask(rng, empty_rows=(1, 5))
        v, vo, ret = randn(rng), randn(rng), randn(rng)
        full, g_full = _check_accumulation("value_loss", mode, v, (vo, ret), m)
        want, want_g, _ = ref.value_loss(v, vo, ret, m, mode)
        assert_close(full, want, rtol=1e-5, atol=1e-6)
        assert_close(g_full, want_g, rtol=GRTOL, atol=GATOL)
        z = np.zeros((B, T), np.float32)
        nan = poison(z, z)
        (val, _), g = _vg("value_loss", True, mode=mode, clip=0.5)(jnp.asarray(nan), nan, nan, z)
        assert float(val) == 0.0 and np.all(np.asarray(g) == 0)


# ---------------------------------------------------------------- KL


KL_KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
KL_KINDS_ALL = KL_KINDS + [k + "+" for k in KL_KINDS]


def _kl_inputs():
    rng = rng_for(13)
    lp = (-np.abs(randn(rng)) - 0.1).astype(np.float32)
    d = randn(rng, scale=1.5)
    d[0, :4] = [25.0, -25.0, 12.0, -12.0]  # outside the ±20 / ±10 clips of k3
    return lp, (lp - d).astype(np.float32)


class TestKL:
    @pytest.mark.parametrize("kind", KL_KINDS_ALL)
    def test_value_and_grad(self, kind):
        lp, rp = _kl_inputs()
        fn = jitted(algos.kl, kind=kind)
        val = fn(lp, rp)
        g = jax.grad(lambda x: jnp.sum(fn(x, rp)))(jnp.asarray(lp))
        want, want_g = ref.kl(lp, rp, kind)
        assert_f32(val)
        assert val.shape == lp.shape
        assert_close(val, want, rtol=1e-5, atol=1e-5, err=kind)
        assert_close(g, want_g, rtol=1e-5, atol=1e-5, err=kind)

    @pytest.mark.parametrize("base", ["k1", "abs", "k2", "k3"])
    def test_plus_forms_gradient_is_d(self, base):
        lp, rp = _kl_inputs()
        g = jax.grad(lambda x: jnp.sum(algos.kl(x, rp, base + "+")))(jnp.asarray(lp))
        assert_close(g, lp.astype(np.float64) - rp, rtol=1e-5, atol=1e-5)
        assert_close(algos.kl(lp, rp, base + "+"), algos.kl(lp, rp, base), rtol=0, atol=0)

    @pytest.mark.parametrize("kind", ["abs", "abs+", "k1", "k2", "k3", "k3+"])
    def test_policy_equal_to_reference(self, kind):
        # the first step of a run: logp == ref_logp exactly, d = 0 everywhere.
        # abs has gradient sign(0) = 0 there (FORMULAS, and torch.abs in verl).
        lp = _kl_inputs()[0]
        val = algos.kl(lp, lp, kind)
        g = jax.grad(lambda x: jnp.sum(algos.kl(x, lp, kind)))(jnp.asarray(lp))
        want, want_g = ref.kl(lp, lp, kind)
        assert_close(val, want, rtol=0, atol=0, err=kind)
        assert_close(g, want_g, rtol=0, atol=0, err=kind)

    def test_aliases(self):
        lp, rp = _kl_inputs()
        for a, b in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
            assert_close(algos.kl(lp, rp, a), algos.kl(lp, rp, b), rtol=0, atol=0)

    def test_default_is_k3(self):
        lp, rp = _kl_inputs()
        assert_close(algos.kl(lp, rp), ref.kl(lp, rp, "k3")[0], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("kind", ["k3", "k2+"])
    def test_vmap_and_other_shapes(self, kind):
        rng = rng_for(14)
        lp = randn(rng, (3, B, T))
        rp = randn(rng, (3, B, T))
        got = jax.vmap(functools.partial(algos.kl, kind=kind))(lp, rp)
        direct = algos.kl(lp, rp, kind)
        assert_close(got, direct, rtol=1e-6, atol=1e-7)
        assert_close(direct, ref.kl(lp, rp, kind)[0], rtol=1e-5, atol=1e-5)

    def test_bfloat16(self):
        lp, rp = _kl_inputs()
        lb, rb = jnp.asarray(lp, jnp.bfloat16), jnp.asarray(rp, jnp.bfloat16)
        out = algos.kl(lb, rb, "k3")
        assert_f32(out)
        assert_close(out, ref.kl(lb, rb, "k3")[0], rtol=1e-5, atol=1e-5)

    def test_unknown_kind(self):
        with pytest.raises(ValueError) as e:
            algos.kl(np.zeros(3, np.float32), np.zeros(3, np.float32), "k4")
        assert "kind" in str(e.value) or "k4" in str(e.value)


# ---------------------------------------------------------------- entropy


def _logits(shape=(2, 3, 37), scale=4.0, seed=15):
    return randn(rng_for(seed), shape, scale=scale)


class TestEntropy:
    @pytest.mark.parametrize("chunk", [None, 8, 37, 64])
    def test_matches_reference_and_grad(self, chunk):
        z = _logits()
        c = randn(rng_for(16), z.shape[:-1])

        def f(x, cc):
            h = algos.entropy(x, chunk_size=chunk)
            return jnp.sum(h * cc), h

        (_, h), g = jax.jit(jax.value_and_grad(f, has_aux=True))(z, c)
        assert_f32(h)
        assert h.shape == z.shape[:-1]
        assert_close(h, ref.entropy(z), rtol=1e-5, atol=1e-5)
        assert_close(g, ref.entropy_grad(z) * c[..., None], rtol=1e-4, atol=1e-5)

    @pytest.mark.parametrize("chunk", [None, 8])
    def test_realistic_logit_range_to_float32_rounding(self, chunk):
        # LLM logits span about ±30; a cancellation-free float32 formula
        # (shift by the max inside the p·z sum) is accurate to ~2e-7 here.
        z = _logits(scale=10.0)
        assert_close(algos.entropy(z, chunk_size=chunk), ref.entropy(z), rtol=1e-5, atol=1e-5)

    def test_chunked_equals_unchunked(self):
        z = _logits(scale=10.0)
        a = algos.entropy(z)
        b = algos.entropy(z, chunk_size=8)  # 37 = 4*8 + 5: ragged last chunk
        assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_extreme_logits_stable(self):
        z = _logits(scale=1.0)
        z[0, 0, 3] = 200.0  # one dominant logit: H ~ 0
        z[0, 1, :] = 0.0  # uniform: H = log V
        z[1, 0, 5] = -1e4
        for chunk in (None, 8):
            h = algos.entropy(z, chunk_size=chunk)
            assert_finite(h)
            assert_close(h, ref.entropy(z), rtol=1e-5, atol=1e-4)
            assert_close(h[0, 1], np.log(37.0), rtol=1e-6)

    @pytest.mark.parametrize("chunk", [None, 4])
    def test_minus_inf_logits(self, chunk):
        # a masked vocabulary (-inf logits, e.g. padded vocab entries) adds nothing:
        # same value and gradient as the finite entries alone, gradient 0 at -inf.
        z = np.array([[1.0, 2.0, -np.inf, 0.5, -np.inf, 3.0, 1.0, 0.0, -1.0]], np.float32)
        keep = np.isfinite(z[0])
        h, g = jax.value_and_grad(lambda x: jnp.sum(algos.entropy(x, chunk_size=chunk)))(jnp.asarray(z))
        assert_close(h, ref.entropy(z[:, keep]).sum(), rtol=1e-6)
        want_g = np.zeros_like(z)
        want_g[:, keep] = ref.entropy_grad(z[:, keep])
        assert_finite(g, "grad")
        assert_close(g, want_g, rtol=1e-5, atol=1e-6)

    def test_vmap_bf16_jit(self):
        z = _logits()
        got = jax.vmap(functools.partial(algos.entropy, chunk_size=8))(z)
        assert_close(got, ref.entropy(z), rtol=1e-5, atol=1e-5)
        zb = jnp.asarray(z, jnp.bfloat16)
        hb = jax.jit(functools.partial(algos.entropy, chunk_size=8))(zb)
        assert_f32(hb)
        assert_close(hb, ref.entropy(zb), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- truncated IS


class TestTIS:
    @pytest.mark.parametrize("level", ["token", "sequence"])
    @pytest.mark.parametrize("cap", [2.0, 1.2])
    def test_matches_reference(self, level, cap):
        rng = rng_for(17)
        m = multiturn_mask(rng, empty_rows=(2,))
        old = (-np.abs(randn(rng)) - 0.1).astype(np.float32)
        roll = (old + randn(rng, scale=0.5)).astype(np.float32)
        fn = jitted(algos.tis_weights, cap=cap, level=level)
        w = fn(poison(old, m), poison(roll, m), m)
        assert_f32(w)
        assert_close(w, ref.tis_weights(old, roll, m, cap, level), rtol=1e-5, atol=1e-6)
        assert_zero_where_masked(w, m)
        g = jax.grad(lambda o: jnp.sum(fn(o, roll, m)))(jnp.asarray(old))
        assert np.all(np.asarray(g) == 0), "tis weights must be stop-gradient"

    def test_unknown_level(self):
        x = np.zeros((B, T), np.float32)
        with pytest.raises(ValueError) as e:
            algos.tis_weights(x, x, np.ones((B, T)), level="batch")
        assert "level" in str(e.value) or "batch" in str(e.value)


# ---------------------------------------------------------------- errors


class TestLossErrors:
    def _raises(self, fn, word):
        with pytest.raises((ValueError, TypeError)) as e:
            fn()
        assert word in str(e.value), f"message does not name {word!r}: {e.value}"

    def test_shape_mismatches(self):
        x = np.zeros((B, T), np.float32)
        m = np.ones((B, T), np.float32)
        self._raises(lambda: algos.ppo_loss(x, x, x, m[:, :-1]), "mask")
        self._raises(lambda: algos.ppo_loss(x, x[:, :-1], x, m), "old_logp")
        self._raises(lambda: algos.ppo_loss(x, x, x[:-1], m), "advantages")
        self._raises(lambda: algos.value_loss(x, x, x[:, :2], m), "returns")
        self._raises(lambda: algos.aggregate(x, m[:-1], "token-mean"), "mask")

    def test_unknown_mode(self):
        x = np.zeros((B, T), np.float32)
        m = np.ones((B, T), np.float32)
        self._raises(lambda: algos.ppo_loss(x, x, x, m, mode="token-max"), "mode")
        self._raises(lambda: algos.value_loss(x, x, x, m, mode="token-max"), "mode")
        self._raises(lambda: algos.cispo_loss(x, x, x, m, mode="token-max"), "mode")
