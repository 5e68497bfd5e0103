"""Estimators are dispatched by what they declare they consume (`jaxagent.algos`
registry), so one registered from outside the package trains by name.

The outside estimators here are written in float64 NumPy from the formulas, not with
`jaxagent.algos`: a run with the NumPy GRPO must give the built-in GRPO run's metrics.
"""

import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import algos
from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.algo import AlgoSection
from jaxagent.train.trainer import Trainer
from jaxagent.train.update.advantages import compute_advantages

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
#: rewards that vary within a group even for a random policy (non-zero advantages)
VARIED = ["env.name=testing/faulty", "env.kwargs={horizon: 2}", "rollout.max_context=256"]


def numpy_grpo(rewards, mask, group_ids):
    """GRPO from the formula: s_i = sum_t r m; a_i = (s_i - mean_g) / (std_g(ddof=1) + 1e-6),
    a group of one keeps s_i; broadcast onto the row's valid tokens."""
    r, m, g = np.asarray(rewards, np.float64), np.asarray(mask, np.float64), np.asarray(group_ids)
    s = (r * m).sum(axis=1)
    a = np.empty_like(s)
    for gid in np.unique(g):
        rows = g == gid
        if rows.sum() < 2:
            a[rows] = s[rows]
        else:
            a[rows] = (s[rows] - s[rows].mean()) / (s[rows].std(ddof=1) + 1e-6)
    return jnp.asarray((a[:, None] * (m != 0)).astype(np.float32))


def numpy_scaled_turn_returns(turn_rewards, turn_mask, gamma, *, scale=1.0):
    """scale * the discounted return of each played turn, R[k] = r[k] + gamma R[k+1]."""
    r, m = np.asarray(turn_rewards, np.float64), np.asarray(turn_mask, bool)
    out = np.zeros_like(r)
    for b in range(r.shape[0]):
        running = 0.0
        for k in reversed(range(r.shape[1])):
            if m[b, k]:
                running = r[b, k] + gamma * running
                out[b, k] = scale * running
    return jnp.asarray(out.astype(np.float32))


algos.register_advantage_estimator(
    "test_outside_grpo", numpy_grpo, inputs=("rewards", "mask", "group_ids"), overwrite=True
)
algos.register_advantage_estimator(
    "test_outside_turns",
    numpy_scaled_turn_returns,
    inputs=("turn_rewards", "turn_mask"),
    keywords=("gamma",),
    overwrite=True,
)
algos.register_advantage_estimator("test_undeclared", numpy_grpo, overwrite=True)


def learning(history):
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k != "tokens_per_s"} for m in history]


def test_an_estimator_registered_outside_the_package_trains_like_the_builtin(tmp_path):
    runs = {}
    for name in ("grpo", "test_outside_grpo"):
        cfg = load_config(
            TrainerConfig,
            CONFIG,
            [
                f"run_dir={tmp_path / name}",
                *VARIED,
                f"algo.advantage={name}",
                "logging.tensorboard=false",
                "logging.transcripts_every=0",
            ],
        )
        runs[name] = learning(Trainer(cfg, log=lambda *_: None).run())
    builtin, outside = runs["grpo"], runs["test_outside_grpo"]
    assert len(outside) == 2 and builtin[0]["advantage_abs_mean"] > 0  # the runs had a learning signal
    for a, b in zip(builtin, outside, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_turn_level_estimator_gets_its_declared_inputs_and_kwargs():
    # 2 episodes x 3 turns; episode 1 failed (its turns must not be seen as played)
    turn_rewards = np.array([[1.0, 0.0, 2.0], [5.0, 5.0, 0.0]], np.float32)
    turn_mask = np.array([[True, True, True], [True, True, False]])
    turn_ids = np.array([[-1, 0, 0, -1, 1, -1, 2, 2], [-1, 0, -1, 1, 1, -1, -1, -1]], np.int32)
    loss_mask = (turn_ids >= 0).astype(np.float32)
    loss_mask[1] = 0.0  # failed episodes are already out of the loss mask
    traj = types.SimpleNamespace(
        rewards=jnp.zeros(turn_ids.shape),
        failed=jnp.array([False, True]),
        group_ids=jnp.array([0, 0]),
        turn_rewards=jnp.asarray(turn_rewards),
        turn_mask=jnp.asarray(turn_mask),
        anchor_ids=jnp.full((2, 3), -1),
        turn_ids=jnp.asarray(turn_ids),
    )
    algo = AlgoSection(advantage="test_outside_turns", gamma=0.5, advantage_kwargs={"scale": 2.0})
    adv, returns = compute_advantages(algo, traj, jnp.asarray(loss_mask))
    # episode 0's returns: R2 = 2, R1 = 0 + 0.5 * 2 = 1, R0 = 1 + 0.5 * 1 = 1.5; times scale 2
    expected = np.array([[0, 3, 3, 0, 2, 0, 4, 4], [0] * 8], np.float32)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6)
    assert returns is None


