"""The loop's reward options (`AlgoSection`): scaling, clipping, truncation handling, KL as
a reward penalty, dynamic sampling.

`shape_rewards` is checked against a float64 NumPy restatement written here from the
documented rules, on a hand-made trajectory; dynamic sampling and the KL reference
through short runs of the loop.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.rollout.trajectory import Trajectory, trim_padding
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.algo import AlgoSection
from jaxagent.train.trainer import Trainer
from jaxagent.train.update.advantages import shape_rewards

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"


def make_traj():
    """3 episodes, T = 10, K = 3: row 0 two turns (done), row 1 three turns (truncated),
    row 2 one turn (failed)."""
    B, T, K = 3, 10, 3
    turn_ids = np.full((B, T), -1, np.int32)
    turn_ids[0, 2:4], turn_ids[0, 6:8] = 0, 1
    turn_ids[1, 1:3], turn_ids[1, 4:5], turn_ids[1, 7:9] = 0, 1, 2
    turn_ids[2, 3:5] = 0
    turn_rewards = np.array([[0.5, 2.0, 0], [-3.0, 0.25, 1.0], [7.0, 0, 0]], np.float32)
    turn_mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], bool)
    loss_mask = (turn_ids >= 0).astype(np.float32)
    z = jnp.zeros((B, T), jnp.float32)
    return Trajectory(
        tokens=jnp.zeros((B, T), jnp.int32),
        attention_mask=jnp.ones((B, T), jnp.int32),
        loss_mask=jnp.asarray(loss_mask),
        rollout_logp=z,
        turn_ids=jnp.asarray(turn_ids),
        rewards=z,
        group_ids=jnp.zeros((B,), jnp.int32),
        turn_rewards=jnp.asarray(turn_rewards),
        turn_mask=jnp.asarray(turn_mask),
        anchor_ids=jnp.full((B, K), -1, jnp.int32),
        episode_return=jnp.asarray(turn_rewards.sum(1)),
        lengths=jnp.full((B,), T, jnp.int32),
        num_turns=jnp.asarray(turn_mask.sum(1).astype(np.int32)),
        done=jnp.asarray([True, False, False]),
        truncated=jnp.asarray([False, True, False]),
        failed=jnp.asarray([False, False, True]),
    )


def reference(traj, scale, clip, truncation, penalty, kl_coef, old, ref):
    """float64 restatement: per-turn shaped rewards, then token rewards at each turn's last token."""
    tr = np.asarray(traj.turn_rewards, np.float64) * scale
    if clip is not None:
        tr = np.clip(tr, -clip, clip)
    mask = np.asarray(traj.turn_mask)
    tid = np.asarray(traj.turn_ids)
    B, T = tid.shape
    if truncation == "penalty":
        for b in range(B):
            if traj.truncated[b] and not traj.failed[b]:
                tr[b, mask[b].sum() - 1] += penalty
    tr = np.where(mask, tr, 0.0)
    tok = np.zeros((B, T))
    for b in range(B):
        for k in range(tr.shape[1]):
            where = np.nonzero(tid[b] == k)[0]
            if where.size:
                tok[b, where[-1]] = tr[b, k]
    if kl_coef:
        d = (np.asarray(old, np.float64) - np.asarray(ref, np.float64)) * (tid >= 0)
        tok -= kl_coef * d
        for b in range(B):
            for t in range(T):
                if tid[b, t] >= 0:
                    tr[b, tid[b, t]] -= kl_coef * d[b, t]
    return tr, tok


@pytest.mark.parametrize(
    "scale, clip, truncation, kl_coef",
    [
        (1.0, None, "keep", 0.0),
        (0.5, 1.5, "keep", 0.0),
        (2.0, None, "penalty", 0.0),
        (1.0, 2.5, "filter", 0.0),
        (1.0, None, "keep", 0.1),
        (3.0, 4.0, "penalty", 0.05),
    ],
)
def test_shape_rewards_matches_the_rules(scale, clip, truncation, kl_coef):
    traj = make_traj()
    rng = np.random.default_rng(0)
    old = jnp.asarray(rng.normal(size=traj.tokens.shape).astype(np.float32))
    ref = jnp.asarray(rng.normal(size=traj.tokens.shape).astype(np.float32))
    algo = AlgoSection(
        reward_scale=scale, reward_clip=clip, truncation=truncation, truncation_penalty=-0.75, kl_reward_coef=kl_coef
    )
    loss_mask = traj.loss_mask
    out, mask, stats = shape_rewards(algo, traj, loss_mask, old, ref)
    want_turn, want_tok = reference(traj, scale, clip, truncation, -0.75, kl_coef, old, ref)
    np.testing.assert_allclose(np.asarray(out.turn_rewards), want_turn, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.rewards), want_tok, rtol=1e-6, atol=1e-6)
    if truncation == "filter":
        np.testing.assert_array_equal(np.asarray(mask)[1], 0.0)
        np.testing.assert_array_equal(np.asarray(mask)[0], np.asarray(loss_mask)[0])
        assert stats["truncated_filtered"] == 1
    else:
        np.testing.assert_array_equal(np.asarray(mask), np.asarray(loss_mask))
    # the outcome estimators see the shaped returns: GRPO's score is the token-reward sum
    np.testing.assert_allclose(np.asarray(out.rewards).sum(1), want_turn.sum(1), rtol=1e-5, atol=1e-5)


