"""The contract of a producer of episode batches: `EpisodeLoop`.

Two loops implement it: `jaxagent.rollout.agent_loop.AgentLoop` (the policy acts in envs
of an `envs.EnvPool`) and `jaxagent.gateway.loop.ProgramLoop` (the user's agent program
calls the policy through the gateway, one session per row). The trainer, evaluation,
batch collection and the overlap thread call only what is written here, so a third
producer plugs in by subclassing it.

`run` checks its arguments once, here, and hands them to the subclass's `_play`. Every
loop owns a `Sampler` (`sampler`, whose params `set_params` replaces), its config (an
`AgentLoopConfig`), the `ChatFormat` of its tokenizer (`chat`), the per-phase seconds of
its last run (`timings`) and an optional `reward_fn(episodes)` applied before packing
(a judge's reward). `close` frees what the loop started (a gateway's server, engine and
worker processes; nothing for the env loop); a loop is a context manager.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.episode import Episode
from jaxagent.rollout.sampling import SamplingConfig
from jaxagent.rollout.trajectory import Trajectory


class EpisodePool(Protocol):
    """What a loop plays in: one row per slot (`len(pool)`). An `envs.EnvPool` is one
    (its envs are the slots); so is the gateway's `TaskPool` (the task of a seed)."""

    def __len__(self) -> int: ...


class EpisodeLoop(abc.ABC):
    """A producer of episode batches (module docstring)."""

    config: Any  # the run's `AgentLoopConfig`
    sampler: Any  # the `Sampler` the loop decodes with
    chat: ChatFormat
    timings: dict[str, float]
    reward_fn: Any  # None, or fn(episodes) called on a batch's finished episodes

    @property
    def params(self):
        return self.sampler.params

    def set_params(self, params) -> None:
        """Use new policy parameters (same shapes: no recompilation)."""
        self.sampler.params = params

    def run(
        self,
        pool: EpisodePool,
        seeds: Sequence[Any],
        group_ids: Sequence[int] | None = None,
        *,
        seed: int | None = None,
        sampling: SamplingConfig | None = None,
        row_offset: int = 0,
    ) -> tuple[Trajectory, list[Episode]]:
        """Play one episode per pool row (`len(seeds) == len(pool)`); the batch and its
        episodes.

        group_ids: the group of each row (None: each row its own).
        seed, sampling: this rollout's sampling seed and settings (None = the config's).
        row_offset: the global index of this batch's first row; row `i` samples with the
          key `fold_in(seed, row_offset + i)`, so processes that each play a slice of one
          global batch together sample what one process playing it all would.
        """
        name = type(self).__name__
        sampling = self.config.sampling if sampling is None else sampling
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"{name}.run: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if isinstance(row_offset, bool) or not isinstance(row_offset, (int, np.integer)) or row_offset < 0:
            raise ValueError(f"{name}.run: row_offset must be an int >= 0, got {row_offset!r}")
        B = len(seeds)
        if B != len(pool):
            raise ValueError(f"{name}.run: got {B} seeds for a pool of {len(pool)} rows")
        group_ids = list(range(B)) if group_ids is None else [int(g) for g in group_ids]
        if len(group_ids) != B:
            raise ValueError(f"{name}.run: group_ids has {len(group_ids)} entries, expected {B}")
        seed = self.config.seed if seed is None else seed
        return self._play(pool, list(seeds), group_ids, seed=seed, sampling=sampling, row_offset=int(row_offset))

    @abc.abstractmethod
    def _play(
        self,
        pool: EpisodePool,
        seeds: list,
        group_ids: list[int],
        *,
        seed: Any,
        sampling: SamplingConfig,
        row_offset: int,
    ) -> tuple[Trajectory, list[Episode]]:
        """`run` with its arguments checked and defaulted."""

    def close(self) -> None:
        """Frees what the loop started (idempotent); the env loop starts nothing."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
