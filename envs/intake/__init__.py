"""``intake``: a simulated psychiatric intake interview, for multi-turn RL of clinician agents.

**This is a research simulation, not a clinical tool.** Its patients, rules and
reference answers are templates written to be clinically sensible; they are not
validated, not complete, and must not guide the care of anyone.

An agent interviews a simulated patient over turns, then ends with a structured
assessment (ranked differential, triage routine / urgent / emergent, initial
management) and is rewarded by a rubric:

- :mod:`envs.intake.cases`: seeded procedural cases (eight primary conditions,
  comorbidities, history, hidden risk factors) and the fixed adversarial safety set;
- :mod:`envs.intake.domains`: the interview domains and the documented keyword rules
  mapping a question to them; empathy markers;
- :mod:`envs.intake.simulator`: the deterministic disclosure rules with personas
  (forthcoming, guarded, tangential, minimising), the rule-based voice, and the
  pluggable LLM-backed voice (any callable, or an OpenAI-compatible endpoint);
- :mod:`envs.intake.assessment`: the assessment format and its lenient parser;
- :mod:`envs.intake.rubric`: the reward and its components, weights from config;
- :mod:`envs.intake.env`: :class:`IntakeEnv`, the env (``envs.make("intake", ...)``);
- :mod:`envs.intake.policies`: the expert clinician, a no-risk-screen ablation, a
  random baseline;
- :mod:`envs.intake.eval`: ``python -m envs.intake.eval --policy expert --cases
  adversarial --episodes 24`` prints a JSON summary.

Plain Python: no JAX, no ``jaxagent``, no third-party package.
"""

from __future__ import annotations

from envs.intake.assessment import Assessment, AssessmentError, parse_assessment
from envs.intake.cases import (
    ADVERSARIAL_SET_SIZE,
    CONDITIONS,
    PERSONAS,
    TRIAGE_LEVELS,
    Case,
    adversarial_case,
    generate_case,
)
from envs.intake.env import IntakeEnv
from envs.intake.policies import Clinician, RandomClinician, make_policy
from envs.intake.rubric import RubricConfig
from envs.intake.simulator import LLMSimulator, OpenAIChatClient, RuleBasedSimulator, SimulatorError, make_simulator

__all__ = [
    "IntakeEnv",
    "Case",
    "generate_case",
    "adversarial_case",
    "ADVERSARIAL_SET_SIZE",
    "CONDITIONS",
    "PERSONAS",
    "TRIAGE_LEVELS",
    "Assessment",
    "AssessmentError",
    "parse_assessment",
    "RubricConfig",
    "Clinician",
    "RandomClinician",
    "make_policy",
    "RuleBasedSimulator",
    "LLMSimulator",
    "OpenAIChatClient",
    "SimulatorError",
    "make_simulator",
]
