"""Name -> function registry of ``jaxagent.algos``."""

from __future__ import annotations

import numpy as np
import pytest
import reference_numpy as ref
from algos_testlib import B, T, assert_close, multiturn_mask, randn, rng_for

from jaxagent import algos

ADVANTAGE_NAMES = [
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "gigpo",
    "turn_gae",
    "turn_returns",
]
POLICY_LOSS_NAMES = ["ppo", "gspo", "cispo"]


def test_lists_contain_builtin_names():
    adv = list(algos.list_advantage_estimators())
    pol = list(algos.list_policy_losses())
    assert set(ADVANTAGE_NAMES) <= set(adv), set(ADVANTAGE_NAMES) - set(adv)
    assert set(POLICY_LOSS_NAMES) <= set(pol), set(POLICY_LOSS_NAMES) - set(pol)
    assert all(isinstance(n, str) for n in adv + pol)


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_get_advantage_estimator(name):
    assert callable(algos.get_advantage_estimator(name))


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_get_policy_loss(name):
    assert callable(algos.get_policy_loss(name))


def test_registered_functions_behave_like_the_direct_ones():
    rng = rng_for(0)
    m = multiturn_mask(rng)
    r = randn(rng)
    g = np.array([0, 1, 0, 1, 2, 2], np.int32)
    assert_close(algos.get_advantage_estimator("grpo")(r, m, g), ref.grpo(r, m, g), m, rtol=1e-4, atol=1e-4)
    lp = -np.abs(randn(rng))
    old = lp + randn(rng, scale=0.2)
    loss = algos.get_policy_loss("ppo")(lp, old, r, m)
    loss = loss[0] if isinstance(loss, tuple) else loss
    assert_close(loss, ref.ppo_loss(lp, old, r, m)[0], rtol=1e-5, atol=1e-6)


def test_unknown_advantage_name_lists_known_names():
    with pytest.raises(ValueError) as e:
        algos.get_advantage_estimator("grpo_typo")
    msg = str(e.value)
    for name in ADVANTAGE_NAMES:
        assert name in msg, f"{name!r} missing from: {msg}"


def test_unknown_policy_loss_lists_known_names():
    with pytest.raises(ValueError) as e:
        algos.get_policy_loss("ppo2")
    msg = str(e.value)
    for name in POLICY_LOSS_NAMES:
        assert name in msg, f"{name!r} missing from: {msg}"


def test_register_custom():
    def my_adv(rewards, mask, group_ids):
        return rewards * mask

    def my_loss(logp, old_logp, advantages, mask, mode="token-mean", **kw):
        return algos.aggregate(-advantages * logp, mask, mode), {}

    algos.register_advantage_estimator("test_registry_custom_adv", my_adv)
    algos.register_policy_loss("test_registry_custom_loss", my_loss)
    assert algos.get_advantage_estimator("test_registry_custom_adv") is my_adv
    assert algos.get_policy_loss("test_registry_custom_loss") is my_loss
    assert "test_registry_custom_adv" in algos.list_advantage_estimators()
    assert "test_registry_custom_loss" in algos.list_policy_losses()
    # a custom name then shows up in the error for an unknown one
    with pytest.raises(ValueError, match="test_registry_custom_adv"):
        algos.get_advantage_estimator("nope")
    x = np.ones((B, T), np.float32)
    assert_close(algos.get_advantage_estimator("test_registry_custom_adv")(x, x, None), x)
