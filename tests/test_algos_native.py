"""The native (C++ via XLA FFI) GAE kernel against an independent float64 loop and
against the pure-JAX scan, plus its dispatch and fallback rules."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import algos
from jaxagent.algos import _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="native kernel could not be built")


def _reference_gae(r, v, m, gamma, lam):
    """float64 loop straight from the formula (FORMULAS.md, GAE)."""
    b, t = r.shape
    raw = np.zeros((b, t))
    for i in range(b):
        nextvalue = lastgae = 0.0
        for k in reversed(range(t)):
            delta = r[i, k] + gamma * nextvalue - v[i, k]
            g = delta + gamma * lam * lastgae
            if m[i, k]:
                nextvalue, lastgae = v[i, k], g
            raw[i, k] = lastgae
    valid = m.astype(bool)
    n = valid.sum()
    mean = raw[valid].sum() / (n + 1e-8)
    var = ((raw[valid] - mean) ** 2).sum() / (n + 1e-8) * (n / (n - 1))
    adv = np.where(valid, (raw - mean) / np.sqrt(var + 1e-8), 0.0)
    return adv, np.where(valid, raw + v, 0.0)


def _batch(seed, b=6, t=40):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(b, t)).astype(np.float32)
    v = rng.normal(size=(b, t)).astype(np.float32)
    m = np.zeros((b, t), bool)
    for i in range(b):  # prompt span, then alternating policy / observation spans
        start = rng.integers(0, 5)
        for k in range(start, rng.integers(t // 2, t + 1)):
            m[i, k] = (k // 7) % 2 == 0
    m[1] = False  # a fully masked row
    r[~m] = np.nan  # garbage at masked positions must not leak
    v[~m] = np.inf
    return r, v, m


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_native_matches_float64_reference(gamma, lam):
    r, v, m = _batch(0)
    adv, ret = algos.gae(r, v, m, gamma, lam, method="native")
    ref_adv, ref_ret = _reference_gae(
        np.nan_to_num(r, nan=0.0, posinf=0.0).astype(np.float64),
        np.nan_to_num(v, nan=0.0, posinf=0.0).astype(np.float64),
        m,
        gamma,
        lam,
    )
    np.testing.assert_allclose(adv, ref_adv, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(adv)[~m] == 0) and np.all(np.asarray(ret)[~m] == 0)


@pytest.mark.parametrize("whiten", [True, False])
def test_native_equals_scan_values_and_gradients(whiten):
    r, v, m = _batch(1)
    r, v = np.where(m, r, 0.0), np.where(m, v, 0.0)
    weights = np.random.default_rng(2).normal(size=r.shape).astype(np.float32)

    def objective(r, v, method):
        adv, ret = algos.gae(r, v, m, 0.97, 0.9, whiten=whiten, method=method)
        return jnp.sum(adv * weights) + jnp.sum(ret * weights**2)

    for method in ("native", "scan"):
        assert np.isfinite(objective(r, v, method))
    np.testing.assert_allclose(objective(r, v, "native"), objective(r, v, "scan"), rtol=1e-5)
    g_nat = jax.grad(objective, argnums=(0, 1))(r, v, "native")
    g_scan = jax.grad(objective, argnums=(0, 1))(r, v, "scan")
    for a, b in zip(g_nat, g_scan, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_vmap_whitens_each_slice_separately():
    r, v, m = _batch(3)
    r, v = np.where(m, r, 0.0), np.where(m, v, 0.0)
    stacked = np.stack([r, 3.0 * r + 1.0])
    out = jax.vmap(lambda x: algos.gae(x, v, m, 0.99, 0.95)[0])(stacked)
    for k in range(2):
        np.testing.assert_allclose(
            out[k], algos.gae(stacked[k], v, m, 0.99, 0.95, method="scan")[0], rtol=1e-5, atol=1e-5
        )


def test_inside_jit_and_traced_gamma_falls_back_to_scan():
    r, v, m = _batch(4)
    r, v = np.where(m, r, 0.0), np.where(m, v, 0.0)
    expected = algos.gae(r, v, m, 0.99, 0.95, method="scan")[0]
    native_in_jit = jax.jit(lambda x: algos.gae(x, v, m, 0.99, 0.95)[0])(r)
    traced_gamma = jax.jit(lambda x, g: algos.gae(x, v, m, g, 0.95)[0])(r, 0.99)
    np.testing.assert_allclose(native_in_jit, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traced_gamma, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="native"):
        jax.jit(lambda x, g: algos.gae(x, v, m, g, 0.95, method="native")[0])(r, 0.99)


def test_disabled_by_environment_variable():
    code = "import os; from jaxagent.algos import _native; print(_native.available())"
    env = dict(os.environ, JAXAGENT_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