def test_without_options_the_rewards_are_the_env_rewards():
    traj = make_traj()
    traj = traj.replace(rewards=jnp.asarray(reference(traj, 1.0, None, "keep", 0, 0, None, None)[1], jnp.float32))
    out, _, stats = shape_rewards(AlgoSection(), traj, traj.loss_mask)
    np.testing.assert_array_equal(np.asarray(out.rewards), np.asarray(traj.rewards))
    assert stats == {}


def test_kl_penalty_needs_the_log_probs():
    with pytest.raises(ValueError, match="ref_logp"):
        shape_rewards(AlgoSection(kl_reward_coef=0.1), make_traj(), make_traj().loss_mask)


@pytest.mark.parametrize(
    "override, names",
    [
        ("algo.truncation=drop", "truncation"),
        ("algo.reward_clip=-1", "reward_clip"),
        ("algo.kl_reward_coef=-0.5", "kl_reward_coef"),
        ("algo.kl_reward_kind=k9", "kl_reward_kind"),
        ("algo.max_sampling_rounds=0", "max_sampling_rounds"),
    ],
)
def test_option_errors_name_the_key(tmp_path, override, names):
    with pytest.raises(ConfigError, match=names):
        load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", override])


def test_dynamic_sampling_needs_a_group_estimator(tmp_path):
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "algo.advantage=gae", "algo.dynamic_sampling=true"])


@pytest.mark.slow
def test_dynamic_sampling_refills_groups_without_signal(tmp_path):
    # a from-scratch policy on Countdown never solves a task: every group's returns are
    # equal, so each iteration plays all its rounds and keeps the batch shape
    cfg = load_config(
        TrainerConfig,
        CONFIG,
        [f"run_dir={tmp_path / 'run'}", "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2", "iterations=2"],
    )
    trainer = Trainer(cfg, log=lambda *_: None)
    history = trainer.run()
    assert [m["sampling_rounds"] for m in history] == [2, 2]
    assert [m["groups_with_signal"] for m in history] == [0, 0]
    # the stream advanced by every task played, so the next iteration plays new tasks
    n = cfg.env.tasks_per_iteration
    assert [m["tasks_seen"] for m in history] == [2 * n, 4 * n]
    assert all(m["skipped_updates"] == 0 for m in history)


