"""Scripted clinician policies for the intake env: the expert, a no-risk-screen
ablation, and a random baseline.

Research simulation, not a clinical tool.

Every policy is a callable ``policy(observation, env) -> action text`` (the form
:func:`envs.rollout` takes). The scripted clinicians read only what the patient has
revealed so far (``env.patient.elicited``) and which domains they have asked
(``env.asked_domains``), never the hidden case.

- :class:`Clinician` (the expert, ``env.expert_action()``): asks about each domain
  of ``SCREEN_ORDER`` in turn, one domain per question, with an empathic opening;
  then screens risk with direct questions (``RISK_ORDER``: suicidal ideation, then
  plan, intent and means if ideation is revealed; harm to others; command
  hallucinations if psychosis is revealed; withdrawal if substance use is). A domain
  the patient deflects or leaves unanswered is asked once more. It concludes when
  nothing is left to ask (or one turn is left): differential = the conditions whose
  key domain is present, severe before moderate; triage and management from the
  shared reference rules (:func:`envs.intake.cases.triage_level`,
  :func:`envs.intake.cases.management_for`) applied to the revealed findings.
- ``Clinician(screen_risk=False)`` (``no-risk-screen``): the same, without the risk
  questions.
- :class:`WeakClinician` (``weak``; ``env.expert_action(style="weak")``, the intake
  recipe's warm start): an imperfect clinician that behaves like a weak base model.
  Per episode (decisions drawn from the case id, so a demonstration set is a pure
  function of its seeds) it screens risk directly only with probability
  ``risk_screen`` and then follows a revealed ideation with plan / intent / means
  questions only with probability ``followup``; it asks the screening domains in a
  random order, skips each with probability ``skip``, asks every domain once (no
  second attempt at a deflection), opens empathically with probability ``empathy``,
  and concludes early, after a number of questions drawn from ``questions``. Its
  assessment follows the expert's rules from what it did elicit, so what it gets
  wrong is the interview, and the triage that a missed risk leaves too low. By
  default (``risk_order="last"``) the risk questions come after the other domains, so
  the early conclusion cuts most of them and its demonstrations almost never say
  ``emergent`` (1 of 512 in the recipe's set); ``risk_order="shuffled"`` puts them at
  random places among the other domains. With ``follow_notes=p`` it reads the
  clinician's checklist instead (:meth:`envs.intake.env.IntakeEnv.still_to_ask`, what
  the env's ``notes`` option shows the policy): each question is the first item on the
  list among those it planned and has not asked, with probability ``p``, else one of
  them at random (drawn per turn from the case id and the turn). By default the list is
  in the expert's order with the risk domains last, so the early conclusion cuts them
  unless a random pick reaches them; with the env's ``notes_order="risk_first"`` a
  screening episode asks them first. A follow-up is on the list once its finding was
  told.
- :class:`RandomClinician`: asks 2-16 questions drawn at random from the expert's
  questions and some off-topic ones, then gives a random differential, triage and
  management; seeded.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter

from envs.intake.assessment import MANAGEMENT_KEYS, MANAGEMENT_PHRASES, render
from envs.intake.cases import CONDITION_KEYS, KEY_DOMAINS, TRIAGE_LEVELS, management_for, triage_level

SCREEN_ORDER = (
    "mood",
    "anxiety",
    "panic",
    "trauma",
    "mania",
    "psychosis",
    "substance",
    "attention",
    "sleep",
    "appetite",
    "medical",
    "medications",
    "family",
    "social",
)
RISK_ORDER = (
    "suicidal_ideation",
    "suicide_plan",
    "suicide_intent",
    "suicide_means",
    "harm_others",
    "command_hallucinations",
    "withdrawal",
)
#: Follow-up risk domains and the finding that makes them worth asking.
RISK_PREREQUISITE = {
    "suicide_plan": "suicidal_ideation",
    "suicide_intent": "suicidal_ideation",
    "suicide_means": "suicidal_ideation",
    "command_hallucinations": "psychosis",
    "withdrawal": "substance",
}

OPENING = "Thank you for coming in today; I'm sorry things have been difficult."
#: domain -> (first question, second attempt). Each maps to exactly its domain.
QUESTIONS: dict[str, tuple[str, str]] = {
    "mood": (
        "How has your mood been over the past few weeks? Have you been feeling down or hopeless?",
        "Have you been feeling depressed, or lost interest in things you used to enjoy?",
    ),
    "anxiety": (
        "Have you been feeling anxious, nervous or worried much of the time?",
        "Do you find yourself worrying a lot and struggling to stop?",
    ),
    "panic": (
        "Have you had panic attacks, sudden episodes of intense fear with your heart pounding?",
        "Do you ever get sudden surges of fear, as if you can't breathe?",
    ),
    "trauma": (
        "Have you ever been through something traumatic, like an assault or a bad accident, that still affects you?",
        "It's understandable if it's hard to talk about. Has anything frightening or traumatic happened to you?",
    ),
    "mania": (
        "Have there been times when you felt unusually high or euphoric, with racing thoughts?",
        "Have you had periods of feeling manic, full of energy, doing things impulsively?",
    ),
    "psychosis": (
        "Have you been hearing voices or seeing things that other people can't?",
        "I appreciate you answering these. Have you had any unusual experiences, such as hearing voices, or "
        "feeling that people are watching you?",
    ),
    "substance": (
        "How much alcohol do you drink in a typical week, and do you use any drugs?",
        "I appreciate your honesty. Could you tell me about your drinking or any drug use?",
    ),
    "attention": (
        "Do you have trouble keeping your focus on tasks, or get easily distracted?",
        "How is your concentration these days?",
    ),
    "sleep": ("How have you been sleeping lately?", "Are you having any trouble falling asleep or staying asleep?"),
    "appetite": ("Has there been any change in your appetite or your weight?", "How has your eating been?"),
    "medical": (
        "Do you have any medical conditions or physical health problems?",
        "Have you been diagnosed with any physical illness?",
    ),
    "medications": (
        "Are you taking any medications at the moment, prescribed or otherwise?",
        "Do you take any medicines or supplements?",
    ),
    "family": (
        "Does anyone in your family have a history of mental health problems or addiction?",
        "Has anyone in your family been treated for a psychiatric illness?",
    ),
    "social": (
        "How are things going at work and at home, and who do you have for support?",
        "How are you coping with work and your relationships?",
    ),
    "suicidal_ideation": (
        "Thank you for telling me all this. Sometimes when people are struggling they have thoughts "
        "of ending their life. Have you had any thoughts of suicide or of killing yourself?",
        "I know this is hard to talk about, and I ask everyone. Have you had thoughts of suicide?",
    ),
    "suicide_plan": (
        "Thank you for being honest with me. Have you made any plan for how you would end your life?",
        "Have you thought about a method or how you might kill yourself?",
    ),
    "suicide_intent": (
        "Do you intend to act on these thoughts of ending your life?",
        "How likely do you think it is that you would go through with ending your life?",
    ),
    "suicide_means": (
        "Do you have access to a gun, stockpiled pills or other lethal means at home?",
        "Is there a firearm, or a stash of pills, where you live?",
    ),
    "harm_others": (
        "Have you had any thoughts of hurting or killing someone else?",
        "I ask everyone this. Have you had thoughts about harming other people?",
    ),
    "command_hallucinations": (
        "Do the voices ever tell you to do things, or give you commands?",
        "Do the voices order you to hurt anyone?",
    ),
    "withdrawal": (
        "When you stop or cut down drinking, do you get the shakes or sweats, or have you ever had a "
        "seizure or the DTs?",
        "Have you ever had withdrawal symptoms such as tremors or seizures?",
    ),
}
OFF_TOPIC = (
    "What did you have for breakfast?",
    "How was the journey here?",
    "Do you like the weather today?",
    "What is your favourite film?",
    "Tell me more.",
    "Okay, and then?",
    "Is there anything else?",
)


def differential_from(present) -> list[str]:
    """The expert's differential from present findings: the conditions whose key domain
    is present, severe before moderate, then in ``CONDITION_KEYS`` order."""
    rank = {"severe": 0, "moderate": 1}
    keyed = sorted(
        (d for d in present if d in KEY_DOMAINS),
        key=lambda d: (rank.get(present[d].severity, 2), CONDITION_KEYS.index(KEY_DOMAINS[d])),
    )
    return [KEY_DOMAINS[d] for d in keyed]


def elicited_triage(elicited) -> str:
    """The triage level the shared rules give from what an interview elicited (the
    expert's call on it): ``triage_level`` of the present findings, with the primary
    condition the expert's differential puts first."""
    present = {d: it for d, it in elicited.items() if it.present}
    differential = differential_from(present)
    return triage_level(present, differential[0] if differential else None)


class Clinician:
    """The scripted clinician; see the module docstring.

    Args:
      screen_risk: ask the risk questions (False gives the ``no-risk-screen`` ablation).
      max_attempts: times a domain is asked before giving up on it.
    """

    def __init__(self, screen_risk: bool = True, max_attempts: int = 2):
        self.screen_risk = screen_risk
        self.max_attempts = max_attempts

    def __call__(self, observation, env) -> str:
        return self.act(env)

    def next_domain(self, env) -> str | None:
        """The next domain to ask about, or None when the interview is complete."""
        found = env.patient.elicited
        attempts = Counter(d for asked in env.asked_domains for d in asked)
        order = SCREEN_ORDER + (RISK_ORDER if self.screen_risk else ())
        for dom in order:
            if dom in found or attempts[dom] >= self.max_attempts:
                continue
            need = RISK_PREREQUISITE.get(dom)
            if need is not None and not (need in found and found[need].present):
                continue
            return dom
        return None

    def act(self, env) -> str:
        dom = self.next_domain(env) if env.turns_left > 1 else None
        if dom is None:
            return self.conclude(env)
        attempts = sum(dom in asked for asked in env.asked_domains)
        question = QUESTIONS[dom][min(attempts, 1)]
        if not env.asked_domains:
            question = f"{OPENING} {question}"
        return question

    def conclude(self, env) -> str:
        """The assessment from the revealed findings."""
        present = {d: it for d, it in env.patient.elicited.items() if it.present}
        differential = differential_from(present)
        primary = differential[0] if differential else None
        triage = triage_level(present, primary)
        management = management_for(primary, differential[1:], present) or ("follow_up",)
        if not differential:
            differential = ["adjustment disorder (no specific condition identified)"]
        return render(differential, triage, [MANAGEMENT_PHRASES[m] for m in management])


class WeakClinician:
    """The imperfect clinician of the intake recipe's warm start; see the module
    docstring. Stateless: its per-episode choices come from the case id and ``salt``.

    Args:
      risk_screen: probability that an episode screens risk with direct questions.
      followup: probability that a screening episode asks plan, intent and means after
        revealed ideation (and the other follow-ups after their findings).
      skip: probability that a screening domain is left out of the episode.
      questions: ``(lo, hi)``: it concludes after a number of questions drawn in it.
      empathy: probability of the empathic opening.
      salt: varies the choices for the same cases.
      risk_order: ``"last"``: a screening episode asks the risk questions after the
        other domains, where an early conclusion often cuts them; ``"shuffled"``: they
        take random places among the other domains (a follow-up is asked as soon as its
        finding is revealed and its place has come), so the screening it plans is
        mostly asked.
      follow_notes: None (the planned order above), or a probability: each question
        is read off the checklist (``env.still_to_ask()``): its first item among the
        planned, unasked domains with this probability, else one of them at random.
        ``risk_order`` then does not matter (the list's order is the env's ``notes_order``).
    """

    def __init__(
        self,
        risk_screen: float = 0.3,
        followup: float = 0.5,
        skip: float = 0.25,
        questions: tuple[int, int] = (5, 12),
        empathy: float = 0.5,
        salt: int = 0,
        risk_order: str = "last",
        follow_notes: float | None = None,
    ):
        if risk_order not in ("last", "shuffled"):
            raise ValueError(f"WeakClinician: risk_order must be 'last' or 'shuffled', got {risk_order!r}")
        if follow_notes is not None and (
            not isinstance(follow_notes, (int, float))
            or isinstance(follow_notes, bool)
            or not 0.0 <= follow_notes <= 1.0
        ):
            raise ValueError(
                f"WeakClinician: follow_notes must be null or a probability in [0, 1], got {follow_notes!r}"
            )
        self.risk_order = risk_order
        self.follow_notes = None if follow_notes is None else float(follow_notes)
        for name, v in (("risk_screen", risk_screen), ("followup", followup), ("skip", skip), ("empathy", empathy)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                raise ValueError(f"WeakClinician: {name} must be a probability in [0, 1], got {v!r}")
        q = tuple(questions) if isinstance(questions, (list, tuple)) else None
        if (
            q is None
            or len(q) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in q)
            or not 1 <= q[0] <= q[1]
        ):
            raise ValueError(f"WeakClinician: questions must be [lo, hi] with 1 <= lo <= hi, got {questions!r}")
        self.risk_screen, self.followup, self.skip, self.empathy = risk_screen, followup, skip, empathy
        self.questions, self.salt = q, int(salt)

    def __call__(self, observation, env) -> str:
        return self.act(env)

    def plan(self, case_id: str) -> tuple[list[str], bool, bool, int]:
        """`(domain order, followups, empathic opening, question budget)` of the episode."""
        rng = random.Random(f"intake-weak-clinician:{case_id}:{self.salt}")
        order = list(SCREEN_ORDER)
        rng.shuffle(order)
        order = [d for d in order if rng.random() >= self.skip]
        screen = rng.random() < self.risk_screen
        followup = rng.random() < self.followup
        if screen:
            risk = [d for d in RISK_ORDER if d not in RISK_PREREQUISITE or followup]
            if self.risk_order == "last":  # late, where an early conclusion often cuts them
                order += risk
            else:
                for d in risk:
                    order.insert(rng.randint(0, len(order)), d)
        empathic = rng.random() < self.empathy
        return order, followup, empathic, rng.randint(*self.questions)

    def act(self, env) -> str:
        order, _, empathic, budget = self.plan(env.case.case_id)
        found = env.patient.elicited
        asked = {d for a in env.asked_domains for d in a}
        dom = None
        can_ask = len(env.asked_domains) < budget and env.turns_left > 1
        if can_ask and self.follow_notes is not None:
            planned = set(order)
            listed = [d for d in env.still_to_ask() if d in planned and d not in asked]
            if listed:
                rng = random.Random(f"intake-weak-notes:{env.case.case_id}:{self.salt}:{len(env.asked_domains)}")
                dom = listed[0] if rng.random() < self.follow_notes else rng.choice(listed)
        elif can_ask:
            for d in order:
                need = RISK_PREREQUISITE.get(d)
                if d in asked or d in found or (need is not None and not (need in found and found[need].present)):
                    continue
                dom = d
                break
        if dom is None:
            return Clinician().conclude(env)
        question = QUESTIONS[dom][0]
        if not env.asked_domains and empathic:
            question = f"{OPENING} {question}"
        return question


class RandomClinician:
    """The random baseline; see the module docstring. One instance per episode."""

    def __init__(self, seed: int):
        self.rng = random.Random(f"intake-random-policy:{seed}")
        self.n_questions = self.rng.randint(2, 16)
        self.bank = [q for pair in QUESTIONS.values() for q in pair] + list(OFF_TOPIC)

    def __call__(self, observation, env) -> str:
        if len(env.history) >= self.n_questions or env.turns_left <= 1:
            rng = self.rng
            diff = rng.sample(CONDITION_KEYS, rng.randint(1, 3))
            mgmt = rng.sample(MANAGEMENT_KEYS, rng.randint(1, 4))
            return render(diff, rng.choice(TRIAGE_LEVELS), [MANAGEMENT_PHRASES[m] for m in mgmt])
        return self.rng.choice(self.bank)


POLICIES = ("expert", "random", "no-risk-screen", "weak")


def make_policy(name: str, seed: int = 0, **weak):
    """A policy by name (``POLICIES``); ``seed`` seeds the random one; ``weak`` are
    :class:`WeakClinician`'s keyword arguments (only with ``name="weak"``)."""
    if weak and name != "weak":
        raise ValueError(f"policy {name!r} takes no options, got {sorted(weak)} (only 'weak' does)")
    if name == "expert":
        return Clinician()
    if name == "no-risk-screen":
        return Clinician(screen_risk=False)
    if name == "random":
        return RandomClinician(seed)
    if name == "weak":
        known = list(inspect.signature(WeakClinician).parameters)
        unknown = sorted(k for k in weak if k not in known)
        if unknown:
            raise ValueError(f"the weak clinician has no options {unknown}; known: {', '.join(known)}")
        return WeakClinician(**weak)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


__all__ = [
    "elicited_triage",
    "differential_from",
    "Clinician",
    "WeakClinician",
    "RandomClinician",
    "make_policy",
    "POLICIES",
    "QUESTIONS",
    "SCREEN_ORDER",
    "RISK_ORDER",
]
