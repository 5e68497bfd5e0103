"""`Trajectory`: the batch of multi-turn episodes the trainer learns from, as one pytree.

Token axis `T` (= the rollout's `max_context`, fixed so the train step compiles once;
:func:`trim_padding` cuts it to the batch's longest episode, rounded up) and turn axis
`K` (= `max_turns`). Row `b` holds episode `b`'s token sequence exactly
as the sampler saw it: the first prompt, then per turn the policy's tokens followed by
the next observation's tokens, then padding.

=================  ==========  =======  ==============================================
field              shape       dtype    meaning
=================  ==========  =======  ==============================================
tokens             [B, T]      int32    token ids (pad_id after `lengths[b]`)
attention_mask     [B, T]      int32    1 on the episode's tokens, 0 on padding
loss_mask          [B, T]      float32  1 on policy (sampled) tokens only
rollout_logp       [B, T]      float32  sampler log-prob of each policy token, else 0
turn_ids           [B, T]      int32    turn index of each policy token, -1 elsewhere
rewards            [B, T]      float32  each turn's env reward at its last policy token
group_ids          [B]         int32    episodes sharing a task (seed / prompt)
turn_rewards       [B, K]      float32  env reward of each turn
turn_mask          [B, K]      bool     turn k was played (has policy tokens)
anchor_ids         [B, K]      int32    dense id of the env state a turn acted in
                                        (equal state keys, equal ids, across the batch;
                                        -1 for turns not played / unknown state)
episode_return     [B]         float32  sum of turn rewards
lengths            [B]         int32    tokens in the episode
num_turns          [B]         int32    turns played
done               [B]         bool     the env ended the episode (terminated)
truncated          [B]         bool     cut short: env step limit, max turns, context
failed             [B]         bool     the env failed (masked out of the loss)
segment_ids        [B, T]      int32    or None: a row packing several sequences of one
                                        episode (an agent program's session that
                                        rewrote its history), 1, 2, ... per sequence,
                                        each a contiguous run; tokens attend within
                                        their own sequence, positions restart at 0 (0
                                        on padding)
=================  ==========  =======  ==============================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass
class Trajectory:
    """A batch of episodes; see the module docstring for the fields."""

    tokens: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    rollout_logp: jax.Array
    turn_ids: jax.Array
    rewards: jax.Array
    group_ids: jax.Array
    turn_rewards: jax.Array
    turn_mask: jax.Array
    anchor_ids: jax.Array
    episode_return: jax.Array
    lengths: jax.Array
    num_turns: jax.Array
    done: jax.Array
    truncated: jax.Array
    failed: jax.Array
    segment_ids: jax.Array | None = None

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]


def rewards_at_turn_ends(turn_rewards_BxK, turn_ids_BxT) -> np.ndarray:
    """The per-token `rewards` field from per-turn rewards: turn k's reward at its last
    policy token (`turn_ids == k`, a contiguous run), 0 elsewhere. `[B, T]` float32."""
    tid = np.asarray(turn_ids_BxT)
    turn_r = np.asarray(turn_rewards_BxK, np.float32)
    nxt = np.concatenate([tid[:, 1:], np.full((tid.shape[0], 1), -1, tid.dtype)], axis=1)
    b, t = np.nonzero((tid >= 0) & (nxt != tid))
    out = np.zeros(tid.shape, np.float32)
    out[b, t] = turn_r[b, tid[b, t]]
    return out


#: the `[B, T]` fields, the ones `trim_padding` cuts (`segment_ids` too, when set)
TOKEN_FIELDS = ("tokens", "attention_mask", "loss_mask", "rollout_logp", "turn_ids", "rewards", "segment_ids")


def trim_padding(traj: Trajectory, multiple: int, longest: int | None = None) -> Trajectory:
    """`traj` with its token axis cut to its longest episode rounded up to a multiple of
    `multiple` (never longer than it was). Only trailing padding goes: a causal model's
    outputs at the kept positions, and every masked sum over them, are unchanged, while
    the log-prob pass and the update stop paying for padding. Each distinct length
    compiles those passes once, so a multiple of 64-128 keeps the compiles few.
    `longest`: the length to keep instead of this batch's longest episode (at least it):
    with several processes, the longest over all their batches, so that they agree."""
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"trim_padding: multiple must be an int >= 1, got {multiple!r}")
    T = traj.tokens.shape[1]
    own = int(np.max(np.asarray(traj.lengths))) if traj.tokens.shape[0] else 0
    if longest is not None and longest < own:
        raise ValueError(f"trim_padding: longest ({longest}) is shorter than this batch's longest episode ({own})")
    longest = own if longest is None else int(longest)
    keep = min(T, max(multiple, -(-longest // multiple) * multiple))
    if keep == T:
        return traj
    return traj.replace(**{f: getattr(traj, f)[:, :keep] for f in TOKEN_FIELDS if getattr(traj, f) is not None})