@pytest.mark.slow  # ~20 s (suite budget): the penalty's formula is checked above against NumPy, and a
# run with a reference pass by test_train_lora's adapter-reference run
def test_kl_reward_penalty_runs_with_a_reference(tmp_path):
    cfg = load_config(
        TrainerConfig,
        CONFIG,
        [f"run_dir={tmp_path / 'run'}", "algo.kl_reward_coef=0.05", "iterations=2", "algo.truncation=penalty"],
    )
    trainer = Trainer(cfg, log=lambda *_: None)
    initial = jax.device_get(trainer.state.params)
    history = trainer.run()
    # without a warm start the reference is the initial policy, kept while the policy trains
    ref, final = jax.device_get(trainer.ref_params), jax.device_get(trainer.state.params)
    assert jax.tree.structure(ref) == jax.tree.structure(initial)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(initial), strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(final), strict=True))
    # iteration 1 samples from the reference itself: the k1 penalty is exactly 0; then the policy moved
    assert history[0]["kl_reward_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert history[1]["kl_reward_penalty"] != 0.0


def test_trim_padding_cuts_only_trailing_padding():
    traj = make_traj().replace(lengths=jnp.asarray([5, 9, 3], jnp.int32))
    cut = trim_padding(traj, 4)  # longest 9 -> 12 > T = 10: nothing to cut
    assert cut.tokens.shape == (3, 10)
    cut = trim_padding(traj, 3)  # longest 9 -> 9
    for name in ("tokens", "attention_mask", "loss_mask", "rollout_logp", "turn_ids", "rewards"):
        np.testing.assert_array_equal(np.asarray(getattr(cut, name)), np.asarray(getattr(traj, name))[:, :9])
    for name in ("turn_rewards", "turn_mask", "anchor_ids", "lengths", "group_ids", "done", "failed"):
        np.testing.assert_array_equal(np.asarray(getattr(cut, name)), np.asarray(getattr(traj, name)))
    with pytest.raises(ValueError, match="multiple"):
        trim_padding(traj, 0)
    # the longest over the processes decides the length (9, though this batch's may be 6)
    assert trim_padding(traj, 3, longest=9).tokens.shape == (3, 9)
    assert trim_padding(traj.replace(lengths=jnp.asarray([5, 6, 3], jnp.int32)), 3, longest=9).tokens.shape == (3, 9)
    with pytest.raises(ValueError, match=r"longest \(6\) is shorter than this batch's longest episode \(9\)"):
        trim_padding(traj, 3, longest=6)


def test_trim_padding_error_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trim_padding"):
        load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "update.trim_padding=-1"])


@pytest.mark.slow  # ~37 s; the trimmed batch's exactness is checked in test_train_step (trimmed micro-batches)
def test_trim_padding_trains_as_the_full_length_batch(tmp_path):
    """The same iteration with and without `update.trim_padding`: the rollout is the same,
    the batch the passes see is shorter, and the update lands on the same parameters."""
    runs = {}
    for name, extra in (("full", []), ("trimmed", ["update.trim_padding=64"])):
        cfg = load_config(
            TrainerConfig, CONFIG, [f"run_dir={tmp_path / name}", "iterations=1", "rollout.max_context=768", *extra]
        )
        trainer = Trainer(cfg, log=lambda *_: None)
        seen = []
        update = trainer._update

        def record(state, batch, *a, seen=seen, update=update, **k):
            seen.append(batch.tokens.shape)
            return update(state, batch, *a, **k)

        trainer._update = record
        history = trainer.run()
        runs[name] = (history[0], jax.device_get(trainer.state.params), seen)
    (full, p_full, s_full), (trim, p_trim, s_trim) = runs["full"], runs["trimmed"]
    assert s_full and all(s[1] == 768 for s in s_full)  # max_context
    assert s_trim and all(s[1] < 768 and s[1] % 64 == 0 for s in s_trim)
    assert trim["reward_mean"] == full["reward_mean"]  # the same episodes
    for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(p_trim), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)


#: episodes of 1 or 2 turns (the env's seed decides), so rows of uneven length
UNEVEN = [
    "env.name=testing/uneven",
    "env.kwargs={prompt_words: 4, obs_words: 3, min_turns: 1, max_turns: 2, median_ms: 0.1}",
    "rollout.max_turns=3",
    "rollout.max_context=512",
    "env.group_size=2",
    "env.tasks_per_iteration=4",
]


