"""``turn_loo``: the turn-level leave-one-out advantage (docs/explanations/turn-baseline.md).

1. It matches a float64 NumPy loop written from the formula.
2. Its policy-gradient estimate is unbiased on a tabular problem where the policy
   chooses the episode's length, while the self-inclusive per-turn mean/std
   normalisation (verl issue #7244) is measurably biased on the same problem.
3. It dispatches through the registry, jits, and runs on sharded inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algos_testlib import assert_close, assert_f32, assert_zero_where_masked, poison

from jaxagent import algos

# --------------------------------------------------------------------------------------
# 1. float64 reference, written from the definition with explicit loops
# --------------------------------------------------------------------------------------


def ref_turn_loo(turn_rewards, turn_mask, group_ids, gamma):
    r = np.asarray(turn_rewards, np.float64)
    m = np.asarray(turn_mask) != 0
    gid = np.asarray(group_ids)
    b, k = r.shape
    # G[i,t] = sum over valid s >= t of gamma^(valid turns in [t, s)) * r[i,s]
    G = np.zeros((b, k))
    for i in range(b):
        for t in range(k):
            if not m[i, t]:
                continue
            total, power = 0.0, 0
            for s in range(t, k):
                if m[i, s]:
                    total += gamma**power * r[i, s]
                    power += 1
            G[i, t] = total
    member = [bool(m[i].any()) for i in range(b)]
    G0 = [G[i, int(np.argmax(m[i]))] if member[i] else 0.0 for i in range(b)]
    out = np.zeros((b, k))
    fallbacks = 0
    for i in range(b):
        others = [j for j in range(b) if j != i and gid[j] == gid[i] and member[j]]
        for t in range(k):
            if not m[i, t] or not others:
                continue
            alive = [j for j in others if m[j, t]]
            if alive:
                base = np.mean([G[j, t] for j in alive])
            else:
                base = np.mean([G0[j] for j in others])
                fallbacks += 1
            out[i, t] = G[i, t] - base
    return out, fallbacks


def _batch(seed, k=6):
    """Groups of 4, 3, 1 (a singleton) and 3 with uneven lengths, shuffled, with
    arbitrary non-contiguous ids; one failed (fully masked) episode, one episode with
    an interior masked turn, and a group where from turn 2 on one episode is alive
    alone (so the fallback runs)."""
    rng = np.random.default_rng(seed)
    lengths = [
        6,
        4,
        2,
        5,  # group 7
        6,
        2,
        1,  # group -3: from turn 2 only the first is alive
        3,  # group 100: a singleton
        1,
        5,
        0,
    ]  # group 2: one failed episode (no valid turn)
    gids = [7] * 4 + [-3] * 3 + [100] + [2] * 3
    mask = np.zeros((len(lengths), k), bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    mask[3, 2] = False  # an interior masked turn
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    perm = rng.permutation(len(lengths))
    return rewards[perm], mask[perm], np.asarray(gids, np.int32)[perm]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference(seed, gamma):
    r, m, g = _batch(seed)
    want, fallbacks = ref_turn_loo(r, m, g, gamma)
    assert fallbacks >= 4  # the lone-survivor turns were exercised
    out = algos.turn_loo(poison(r, m), m, g, gamma)  # NaN/inf on masked turns must not leak
    assert_f32(out)
    assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert_zero_where_masked(out, m)
    singleton = g == 100
    assert np.all(np.asarray(out)[singleton] == 0)


@pytest.mark.parametrize("seed", [3, 4])
def test_random_masks_and_groups(seed):
    rng = np.random.default_rng(seed)
    b, k = 14, 7
    lengths = rng.integers(0, k + 1, size=b)
    m = np.arange(k)[None, :] < lengths[:, None]
    m &= rng.random((b, k)) > 0.1  # a few interior holes
    g = rng.integers(0, 5, size=b).astype(np.int32) * 11 - 20
    r = rng.normal(size=(b, k)).astype(np.float32)
    for gamma in (1.0, 0.9):
        want, _ = ref_turn_loo(r, m, g, gamma)
        assert_close(algos.turn_loo(r, m.astype(np.float32), g, gamma), want, rtol=1e-5, atol=1e-5)


def test_equal_returns_give_exact_zero():
    m = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
    r = np.where(m, np.float32(0.1), 0).astype(np.float32)
    r[1, 1] += np.float32(0.1)  # equal returns at turns 0 and 1
    out = np.asarray(algos.turn_loo(r, m, np.zeros(3, np.int32), 1.0))
    assert np.all(out[:, :2] == 0)


def test_by_hand():
    # one group: lengths 3, 1; gamma 1
    r = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], np.float32)
    m = np.array([[1, 1, 1], [1, 0, 0]], bool)
    out = np.asarray(algos.turn_loo(r, m, np.array([5, 5], np.int32), 1.0))
    # G = [[6, 5, 3], [4]]; turn 0: 6-4 and 4-6; turns 1, 2: fallback to the other's G0 = 4
    np.testing.assert_allclose(out, [[2.0, 1.0, -1.0], [-2.0, 0.0, 0.0]], atol=1e-6)


# --------------------------------------------------------------------------------------
# 2. unbiasedness when the policy chooses the episode length
# --------------------------------------------------------------------------------------
#
# Turns 0..2. At turns 0 and 1 the policy continues with probability p_t =
# sigmoid(theta_t) (a two-action softmax with logits (theta_t, 0)), else it stops;
# turn 2 always ends the episode. Every turn taken pays STEP_REWARD, the last turn
# also FINAL_REWARD[length - 1].

THETA = np.array([0.5, -0.5])
STEP_REWARD = 0.5
FINAL_REWARD = np.array([1.0, 0.0, 1.0])
MAX_TURNS = 3
GROUP = 3
GROUPS = 40_000


def _probs(theta):
    return 1.0 / (1.0 + np.exp(-theta))


def _episode(length, gamma):
    """Turn rewards and returns-to-go of an episode of `length` turns."""
    r = np.full(length, STEP_REWARD)
    r[-1] += FINAL_REWARD[length - 1]
    G = np.zeros(length)
    acc = 0.0
    for t in range(length - 1, -1, -1):
        acc = r[t] + gamma * acc
        G[t] = acc
    return r, G


def _score(length, p):
    """grad_theta log pi(a_t | h_t) for each turn of an episode of `length` turns."""
    s = np.zeros((length, MAX_TURNS - 1))
    for t in range(min(length, MAX_TURNS - 1)):
        s[t, t] = (1 - p[t]) if t < length - 1 else -p[t]
    return s


def exact_gradient(theta, gamma):
    """E[sum_t grad log pi(a_t|h_t) * G_t] by enumerating the three trajectories (the
    policy gradient of the expected return when gamma = 1); also returns J(theta)."""
    p = _probs(theta)
    grad, value = np.zeros(MAX_TURNS - 1), 0.0
    for length in range(1, MAX_TURNS + 1):
        prob = np.prod([p[t] if t < length - 1 else 1 - p[t] for t in range(min(length, MAX_TURNS - 1))])
        _, G = _episode(length, gamma)
        grad += prob * (_score(length, p) * G[:, None]).sum(0)
        value += prob * G[0]
    return grad, value


def sample_groups(rng, groups, theta, gamma):
    """`groups` groups of GROUP episodes: turn rewards, mask, group ids, returns and
    per-turn scores [B, turns, params], vectorised."""
    p = _probs(theta)
    b = groups * GROUP
    cont = rng.random((b, MAX_TURNS - 1)) < p[None, :]
    alive = np.ones(b, bool)
    mask = np.zeros((b, MAX_TURNS), bool)
    score = np.zeros((b, MAX_TURNS, MAX_TURNS - 1))
    length = np.full(b, MAX_TURNS)
    for t in range(MAX_TURNS):
        mask[:, t] = alive
        if t < MAX_TURNS - 1:
            score[:, t, t] = np.where(alive, np.where(cont[:, t], 1 - p[t], -p[t]), 0.0)
            length[alive & ~cont[:, t]] = t + 1
            alive &= cont[:, t]
    r = np.where(mask, STEP_REWARD, 0.0)
    r[np.arange(b), length - 1] += FINAL_REWARD[length - 1]
    G = np.zeros_like(r)
    acc = np.zeros(b)
    for t in range(MAX_TURNS - 1, -1, -1):
        acc = np.where(mask[:, t], r[:, t] + gamma * acc, acc)
        G[:, t] = np.where(mask[:, t], acc, 0.0)
    gid = np.repeat(np.arange(groups), GROUP).astype(np.int32)
    return r, mask, gid, G, score


def self_inclusive_per_turn(G, mask, groups, eps=1e-6):
    """The normalisation verl issue #7244 warns about: at each turn, the mean and std
    (ddof 1) of G over the group's alive episodes, episode i included; a lone alive
    episode gets (G - G)/eps = 0."""
    g = G.reshape(groups, GROUP, -1)
    m = mask.reshape(groups, GROUP, -1)
    n = m.sum(1, keepdims=True)
    mean = (g * m).sum(1, keepdims=True) / np.maximum(n, 1)
    var = (((g - mean) * m) ** 2).sum(1, keepdims=True) / np.maximum(n - 1, 1)
    a = (g - mean) / (np.sqrt(var) + eps)
    return np.where(m, a, 0.0).reshape(G.shape)


def gradient_estimate(adv, score, groups):
    """Per group: mean over its episodes of sum_t score_t * A_t; then the mean over
    groups and its standard error (groups are independent, episodes within a group
    are not, through the baselines)."""
    per_group = (score * adv[:, :, None]).sum(1).reshape(groups, GROUP, -1).mean(1)
    return per_group.mean(0), per_group.std(0, ddof=1) / np.sqrt(groups), per_group


def test_exact_gradient_is_the_derivative_of_the_expected_return():
    grad, _ = exact_gradient(THETA, 1.0)
    h = 1e-6
    fd = [(exact_gradient(THETA + h * e, 1.0)[1] - exact_gradient(THETA - h * e, 1.0)[1]) / (2 * h) for e in np.eye(2)]
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_unbiased_where_self_inclusive_normalisation_is_not(gamma):
    exact, _ = exact_gradient(THETA, gamma)
    rng = np.random.default_rng(1234)
    r, mask, gid, G, score = sample_groups(rng, GROUPS, THETA, gamma)
    lone = (mask.reshape(GROUPS, GROUP, -1).sum(1) == 1)[:, 1:].sum()
    assert lone > 1000  # the fallback turns occur often

    adv = np.asarray(algos.turn_loo(r.astype(np.float32), mask, gid, gamma), np.float64)
    mean, se, per_group = gradient_estimate(adv, score, GROUPS)
    z = (mean - exact) / se
    assert np.all(np.abs(z) < 4), (exact, mean, se)

    # Direction: the component orthogonal to the exact gradient (scale-free).
    ortho = np.array([-exact[1], exact[0]]) / np.linalg.norm(exact)

    def z_ortho(pg):
        x = pg @ ortho
        return x.mean() / (x.std(ddof=1) / np.sqrt(GROUPS))

    assert abs(z_ortho(per_group)) < 4

    inc = self_inclusive_per_turn(G, mask, GROUPS)
    mean_i, se_i, per_group_i = gradient_estimate(inc, score, GROUPS)
    assert np.max(np.abs((mean_i - exact) / se_i)) > 20, (exact, mean_i, se_i)
    # not only a rescaling: its direction is off by many standard errors; at gamma 1
    # it even pushes the first parameter ("continue at turn 0") the wrong way
    assert abs(z_ortho(per_group_i)) > 20
    if gamma == 1.0:
        assert exact[0] > 0 and mean_i[0] < -10 * se_i[0]


def test_a_baseline_that_reads_the_episodes_own_return_is_caught():
    """A negative control for the test above: turn_loo with its fallback replaced by
    the episode's *own* total return (which depends on its later actions)."""
    exact, _ = exact_gradient(THETA, 1.0)
    rng = np.random.default_rng(1234)
    r, mask, gid, G, score = sample_groups(rng, GROUPS, THETA, 1.0)
    adv = np.asarray(algos.turn_loo(r.astype(np.float32), mask, gid, 1.0), np.float64)
    alone = np.repeat(mask.reshape(GROUPS, GROUP, -1).sum(1) == 1, GROUP, axis=0) & mask
    own = np.where(alone, G - G[:, :1], adv)
    mean, se, _ = gradient_estimate(own, score, GROUPS)
    assert np.max(np.abs((mean - exact) / se)) > 10


