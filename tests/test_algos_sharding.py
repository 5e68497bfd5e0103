"""Sharded results equal unsharded ones (8 virtual CPU devices, see conftest.py).

Rows are sharded over an Explicit ``data`` mesh axis, as the trainer shards its
batch; every kernel must give the same numbers as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_numpy as ref
from algos_testlib import WATOL, WRTOL, assert_close, multiturn_mask, poison, randn, rng_for
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent import algos

NB, NT = 8, 9


@pytest.fixture(scope="module")
def put():
    n = len(jax.devices())
    if n < 2 or NB % n:
        pytest.skip(f"needs a device count dividing {NB}, have {n}")
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        yield lambda x: jax.device_put(jnp.asarray(x), sharding)


def _data():
    rng = rng_for(0)
    m = multiturn_mask(rng, NB, NT, empty_rows=(3,))
    return m, randn(rng, (NB, NT)), randn(rng, (NB, NT))


@pytest.mark.parametrize("method", ["scan", "associative", None])
def test_gae_sharded(put, method):
    m, r, v = _data()
    kw = {} if method is None else {"method": method}
    f = jax.jit(lambda a, b, c: algos.gae(a, b, c, 0.9, 0.8, **kw))
    adv, ret = f(put(poison(r, m)), put(poison(v, m)), put(m))
    ref_adv, ref_ret = ref.gae(r, v, m, 0.9, 0.8)
    assert_close(adv, ref_adv, m, rtol=WRTOL, atol=WATOL)
    assert_close(ret, ref_ret, m)


def test_grpo_sharded(put):
    m, r, _ = _data()
    g = np.array([5, 1, 5, 2, 1, 5, 3, 3], np.int32)
    out = jax.jit(algos.grpo)(put(poison(r, m)), put(m), put(g))
    assert_close(out, ref.grpo(r, m, g), m, rtol=1e-4, atol=1e-4)


def test_ppo_loss_and_grad_sharded(put):
    m, a, b = _data()
    lp = -np.abs(a) - 0.1
    old = lp + 0.3 * b
    f = jax.jit(jax.value_and_grad(lambda x, o, adv, mm: algos.ppo_loss(x, o, adv, mm, "seq-mean-token-mean")[0]))
    loss, g = f(put(lp), put(old), put(a), put(m))
    want, want_g, _ = ref.ppo_loss(lp, old, a, m, "seq-mean-token-mean")
    assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert_close(g, want_g, rtol=1e-5, atol=1e-6)
