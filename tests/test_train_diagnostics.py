"""Learning diagnostics of an iteration (`jaxagent.train.metrics`): flat groups, anchor
repeats, invalid actions, input dependence (template collapse), and the entropy-collapse,
template-collapse and reward-hacking warnings."""

import collections
import itertools
import types

import numpy as np
import pytest

from jaxagent.train.metrics import (
    collapse_warning,
    hacking_warning,
    input_dependence,
    learning_diagnostics,
    template_collapse_warning,
)


def batch(returns, group_ids, failed, anchor_ids, turn_mask, tokens=None, loss_mask=None):
    turn_mask = np.asarray(turn_mask, bool)
    n = len(returns)
    tokens = np.zeros((n, 1), np.int32) if tokens is None else np.asarray(tokens)
    loss_mask = np.ones(tokens.shape, np.int32) if loss_mask is None else np.asarray(loss_mask)
    return types.SimpleNamespace(
        episode_return=np.asarray(returns, np.float32),
        group_ids=np.asarray(group_ids),
        failed=np.asarray(failed, bool),
        anchor_ids=np.asarray(anchor_ids),
        turn_mask=turn_mask,
        num_turns=turn_mask.sum(1),
        tokens=tokens,
        loss_mask=loss_mask,
    )


def test_flat_groups_anchor_repeats_and_invalid_actions():
    traj = batch(
        returns=[1, 1, 0, 1, 2, 2],  # group 0: flat; group 1: varies; group 2: one survivor -> flat
        group_ids=[0, 0, 1, 1, 2, 2],
        failed=[0, 0, 0, 0, 0, 1],
        anchor_ids=[[5, 6, -1], [5, 7, -1], [5, 6, 9], [8, -1, -1], [6, 6, -1], [6, 6, 6]],
        turn_mask=[[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
    )
    got = learning_diagnostics(
        traj, invalid_actions=np.array([0, 1, 0, 2, 0, 5]), noop_actions=np.array([1, 0, 0, 0, 2, 0])
    )
    assert got["flat_groups_frac"] == 2 / 3
    # played turns of live episodes: 2 + 2 + 3 + 1 + 2 = 10. Repeated (group, anchor):
    # group 0 anchor 5 (two turns); group 1: 5, 6, 9, 8 all once; group 2 anchor 6 twice
    # in row 4 (row 5 failed): 4 turns
    assert got["anchor_repeat_frac"] == 4 / 10
    # invalid actions over all turns played (failed rows included): 8 / 13
    assert got["invalid_action_frac"] == 8 / 13
    assert got["noop_action_frac"] == 3 / 13
    assert "invalid_action_frac" not in learning_diagnostics(traj)
    assert "noop_action_frac" not in learning_diagnostics(traj)


def test_collapse_warning_needs_low_entropy_and_no_rise():
    hist = [{"iteration": i + 1, "success_rate": s, "entropy": 0.5} for i, s in enumerate([0.2, 0.6, 0.4, 0.4, 0.4])]
    low_flat = {"iteration": 6, "success_rate": 0.3, "entropy": 0.01}
    msg = collapse_warning(hist, low_flat, entropy_below=0.05, window=3)
    assert msg is not None and "iteration 6" in msg and "0.0100" in msg
    # the last window (0.4, 0.4, 0.3) = 0.367 is below the one before (0.2, 0.6, 0.4) = 0.400
    assert "last 3 iterations 0.367, the 3 before 0.400" in msg
    assert collapse_warning(hist, {**low_flat, "success_rate": 0.9}, entropy_below=0.05, window=3) is None
    assert collapse_warning(hist, {**low_flat, "entropy": 0.2}, entropy_below=0.05, window=3) is None
    assert collapse_warning(hist[:3], low_flat, entropy_below=0.05, window=3) is None  # too early to tell


# ----------------------------------------------------------------- input dependence
def reference_input_dependence(tokens, loss_mask, group_ids, ok):
    """The same quantities written out plainly (dicts of counts, float64 loops)."""
    bags = {}
    for i in range(len(tokens)):
        if not ok[i]:
            continue
        t = [int(x) for x, m in zip(tokens[i], loss_mask[i], strict=True) if m]
        # bigrams: each token with the next (strict=False: t[1:] is one shorter)
        bags[i] = collections.Counter([("u", x) for x in t] + [("b", a, b) for a, b in zip(t, t[1:], strict=False)])
    sizes = collections.Counter(group_ids[i] for i in bags)
    groups = sorted(g for g, c in sizes.items() if c >= 2)
    rows = [i for i in bags if group_ids[i] in groups]

    def cos(a, b):
        na = np.sqrt(sum(v * v for v in bags[a].values()))
        nb = np.sqrt(sum(v * v for v in bags[b].values()))
        dot = sum(v * bags[b][k] for k, v in bags[a].items())
        return dot / (na * nb) if na and nb else 0.0

    m = min(sizes[g] for g in groups) - 1
    hits = 0
    for r in rows:
        score = {}
        for g in groups:
            others = [j for j in rows if group_ids[j] == g and j != r]
            if group_ids[r] != g:
                others = others[:m]
            else:  # its own group: the first m + 1, itself left out
                firsts = [j for j in rows if group_ids[j] == g][: m + 1]
                others = [j for j in firsts if j != r][:m]
            score[g] = np.mean([cos(r, j) for j in others])
        own = score.pop(group_ids[r])
        hits += own > max(score.values())
    acc = hits / len(rows)
    pairs = [(a, b) for a, b in itertools.permutations(rows, 2)]
    within = np.mean([cos(a, b) for a, b in pairs if group_ids[a] == group_ids[b]])
    cross = np.mean([cos(a, b) for a, b in pairs if group_ids[a] != group_ids[b]])
    chance = 1 / len(groups)
    return {
        "input_retrieval_acc": acc,
        "input_dependence": (acc - chance) / (1 - chance),
        "within_input_similarity": within,
        "cross_input_similarity": cross,
    }


def test_input_dependence_against_a_plain_reference():
    rng = np.random.default_rng(3)
    n, length = 14, 12
    gid = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 4, 4])  # group 3 has one episode: left out
    tokens = rng.integers(0, 6, (n, length)) + 3 * gid[:, None]  # groups share part of their vocabulary
    mask = (rng.random((n, length)) < 0.8).astype(np.int32)
    ok = np.ones(n, bool)
    ok[13] = False  # a failed episode takes no part
    got = input_dependence(tokens, mask, gid, ok)
    want = reference_input_dependence(tokens, mask, gid, ok)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k


