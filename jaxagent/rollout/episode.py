"""An episode's host record, how the loop cuts it off, and the packing of a batch of them.

Every scheduler of `AgentLoop` fills `Episode` records the same way (`scheduling.Rollout`)
and packs them with `pack` into the `Trajectory` the trainer consumes.

The loop's cut: an episode the loop stops at its own limit (context or turns) ends
truncated; when the env said what its episode scores if cut off now (the env protocol's
optional `envs.Env.cut_outcome`, which `envs.TextEnv` carries in the reset's and each
step's `info["if_cut"]`), `Episode.cut` applies it (intake: the rubric without an
assessment), so that filling the context is never a way around the env's own
truncation score.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxagent.rollout.trajectory import Trajectory, rewards_at_turn_ends

#: the `info` key under which an env carries its `cut_outcome` (`envs.core.CUT_KEY`; the
#: rollout does not import `envs`): `{"reward": r, "info": {...}}`
CUT_KEY = "if_cut"


def episode_success(done: bool, rewards: Sequence[float], info: dict | None) -> bool:
    """Success of an episode, the one definition metrics, evaluations, demonstrations and
    transcripts share: the env's own `info["success"]` on its last step when it reports
    one, else "the env terminated it with a last reward > 0" (true of the built-in games)."""
    if info and "success" in info:
        return bool(info["success"])
    return bool(done and rewards and rewards[-1] > 0)


@dataclasses.dataclass
class Episode:
    """Host record of one episode (also returned for logging and debugging).

    `segments` lists the token segments in order as `(kind, tokens)` with kind
    "prompt", "policy" or "observation"; `sequence_ids` the sequence of each token (0
    unless `start_sequence` began another: a row packing several sequences, which attend
    only within themselves; `pack(segmented=True)`); `actions`, `observations` are the texts
    exchanged; `state_keys[k]` is the env state turn k acted in; `finish_reasons[k]` the
    sampler's reason for ending turn k; `end_reason` why the episode ended.
    """

    index: int
    seed: Any
    group_id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    segments: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    sequence_ids: list[int] = dataclasses.field(default_factory=list)
    #: the sequence `add` appends to
    sequence: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    state_keys: list[Hashable] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)
    observations: list[Any] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    done: bool = False
    truncated: bool = False
    failed: bool = False
    end_reason: str = ""
    failure: str = ""
    #: for a failed episode: its failure kind (one of `jaxagent.failures`: raised, crashed,
    #: timeout ...; or a judge's) and traceback
    failure_kind: str = ""
    failure_traceback: str = ""
    system_prompt: str | None = None
    state_key: Hashable = None
    #: the env's info dict of the episode's last step ({} before the first step)
    info: dict = dataclasses.field(default_factory=dict)
    #: steps the env answered with `info["invalid_action"]` (a malformed action)
    invalid_actions: int = 0
    #: steps the env answered with `info["noop"]` (a valid action that changed nothing)
    noop_actions: int = 0

    @property
    def finished(self) -> bool:
        return self.done or self.truncated or self.failed

    @property
    def success(self) -> bool:
        """`episode_success` of this episode."""
        return episode_success(self.done, self.rewards, self.info)

    def add(self, kind: str, tokens: Sequence[int], logp: Sequence[float] | None = None, turn: int = -1):
        tokens = [int(t) for t in tokens]
        policy = kind == "policy"
        if policy:
            if logp is None:
                raise TypeError("Episode.add: policy tokens need their log-probs (logp)")
            logps = [float(x) for x in logp]
        else:
            logps = [0.0] * len(tokens)
        self.segments.append((kind, tokens))
        self.sequence_ids += [self.sequence] * len(tokens)
        self.tokens += tokens
        self.loss_mask += [1 if policy else 0] * len(tokens)
        self.logp += logps
        self.turn_ids += [turn if policy else -1] * len(tokens)

    def start_sequence(self) -> None:
        """The tokens added from now on are a new sequence of this row: they do not see
        the earlier ones (a session that rewrote its history; `sequence_ids`)."""
        if not self.tokens:
            raise ValueError("Episode.start_sequence: the episode has no tokens yet (its first sequence is implicit)")
        self.sequence += 1

    def end(self, *, done=False, truncated=False, failed=False, reason: str, failure: str = ""):
        self.done, self.truncated, self.failed = bool(done), bool(truncated), bool(failed)
        self.end_reason, self.failure = reason, failure

    def fail(self, info: dict) -> None:
        """Ends the episode as failed with what the pool's `info` says about the failure."""
        self.end(failed=True, reason="env_failed", failure=str(info.get("failure", "")))
        self.failure_kind = str(info.get("failure_kind", "") or "")
        self.failure_traceback = str(info.get("traceback", "") or "")

    def cut(self, reason: str) -> None:
        """Ends the episode truncated by the loop (`reason`: the context or turn limit).
        When the env's last info carries its cut outcome (`info["if_cut"]`: `{"reward":
        r, "info": {...}}`, from `envs.Env.cut_outcome`), the last turn gets that reward
        and the episode that info: a policy cannot escape the env's truncation score by
        filling the context."""
        cut = self.info.get(CUT_KEY) if isinstance(self.info, dict) else None
        if isinstance(cut, dict) and self.rewards:
            self.rewards[-1] += float(cut.get("reward", 0.0))
            self.info = dict(cut.get("info") or {})
        self.end(truncated=True, reason=reason)


