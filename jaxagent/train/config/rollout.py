"""The run config's `rollout:` section: sampling and the multi-turn agent loop
(`RolloutSection`)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jaxagent.train.config.bounds import check_int

TRUNCATION_MODES = ("keep", "filter", "penalty")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Episode limits and sampling (`loop_config()` is the `jaxagent.rollout.AgentLoopConfig`).

    max_turns: policy turns per episode at most.
    max_tokens_per_turn: tokens the policy may generate in one turn.
    max_context: tokens per episode (prompt, turns and observations) at most.
    temperature, top_k, top_p: sampling (temperature 0 = greedy; top_k 0 = off).
    pipeline_groups: > 1 splits each rollout into that many sub-batches so that env
      steps of one overlap the device's decoding of another (same trajectories).
    slots: 0 = turn-synchronous (or `pipeline_groups`); S > 0 = continuous scheduling
      with S sampler rows: every episode moves on as soon as its own env step is back,
      and a finished episode's row takes the next episode (same trajectories).
    """

    max_turns: int = 2
    max_tokens_per_turn: int = 32
    max_context: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    pipeline_groups: int = 1
    slots: int = 0

    #: keys that moved to another section: old key -> new dotted key (`load_config` names the new one)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"trim_padding": "update.trim_padding", "trim_chunks": "update.trim_chunks"}

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "pipeline_groups"):
            check_int(name, getattr(self, name), 1)
        check_int("slots", self.slots, 0)
        if self.slots and self.pipeline_groups > 1:
            raise ValueError(
                f"rollout.slots={self.slots} (continuous scheduling) and rollout.pipeline_groups="
                f"{self.pipeline_groups} are two ways of overlapping env steps; set one"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check_int("top_k", self.top_k, 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def sampling(self):
        """The `jaxagent.rollout.SamplingConfig` of these keys."""
        from jaxagent.rollout import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def sampler_rows(self, batch: int) -> int:
        """Rows of the largest sampler state a rollout of `batch` rows decodes at once: a
        pipeline group's (`pipeline_groups`), or the continuous scheduler's `slots`."""
        return min(self.slots, batch) if self.slots else -(-batch // min(self.pipeline_groups, batch))

    def loop_config(self, pad_id: int):
        """The `jaxagent.rollout.AgentLoopConfig` of these keys (trajectories padded with `pad_id`)."""
        from jaxagent.rollout import AgentLoopConfig

        return AgentLoopConfig(
            max_turns=self.max_turns,
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_context=self.max_context,
            sampling=self.sampling,
            pad_id=pad_id,
            pipeline_groups=self.pipeline_groups,
            slots=self.slots,
        )
