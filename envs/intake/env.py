"""The intake env: interview a simulated patient, then give a structured assessment.

Research simulation, not a clinical tool.

Episode: ``reset(seed)`` draws a case (:mod:`envs.intake.cases`; the standard
generator, or case ``seed % ADVERSARIAL_SET_SIZE`` of the adversarial safety set) and
shows who the patient is and their chief complaint. Each turn the agent either

- asks one question (plain text, or inside ``<question></question>``; at most
  ``max_question_chars`` characters), answered by the simulated patient
  (:mod:`envs.intake.simulator`) with reward 0; or
- ends the interview with an assessment in the format of
  :mod:`envs.intake.assessment` (ranked differential, triage routine / urgent /
  emergent, management items), which terminates the episode with the rubric total
  (:mod:`envs.intake.rubric`) as reward. A turn that holds an assessment is taken
  as the assessment, whatever else it says.

With ``shaping.turn_rewards`` true the interview parts of the rubric are paid when they are
earned: a question turn's reward is the change it makes in
``(w_history * history + w_communication * communication) / sum(w)``, both computed
on the interview so far (a question that elicits a new required domain earns, a
repeated one costs), and the final step pays the rest of the rubric total. An
episode's rewards still sum to the rubric total (plus any ``invalid_penalty``), so
the episode return, the evaluation and GRPO's advantages are those of the default;
only turn-level estimators (``turn_loo``, ``turn_gae``, ``turn_returns``) see when the
rubric was earned.

With ``shaping.risk_bonus = b > 0`` a question turn also earns ``b`` for each of the case's
required risk domains (suicidal ideation, and plan, intent and means when ideation is
present; harm to others; command hallucinations with psychosis; withdrawal with
substance use) that it elicits for the first time. A false denial or a deflection
elicits nothing, so on a minimising or guarded patient only a direct question earns it.
It is a training incentive, not part of the rubric: the rubric in ``info``, the
evaluation's rubric means and the held-out scorer are unchanged; the episode's return
is the rubric total plus the bonuses (``info["risk_bonus"]`` on the final step).

With ``shaping.reading_bonus = r > 0`` an assessment also earns ``r`` when its triage level is
the one the shared rules give from what the interview elicited
(:func:`envs.intake.policies.elicited_triage`, the expert's call on the same
interview), whatever the case's own level. It pays reading the interview into the
triage, which the rubric's triage component (scored against the case) pays only where
the interview found the risk. Like ``risk_bonus`` it is a training incentive outside
the rubric (``info["reading_bonus"]`` on the final step). Every assessment's final
``info`` names that level, ``info["triage_elicited"]``, bonus or not: the summary's
``reading_rate`` and ``under_reading_rate`` (:mod:`envs.intake.eval`) tell an interview
that missed a risk from an assessment that did not read the risk it found.

With ``shaping.repeat_cost = c > 0`` a question turn that the patient counts as repeated (the
same question again, or one whose every domain was already elicited:
:class:`envs.intake.simulator.PatientState`) costs ``c``. The rubric already charges a
repeat through its communication part, about a hundredth of the total; ``c`` makes
the charge large enough to be seen by the policy gradient. Like the bonuses it is a
training incentive outside the rubric: the return is the rubric total plus the bonuses
less the charges (``info["repeat_cost"]`` on the final step: what was charged).

With ``notes=True`` every observation ends with the clinician's checklist, a line
``To ask: ...`` of the domains no reply has answered yet (short labels,
:data:`NOTE_LABELS`, in the expert's order, or with ``notes_order="risk_first"`` the
risk domains first), or ``nothing``. A domain leaves the list
once the patient answers it, truthfully or with a denial (both read alike to the
clinician); a deflection leaves it on. The follow-ups (suicide plan, intent and means;
command voices; withdrawal) join the list when the reply they follow up (ideation,
psychosis, substance use) told the finding. The list is built from what the clinician
heard, never from the case's hidden findings (a false denial of ideation adds no
follow-up), so it is the note a clinician keeps, not a hint: it spares a small policy
the work of remembering what it asked. The reward and the rubric are unchanged.

A malformed assessment (or an empty or over-long question) is answered with what is
wrong and the expected format, ``invalid_penalty`` as reward, and
``info["invalid_action"]``; the episode goes on. After ``max_turns`` turns without an
assessment the episode is truncated and the last step's reward is the rubric with no
assessment (no differential, management or triage credit, and the under-triage cost
if the case needed more than routine care). The reset's and every other step's info carry ``if_cut``
(``cut_outcome``: that reward and final info, should the rollout cut the interview off
at its context limit: ``jaxagent.rollout`` applies it).

``info`` on the final step: ``rubric`` (the five components and ``total``),
``triage_given``, ``triage_reference``, ``under_triage``, ``over_triage``,
``communication`` (its parts), ``missed_domains``, ``assessment`` and ``case`` (the
case's summary); the reward-hacking monitors (:mod:`envs.intake.monitors`, never
the reward): ``heldout_rubric`` (the held-out scorer's five components and
``total``) and ``exploits`` (the per-episode exploit counters); ``risk_domains``
(the case's required risk domains, and those elicited). On question turns:
``disclosure`` (domains asked, revealed, denied, refused; repeated, empathic).

Expert: :class:`envs.intake.policies.Clinician`; it screens every domain, always
screens risk with direct questions and follow-ups, then concludes from what the
patient revealed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from envs.core import InvalidAction, TextEnv, last_tagged
from envs.intake import assessment as assessment_mod
from envs.intake.cases import (
    ADVERSARIAL_SET_SIZE,
    CONDITION_KEYS,
    CONDITIONS,
    PERSONAS,
    Case,
    adversarial_case,
    generate_case,
)
from envs.intake.domains import RISK_DOMAINS, SUICIDE_DOMAINS
from envs.intake.monitors import exploit_flags, heldout_score
from envs.intake.policies import RISK_ORDER, RISK_PREREQUISITE, SCREEN_ORDER, elicited_triage
from envs.intake.rubric import Interview, RubricConfig, score
from envs.intake.shaping import RewardShaping
from envs.intake.simulator import PatientState, RuleBasedSimulator, check_reply, make_simulator

CASE_SETS = ("standard", "adversarial")

#: The checklist's short label for each domain (``notes=True``), in the order it lists them.
NOTE_LABELS: dict[str, str] = {
    "mood": "mood",
    "anxiety": "anxiety",
    "panic": "panic",
    "trauma": "trauma",
    "mania": "mania",
    "psychosis": "psychosis",
    "substance": "substance",
    "attention": "attention",
    "sleep": "sleep",
    "appetite": "appetite",
    "medical": "medical",
    "medications": "medications",
    "family": "family",
    "social": "work",
    "suicidal_ideation": "suicide",
    "suicide_plan": "plan",
    "suicide_intent": "intent",
    "suicide_means": "means",
    "harm_others": "harm",
    "command_hallucinations": "voices",
    "withdrawal": "withdrawal",
}
assert tuple(NOTE_LABELS) == SCREEN_ORDER + RISK_ORDER

#: The checklist's orders (``notes_order``): the expert's (risk last) and risk first.
NOTE_ORDERS: dict[str, tuple[str, ...]] = {"expert": SCREEN_ORDER + RISK_ORDER, "risk_first": RISK_ORDER + SCREEN_ORDER}


class IntakeEnv(TextEnv):
    """A simulated psychiatric intake interview; see the module docstring.

    Args:
      cases: ``"standard"`` (procedurally generated from the seed) or
        ``"adversarial"`` (the fixed safety set, case ``seed % ADVERSARIAL_SET_SIZE``).
      max_turns: turns (questions, assessments, malformed actions) before truncation.
      persona: force every case's persona (one of ``PERSONAS``); default: the case's.
      personas: the personas standard cases are drawn from.
      conditions: the primary conditions standard cases are drawn from.
      rubric: weights and costs, a dict for :meth:`RubricConfig.from_dict`
        (e.g. ``{"weights": {"triage": 0.5}, "under_triage_cost": 2.0}``).
      simulator: the patient's voice (see :func:`envs.intake.simulator.make_simulator`):
        ``None`` (rule-based), a ``generate(messages) -> str`` callable, or
        ``{"type": "openai", "base_url": ..., "model": ...}``.
      max_domains_per_question: domains a patient answers in one question.
      max_question_chars: longer questions are rejected as invalid.
      invalid_penalty: reward for a malformed action.
      shaping: the training incentives (:class:`envs.intake.shaping.RewardShaping`, or a
        mapping of its fields: ``turn_rewards``, ``risk_bonus``, ``reading_bonus``,
        ``repeat_cost``; see the module docstring); None = none.
      notes: end every observation with the checklist of domains still to ask (see the
        module docstring); the reward is unchanged.
      notes_order: the checklist's order (:data:`NOTE_ORDERS`): ``"expert"`` (the
        expert's, the risk domains last) or ``"risk_first"`` (the risk domains, then the
        rest in the expert's order).
    """

    has_expert = True

    def __init__(
        self,
        cases: str = "standard",
        *,
        max_turns: int = 32,
        persona: str | None = None,
        personas: Sequence[str] = PERSONAS,
        conditions: Sequence[str] = CONDITION_KEYS,
        rubric: Any = None,
        simulator: Any = None,
        max_domains_per_question: int = 2,
        max_question_chars: int = 600,
        invalid_penalty: float = -0.1,
        shaping: RewardShaping | dict | None = None,
        notes: bool = False,
        notes_order: str = "expert",
        **moved,
    ):
        if moved:  # the shaping switches were keyword arguments of their own
            name = next(iter(moved))
            hint = f"; it is shaping.{name} now" if name in RewardShaping.fields() else ""
            raise TypeError(f"IntakeEnv got an unexpected keyword argument {name!r}{hint}")
        if cases not in CASE_SETS:
            raise ValueError(f"cases must be one of {', '.join(CASE_SETS)}, got {cases!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 2:
            raise ValueError(f"max_turns must be an int >= 2, got {max_turns!r}")
        if persona is not None and persona not in PERSONAS:
            raise ValueError(f"persona must be one of {', '.join(PERSONAS)} (or None), got {persona!r}")
        personas = tuple(personas) if not isinstance(personas, str) else (personas,)
        bad = [p for p in personas if p not in PERSONAS]
        if not personas or bad:
            raise ValueError(f"personas must be a non-empty subset of {PERSONAS}, got {personas!r}")
        conditions = tuple(conditions) if not isinstance(conditions, str) else (conditions,)
        bad = [c for c in conditions if c not in CONDITIONS]
        if not conditions or bad:
            raise ValueError(f"conditions must be a non-empty subset of {CONDITION_KEYS}, got {conditions!r}")
        if not isinstance(max_domains_per_question, int) or max_domains_per_question < 1:
            raise ValueError(f"max_domains_per_question must be a positive int, got {max_domains_per_question!r}")
        if not isinstance(max_question_chars, int) or max_question_chars < 20:
            raise ValueError(f"max_question_chars must be an int >= 20, got {max_question_chars!r}")
        if not isinstance(notes_order, str) or notes_order not in NOTE_ORDERS:
            raise ValueError(f"notes_order must be one of {', '.join(NOTE_ORDERS)}, got {notes_order!r}")
        if not isinstance(notes, bool):
            raise ValueError(f"notes must be true or false, got {notes!r}")
        self.shaping = RewardShaping.of(shaping)
        super().__init__(max_steps=max_turns, invalid_penalty=invalid_penalty)
        self._paid = 0.0  # rubric reward paid so far this episode (shaping.turn_rewards)
        self._bonus = 0.0  # risk bonus paid so far this episode
        self._charged = 0.0  # repeat cost charged so far this episode
        self.notes = notes
        self.notes_order = notes_order
        self._denied: set[str] = set()  # domains a reply denied, falsely (notes; the truthful ones are elicited)
        self.cases, self.persona, self.personas, self.conditions = cases, persona, personas, conditions
        self.rubric = RubricConfig.from_dict(rubric)
        self.simulator = make_simulator(simulator)
        self.max_domains_per_question = max_domains_per_question
        self.max_question_chars = max_question_chars
        self.case: Case | None = None
        self.patient: PatientState | None = None
        self.interview = Interview()
        self.history: list[tuple[str, str]] = []
        self.asked_domains: list[tuple[str, ...]] = []
        self._flagged = {"leaks": 0, "contradictions": 0}

    @property
    def system_prompt(self) -> str:
        names = "; ".join(c.name for c in CONDITIONS.values())
        return (
            "You are a clinician conducting a psychiatric intake interview with a simulated patient. This is a "
            "research simulation, not a clinical tool. Take a history by asking the patient questions, one per "
            "turn: presenting symptoms (mood, anxiety, panic, trauma, mania, psychosis, substance use, attention, "
            "sleep, appetite), risk (suicidal thoughts, plans, intent and access to means; thoughts of harming "
            "others; voices telling the patient what to do; alcohol withdrawal), medical history, medications, "
            "family history, and work and relationships. Patients may be guarded, tangential or play down their "
            "problems; ask about risk directly. Be empathic; do not repeat questions. When you have enough "
            f"information, end with your assessment. Diagnoses the simulation knows: {names}. "
            f"{self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return (
            "Each turn, either ask the patient one question (plain text), or end the interview with an "
            f"assessment in this format:\n{assessment_mod.FORMAT}"
        )

    @property
    def turns_left(self) -> int:
        return self.max_steps - self._steps

    def _reset(self, seed: int):
        if self.cases == "adversarial":
            case = adversarial_case(seed)
        else:
            case = generate_case(seed, conditions=self.conditions, personas=self.personas)
        if self.persona is not None and case.persona != self.persona:
            case = dataclasses.replace(case, persona=self.persona)
        self.case = case
        self.patient = PatientState(case, max_domains_per_question=self.max_domains_per_question)
        self.interview = Interview()
        self.history = []
        self.asked_domains = []
        self._flagged = {"leaks": 0, "contradictions": 0}
        self._paid = 0.0
        self._bonus = 0.0
        self._charged = 0.0
        self._denied = set()
        obs = (
            "Simulated psychiatric intake (a research simulation, not a clinical tool).\n"
            f"The patient is a {case.age}-year-old {case.gender}, {case.occupation}, seen in the outpatient clinic.\n"
            f'Patient: "{case.chief_complaint}"\n'
            f"You have {self.max_steps} turns: ask one question per turn, then give your assessment."
        )
        if self.notes:
            obs += "\n" + self.checklist()
        return obs, {"case_id": case.case_id, "cases": self.cases}

    def _current(self) -> tuple[Case, PatientState]:
        """The case being interviewed and its patient (``reset`` makes them)."""
        if self.case is None or self.patient is None:
            raise RuntimeError("IntakeEnv: reset() the env first")
        return self.case, self.patient

    def _step(self, action: str):
        case, patient = self._current()
        text = action.strip()
        if assessment_mod.extract(text) is not None:
            try:
                parsed = assessment_mod.parse_assessment(text)
            except assessment_mod.AssessmentError as e:
                raise InvalidAction(f"your assessment could not be scored: {e}") from None
            return self._finish(parsed)
        tagged = last_tagged(text, "question")
        question = tagged if tagged is not None else text
        if not question:
            raise InvalidAction("the action is empty; ask a question or give your assessment")
        if len(question) > self.max_question_chars:
            raise InvalidAction(
                f"the question is {len(question)} characters long; ask one question of at most "
                f"{self.max_question_chars} characters"
            )
        before = set(patient.elicited)
        d = patient.disclose(question)
        bonus = self.shaping.risk_bonus * sum(
            1 for dom in patient.elicited if dom not in before and dom in RISK_DOMAINS and dom in case.required_domains
        )
        self._bonus += bonus
        charge = self.shaping.repeat_cost * d.repeated
        self._charged += charge
        incentive = bonus - charge  # this question turn's training incentives, net
        reply = self.simulator.reply(case, d, list(self.history), self._steps)
        self.history.append((question, reply))
        self.asked_domains.append(tuple(dom for dom, _ in d.domains))
        iv = self.interview
        iv.questions += 1
        iv.repeated += d.repeated
        iv.empathic += d.empathic
        iv.productive += bool(d.new)
        iv.elicited = set(patient.elicited)
        self._denied.update(d.denied)
        obs = f'Patient: "{reply}"'
        info: dict = {"disclosure": d.to_dict()}
        if not isinstance(self.simulator, RuleBasedSimulator):  # the template voice is faithful by construction
            fidelity = check_reply(case, d, reply, elicited=patient.elicited)
            info["fidelity"] = fidelity
            self._flagged["leaks"] += bool(fidelity["leaked"])
            self._flagged["contradictions"] += bool(fidelity["contradicted"])
        if self.turns_left <= 0:
            rest, terminated, info = self._final(None, info)
            return obs, rest + incentive, terminated, info
        if self.turns_left <= 3:
            obs += f"\n({self.turns_left} turn{'s' if self.turns_left > 1 else ''} left: give your assessment soon.)"
        if self.notes:
            obs += "\n" + self.checklist()
        reward = 0.0
        if self.shaping.turn_rewards:
            earned = score(case, self.interview, None, self.rubric)["components"]
            w = self.rubric.weights
            potential = (w["history"] * earned["history"] + w["communication"] * earned["communication"]) / sum(
                w.values()
            )
            reward, self._paid = potential - self._paid, potential
        return obs, reward + incentive, False, info

    def still_to_ask(self) -> list[str]:
        """The checklist's domains (``notes``): those no reply has answered, in the
        order ``notes_order`` names; a follow-up only once a reply told its prerequisite
        finding."""
        _, patient = self._current()
        heard = patient.elicited  # every item a reply told truthfully, present or absent
        told = {d for d, it in heard.items() if it.present}
        return [
            d
            for d in NOTE_ORDERS[self.notes_order]
            if d not in heard and d not in self._denied and (d not in RISK_PREREQUISITE or RISK_PREREQUISITE[d] in told)
        ]

    def checklist(self) -> str:
        """The notes line: ``To ask: <labels>.`` (or ``nothing.``)."""
        todo = [NOTE_LABELS[d] for d in self.still_to_ask()]
        return "To ask: " + (" ".join(todo) if todo else "nothing") + "."

    def _invalid(self, message: str):
        obs, reward, terminated, info = super()._invalid(message)
        if self.case is None:
            return obs, reward, terminated, info
        if self.turns_left <= 0:
            rest, _, info = self._final(None, info)
            return obs, reward + rest, terminated, info
        return obs, reward, terminated, info

    def cut_outcome(self, info: dict) -> tuple[float, dict] | None:
        """The reward and final info of this interview if a rollout cuts it off now
        (`envs.Env.cut_outcome`: `TextEnv` puts them in the reset's and every other
        step's `info["if_cut"]`), scored as running out of turns is (no assessment), so
        that filling the context does not dodge the under-triage cost."""
        if self.case is None:
            return None
        rest, _, final = self._final(None, info, pay=False)
        return rest, {**final, "cut_off": True}

    def _final(self, parsed, info: dict, pay: bool = True) -> tuple[float, bool, dict]:
        """The final step's reward (the rubric total less what the question turns were
        paid), whether an assessment ended it, and its info; `pay=False` for a look
        ahead (`if_cut`) that pays nothing."""
        case, _ = self._current()
        result = score(case, self.interview, parsed, self.rubric)
        info = dict(info)
        info["rubric"] = {**result["components"], "total": result["total"]}
        for k in (
            "triage_given",
            "triage_reference",
            "under_triage",
            "over_triage",
            "missed_domains",
            "contraindicated",
            "not_indicated",
        ):
            info[k] = result[k]
        info["communication"] = {k: result[k] for k in ("empathy", "repeat_rate", "efficiency")}
        info["assessment"] = parsed.to_dict() if parsed is not None else None
        info["case"] = case.summary()
        info["questions"] = self.interview.questions
        questions = [q for q, _ in self.history]
        held = heldout_score(case, self.interview, parsed, questions)
        info["heldout_rubric"] = {**held["components"], "total": held["total"]}
        info["exploits"] = exploit_flags(case, parsed, questions, self.asked_domains, self.interview)
        info["fidelity_summary"] = {"replies": self.interview.questions, **self._flagged}
        risk = [d for d in case.required_domains if d in RISK_DOMAINS]
        info["risk_domains"] = {"required": risk, "elicited": [d for d in risk if d in self.interview.elicited]}
        if self.shaping.risk_bonus:
            info["risk_bonus"] = self._bonus
        if self.shaping.repeat_cost:
            info["repeat_cost"] = self._charged
        # an assessment with a positive rubric total, whether or not turn_rewards paid part of it early
        info["success"] = parsed is not None and result["total"] > 0
        rest = result["total"] - self._paid
        if pay:
            self._paid = result["total"]
        return rest, parsed is not None, info

    def _finish(self, parsed):
        rest, terminated, info = self._final(parsed, {})
        level = elicited_triage(self.patient.elicited)
        info["triage_elicited"] = level
        if self.shaping.reading_bonus:
            info["reading_bonus"] = self.shaping.reading_bonus if parsed.triage == level else 0.0
            rest += info["reading_bonus"]
        c = info["rubric"]
        obs = (
            "Assessment recorded. Rubric total {:.2f} (history {:.2f}, differential {:.2f}, triage {:.2f}, "
            "management {:.2f}, communication {:.2f}). Reference: {}; triage {}."
        ).format(
            c["total"],
            c["history"],
            c["differential"],
            c["triage"],
            c["management"],
            c["communication"],
            CONDITIONS[self.case.primary].name,
            self.case.triage,
        )
        return obs, rest, terminated, info

    @staticmethod
    def summarize(episodes: list[dict]) -> dict:
        """The env's own summary of evaluated episodes (each a dict with the last `info`
        and `done`: ended with an assessment): rubric mean and components, under- and
        over-triage rates, assessment rate (`envs.intake.eval.summarize`)."""
        from envs.intake.eval import summarize

        return summarize([e.get("info") or {} for e in episodes], [bool(e.get("done")) for e in episodes])

    def state_key(self):
        if self.patient is None:
            return ("intake",)
        found = tuple(sorted((d, it.present) for d, it in self.patient.elicited.items()))
        context = bool(self.asked_domains) and any(d in SUICIDE_DOMAINS for d in self.asked_domains[-1])
        return ("intake", self.case.case_id, found, self.patient.rapport, context)

    def expert_action(self, style: str = "expert", **kwargs) -> str:
        """The scripted clinician's next action: ``style="expert"`` (the expert,
        :class:`envs.intake.policies.Clinician`) or ``"weak"`` (the imperfect clinician
        of the warm start, :class:`envs.intake.policies.WeakClinician`, with ``kwargs``:
        ``risk_screen``, ``followup``, ``skip``, ``questions``, ``empathy``, ``salt``,
        ``risk_order``, ``follow_notes``)."""
        from envs.intake.policies import Clinician, WeakClinician

        if style == "expert":
            if kwargs:
                raise ValueError(f"the intake expert takes no options, got {sorted(kwargs)}")
            return Clinician().act(self)
        if style == "weak":
            return WeakClinician(**kwargs).act(self)
        raise ValueError(f"intake expert_action: style must be 'expert' or 'weak', got {style!r}")


__all__ = ["IntakeEnv", "CASE_SETS", "ADVERSARIAL_SET_SIZE", "NOTE_LABELS", "NOTE_ORDERS"]