def pack(
    episodes: Sequence[Episode], *, max_context: int, max_turns: int, pad_id: int, segmented: bool = False
) -> Trajectory:
    """The `Trajectory` of a batch of finished episodes: `[B, max_context]` token arrays,
    `[B, max_turns]` turn arrays, padded with `pad_id`. `segmented`: with `segment_ids`
    (`Episode.sequence_ids` + 1, 0 on padding) whether or not a row packs several
    sequences, so that a loop whose rows may pack them always gives one batch layout;
    without it, every episode must be one sequence."""
    B, T, K = len(episodes), max_context, max_turns
    tokens = np.full((B, T), pad_id, np.int32)
    attn = np.zeros((B, T), np.int32)
    loss = np.zeros((B, T), np.float32)
    logp = np.zeros((B, T), np.float32)
    tid = np.full((B, T), -1, np.int32)
    turn_rew = np.zeros((B, K), np.float32)
    turn_mask = np.zeros((B, K), bool)
    seg = np.zeros((B, T), np.int32) if segmented else None
    for b, ep in enumerate(episodes):
        n = len(ep.tokens)
        if n > T:
            raise ValueError(f"pack: episode {ep.index} has {n} tokens, more than max_context={T}")
        if seg is not None:
            seg[b, :n] = np.asarray(ep.sequence_ids, np.int32) + 1
        elif ep.sequence:
            raise ValueError(f"pack: episode {ep.index} packs {ep.sequence + 1} sequences; pack it with segmented=True")
        tokens[b, :n], attn[b, :n] = ep.tokens, 1
        loss[b, :n], logp[b, :n], tid[b, :n] = ep.loss_mask, ep.logp, ep.turn_ids
        for k, r in enumerate(ep.rewards):
            turn_rew[b, k], turn_mask[b, k] = r, True
    rew = rewards_at_turn_ends(turn_rew, tid)
    anchor = anchor_ids(episodes, K)
    return Trajectory(
        tokens=jnp.asarray(tokens),
        attention_mask=jnp.asarray(attn),
        loss_mask=jnp.asarray(loss),
        rollout_logp=jnp.asarray(logp),
        turn_ids=jnp.asarray(tid),
        rewards=jnp.asarray(rew),
        group_ids=jnp.asarray(np.array([ep.group_id for ep in episodes], np.int32)),
        turn_rewards=jnp.asarray(turn_rew),
        turn_mask=jnp.asarray(turn_mask),
        anchor_ids=jnp.asarray(anchor),
        episode_return=jnp.asarray(turn_rew.sum(axis=1)),
        lengths=jnp.asarray(np.array([len(ep.tokens) for ep in episodes], np.int32)),
        num_turns=jnp.asarray(turn_mask.sum(axis=1).astype(np.int32)),
        done=jnp.asarray(np.array([ep.done for ep in episodes])),
        truncated=jnp.asarray(np.array([ep.truncated for ep in episodes])),
        failed=jnp.asarray(np.array([ep.failed for ep in episodes])),
        segment_ids=None if seg is None else jnp.asarray(seg),
    )


def anchor_ids(episodes: Sequence[Episode], max_turns: int) -> np.ndarray:
    """Dense anchor-state ids `[B, K]` of a batch of episodes: turns that acted in equal
    env states (`Episode.state_keys`) share an id, numbered in order of first
    appearance; -1 where a turn was not played or its state has no key."""
    out = np.full((len(episodes), max_turns), -1, np.int32)
    table: dict = {}
    for b, ep in enumerate(episodes):
        for k, key in enumerate(ep.state_keys[:max_turns]):
            if key is not None:
                out[b, k] = table.setdefault(_stable(key), len(table))
    return out


def _stable(key: Hashable) -> str:
    """A process-independent identity of a state key (keys may come from worker processes)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()
