"""Learning diagnostics of an iteration (`jaxagent.train.metrics`): flat groups, anchor
repeats, invalid actions, and the entropy-collapse warning."""
import types

import numpy as np

from jaxagent.train.metrics import collapse_warning, learning_diagnostics


def batch(returns, group_ids, failed, anchor_ids, turn_mask):
    turn_mask = np.asarray(turn_mask, bool)
    return types.SimpleNamespace(episode_return=np.asarray(returns, np.float32), group_ids=np.asarray(group_ids),
                                 failed=np.asarray(failed, bool), anchor_ids=np.asarray(anchor_ids),
                                 turn_mask=turn_mask, num_turns=turn_mask.sum(1))


def test_flat_groups_anchor_repeats_and_invalid_actions():
    traj = batch(
        returns=[1, 1, 0, 1, 2, 2],             # group 0: flat; group 1: varies; group 2: one survivor -> flat
        group_ids=[0, 0, 1, 1, 2, 2],
        failed=[0, 0, 0, 0, 0, 1],
        anchor_ids=[[5, 6, -1], [5, 7, -1], [5, 6, 9], [8, -1, -1], [6, 6, -1], [6, 6, 6]],
        turn_mask=[[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    got = learning_diagnostics(traj, invalid_actions=np.array([0, 1, 0, 2, 0, 5]),
                               noop_actions=np.array([1, 0, 0, 0, 2, 0]))
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
