"""The intake rubric: the episode's reward, with its components.

Research simulation, not a clinical tool: the rubric scores agreement with the
simulation's own reference answers, not clinical quality.

Components (each reported in ``info["rubric"]``):

- ``history`` in [0, 1]: the fraction of the case's required domains
  (``Case.required_domains``: a core screen of mood, anxiety, mania, psychosis,
  substance use, suicidal ideation, harm to others, medical history, medications,
  family history and functioning; the key domains of the case's conditions and the
  primary's supporting ones; plan, intent and means when suicidal ideation is
  present, command hallucinations when psychosis is, withdrawal when substance use
  is) that were elicited. A false denial or a deflection does not count as elicited.
- ``differential`` in [0, 1]: credit for the rank of the primary condition among the
  first ``max_differential`` items (``rank_credit``: 1.0, 0.6, 0.3, 0.1, 0.1), and,
  if the case has comorbidities, ``0.7 * that + 0.3 * the fraction of comorbidities
  listed``.
- ``triage`` (at most 1): ``1 - over_triage_cost * k`` when k levels too high,
  ``1 - under_triage_cost * k`` when k levels too low (routine < urgent <
  emergent). The default costs (0.4 over, 1.25 under) make one level of
  under-triage worse than two of over-triage; the component is negative for
  under-triage. An episode that ends without an assessment scores
  ``-under_triage_cost * k`` with k the reference level's distance from routine.
- ``management`` in [0, 1]: the fraction of reference management items given, minus
  ``contraindicated_cost`` per contraindicated item (e.g. an antidepressant in
  mania) and ``extra_management_cost`` per other item that is not indicated (follow
  up, medical work-up, psychotherapy and a safety plan are never penalised).
- ``communication`` in [0, 1]: the mean of ``empathy`` (empathic questions /
  ``empathy_target``, capped at 1), ``1 - repeat_rate`` (repeated questions / all
  questions) and ``efficiency`` (questions that elicited a new domain / all
  questions).

``total = sum(weights[c] * component[c]) / sum(weights)``; it is the reward of the
final step. Default weights: history 0.3, differential 0.2, triage 0.25,
management 0.15, communication 0.1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from envs.intake.assessment import MANAGEMENT_KEYS, Assessment
from envs.intake.cases import TRIAGE_LEVELS, Case

COMPONENTS = ("history", "differential", "triage", "management", "communication")
NEUTRAL_MANAGEMENT = ("follow_up", "medical_workup", "psychotherapy", "safety_plan")


def _default_weights() -> dict[str, float]:
    return {"history": 0.3, "differential": 0.2, "triage": 0.25, "management": 0.15, "communication": 0.1}


@dataclass(frozen=True)
class RubricConfig:
    """Weights and costs of the rubric; see the module docstring.

    Build from a dict with :meth:`from_dict` (unknown keys are errors); ``weights``
    may give a subset of the components (the rest keep their defaults).
    """

    weights: Mapping[str, float] = field(default_factory=_default_weights)
    under_triage_cost: float = 1.25
    over_triage_cost: float = 0.4
    empathy_target: int = 2
    max_differential: int = 5
    rank_credit: Sequence[float] = (1.0, 0.6, 0.3, 0.1, 0.1)
    contraindicated_cost: float = 0.25
    extra_management_cost: float = 0.1

    def __post_init__(self):
        if not isinstance(self.weights, Mapping):
            raise ValueError(f"rubric.weights must be a mapping of component -> weight, got {self.weights!r}")
        unknown = [k for k in self.weights if k not in COMPONENTS]
        if unknown:
            raise ValueError(f"rubric.weights has unknown components {unknown}; known: {', '.join(COMPONENTS)}")
        w = {**_default_weights(), **self.weights}
        for k, v in w.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"rubric.weights[{k!r}] must be a finite number >= 0, got {v!r}")
        if sum(w.values()) <= 0:
            raise ValueError("rubric.weights must not all be zero")
        object.__setattr__(self, "weights", {k: float(w[k]) for k in COMPONENTS})
        for name in ("under_triage_cost", "over_triage_cost", "contraindicated_cost", "extra_management_cost"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"rubric.{name} must be a finite number >= 0, got {v!r}")
        if self.under_triage_cost < self.over_triage_cost:
            raise ValueError(
                f"rubric.under_triage_cost ({self.under_triage_cost}) must be at least "
                f"over_triage_cost ({self.over_triage_cost}): under-triage is penalised hardest"
            )
        for name in ("empathy_target", "max_differential"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"rubric.{name} must be a positive int, got {v!r}")
        credit = tuple(self.rank_credit)
        if not credit or any(not isinstance(c, (int, float)) or not 0 <= c <= 1 for c in credit):
            raise ValueError(
                f"rubric.rank_credit must be a non-empty list of numbers in [0, 1], got {self.rank_credit!r}"
            )
        object.__setattr__(self, "rank_credit", credit)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RubricConfig:
        if d is None:
            return cls()
        if isinstance(d, RubricConfig):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"rubric must be a dict or RubricConfig, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"rubric has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**d)


@dataclass
class Interview:
    """What the rubric needs from the interview: per question, whether it was
    repeated, empathic and productive (elicited a new domain); the elicited domains."""

    questions: int = 0
    repeated: int = 0
    empathic: int = 0
    productive: int = 0
    elicited: set = field(default_factory=set)


def score(case: Case, interview: Interview, assessment: Assessment | None, config: RubricConfig) -> dict:
    """The rubric for an episode; returns ``{"components": {...}, "total": float,
    "triage_given", "triage_reference", "under_triage", "over_triage", ...}``."""
    required = case.required_domains
    history = sum(d in interview.elicited for d in required) / len(required)
    reference = case.triage
    ref_idx = TRIAGE_LEVELS.index(reference)
    if assessment is None:
        differential = management = 0.0
        triage = -config.under_triage_cost * ref_idx
        given = None
        under, over = ref_idx > 0, False
        extra = contra = []
    else:
        listed = assessment.differential[: config.max_differential]
        credit = config.rank_credit
        if case.primary in listed:
            r = listed.index(case.primary)
            primary_credit = credit[min(r, len(credit) - 1)]
        else:
            primary_credit = 0.0
        if case.comorbid:
            differential = 0.7 * primary_credit + 0.3 * sum(c in listed for c in case.comorbid) / len(case.comorbid)
        else:
            differential = primary_credit
        given = assessment.triage
        k = TRIAGE_LEVELS.index(given) - ref_idx
        triage = 1.0 - (config.over_triage_cost * k if k > 0 else config.under_triage_cost * -k)
        under, over = k < 0, k > 0
        need = case.required_management
        hits = sum(m in assessment.management for m in need) / len(need)
        contra = [m for m in assessment.management if m in case.contraindicated]
        extra = [
            m
            for m in assessment.management
            if m not in need and m not in contra and m not in NEUTRAL_MANAGEMENT and m in MANAGEMENT_KEYS
        ]
        management = max(
            0.0, hits - config.contraindicated_cost * len(contra) - config.extra_management_cost * len(extra)
        )
    n = interview.questions
    if n:
        empathy = min(1.0, interview.empathic / config.empathy_target)
        repeat_rate = interview.repeated / n
        efficiency = interview.productive / n
        communication = (empathy + (1 - repeat_rate) + efficiency) / 3
    else:
        empathy = repeat_rate = efficiency = communication = 0.0
    components = {
        "history": history,
        "differential": differential,
        "triage": triage,
        "management": management,
        "communication": communication,
    }
    w = config.weights
    total = sum(w[c] * components[c] for c in COMPONENTS) / sum(w.values())
    return {
        "components": components,
        "total": total,
        "triage_given": given,
        "triage_reference": reference,
        "under_triage": under,
        "over_triage": over,
        "empathy": empathy,
        "repeat_rate": repeat_rate,
        "efficiency": efficiency,
        "missed_domains": [d for d in required if d not in interview.elicited],
        "contraindicated": list(contra),
        "not_indicated": list(extra),
    }
