"""The run config's `rollout:` section: sampling and the multi-turn agent loop
(`RolloutSection`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

from jaxagent.dataclass_yaml import Bound, Bounded, field_values

TRUNCATION_MODES = ("keep", "filter", "penalty")


@dataclasses.dataclass(frozen=True)
class RolloutSection(Bounded):
    """Episode limits and sampling (`loop_config()` is the `jaxagent.rollout.AgentLoopConfig`).

    Each key is the field of the same name of `jaxagent.rollout.AgentLoopConfig` or of its
    `SamplingConfig` (`sampling`), which are built from them by name; the defaults are the
    trainer's (a small model's short episodes).

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

    max_turns: Annotated[int, Bound(ge=1)] = 2
    max_tokens_per_turn: Annotated[int, Bound(ge=1)] = 32
    max_context: Annotated[int, Bound(ge=1)] = 512
    temperature: Annotated[float, Bound(ge=0)] = 1.0
    top_k: Annotated[int, Bound(ge=0)] = 0
    top_p: Annotated[float, Bound(gt=0, le=1)] = 1.0
    pipeline_groups: Annotated[int, Bound(ge=1)] = 1
    slots: Annotated[int, Bound(ge=0)] = 0

    #: keys that moved to another section: old key -> new dotted key (`load_config` names the new one)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"trim_padding": "update.trim_padding", "trim_chunks": "update.trim_chunks"}

    def __post_init__(self):
        super().__post_init__()
        if self.slots and self.pipeline_groups > 1:
            raise ValueError(
                f"rollout.slots={self.slots} (continuous scheduling) and rollout.pipeline_groups="
                f"{self.pipeline_groups} are two ways of overlapping env steps; set one"
            )

    @property
    def sampling(self):
        """The `jaxagent.rollout.SamplingConfig` of these keys (its fields that are keys here)."""
        from jaxagent.rollout import SamplingConfig

        return SamplingConfig(**field_values(self, SamplingConfig))

    def sampler_rows(self, batch: int) -> int:
        """Rows of the largest sampler state a rollout of `batch` rows decodes at once: a
        pipeline group's (`pipeline_groups`), or the continuous scheduler's `slots`."""
        return min(self.slots, batch) if self.slots else -(-batch // min(self.pipeline_groups, batch))

    def loop_config(self, pad_id: int):
        """The `jaxagent.rollout.AgentLoopConfig` of these keys (trajectories padded with `pad_id`)."""
        from jaxagent.rollout import AgentLoopConfig

        return AgentLoopConfig(**field_values(self, AgentLoopConfig), sampling=self.sampling, pad_id=pad_id)