# --------------------------------------------------------------------------------------
# 3. registry, jit, sharding
# --------------------------------------------------------------------------------------


def test_registry_dispatch_and_jit():
    spec = algos.get_estimator_spec("turn_loo")
    assert spec.turn_level
    assert spec.inputs == ("turn_rewards", "turn_mask", "group_ids", "gamma")
    assert not spec.returns and spec.fn is algos.turn_loo
    assert "turn_loo" in algos.list_advantage_estimators()
    r, m, g = _batch(5)
    inputs = {"turn_rewards": jnp.asarray(r), "turn_mask": jnp.asarray(m), "group_ids": jnp.asarray(g), "gamma": 0.9}
    direct = algos.turn_loo(r, m, g, 0.9)
    via = algos.get_advantage_estimator("turn_loo")(*[inputs[n] for n in spec.inputs])
    jitted = jax.jit(lambda r, m, g, gamma: spec.fn(r, m, g, gamma))(r, m, g, jnp.float32(0.9))
    want, _ = ref_turn_loo(r, m, g, 0.9)
    for out in (direct, via, jitted):
        assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_input_checks():
    r, m, g = _batch(0)
    with pytest.raises(ValueError, match="turn_mask"):
        algos.turn_loo(r, m[:, :-1], g, 1.0)
    with pytest.raises(ValueError, match="group_ids"):
        algos.turn_loo(r, m, g[:-1], 1.0)
    with pytest.raises(TypeError, match="group_ids"):
        algos.turn_loo(r, m, g.astype(np.float32), 1.0)
    with pytest.raises(TypeError, match="turn_rewards"):
        algos.turn_loo(r.astype(np.int32), m, g, 1.0)


def test_sharded_equals_unsharded():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    if n < 4:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")
    mesh = jax.make_mesh((n // 2, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(6)
    b, k = 16, 6
    r = rng.normal(size=(b, k)).astype(np.float32)
    m = np.arange(k)[None, :] < rng.integers(1, k + 1, size=b)[:, None]
    g = np.repeat(np.arange(4), 4).astype(np.int32)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        out = algos.turn_loo(put(r, P("data", None)), put(m, P("data", None)), put(g, P("data")), 0.9)
    np.testing.assert_allclose(out, algos.turn_loo(r, m, g, 0.9), rtol=1e-5, atol=1e-6)