def test_input_dependence_is_one_for_responses_that_name_their_task_and_zero_for_a_template():
    gid = np.repeat(np.arange(4), 3)
    own_words = np.stack([np.arange(5) + 10 * g for g in gid])  # disjoint vocabularies
    got = input_dependence(own_words, np.ones_like(own_words), gid, np.ones(12, bool))
    assert got["input_retrieval_acc"] == 1.0 and got["input_dependence"] == 1.0
    assert got["cross_input_similarity"] == 0.0 and got["within_input_similarity"] == pytest.approx(1.0)
    # every response the same template: every match is a tie, a miss; below chance
    template = np.tile(np.arange(5), (12, 1))
    got = input_dependence(template, np.ones_like(template), gid, np.ones(12, bool))
    assert got["input_retrieval_acc"] == 0.0 and got["input_dependence"] == pytest.approx(-1 / 3)
    assert got["cross_input_similarity"] == pytest.approx(1.0)
    # fewer than two groups with two live episodes: nothing to tell
    assert input_dependence(template, np.ones_like(template), gid, gid == 0) == {}


def test_input_dependence_of_input_blind_responses_is_chance_on_average():
    """Responses drawn without looking at the task: the retrieval accuracy is 1/T on
    average (the groups' scores are means over equally many episodes, so no group's
    score is noisier than another's), whatever the group sizes."""
    gid = np.array([0] * 3 + [1] * 5 + [2] * 4 + [3] * 3)
    accs = [
        input_dependence(np.random.default_rng(s).integers(0, 12, (15, 20)), np.ones((15, 20)), gid, np.ones(15, bool))[
            "input_retrieval_acc"
        ]
        for s in range(400)
    ]
    assert abs(np.mean(accs) - 0.25) < 3 * np.std(accs) / np.sqrt(len(accs)) + 0.005


