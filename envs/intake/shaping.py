"""The intake env's reward shaping: the training incentives an experiment may switch on,
in one place with their validation (`IntakeEnv(shaping=...)`, in a config
`env.kwargs.shaping: {risk_bonus: 0.05}`).

None of them changes the rubric: `info["rubric"]`, the held-out scorer and the
evaluation's rubric means are the same with any shaping (`envs.intake.env` describes
each switch's payments).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """Training incentives of the intake env (all off by default).

    turn_rewards: pay the history and communication parts of the rubric at the question
      turns that earn them; an episode's rewards sum to the same rubric total.
    risk_bonus: reward (>= 0) for each required risk domain a question elicits first.
    reading_bonus: reward (>= 0) for an assessment whose triage is the rules' level from
      what the interview elicited.
    repeat_cost: charge (>= 0) for each question the patient counts as repeated.
    """

    turn_rewards: bool = False
    risk_bonus: float = 0.0
    reading_bonus: float = 0.0
    repeat_cost: float = 0.0

    def __post_init__(self):
        if not isinstance(self.turn_rewards, bool):
            raise ValueError(f"shaping.turn_rewards must be true or false, got {self.turn_rewards!r}")
        for name in ("risk_bonus", "reading_bonus", "repeat_cost"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"shaping.{name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))

    @classmethod
    def of(cls, value: Any) -> RewardShaping:
        """`value` as a `RewardShaping`: None (no shaping), a mapping of its fields, or one."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"shaping must be a mapping of {cls.fields()} or None, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.fields()))
        if unknown:
            raise ValueError(f"shaping: unknown keys {unknown}; the keys are {cls.fields()}")
        return cls(**value)

    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
