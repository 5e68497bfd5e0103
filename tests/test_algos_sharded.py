"""The kernels on inputs sharded over an 8-device CPU mesh give the unsharded results."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent import algos


@pytest.fixture(scope="module")
def mesh():
    n = len(jax.devices())
    if n < 4:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")
    return jax.make_mesh((n // 2, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)


def _data(seed=0, b=16, t=24):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(b, t)).astype(np.float32)
    v = rng.normal(size=(b, t)).astype(np.float32)
    m = rng.random((b, t)) > 0.3
    g = np.repeat(np.arange(b // 4), 4).astype(np.int32)
    logp = (-rng.random((b, t))).astype(np.float32)
    old = (logp + 0.1 * rng.normal(size=(b, t))).astype(np.float32)
    return r, v, m, g, logp, old


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("method", ["auto", "scan"])
def test_gae_sharded_equals_unsharded(mesh, method):
    r, v, m, *_ = _data()
    spec = P(("data", "fsdp"), None)
    with jax.set_mesh(mesh):
        adv, ret = algos.gae(_put(mesh, r, spec), _put(mesh, v, spec), _put(mesh, m, spec), 0.99, 0.95, method=method)
    ref_adv, ref_ret = algos.gae(r, v, m, 0.99, 0.95, method="scan")
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_outcome_estimators_and_losses_sharded(mesh):
    r, v, m, g, logp, old = _data(1)
    spec = P("data", "fsdp")
    rs, ms, ls, os_ = (_put(mesh, x, spec) for x in (r, m, logp, old))
    gs = _put(mesh, g, P("data"))
    with jax.set_mesh(mesh):
        adv = algos.grpo(rs, ms, gs)
        loo = algos.rloo(rs, ms, gs)
        loss, metrics = algos.ppo_loss(ls, os_, adv, ms, clip_high=0.28)
        grad = jax.grad(lambda lp: algos.ppo_loss(lp, os_, adv, ms)[0])(ls)
    ref_adv = algos.grpo(r, m, g)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loo, algos.rloo(r, m, g), rtol=1e-5, atol=1e-6)
    ref_loss, ref_metrics = algos.ppo_loss(logp, old, ref_adv, m, clip_high=0.28)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k in ref_metrics:
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7)
    ref_grad = jax.grad(lambda lp: algos.ppo_loss(lp, old, ref_adv, m)[0])(logp)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)


def test_gigpo_and_baseline_sharded(mesh):
    rng = np.random.default_rng(5)
    b, s = 16, 6
    r = rng.normal(size=(b, s)).astype(np.float32)
    m = rng.random((b, s)) > 0.2
    g = np.repeat(np.arange(4), 4).astype(np.int32)
    anchors = rng.integers(0, 3, size=(b, s)).astype(np.int32)
    spec = P("data", None)
    with jax.set_mesh(mesh):
        out = algos.gigpo(
            _put(mesh, r, spec),
            _put(mesh, m, spec),
            _put(mesh, g, P("data")),
            _put(mesh, anchors, spec),
            gamma=0.9,
            mode="mean_std_norm",
        )
        base = algos.reinforce_pp_baseline(_put(mesh, r, spec), _put(mesh, m, spec), _put(mesh, g, P("data")))
    np.testing.assert_allclose(
        out, algos.gigpo(r, m, g, anchors, gamma=0.9, mode="mean_std_norm"), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(base, algos.reinforce_pp_baseline(r, m, g), rtol=1e-5, atol=1e-6)