def test_estimator_declarations_are_checked_with_clear_errors(tmp_path):
    def load(*overrides):
        return load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", *overrides])

    with pytest.raises(ConfigError, match="without declaring its inputs"):
        load("algo.advantage=test_undeclared")
    with pytest.raises(ConfigError, match="'scal'"):
        load("algo.advantage=test_outside_turns", "algo.advantage_kwargs={scal: 2.0}")
    with pytest.raises(ConfigError, match="group_size"):  # it consumes group_ids
        load("algo.advantage=test_outside_grpo", "env.group_size=1")
    with pytest.raises(ConfigError, match="nonsense"):
        load("algo.advantage=nonsense")
    with pytest.raises(ValueError, match="unknown input"):
        algos.register_advantage_estimator("test_bad_inputs", numpy_grpo, inputs=("reward",))
    # what the built-ins declare decides what the trainer builds
    assert load("algo.advantage=gae").algo.uses_critic and not load().algo.uses_critic
    assert load("algo.advantage=turn_gae").algo.uses_critic
    assert load("algo.advantage=remax").algo.uses_greedy_baseline and not load().algo.uses_greedy_baseline
    assert load("algo.advantage=test_outside_turns").algo.estimator.turn_level
    assert algos.get_estimator_spec("gigpo").consumes == (
        "turn_rewards",
        "turn_mask",
        "group_ids",
        "anchor_ids",
        "gamma",
    )


@pytest.mark.parametrize(
    "name",
    [pytest.param("remax", marks=pytest.mark.slow), "turn_gae", pytest.param("turn_returns", marks=pytest.mark.slow)],
)
def test_every_builtin_estimator_trains(tmp_path, name):
    """remax (a greedy baseline rollout per task), turn_gae (a critic read at turn starts)
    and turn_returns (REINFORCE over turns) train end to end."""
    import jax

    cfg = load_config(
        TrainerConfig,
        CONFIG,
        [
            f"run_dir={tmp_path}",
            *VARIED,
            f"algo.advantage={name}",
            "algo.gamma=0.9",
            "algo.lam=0.95",
            "logging.tensorboard=false",
            "logging.transcripts_every=0",
        ],
    )
    trainer = Trainer(cfg, log=lambda *_: None)
    before = jax.device_get(trainer.state.params)
    history = trainer.run()
    assert [m["iteration"] for m in history] == [1, 2]
    assert all(np.isfinite(v) for m in history for v in m.values())
    assert history[0]["advantage_abs_mean"] > 0
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(trainer.state.params)), strict=True)
    ]
    assert all(moved)
    assert ("value_loss" in history[0]) == (name == "turn_gae")
    assert (trainer.state.critic_params is not None) == (name == "turn_gae")