def test_learning_diagnostics_carry_input_dependence():
    tokens = np.array([[1, 2, 0], [1, 2, 0], [7, 8, 9], [7, 9, 8]])
    traj = batch(
        returns=[0, 1, 0, 1],
        group_ids=[0, 0, 1, 1],
        failed=[0, 0, 0, 0],
        anchor_ids=np.full((4, 1), -1),
        turn_mask=np.ones((4, 1)),
        tokens=tokens,
        loss_mask=np.array([[1, 1, 0]] * 2 + [[1, 1, 1]] * 2),
    )
    got = learning_diagnostics(traj)
    assert got["input_dependence"] == 1.0 and got["cross_input_similarity"] == 0.0


def test_template_collapse_warning_after_a_window_below_the_threshold():
    hist = [{"iteration": i + 1, "input_dependence": v, "entropy": 0.8} for i, v in enumerate([0.9, 0.1, 0.05])]
    now = {"iteration": 4, "input_dependence": 0.02, "entropy": 0.8}
    msg = template_collapse_warning(hist, now, below=0.2, window=3)
    assert msg is not None and "iteration 4" in msg and "0.020 < 0.2 for 3 iterations" in msg
    assert template_collapse_warning(hist[:2], now, below=0.2, window=3) is None  # 0.9 in the window
    assert template_collapse_warning(hist, {**now, "input_dependence": 0.5}, below=0.2, window=3) is None
    assert template_collapse_warning(hist, {"iteration": 4}, below=0.2, window=3) is None  # no measure
    assert template_collapse_warning([], now, below=0.2, window=1) is not None


def test_hacking_warning_when_the_training_reward_rises_and_the_held_out_scorer_falls():
    rows = [(0.1, 0.30), (0.2, 0.32), (0.3, 0.31), (0.4, 0.28), (0.5, 0.25)]
    hist = [{"iteration": i + 1, "reward_mean": r, "heldout": h} for i, (r, h) in enumerate(rows)]
    now = {"iteration": 6, "reward_mean": 0.6, "heldout": 0.20}
    msg = hacking_warning(hist, now, heldout="heldout", window=3)
    # last 3: reward 0.5, held-out 0.2433; the 3 before: reward 0.2, held-out 0.31
    assert msg is not None and "0.200 -> 0.500" in msg and "0.3100 -> 0.2433" in msg and "iteration 6" in msg
    assert hacking_warning(hist, {**now, "heldout": 0.5}, heldout="heldout", window=3) is None  # both rose
    falling = [{**m, "reward_mean": 1 - m["reward_mean"]} for m in hist]
    assert hacking_warning(falling, {**now, "reward_mean": 0.0}, heldout="heldout", window=3) is None
    assert hacking_warning(hist[:4], now, heldout="heldout", window=3) is None  # too early to tell
    assert hacking_warning(hist, {"iteration": 6, "reward_mean": 0.6}, heldout="heldout", window=3) is None


@pytest.mark.slow  # a whole (tiny) run, ~10-15 s
def test_an_unknown_held_out_metric_is_named_with_the_ones_the_iterations_have(tmp_path):
    from pathlib import Path

    from jaxagent.dataclass_yaml import ConfigError, load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        TrainerConfig,
        root / "configs" / "tiny_frozenlake_gigpo.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            "iterations=1",
            "eval.episodes=0",
            "logging.heldout_metric=train_env_heldout_score",
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"logging.heldout_metric: the iterations have no metric "
        r"'train_env_heldout_score' \(they have: .*reward_mean",
    ):
        Trainer(cfg, log=lambda *_: None).run()
    for bad, match in (
        ("logging.template_collapse_below=1.5", "template_collapse_below must be a number in"),
        ("logging.heldout_metric=", "heldout_metric must be a metric name"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(TrainerConfig, None, [bad])
