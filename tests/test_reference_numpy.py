"""Self-checks of the float64 references (no jaxagent involved).

The hand-derived per-token gradients of reference_numpy are checked against
central finite differences of the reference values, and a few estimators
against closed forms, so a mistake in a reference cannot pass silently.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_numpy as ref
from algos_testlib import B, T, multiturn_mask, randn, rng_for


def _fd(f, x, eps=1e-6):
    g = np.zeros_like(x, dtype=np.float64)
    x = x.astype(np.float64)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


def _data(seed, spread=0.4):
    rng = rng_for(seed)
    m = multiturn_mask(rng, empty_rows=(2,))
    lp = (-np.abs(randn(rng)) - 0.1).astype(np.float64)
    old = lp + randn(rng, scale=spread)
    adv = randn(rng).astype(np.float64)
    return lp, old, adv, m


@pytest.mark.parametrize("mode", ref.AGG_MODES)
def test_ppo_and_cispo_gradients_by_finite_differences(mode):
    lp, old, adv, m = _data(0, spread=1.0)
    _, g, _ = ref.ppo_loss(lp, old, adv, m, mode, clip_high=0.28)
    fd = _fd(lambda x: ref.ppo_loss(x, old, adv, m, mode, clip_high=0.28)[0], lp)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)
    # CISPO's clipped ratio is a stop-gradient: move old_logp with logp so it stays fixed
    _, g = ref.cispo_loss(lp, old, adv, m, mode)
    fd = _fd(lambda x: ref.cispo_loss(x, old + (x - lp), adv, m, mode)[0], lp)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ref.AGG_MODES)
def test_value_loss_gradient_by_finite_differences(mode):
    rng = rng_for(1)
    m = multiturn_mask(rng)
    v, vo, ret = (randn(rng).astype(np.float64) for _ in range(3))
    _, g, _ = ref.value_loss(v, vo, ret, m, mode)
    fd = _fd(lambda x: ref.value_loss(x, vo, ret, m, mode)[0], v)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


def test_gspo_gradient_matches_straight_through_derivation():
    # the straight-through ratio has d log s[i,t] / d logp[i,u] = [t == u]; so the
    # gradient equals the finite difference of the per-token loss in which token t's
    # ratio is exp(d_seq + (logp[t] - logp0[t])).
    lp, old, adv, m = _data(2, spread=0.05)
    lo, hi = 0.02, 0.03
    _, G = ref.gspo_per_token(lp, old, adv, m, lo, hi)
    L0, _ = ref.gspo_per_token(lp, old, adv, m, lo, hi)
    eps = 1e-7
    d_seq = np.array([((lp - old) * m)[i].sum() / max(m[i].sum(), 1) for i in range(B)])
    for i in range(B):
        for t in range(T):
            if not m[i, t]:
                continue
            a = adv[i, t]

            def lt(x, i=i, a=a):
                s = np.exp(min(d_seq[i] + x, 10.0))
                return max(-a * s, -a * np.clip(s, 1 - lo, 1 + hi))

            np.testing.assert_allclose(lt(0.0), L0[i, t], rtol=1e-12)
            fd = (lt(eps) - lt(-eps)) / (2 * eps)
            np.testing.assert_allclose(fd, G[i, t], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_gradients_by_finite_differences(kind):
    rng = rng_for(3)
    lp = randn(rng, (20,)).astype(np.float64)
    rp = lp - randn(rng, (20,), scale=2.0)
    rp[:2] = lp[:2] - np.array([25.0, -25.0])
    _, g = ref.kl(lp, rp, kind)
    fd = _fd(lambda x: ref.kl(x, rp, kind)[0].sum(), lp)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6)


def test_entropy_and_gradient():
    z = randn(rng_for(4), (3, 7), scale=3.0).astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref.entropy(z), -(p * np.log(p)).sum(-1), rtol=1e-12)
    fd = _fd(lambda x: ref.entropy(x).sum(), z)
    np.testing.assert_allclose(ref.entropy_grad(z), fd, rtol=1e-5, atol=1e-8)


def test_gae_without_holes_is_textbook_gae():
    rng = rng_for(5)
    r, v = randn(rng).astype(np.float64), randn(rng).astype(np.float64)
    m = np.ones((B, T))
    gamma, lam = 0.9, 0.8
    A = np.zeros((B, T))
    last = np.zeros(B)
    for t in reversed(range(T)):
        nv = v[:, t + 1] if t + 1 < T else 0.0
        last = r[:, t] + gamma * nv - v[:, t] + gamma * lam * last
        A[:, t] = last
    np.testing.assert_allclose(ref.gae_raw(r, v, m, gamma, lam), A, rtol=1e-12)
    # and lam = 1 gives discounted returns minus values
    R = ref.turn_returns(r, m, gamma)
    np.testing.assert_allclose(ref.gae_raw(r, v, m, gamma, 1.0), R - v, rtol=1e-10, atol=1e-12)


def test_aggregate_weights_sum():
    m = multiturn_mask(rng_for(6), empty_rows=(0,))
    n_rows = (m.sum(-1) > 0).sum()
    assert np.isclose(ref.aggregate_weights(m, "token-mean").sum(), 1.0)
    assert np.isclose(ref.aggregate_weights(m, "seq-mean-token-mean").sum(), 1.0)
    assert np.isclose(ref.aggregate_weights(m, "seq-mean-token-sum").sum(), m.sum() / n_rows)