def test_turn_gae_reads_the_critic_at_turn_starts_and_spreads_returns():
    """Against a float64 NumPy turn-level GAE from the formula (docs/explanations/formulas.md)."""
    rng = np.random.default_rng(0)
    turn_ids = np.array(
        [[-1, 0, 0, -1, 1, 1, -1, 2], [-1, -1, 0, 0, -1, 1, -1, -1], [-1, 0, -1, 1, 1, -1, -1, -1]], np.int32
    )
    loss_mask = (turn_ids >= 0).astype(np.float32)
    turn_mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]], bool)
    turn_rewards = rng.normal(size=(3, 3)).astype(np.float32) * turn_mask
    values = rng.normal(size=(3, 8)).astype(np.float32)
    gamma, lam = 0.9, 0.8
    traj = types.SimpleNamespace(
        rewards=jnp.zeros((3, 8)),
        failed=jnp.zeros(3, bool),
        group_ids=jnp.arange(3),
        turn_rewards=jnp.asarray(turn_rewards),
        turn_mask=jnp.asarray(turn_mask),
        anchor_ids=jnp.full((3, 3), -1),
        turn_ids=jnp.asarray(turn_ids),
    )
    algo = AlgoSection(advantage="turn_gae", gamma=gamma, lam=lam)
    adv, returns = compute_advantages(algo, traj, jnp.asarray(loss_mask), jnp.asarray(values))

    A = np.zeros((3, 3))
    V = np.zeros((3, 3))
    for b in range(3):
        for k in range(3):
            first = np.nonzero(turn_ids[b] == k)[0]
            V[b, k] = values[b, first[0]] if len(first) else 0.0
        nxt, last = 0.0, 0.0
        for k in reversed(range(3)):
            if turn_mask[b, k]:
                last = turn_rewards[b, k] + gamma * nxt - V[b, k] + gamma * lam * last
                nxt = V[b, k]
                A[b, k] = last
    R = A + V
    valid = turn_mask
    n = valid.sum()
    mean = A[valid].mean()
    var = ((A[valid] - mean) ** 2).sum() / (n - 1)
    W = np.where(valid, (A - mean) / np.sqrt(var + 1e-8), 0.0)
    spread = lambda x: np.where(turn_ids >= 0, np.take_along_axis(x, np.clip(turn_ids, 0, 2), 1), 0.0)  # noqa: E731
    np.testing.assert_allclose(np.asarray(returns), spread(R), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(adv), spread(W), rtol=1e-4, atol=1e-5)


def test_remax_baselines_are_the_greedy_episodes_returns():
    """`collect_batch` with ReMax: every row's baseline is the return of its task's greedy
    episode, played here separately."""
    import dataclasses

    import jax

    import envs
    from jaxagent.train import build
    from jaxagent.train.sources.collect import collect_batch, sampling_seed

    cfg = load_config(
        TrainerConfig, CONFIG, ["run_dir=/tmp/unused", *VARIED, "algo.advantage=remax", "env.num_workers=0"]
    )
    run = build.build_run(cfg, log=lambda *_: None)
    loop = build.episode_loop(run.source, run.tokenizer, run.model_config, run.placement, run.state)
    key = jax.random.key(5)
    with envs.EnvPool([run.source.env_factory()] * cfg.env.batch_size, num_workers=0) as pool:
        got = collect_batch(cfg, loop, pool, run.placement.rows, key, position=3)
        seeds = [cfg.env.seed + 3 + j for j in range(cfg.env.tasks_per_iteration) for _ in range(cfg.env.group_size)]
        greedy, eps = loop.run(
            pool, seeds, seed=sampling_seed(key, 0), sampling=dataclasses.replace(loop.config.sampling, temperature=0.0)
        )
    want = np.array([sum(ep.rewards) for ep in eps])
    np.testing.assert_allclose(got.baselines, want, rtol=1e-6)
    G = cfg.env.group_size
    assert all(np.ptp(got.baselines[i : i + G]) == 0 for i in range(0, len(want), G))  # one greedy episode per task
    assert not np.array_equal(np.asarray(got.traj.tokens), np.asarray(greedy.tokens))  # the batch itself is sampled