# slow (~45-70 s): the suite's time; the trimmed step's own tests stay in it (test_train_step.py)
@pytest.mark.slow
def test_trim_chunks_trains_as_the_trimmed_batch(tmp_path):
    """`update.trim_chunks`: the same iteration as with `trim_padding` alone, the update's
    micro-batches and the log-prob pass's chunks each cut to their own rows' length."""
    from types import SimpleNamespace

    from jaxagent.train.placement import policy_logprobs

    runs = {}
    for name, extra in (("batch", []), ("chunks", ["update.trim_chunks=true"])):
        cfg = load_config(
            TrainerConfig,
            CONFIG,
            [
                f"run_dir={tmp_path / name}",
                "iterations=1",
                "update.micro_batches=2",
                *UNEVEN,
                "update.trim_padding=8",
                *extra,
            ],
        )
        trainer = Trainer(cfg, log=lambda *_: None)
        seen = []
        update = trainer._update

        def record(state, batch, *, seen=seen, update=update):
            seen.append(batch.tokens.shape[1])
            return update(state, batch)

        trainer._update = record
        history = trainer.run()
        runs[name] = (history[0], jax.device_get(trainer.state.params), seen, trainer, update)
    (full, p_full, s_full, _, plain), (chunks, p_chunks, s_chunks, trainer, trimmed) = runs["batch"], runs["chunks"]
    assert not hasattr(plain, "lengths_seen") and s_full == s_chunks  # the plain step, then the trimmed one
    assert trimmed.lengths_seen and min(trimmed.lengths_seen) < max(s_chunks)
    assert all(L % 8 == 0 for L in trimmed.lengths_seen)
    assert chunks["reward_mean"] == full["reward_mean"]  # the same episodes
    np.testing.assert_allclose(chunks["rollout_logp_gap"], full["rollout_logp_gap"], atol=1e-6)
    for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(p_chunks), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    # the chunked log-prob pass: the one-pass values up to each row's length, 0 after its chunk's
    r = np.random.RandomState(0)
    lens = np.array([3, 40, 17, 9, 25, 38, 1, 36])
    am = (np.arange(40)[None, :] < lens[:, None]).astype(np.int32)
    placed = SimpleNamespace(
        tokens=jnp.asarray(r.randint(0, 200, (8, 40)), jnp.int32),
        attention_mask=jnp.asarray(am),
        loss_mask=jnp.asarray(am.astype(np.float32)),
        segment_ids=None,
    )
    params = trainer.state.params
    got = np.asarray(trainer.placement.logprobs(params, placed))
    sc = trainer.config.step_config
    want = np.asarray(
        policy_logprobs(
            params,
            trainer.model_config,
            tokens_BxT=placed.tokens,
            attention_mask_BxT=placed.attention_mask,
            temperature=sc.loss.temperature,
            seq_chunk=sc.seq_chunk,
            vocab_chunk=sc.vocab_chunk,
        )
    )
    real = am != 0
    np.testing.assert_allclose(got[real], want[real], rtol=1e-6, atol=1e-6)
    # chunks of 2 rows (the micro-batch): rows 6, 0 | 3, 2 | 4, 7 | 5, 1 -> lengths 8, 24, 40, 40 (one call)
    for rows, L in (((6, 0), 8), ((3, 2), 24)):
        assert not got[list(rows), L:].any()


def test_trim_chunks_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trim_chunks needs update.trim_padding"):
        load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "update.trim_chunks=true"])
    with pytest.raises(ConfigError, match="update.trim_chunks"):
        load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "update.trim_padding=8", "update.trim_chunks=2"])
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 of the virtual CPU devices of conftest.py")
    # on a mesh each micro-batch's rows are split over data * fsdp: 8 rows / 2 / 2 = 2 over 4
    cfg = load_config(
        TrainerConfig,
        CONFIG,
        [
            f"run_dir={tmp_path}",
            "update.trim_padding=8",
            "update.trim_chunks=true",
            "mesh.data=4",
            "update.micro_batches=2",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"trim_chunks on a mesh: each micro-batch's 2 rows .* mesh.data \* mesh.fsdp = 4"
    ):
        Trainer(cfg, log=lambda *_: None)


def test_a_moved_key_is_refused_with_its_new_name(tmp_path):
    """The update's keys live in the `update` section: the old top-level ones and
    `rollout.trim_*`, in the YAML or on the command line, are errors naming the new key."""
    import yaml

    moved = {
        "epochs": 2,
        "mini_batches": 4,
        "micro_batches": 2,
        "logprob_rows": 8,
        "old_logprobs": "sampler",
        "rollout.trim_padding": 8,
        "rollout.trim_chunks": True,
    }
    for old, value in moved.items():
        new = "update." + old.split(".")[-1]
        with pytest.raises(ConfigError, match=rf"{old} moved to {new}"):
            load_config(TrainerConfig, None, [f"{old}={value}"])
        section, _, key = old.rpartition(".")
        path = tmp_path / "old.yaml"
        path.write_text(yaml.safe_dump({section: {key: value}} if section else {key: value}))
        with pytest.raises(ConfigError, match=rf"{old} moved to {new}"):
            load_config(TrainerConfig, path)

    # a run's own config.yaml written before the keys moved still loads (resume, eval):
    # each old key is read at its new place, and a value already there wins
    path.write_text(
        yaml.safe_dump(
            {
                "mini_batches": 4,
                "epochs": 2,
                "rollout": {"trim_padding": 8, "trim_chunks": True},
                "update": {"epochs": 3},
            }
        )
    )
    cfg = load_config(TrainerConfig, path, saved=True)
    assert (cfg.update.mini_batches, cfg.update.epochs, cfg.update.trim_padding, cfg.update.trim_chunks) == (
        4,
        3,
        8,
        True,
    )
