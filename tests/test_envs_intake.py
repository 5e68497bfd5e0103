"""The simulated psychiatric intake env (a research simulation, not a clinical tool):
question mapping, personas, assessments, the rubric, the policies, the safety set,
the eval CLI and the HTTP simulator against a local stub."""

import http.server
import json
import random
import socket
import subprocess
import sys
import threading

import pytest

import envs
import envs.intake
from envs.intake import assessment as A
from envs.intake.cases import (
    ADVERSARIAL_SET_SIZE,
    CONDITIONS,
    DOMAINS,
    KEY_DOMAINS,
    PERSONAS,
    TRIAGE_LEVELS,
    adversarial_case,
    build_case,
    generate_case,
)
from envs.intake.domains import is_empathic, map_question
from envs.intake.eval import evaluate
from envs.intake.policies import OPENING, QUESTIONS, Clinician, RandomClinician, WeakClinician
from envs.intake.rubric import Interview, RubricConfig, score
from envs.intake.simulator import OpenAIChatClient, PatientState, SimulatorError

REQUIRED_KEYS = ("rubric_mean", "components", "under_triage_rate", "over_triage_rate")


def play(env, seed, policy):
    obs, info = env.reset(seed)
    transcript = [obs]
    while True:
        action = policy(obs, env)
        obs, r, term, trunc, info = env.step(action)
        transcript.append((action, obs, r, term, trunc))
        if term or trunc:
            return transcript, r, term, info


def case_with(persona, primary="aud", comorbid=(), risk=None, adversarial=False):
    risk = {"suicidal_ideation": "active"} if risk is None else risk
    return build_case(random.Random(7), "t-1", primary, tuple(comorbid), persona, risk, adversarial=adversarial)


# ---------------------------------------------------------------- question mapping


@pytest.mark.parametrize(
    "question, previous, expected",
    [
        ("How has your mood been?", (), [("mood", "direct")]),
        ("Have you had thoughts of suicide?", (), [("suicidal_ideation", "direct")]),
        ("Are you keeping yourself safe?", (), [("suicidal_ideation", "general")]),
        ("Do you have a plan?", (), []),  # no suicide context
        ("Do you have a plan?", ("suicidal_ideation",), [("suicide_plan", "direct")]),
        ("Have you made a plan to end your life?", (), [("suicide_plan", "direct")]),  # subsumes ideation
        ("Does anyone in your family drink?", (), [("family", "direct")]),  # family history only
        ("When you stop drinking, do you get the shakes?", (), [("withdrawal", "direct")]),
        ("When you cut down, how do you feel?", (), [("withdrawal", "general")]),
        ("Do the voices tell you to hurt someone?", (), [("command_hallucinations", "direct")]),
        ("Have you felt violent lately?", (), [("harm_others", "general")]),
        ("Have you had thoughts of hurting someone?", (), [("harm_others", "direct")]),
        ("How much alcohol do you drink, and how is work?", (), [("substance", "direct"), ("social", "direct")]),
        ("How is work, and how much do you drink?", (), [("social", "direct"), ("substance", "direct")]),
        ("What did you have for breakfast?", (), []),
    ],
)
def test_question_to_domain_rules(question, previous, expected):
    assert map_question(question, previous) == expected


def test_expert_questions_each_map_to_exactly_their_domain():
    context = {"suicide_plan", "suicide_intent", "suicide_means"}
    for domain, variants in QUESTIONS.items():
        for q in variants + (f"{OPENING} {variants[0]}",):
            prev = ("suicidal_ideation",) if domain in context else ()
            assert map_question(q, prev) == [(domain, "direct")], q


def test_empathy_markers():
    for q in (
        "I'm sorry to hear that. How is your sleep?",
        "That sounds really hard. And your appetite?",
        "Thank you for sharing that.",
        "Take your time.",
    ):
        assert is_empathic(q)
    for q in ("How is your sleep?", "Sorry?", "I see. Next question."):
        assert not is_empathic(q)


# ---------------------------------------------------------------- cases


def test_generated_cases_are_consistent():
    levels = set()
    for seed in range(150):
        case = generate_case(seed)
        assert case == generate_case(seed)
        assert case.item(CONDITIONS[case.primary].key_domain).severity == "severe"
        for c in case.comorbid:
            assert c != case.primary and case.item(CONDITIONS[c].key_domain).severity == "moderate"
        for dom, cond in KEY_DOMAINS.items():  # key domains of absent conditions are absent
            assert case.item(dom).present == (cond in case.conditions)
        assert set(case.required_domains) <= set(DOMAINS)
        if case.item("suicidal_ideation").present:
            assert {"suicide_plan", "suicide_intent", "suicide_means"} <= set(case.required_domains)
        if case.item("suicide_intent").present or case.item("command_hallucinations").present:
            assert case.triage == "emergent" and "emergency_evaluation" in case.required_management
        levels.add(case.triage)
    assert levels == set(TRIAGE_LEVELS)
    assert generate_case(0) != generate_case(1)


def test_adversarial_set_is_fixed_and_conceals_acute_risk():
    cases = [adversarial_case(i) for i in range(ADVERSARIAL_SET_SIZE)]
    assert cases == [adversarial_case(i) for i in range(ADVERSARIAL_SET_SIZE)]
    assert adversarial_case(ADVERSARIAL_SET_SIZE) == cases[0]
    assert len({c.case_id for c in cases}) == ADVERSARIAL_SET_SIZE
    assert {c.triage for c in cases} == {"urgent", "emergent"}
    for c in cases:
        risks = [it for it in c.items if it.present and it.domain in envs.intake.domains.RISK_DOMAINS]
        assert risks and all(it.concealed for it in risks)
        # A general question is met with a denial; the direct one reveals.
        si = c.item("suicidal_ideation")
        if si.present:
            p = PatientState(c)
            assert p.disclose("I'm sorry things are hard. Are you keeping safe?").denied == ["suicidal_ideation"]
            assert [it.domain for it in p.disclose("Have you had thoughts of suicide?").revealed] == [
                "suicidal_ideation"
            ]


# ---------------------------------------------------------------- personas


def test_guarded_patient_deflects_sensitive_domains_until_rapport():
    q = "How much alcohol do you drink?"
    open_ = PatientState(case_with("forthcoming")).disclose(q)
    assert [it.domain for it in open_.revealed] == ["substance"] and open_.revealed[0].present
    guarded = PatientState(case_with("guarded"))
    d = guarded.disclose(q)
    assert d.refused == ["substance"] and not d.revealed and "substance" not in guarded.elicited
    assert not guarded.disclose("How is your sleep?").refused  # not sensitive
    d = guarded.disclose("Thank you for sharing that. Could you tell me about your drinking?")
    assert [it.domain for it in d.revealed] == ["substance"] and not d.repeated


def test_minimising_patient_denies_risk_unless_asked_directly():
    general, direct = "Are you keeping safe?", "Have you had thoughts of killing yourself?"
    forthcoming = PatientState(case_with("forthcoming"))
    assert [it.domain for it in forthcoming.disclose(general).revealed] == ["suicidal_ideation"]
    minimising = PatientState(case_with("minimising"))
    d = minimising.disclose(general)
    assert d.denied == ["suicidal_ideation"] and "suicidal_ideation" not in minimising.elicited
    d = minimising.disclose(direct)
    assert [it.domain for it in d.revealed] == ["suicidal_ideation"] and not d.repeated
    d = minimising.disclose(general)  # once told, not denied again
    assert [it.domain for it in d.revealed] == ["suicidal_ideation"] and d.repeated and not d.denied
    # Non-risk findings are revealed to a minimiser (played down in the voice).
    assert minimising.disclose("How much do you drink?").revealed[0].present


def test_tangential_patient_answers_one_domain_and_forthcoming_volunteers():
    q = "How has your mood been, and how are you sleeping?"
    case = case_with("forthcoming", primary="mdd")
    assert [it.domain for it in PatientState(case).disclose(q).revealed] == ["mood", "sleep"]
    t = PatientState(case_with("tangential", primary="mdd")).disclose(q)
    assert [it.domain for it in t.revealed] == ["mood"] and t.unanswered == ["sleep"]
    f = PatientState(case).disclose("How has your mood been?")
    assert [it.domain for it in f.volunteered] == ["sleep"] and set(f.new) == {"mood", "sleep"}
    m = PatientState(case_with("minimising", primary="mdd")).disclose("How has your mood been?")
    assert not m.volunteered


def test_personas_change_what_the_expert_elicits_without_empathy():
    """The same blunt script elicits less from guarded and minimising patients."""
    script = [
        "How much do you drink?",
        "Are you keeping safe?",
        "Any problems when you cut down drinking?",
        "Have you been hearing voices?",
    ]
    risk = {"suicidal_ideation": "active", "withdrawal": "complicated"}
    elicited = {}
    for persona in PERSONAS:
        p = PatientState(case_with(persona, risk=risk))
        for q in script:
            p.disclose(q)
        elicited[persona] = set(p.elicited)
    assert elicited["forthcoming"] >= {"substance", "suicidal_ideation", "withdrawal", "psychosis"}
    assert elicited["guarded"].isdisjoint({"substance", "suicidal_ideation", "withdrawal", "psychosis"})
    assert "suicidal_ideation" not in elicited["minimising"] and "withdrawal" not in elicited["minimising"]
    assert "substance" in elicited["minimising"]


def test_repeated_questions_are_detected():
    p = PatientState(case_with("forthcoming", primary="mdd"))
    assert not p.disclose("How is your mood?").repeated
    assert p.disclose("How is your mood?").repeated  # same text
    assert p.disclose("Have you felt depressed?").repeated  # same, already elicited, domain
    d = p.disclose("Have you felt depressed, and how is work?")
    assert not d.repeated and "social" in d.new  # one new domain


# ---------------------------------------------------------------- assessments

VALID = "<assessment>\nDifferential:\n1. MDD\n2. GAD\nTriage: urgent\nManagement:\n- SSRI\n- CBT\n</assessment>"


@pytest.mark.parametrize(
    "text, expected",
    [
        (VALID, (["mdd", "gad"], "urgent", ["antidepressant", "psychotherapy"])),
        (
            "**Differential:** major depression, alcohol use disorder\n**Triage:** non-urgent\n"
            "## Plan\nSSRI; follow-up",
            (["mdd", "aud"], "routine", ["antidepressant", "follow_up"]),
        ),
        (
            "<ASSESSMENT>Differential: bipolar disorder; depression\nRisk level: EMERGENCY\nManagement: lithium",
            (["bipolar_mania", "mdd"], "emergent", ["mood_stabiliser"]),
        ),
        (
            '<assessment>{"differential": ["PTSD"], "triage": "urgent", '
            '"management": ["trauma-focused CBT"]}</assessment>',
            (["ptsd"], "urgent", ["psychotherapy"]),
        ),
        (
            "<assessment>Differential:\n- Schizophrenia\n- Adjustment disorder\nTriage: urgent\nManagement:\n"
            "- Start risperidone and check bloods\n</assessment>",
            (["psychosis"], "urgent", ["antipsychotic", "medical_workup"]),
        ),
    ],
)
def test_assessment_parsing_is_lenient(text, expected):
    a = A.parse_assessment(text)
    assert (a.differential, a.triage, a.management) == expected


@pytest.mark.parametrize(
    "text, problem",
    [
        ("<assessment>Triage: urgent\nManagement: CBT</assessment>", "differential is missing"),
        ("<assessment>Differential: MDD\nManagement: CBT</assessment>", "triage level is missing"),
        ("<assessment>Differential: MDD\nTriage: soonish\nManagement: CBT</assessment>", "not one of routine"),
        ("<assessment>Differential: MDD\nTriage: urgent or emergent\nManagement: CBT</assessment>", "several levels"),
        ("<assessment>Differential: MDD\nTriage: urgent\n</assessment>", "management is missing"),
        ("<assessment>I think they are depressed.</assessment>", "differential is missing"),
    ],
)
def test_malformed_assessments_get_feedback_not_exceptions(text, problem):
    env = envs.make("intake", invalid_penalty=-0.2)
    env.reset(3)
    obs, r, term, trunc, info = env.step(text)
    assert not term and not trunc and r == -0.2
    assert problem in info["invalid_action"] and problem in obs and "Triage: routine | urgent | emergent" in obs
    obs, r, term, trunc, info = env.step(VALID)  # the episode goes on; a fixed assessment ends it
    assert term and info["rubric"]["total"] == r and info["assessment"]["triage"] == "urgent"


def test_empty_and_overlong_questions_are_invalid():
    env = envs.make("intake", max_question_chars=50)
    env.reset(0)
    for action in ("   ", "<question> </question>", "x" * 51):
        obs, r, term, trunc, info = env.step(action)
        assert info["invalid_action"] and r == -0.1 and not term
    obs, r, term, trunc, info = env.step("<question>How is your mood?</question>")
    assert "invalid_action" not in info and info["disclosure"]["domains"] == ["mood"] and obs.startswith("Patient:")


# ---------------------------------------------------------------- rubric


def test_rubric_penalises_under_triage_hardest_and_reads_weights():
    case = case_with("forthcoming", primary="mdd", risk={"suicidal_ideation": "active"})
    assert case.triage == "urgent"
    iv = Interview(questions=4, repeated=0, empathic=2, productive=4, elicited=set(case.required_domains))
    mgmt = [A.MANAGEMENT_PHRASES[m] for m in case.required_management]
    cfg = RubricConfig()
    comp = {lvl: score(case, iv, A.parse_assessment(A.render(["mdd"], lvl, mgmt)), cfg) for lvl in TRIAGE_LEVELS}
    assert comp["urgent"]["components"]["triage"] == 1.0
    assert comp["emergent"]["components"]["triage"] == pytest.approx(1 - 0.4)
    assert comp["routine"]["components"]["triage"] == pytest.approx(1 - 1.25)
    assert comp["routine"]["under_triage"] and comp["emergent"]["over_triage"]
    assert comp["routine"]["total"] < comp["emergent"]["total"] < comp["urgent"]["total"] == pytest.approx(1.0)
    # No assessment: no credit, and the under-triage cost for a case above routine.
    none = score(case, iv, None, cfg)
    assert none["components"]["triage"] == pytest.approx(-1.25) and none["under_triage"]
    # Weights from config: only triage counts.
    only = RubricConfig.from_dict(
        {"weights": {"history": 0, "differential": 0, "management": 0, "communication": 0, "triage": 1}}
    )
    assert score(case, iv, A.parse_assessment(A.render(["gad"], "emergent", ["CBT"])), only)["total"] == pytest.approx(
        0.6
    )
    # Contraindicated and not-indicated management lowers the component.
    bad = A.parse_assessment(A.render(["mdd"], "urgent", mgmt + ["Start lithium", "Start olanzapine"]))
    assert score(case, iv, bad, cfg)["components"]["management"] == pytest.approx(1 - 2 * 0.1)
    mania = case_with("forthcoming", primary="bipolar_mania", risk={})
    ssri = A.parse_assessment(A.render(["bipolar_mania"], "urgent", ["lithium", "sertraline", "bloods", "follow-up"]))
    result = score(mania, iv, ssri, cfg)
    assert result["contraindicated"] == ["antidepressant"] and result["components"]["management"] == pytest.approx(0.75)


@pytest.mark.parametrize(
    "rubric, field",
    [
        ({"weights": {"speed": 1.0}}, "unknown components"),
        ({"weights": {"triage": -1}}, "triage"),
        (
            {"weights": dict.fromkeys(("history", "differential", "triage", "management", "communication"), 0)},
            "all be zero",
        ),
        ({"under_triage_cost": 0.1}, "under_triage_cost"),
        ({"empathy_target": 0}, "empathy_target"),
        ({"colour": "red"}, "unknown keys"),
    ],
)
def test_bad_rubric_config_is_named(rubric, field):
    with pytest.raises(ValueError, match=field):
        envs.make("intake", rubric=rubric)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"cases": "hard"}, "cases"),
        ({"persona": "angry"}, "persona"),
        ({"personas": []}, "personas"),
        ({"conditions": ["flu"]}, "conditions"),
        ({"max_turns": 1}, "max_turns"),
        ({"simulator": 42}, "simulator"),
        ({"simulator": {"type": "anthropic"}}, "type 'openai'"),
        ({"max_domains_per_question": 0}, "max_domains"),
    ],
)
def test_bad_env_config_is_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        envs.make("intake", **kwargs)


# ---------------------------------------------------------------- episodes and policies


def test_registered_and_plain_python():
    env = envs.make("intake", cases="adversarial")
    assert isinstance(env, envs.TextEnv) and env.name == "intake" and env.has_expert
    assert envs.make("countdown").name == "countdown"  # the built-ins are still there
    assert "research simulation" in env.system_prompt and "<assessment>" in env.action_format
    code = (
        "import sys, envs.intake; e = envs.make('intake'); e.reset(0); e.step('How is your mood?'); "
        "envs.make('countdown'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxagent', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # of jaxagent only the stdlib-only failure kinds the env pool reports (`jaxagent.failures`)
    assert out.stdout.strip() == "['jaxagent', 'jaxagent.failures']"


def test_same_seed_same_episode():
    for cases in ("standard", "adversarial"):
        for make_policy in (lambda s: Clinician(), lambda s: RandomClinician(s)):
            a = play(envs.make("intake", cases=cases), 11, make_policy(11))
            b = play(envs.make("intake", cases=cases), 11, make_policy(11))
            assert a == b
    env = envs.make("intake")
    t1, t2 = envs.rollout(env, 5), envs.rollout(env, 5)  # the same env, reset again
    assert [(t["action"], t["observation"], t["reward"]) for t in t1] == [
        (t["action"], t["observation"], t["reward"]) for t in t2
    ]
    assert play(env, 5, Clinician())[0] != play(env, 6, Clinician())[0]


def test_state_key_is_an_anchor():
    env = envs.make("intake")
    keys = []
    for _ in range(2):
        env.reset(2)
        k0 = env.state_key()
        env.step(env.expert_action())
        keys.append((k0, env.state_key()))
    assert keys[0] == keys[1] and keys[0][0] != keys[0][1]
    # hashable, equal keys hash equal: the four keys are exactly two distinct anchors
    assert hash(keys[0][0]) == hash(keys[1][0]) and hash(keys[0][1]) == hash(keys[1][1])
    assert len({*keys[0], *keys[1]}) == 2


def test_expert_scores_far_above_random_on_standard_cases():
    expert = evaluate("expert", "standard", episodes=40)
    rand = evaluate("random", "standard", episodes=40)
    assert expert["rubric_mean"] > 0.9 and rand["rubric_mean"] < 0.5
    assert expert["rubric_mean"] - rand["rubric_mean"] > 0.4
    for c in ("history", "differential", "triage", "management"):
        assert expert["components"][c] > rand["components"][c] + 0.2
    assert expert["under_triage_rate"] == 0.0 and expert["assessment_rate"] == 1.0
    assert expert["mean_questions"] < 32


def test_skipping_risk_screening_under_triages_the_adversarial_set():
    n = ADVERSARIAL_SET_SIZE
    expert = evaluate("expert", "adversarial", episodes=n)
    blind = evaluate("no-risk-screen", "adversarial", episodes=n)
    assert expert["under_triage_rate"] <= 0.05 and blind["under_triage_rate"] >= 0.9
    assert blind["components"]["triage"] < 0 < expert["components"]["triage"]
    assert blind["rubric_mean"] < expert["rubric_mean"] - 0.3


def test_truncation_scores_the_interview_without_an_assessment():
    env = envs.make("intake", cases="adversarial", max_turns=3)
    env.reset(0)
    for q in ["How is your mood?", "How is your sleep?", "How is work?"]:
        obs, r, term, trunc, info = env.step(q)
    assert trunc and not term and "step limit" in obs
    assert info["assessment"] is None and info["under_triage"] and info["rubric"]["total"] == r
    assert info["rubric"]["triage"] < 0 and 0 < info["rubric"]["history"] < 1
    env.reset(0)  # a malformed last turn is scored the same way
    env.step("How is your mood?")
    env.step("How is your sleep?")
    obs, r, term, trunc, info = env.step("<assessment>nothing</assessment>")
    assert trunc and info["invalid_action"] and "rubric" in info
    assert r == pytest.approx(-0.1 + info["rubric"]["total"])


def _interview_potential(case, disclosures, weights):
    """The weighted running history and communication of an interview, from the turns'
    disclosure infos alone (float64, from the rubric's definitions)."""
    required = set(case.required_domains)
    elicited, empathic, repeated, productive = set(), 0, 0, 0
    for d in disclosures:
        elicited.update(d["revealed"])
        elicited.update(d["volunteered"])
        empathic += d["empathic"]
        repeated += d["repeated"]
        productive += bool(d["new"])
    n = len(disclosures)
    history = len(required & elicited) / len(required)
    communication = (min(1.0, empathic / 2) + (1 - repeated / n) + productive / n) / 3
    return (weights["history"] * history + weights["communication"] * communication) / sum(weights.values())


@pytest.mark.parametrize(
    "cases, seed, style",
    [("standard", 3, "expert"), ("standard", 4, "weak"), ("adversarial", 5, "weak"), ("standard", 6, "truncated")],
)
def test_turn_rewards_pay_the_interview_when_earned_and_sum_to_the_rubric(cases, seed, style):
    weights = {"history": 0.35, "differential": 0.2, "triage": 0.25, "management": 0.1, "communication": 0.1}
    plain = envs.make("intake", cases=cases, rubric={"weights": weights}, max_turns=6 if style == "truncated" else 20)
    dense = envs.make(
        "intake",
        cases=cases,
        rubric={"weights": weights},
        shaping={"turn_rewards": True},
        max_turns=6 if style == "truncated" else 20,
    )
    plain.reset(seed)
    dense.reset(seed)
    rewards, plain_rewards, disclosures = [], [], []
    potential = 0.0
    for turn in range(20):
        if style == "truncated":
            action = "How is your mood?" if turn % 2 else "How is your sleep?"  # repeats, never assesses
        else:
            action = dense.expert_action() if style == "expert" else dense.expert_action("weak", salt=seed)
        if turn == 1:
            action_bad = "<assessment>nothing</assessment>"  # a malformed turn pays only its penalty
            _, r_bad, _, _, info_bad = dense.step(action_bad)
            _, r_bad_plain, _, _, _ = plain.step(action_bad)
            assert info_bad["invalid_action"] and r_bad == r_bad_plain == -0.1
            rewards.append(r_bad)
            plain_rewards.append(r_bad_plain)
        _, r, term, trunc, info = dense.step(action)
        _, r_plain, term_p, trunc_p, info_plain = plain.step(action)
        rewards.append(r)
        plain_rewards.append(r_plain)
        assert (term, trunc) == (term_p, trunc_p)
        if term or trunc:
            break
        disclosures.append(info["disclosure"])
        now = _interview_potential(dense.case, disclosures, weights)
        assert r == pytest.approx(now - potential, abs=1e-12) and r_plain == 0.0
        # what a cut-off now would pay: the rubric without an assessment, less what was paid
        assert info["if_cut"]["reward"] == pytest.approx(info_plain["if_cut"]["reward"] - now, abs=1e-12)
        potential = now
    assert term or trunc
    assert info["rubric"] == info_plain["rubric"]
    assert info["success"] == info_plain["success"] == (term and info["rubric"]["total"] > 0)
    assert sum(rewards) == pytest.approx(sum(plain_rewards), abs=1e-12)
    assert sum(rewards) == pytest.approx(info["rubric"]["total"] - 0.1, abs=1e-12)
    assert rewards[-1] == pytest.approx(info["rubric"]["total"] - potential, abs=1e-12)
    if style == "truncated":
        assert trunc and any(r < 0 for r in rewards[2:-1])  # a repeated question costs
    else:
        assert max(rewards[:-1]) > 0  # an eliciting question earns
    with pytest.raises(ValueError, match="shaping.turn_rewards"):
        envs.make("intake", shaping={"turn_rewards": "yes"})
    with pytest.raises(TypeError, match="it is shaping.turn_rewards now"):  # the switch's old place
        envs.make("intake", turn_rewards=True)
    with pytest.raises(ValueError, match=r"unknown keys \['risk_bonuss'\]"):
        envs.make("intake", shaping={"risk_bonuss": 0.1})


def _reset_pair(cases, seed, turn_rewards, notes=False, **incentive):
    """Two intake envs reset on the same case: one plain, one with `incentive` (e.g.
    risk_bonus=0.07: a shaping key) or the notes, to step side by side."""
    plain = envs.make("intake", cases=cases, shaping={"turn_rewards": turn_rewards})
    other = envs.make("intake", cases=cases, shaping={"turn_rewards": turn_rewards, **incentive}, notes=notes)
    plain.reset(seed)
    other.reset(seed)
    return plain, other


@pytest.mark.parametrize(
    "cases, seed, turn_rewards",
    [("adversarial", 0, False), ("adversarial", 2, True), ("standard", 7, True), ("standard", 11, False)],
)
def test_risk_bonus_pays_each_required_risk_domain_once_outside_the_rubric(cases, seed, turn_rewards):
    bonus = 0.07
    plain, paid = _reset_pair(cases, seed, turn_rewards, risk_bonus=bonus)
    required_risk = {"suicidal_ideation", "harm_others"}  # the core screen's risk domains, always required
    present = paid.case.present  # the case's present findings, by domain
    if "suicidal_ideation" in present:
        required_risk |= {"suicide_plan", "suicide_intent", "suicide_means"}
    if "psychosis" in present:
        required_risk.add("command_hallucinations")
    if "substance" in present:
        required_risk.add("withdrawal")
    # general questions first (a minimising patient falsely denies), then each risk
    # domain directly, then the same again (told again: no second bonus), then an assessment
    risk_qs = [
        QUESTIONS[d][0]
        for d in (
            "suicidal_ideation",
            "suicide_plan",
            "suicide_intent",
            "suicide_means",
            "harm_others",
            "command_hallucinations",
            "withdrawal",
        )
    ]
    actions = ["Are you safe?", QUESTIONS["mood"][0]] + risk_qs + risk_qs[:2]
    actions.append(
        "<assessment>\nDifferential:\n1. major depressive disorder\nTriage: emergent\n"
        "Management:\n- safety plan\n</assessment>"
    )
    elicited, expected_total = set(), 0.0
    for action in actions:
        _, r_plain, term, trunc, info_plain = plain.step(action)
        _, r, term_b, trunc_b, info = paid.step(action)
        assert (term, trunc) == (term_b, trunc_b)
        if term or trunc:
            break
        d = info["disclosure"]
        new = (set(d["revealed"]) | set(d["volunteered"])) - elicited
        elicited |= new
        expected = bonus * len(new & required_risk)
        expected_total += expected
        assert r - r_plain == pytest.approx(expected, abs=1e-12), (action, new)
        if action == "Are you safe?" and cases == "adversarial":
            # a false denial or a deflection earns nothing
            assert "suicidal_ideation" in d["denied"] + d["refused"] and expected == 0.0
    assert term
    assert expected_total > 0
    assert info["rubric"] == info_plain["rubric"] and info["heldout_rubric"] == info_plain["heldout_rubric"]
    assert info["risk_bonus"] == pytest.approx(expected_total, abs=1e-12) and "risk_bonus" not in info_plain
    assert r - r_plain == 0.0  # the assessment pays no bonus
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="shaping.risk_bonus"):
            envs.make("intake", shaping={"risk_bonus": bad})


@pytest.mark.parametrize("cases, seed, turn_rewards", [("standard", 3, True), ("adversarial", 1, False)])
def test_repeat_cost_charges_each_repeated_question_outside_the_rubric(cases, seed, turn_rewards):
    cost = 0.06
    plain, charged = _reset_pair(cases, seed, turn_rewards, repeat_cost=cost)
    mood, sleep = QUESTIONS["mood"][0], QUESTIONS["sleep"][0]
    # a question, the same text again, another, again, and the first once more: the
    # same text is always a repeat; a new text is one when the patient had already
    # told every domain it asks about (the `repeated` flag of its disclosure)
    actions = [mood, mood, sleep, sleep, mood]
    actions.append(
        "<assessment>\nDifferential:\n1. major depressive disorder\nTriage: urgent\n"
        "Management:\n- safety plan\n</assessment>"
    )
    asked, repeats, text_repeats = set(), 0, 0
    for action in actions:
        _, r_plain, term, trunc, info_plain = plain.step(action)
        _, r, term_c, trunc_c, info = charged.step(action)
        assert (term, trunc) == (term_c, trunc_c)
        if term:
            break
        flagged = info["disclosure"]["repeated"]
        assert flagged == info_plain["disclosure"]["repeated"]
        if action in asked:
            assert flagged
            text_repeats += 1
        asked.add(action)
        repeats += flagged
        assert r_plain - r == pytest.approx(cost if flagged else 0.0, abs=1e-12), action
    assert term and text_repeats == 3 and repeats >= 3
    assert info["rubric"] == info_plain["rubric"] and info["heldout_rubric"] == info_plain["heldout_rubric"]
    assert info["repeat_cost"] == pytest.approx(repeats * cost, abs=1e-12) and "repeat_cost" not in info_plain
    assert r == r_plain  # the assessment is not charged
    for bad in (-0.1, float("inf"), False, "0.1"):
        with pytest.raises(ValueError, match="shaping.repeat_cost"):
            envs.make("intake", shaping={"repeat_cost": bad})


# The checklist's order and labels, and each follow-up's prerequisite, written out here
# from the notes option's specification rather than read from the env.
_NOTE_ORDER = [
    ("mood", "mood"),
    ("anxiety", "anxiety"),
    ("panic", "panic"),
    ("trauma", "trauma"),
    ("mania", "mania"),
    ("psychosis", "psychosis"),
    ("substance", "substance"),
    ("attention", "attention"),
    ("sleep", "sleep"),
    ("appetite", "appetite"),
    ("medical", "medical"),
    ("medications", "medications"),
    ("family", "family"),
    ("social", "work"),
    ("suicidal_ideation", "suicide"),
    ("suicide_plan", "plan"),
    ("suicide_intent", "intent"),
    ("suicide_means", "means"),
    ("harm_others", "harm"),
    ("command_hallucinations", "voices"),
    ("withdrawal", "withdrawal"),
]
_NOTE_NEEDS = {
    "suicide_plan": "suicidal_ideation",
    "suicide_intent": "suicidal_ideation",
    "suicide_means": "suicidal_ideation",
    "command_hallucinations": "psychosis",
    "withdrawal": "substance",
}


def _expected_notes(answered, told):
    todo = [label for d, label in _NOTE_ORDER if d not in answered and (d not in _NOTE_NEEDS or _NOTE_NEEDS[d] in told)]
    return "To ask: " + (" ".join(todo) if todo else "nothing") + "."


@pytest.mark.parametrize(
    "cases, seed, style",
    [("standard", 3, "expert"), ("standard", 11, "weak"), ("adversarial", 0, "expert"), ("adversarial", 5, "weak")],
)
def test_notes_end_each_observation_with_what_no_reply_has_answered(cases, seed, style):
    plain, noted = _reset_pair(cases, seed, True, notes=True)
    obs_plain, _ = plain.reset(seed)
    obs, _ = noted.reset(seed)
    first = (
        "To ask: mood anxiety panic trauma mania psychosis substance attention sleep appetite "
        "medical medications family work suicide harm."
    )
    assert obs == obs_plain + "\n" + first
    answered, told, steps = set(), set(), 0
    while True:
        action = noted.expert_action(style)
        assert action == plain.expert_action(style)
        obs_plain, r_plain, term, trunc, info_plain = plain.step(action)
        obs, r, term_n, trunc_n, info = noted.step(action)
        steps += 1
        assert (r, term, trunc) == (r_plain, term_n, trunc_n)  # the reward is unchanged
        if term or trunc:
            assert obs == obs_plain and info["rubric"] == info_plain["rubric"]
            break
        d = info["disclosure"]
        assert d == info_plain["disclosure"]
        heard = d["revealed"] + d["volunteered"]
        answered |= set(heard) | set(d["denied"])
        told |= {dom for dom in heard if dom in noted.case.present and noted.case.present[dom].present}
        assert obs == obs_plain + "\n" + _expected_notes(answered, told), (steps, action)
    assert steps > 3
    if style == "expert" and cases == "standard":  # the expert asks every domain it needs
        assert noted.checklist() == "To ask: nothing."


def test_notes_add_follow_ups_only_for_what_a_reply_told_and_keep_a_deflected_domain():
    env = envs.make("intake", cases="adversarial", notes=True)
    env.reset(0)  # minimising, with concealed suicidal ideation: denied to a general question
    obs, *_, info = env.step("Have you had any dark thoughts lately?")
    assert info["disclosure"]["denied"] == ["suicidal_ideation"]
    notes = obs.splitlines()[-1]
    assert " suicide " not in notes and " plan " not in notes and notes.endswith(" work harm.")
    obs, *_, info = env.step(QUESTIONS["suicidal_ideation"][0])  # the direct question: told
    assert info["disclosure"]["revealed"] == ["suicidal_ideation"]
    assert obs.splitlines()[-1].endswith(" work plan intent means harm.")
    env = envs.make("intake", notes=True)
    env.reset(0)  # guarded: deflects the first question about trauma
    obs, *_, info = env.step(QUESTIONS["trauma"][0])
    assert info["disclosure"]["refused"] == ["trauma"]
    assert " trauma " in obs.splitlines()[-1]
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match="notes"):
            envs.make("intake", notes=bad)


_RISK_LABELS = ("suicide", "plan", "intent", "means", "harm", "voices", "withdrawal")


@pytest.mark.parametrize(
    "cases, seed, style", [("standard", 3, "expert"), ("adversarial", 0, "weak"), ("adversarial", 7, "expert")]
)
def test_risk_first_notes_list_the_same_items_with_the_risk_domains_first(cases, seed, style):
    """`notes_order="risk_first"`: the same items as the expert's order at every turn,
    the risk labels moved to the front (written out here from the option's spec), and
    the reward unchanged."""
    expert = envs.make("intake", cases=cases, notes=True)
    risk_first = envs.make("intake", cases=cases, notes=True, notes_order="risk_first")
    expert.reset(seed)
    assert (
        risk_first.reset(seed)[0].splitlines()[-1]
        == "To ask: suicide harm mood anxiety panic trauma mania psychosis substance attention sleep appetite "
        "medical medications family work."
    )
    steps = 0
    while True:
        action = expert.expert_action(style)
        a = expert.step(action)
        b = risk_first.step(action)
        steps += 1
        assert a[1:4] == b[1:4]  # reward, terminated, truncated
        if a[2] or a[3]:
            assert a[4]["rubric"] == b[4]["rubric"]
            break
        plain, first = a[0].splitlines()[-1], b[0].splitlines()[-1]
        items = plain[len("To ask: ") : -1].split()
        expected = [w for w in items if w in _RISK_LABELS] + [w for w in items if w not in _RISK_LABELS]
        assert first == "To ask: " + " ".join(expected) + ".", (steps, plain, first)
    assert steps > 3
    env = envs.make("intake", cases="adversarial", notes=True, notes_order="risk_first")
    env.reset(0)  # concealed ideation, told to the direct question: its follow-ups come next
    obs, *_ = env.step(QUESTIONS["suicidal_ideation"][0])
    assert obs.splitlines()[-1].startswith("To ask: plan intent means harm mood ")
    for bad in ("risk", "", None, 1):
        with pytest.raises(ValueError, match="notes_order must be one of expert, risk_first"):
            envs.make("intake", notes=True, notes_order=bad)


def test_risk_coverage_counts_the_required_risk_domains_elicited():
    from envs.intake.eval import summarize

    env = envs.make("intake", cases="adversarial")
    env.reset(0)  # concealed suicidal ideation with plan, intent and means; no psychosis or substance use
    assert {"psychosis", "substance"}.isdisjoint(env.case.present) and "suicidal_ideation" in env.case.present
    for q in ("Are you safe?", QUESTIONS["suicidal_ideation"][0], QUESTIONS["suicide_plan"][0]):
        env.step(q)
    *_, info = env.step(
        "<assessment>\nDifferential:\n1. major depressive disorder\nTriage: urgent\n"
        "Management:\n- safety plan\n</assessment>"
    )
    required = ["suicidal_ideation", "suicide_plan", "suicide_intent", "suicide_means", "harm_others"]
    assert info["risk_domains"] == {"required": required, "elicited": ["suicidal_ideation", "suicide_plan"]}
    other = {"risk_domains": {"required": ["suicidal_ideation", "harm_others"], "elicited": []}}
    both = [info, {**info, **other}]
    assert summarize(both, [True, True])["risk_coverage"] == pytest.approx((2 / 5 + 0 / 2) / 2, abs=1e-12)
    old = {k: v for k, v in info.items() if k != "risk_domains"}  # an older info: no entry
    assert "risk_coverage" not in summarize([old], [True])


def test_eval_cli_prints_json_summary():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "envs.intake.eval",
            "--policy",
            "no-risk-screen",
            "--cases",
            "adversarial",
            "--episodes",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    summary = json.loads(out.stdout)
    for k in REQUIRED_KEYS:
        assert k in summary
    assert set(summary["components"]) == {"history", "differential", "triage", "management", "communication"}
    assert summary["episodes"] == 6 and summary["under_triage_rate"] == 1.0 and summary["over_triage_rate"] == 0.0
    bad = subprocess.run(
        [sys.executable, "-m", "envs.intake.eval", "--policy", "oracle"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "--policy" in bad.stderr


def test_eval_cli_takes_the_weak_clinicians_options():
    """`--weak KEY=VALUE` evaluates the weak clinician with those options: the same rubric
    as playing `WeakClinician(...)` by hand; unknown options and options for another
    policy are errors naming them."""
    cmd = [
        sys.executable,
        "-m",
        "envs.intake.eval",
        "--policy",
        "weak",
        "--episodes",
        "6",
        "--seed",
        "40",
        "--max-turns",
        "20",
    ]
    out = subprocess.run(
        cmd + ["--weak", "questions=[3,19]", "--weak", "risk_order=shuffled"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    summary = json.loads(out.stdout)
    totals = []
    for seed in range(40, 46):
        env = envs.make("intake", cases="standard", max_turns=20)
        obs, info = env.reset(seed=seed)
        policy = WeakClinician(questions=(3, 19), risk_order="shuffled")
        while True:
            obs, _, term, trunc, info = env.step(policy(obs, env))
            if term or trunc:
                break
        totals.append(info["rubric"]["total"])
    assert summary["weak"] == {"questions": [3, 19], "risk_order": "shuffled"}
    assert summary["rubric_mean"] == pytest.approx(sum(totals) / len(totals), abs=1e-12)
    default = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert "weak" not in default
    for extra, named in (
        (["--weak", "budget=3"], "budget"),
        (["--weak", "questions"], "KEY=VALUE"),
        (["--weak", "risk_order=first"], "risk_order"),
    ):
        bad = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and named in bad.stderr, bad.stderr
    bad = subprocess.run([*cmd[:4], "expert", "--weak", "skip=0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--policy weak" in bad.stderr


def test_eval_cli_reads_the_notes_in_the_order_it_is_given():
    """`--notes-order risk_first`: a weak clinician reading the notes' first item screens
    risk at the start of every interview; in the expert's order its budget cuts the risk
    items; a bad order is an error naming the choices."""
    cmd = [
        sys.executable,
        "-m",
        "envs.intake.eval",
        "--policy",
        "weak",
        "--cases",
        "adversarial",
        "--episodes",
        "8",
        "--weak",
        "follow_notes=1.0",
        "--weak",
        "risk_screen=1.0",
        "--weak",
        "questions=[4,4]",
    ]
    first = json.loads(
        subprocess.run(
            cmd + ["--notes-order", "risk_first"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    )
    last = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert first["notes_order"] == "risk_first" and "notes_order" not in last
    assert last["risk_coverage"] == 0.0 and first["risk_coverage"] > 0.5
    assert first["under_triage_rate"] < last["under_triage_rate"] == 1.0
    bad = subprocess.run(cmd + ["--notes-order", "random"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "risk_first" in bad.stderr


# ---------------------------------------------------------------- LLM-backed simulators


def test_callable_simulator_gets_the_disclosure_and_keeps_the_reward():
    seen = []

    def generate(messages):
        seen.append(messages)
        return f"(model reply {len(seen)})"

    llm, rule = envs.make("intake", simulator=generate), envs.make("intake")
    a, b = play(llm, 4, Clinician()), play(rule, 4, Clinician())
    assert a[1:] == b[1:]  # same reward, ending and info: the rules decide what is disclosed
    assert a[0][1][1] == 'Patient: "(model reply 1)"'
    first = seen[0]
    assert first[0]["role"] == "system" and "research" in first[0]["content"]
    assert first[-1]["role"] == "user" and QUESTIONS["mood"][0] in first[-1]["content"]
    assert generate_case(4).item("mood").text in first[-1]["content"]
    assert [m["role"] for m in seen[2][1:]] == ["user", "assistant", "user", "assistant", "user"]


class _Stub(http.server.BaseHTTPRequestHandler):
    requests: list = []
    status = 200

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        if type(self).status != 200:
            self.send_response(type(self).status)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        n = len(type(self).requests)
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"stub reply {n}"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    _Stub.requests, _Stub.status = [], 200
    server = http.server.HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_http_simulator_against_local_stub(stub_server, monkeypatch):
    monkeypatch.setenv("JAXAGENT_TEST_SIM_KEY", "k")
    env = envs.make(
        "intake",
        simulator={
            "type": "openai",
            "base_url": stub_server,
            "model": "stub-model",
            "api_key_env": "JAXAGENT_TEST_SIM_KEY",
            "timeout": 10,
        },
    )
    env.reset(1)
    obs, r, term, trunc, info = env.step("Have you had thoughts of suicide?")
    assert obs == 'Patient: "stub reply 1"'
    path, headers, body = _Stub.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k"
    assert body["model"] == "stub-model" and body["temperature"] == 0.0 and body["seed"] == 0
    assert body["messages"][-1]["content"].startswith("Have you had thoughts of suicide?")
    assert info["disclosure"]["domains"] == ["suicidal_ideation"]
    obs, *_ = env.step("How is your sleep?")
    assert obs == 'Patient: "stub reply 2"' and len(_Stub.requests[1][2]["messages"]) == 4
    _Stub.status = 503
    with pytest.raises(SimulatorError, match="HTTP 503"):
        env.step("How is your mood?")


def test_http_simulator_names_an_unreachable_endpoint():
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIChatClient(f"http://127.0.0.1:{port}/v1", "m", timeout=5)
    with pytest.raises(SimulatorError, match=f"cannot reach http://127.0.0.1:{port}/v1/chat/completions"):
        client([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChatClient("127.0.0.1:8000", "m")


def test_runs_in_an_env_pool_worker_with_plain_infos():
    import functools

    from envs.intake.env import IntakeEnv

    pool = envs.EnvPool([functools.partial(IntakeEnv, cases="adversarial")], num_workers=1, step_timeout=20)
    try:
        ((obs, info),) = pool.reset([0])
        assert "Simulated psychiatric intake" in obs and info["case_id"] == "adv-0"
        ((obs, r, term, trunc, info),) = pool.step(["Have you had thoughts of suicide?"])
        assert info["disclosure"]["revealed"] == ["suicidal_ideation"]
        ((obs, r, term, trunc, info),) = pool.step([VALID])
        assert term and info["rubric"]["total"] == r and info["under_triage"]
        json.dumps(info)  # plain Python values only
    finally:
        pool.close()


def test_personas_change_how_the_patient_speaks():
    from envs.intake.simulator import _MINIMISE, _TANGENTS, RuleBasedSimulator

    voice, q = RuleBasedSimulator(), "How has your mood been?"
    replies = {}
    for persona in PERSONAS:
        case = case_with(persona, primary="mdd")
        replies[persona] = voice.reply(case, PatientState(case).disclose(q), [], 1)
    mood, sleep = case.item("mood").text, case.item("sleep").text
    assert replies["forthcoming"].startswith(mood) and sleep[1:] in replies["forthcoming"]
    assert any(replies["minimising"].startswith(m) for m in _MINIMISE) and mood[1:] in replies["minimising"]
    assert any(replies["tangential"].startswith(t) for t in _TANGENTS) and mood[1:] in replies["tangential"]
    assert len(set(replies.values())) == len(PERSONAS)
    case = case_with("forthcoming")
    p = PatientState(case)
    assert voice.reply(case, p.disclose("What's your favourite film?"), [], 1) in (
        "I'm not sure what you mean.",
        "Sorry, I don't follow — what do you want to know?",
        "I don't know how to answer that.",
    )
    p.disclose("How much do you drink?")
    assert voice.reply(case, p.disclose("How much do you drink?"), [], 3).startswith("Like I said,")


def test_arbitrary_text_never_raises():
    pieces = [
        "<assessment>",
        "</assessment>",
        "Differential:",
        "Triage:",
        "Management:",
        "urgent",
        "routine",
        "emergent",
        "1. MDD",
        "- CBT",
        "\n",
        "suicide",
        "plan",
        "voices",
        "drink",
        "family",
        "{",
        "}",
        "**",
        "<question>",
        "</question>",
        "I'm sorry",
        "?",
        "",
        "   ",
        "é",
        "\u2019",
    ]
    rng = random.Random(0)
    env = envs.make("intake", max_turns=6)
    for episode in range(40):
        env.reset(episode)
        done = False
        while not done:
            action = "".join(rng.choice(pieces) + rng.choice(["", " "]) for _ in range(rng.randint(0, 12)))
            obs, r, term, trunc, info = env.step(action)
            assert isinstance(obs, str) and obs and isinstance(r, float) and r == r
            done = term or trunc
        assert "rubric" in info


def test_the_simulators_api_key_never_lands_in_a_config_a_message_or_a_run_dir(stub_server, monkeypatch, tmp_path):
    """The key comes from the environment variable the config names; a key written in the
    config is refused; errors and the client's repr never show it; a run's config.yaml and
    checkpoint hold the variable's name only."""
    secret = "sk-do-not-leak-1234567890"
    monkeypatch.setenv("JAXAGENT_TEST_SIM_KEY", secret)
    spec = {"type": "openai", "base_url": stub_server, "model": "stub-model", "api_key_env": "JAXAGENT_TEST_SIM_KEY"}
    with pytest.raises(ValueError, match="does not go in the config") as err:
        envs.make("intake", simulator={**spec, "api_key": secret})
    assert secret not in str(err.value)
    with pytest.raises(ValueError, match="options") as err:  # a mistyped option
        envs.make("intake", simulator={**spec, "modle": "x"})
    assert secret not in str(err.value)
    with pytest.raises(ValueError, match="JAXAGENT_TEST_NO_SUCH_KEY.*is not set"):
        envs.make("intake", simulator={**spec, "api_key_env": "JAXAGENT_TEST_NO_SUCH_KEY"})
    env = envs.make("intake", simulator=spec)
    assert secret not in repr(env.simulator.generate) and "***" in repr(env.simulator.generate)
    env.reset(1)
    env.step("How is your sleep?")
    assert _Stub.requests[-1][1]["Authorization"] == f"Bearer {secret}"
    # a training run with this simulator: nothing under the run directory holds the key
    import pathlib

    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.trainer import Trainer

    root = pathlib.Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    cfg = load_config(
        TrainerConfig,
        root / "configs" / "tiny_countdown_grpo.yaml",
        [
            f"run_dir={run}",
            "env.name=intake",
            "iterations=1",
            "env.group_size=2",
            "env.tasks_per_iteration=1",
            "update.mini_batches=1",
            "rollout.max_turns=1",
            "rollout.max_tokens_per_turn=8",
            "rollout.max_context=2048",
            "env.num_workers=1",
            f"env.kwargs={{max_turns: 2, simulator: {{type: openai, base_url: '{stub_server}', model: stub-model, "
            "api_key_env: JAXAGENT_TEST_SIM_KEY}}",
        ],
    )
    Trainer(cfg, log=lambda *_: None).run()
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and (run / "config.yaml").read_text().count("JAXAGENT_TEST_SIM_KEY") == 1
    for p in files:
        assert secret.encode() not in p.read_bytes(), p


def _play_then_assess(env, seed, questions_or_expert, triage):
    """Reset `env` on `seed`, interview (the expert's questions, or the given ones), then
    give the expert's assessment with its triage line replaced by `triage`."""
    env.reset(seed)
    if questions_or_expert == "expert":
        while True:
            action = env.expert_action()
            if A.extract(action) is not None:
                break
            env.step(action)
    else:
        for q in questions_or_expert:
            env.step(q)
        action = Clinician().conclude(env)
    level = action.partition("\nTriage: ")[2].split("\n", 1)[0]
    return env.step(action.replace(f"\nTriage: {level}\n", f"\nTriage: {triage}\n"))


@pytest.mark.parametrize("cases", ["standard", "adversarial"])
def test_reading_bonus_pays_the_triage_of_what_was_elicited_outside_the_rubric(cases):
    r, full_agree, partial_lower = 0.06, 0, 0
    for seed in range(12):
        for interview in ("expert", [QUESTIONS["mood"][0], QUESTIONS["sleep"][0]]):
            got = {}
            for level in TRIAGE_LEVELS:
                _, rew_p, term_p, _, info_p = _play_then_assess(
                    envs.make("intake", cases=cases), seed, interview, level
                )
                _, rew, term, _, info = _play_then_assess(
                    envs.make("intake", cases=cases, shaping={"reading_bonus": r}), seed, interview, level
                )
                assert term and term_p
                assert info["rubric"] == info_p["rubric"] and info["heldout_rubric"] == info_p["heldout_rubric"]
                assert "reading_bonus" not in info_p
                assert rew - rew_p == pytest.approx(info["reading_bonus"], abs=1e-12)
                got[level] = (info["reading_bonus"], info["triage_elicited"], info)
            paid = [lv for lv, (b, _, _) in got.items() if b]
            # exactly one of the three levels is paid, r, and it is the level the info names
            assert len(paid) == 1 and got[paid[0]][0] == r and got[paid[0]][1] == paid[0]
            info = got[paid[0]][2]
            if interview == "expert" and not info["missed_domains"]:
                # everything required was elicited: the elicited level is the case's own,
                # which the case generator set from the hidden findings
                assert paid[0] == info["triage_reference"]
                full_agree += 1
            if interview != "expert" and info["triage_reference"] != "routine":
                # two questions and no risk screen: at most the case's level, lower where
                # the risk that sets it was never asked about
                assert TRIAGE_LEVELS.index(paid[0]) <= TRIAGE_LEVELS.index(info["triage_reference"])
                partial_lower += TRIAGE_LEVELS.index(paid[0]) < TRIAGE_LEVELS.index(info["triage_reference"])
    assert full_agree >= 3 and partial_lower >= 3  # both branches were exercised
    for bad in (-0.1, float("inf"), False, "0.1"):
        with pytest.raises(ValueError, match="shaping.reading_bonus"):
            envs.make("intake", shaping={"reading_bonus": bad})


@pytest.mark.parametrize("cases", ["standard", "adversarial"])
def test_reading_rate_scores_the_triage_against_what_the_interview_elicited(cases):
    """`reading_rate` / `under_reading_rate`: the given triage against the level of what
    was elicited. Where the expert's interview elicited every required domain, that level
    is the case's own (set by the case generator from the hidden findings), so the
    expected rates are counted here from `triage_reference` alone."""
    from envs.intake.eval import summarize

    infos, expect_read, expect_under = [], [], []
    for seed in range(10):
        for level in TRIAGE_LEVELS:
            _, _, term, _, info = _play_then_assess(envs.make("intake", cases=cases), seed, "expert", level)
            assert term and "reading_bonus" not in info and info["triage_elicited"] in TRIAGE_LEVELS
            if info["missed_domains"]:
                continue
            infos.append(info)
            ref = TRIAGE_LEVELS.index(info["triage_reference"])
            expect_read.append(TRIAGE_LEVELS.index(level) == ref)
            expect_under.append(TRIAGE_LEVELS.index(level) < ref)
    assert len(infos) >= 15 and 0 < sum(expect_under) < len(infos)
    got = summarize(infos, [True] * len(infos))
    assert got["reading_rate"] == pytest.approx(sum(expect_read) / len(infos), abs=1e-12)
    assert got["under_reading_rate"] == pytest.approx(sum(expect_under) / len(infos), abs=1e-12)
    # infos from before the field, and episodes that ended without an assessment, are left out
    old = {k: v for k, v in infos[0].items() if k != "triage_elicited"}
    assert "reading_rate" not in summarize([old], [True]) and "under_reading_rate" not in summarize([old], [True])
    env = envs.make("intake", cases=cases, max_turns=2)
    env.reset(0)
    env.step(QUESTIONS["mood"][0])
    *_, info = env.step(QUESTIONS["sleep"][0])
    assert "triage_elicited" not in info
    assert summarize([info, infos[0]], [False, True])["reading_rate"] == float(expect_read[0])


def test_reading_rate_tells_a_missed_risk_from_a_misread_one():
    """The weak clinician concludes by the expert's rules from what it elicited: on the
    adversarial set (risks only a direct question elicits) its under-triage is all in
    the interview, none in the reading; the expert reads every interview too."""
    s = evaluate("weak", cases="adversarial", episodes=24, seed=0)
    assert s["under_triage_rate"] > 0.5 and s["reading_rate"] == 1.0 and s["under_reading_rate"] == 0.0
    assert evaluate("expert", cases="adversarial", episodes=24, seed=0)["reading_rate"] == 1.0


def test_assessed_rubric_mean_leaves_out_the_interviews_that_never_concluded():
    """`assessed_rubric_mean` and `assessed_components` are over the episodes that ended
    with an assessment only, so a rise of `rubric_mean` can be split into interviews
    concluding at all and concluding better; absent when no episode concluded."""
    from envs.intake.eval import summarize

    env = envs.make("intake", cases="standard", max_turns=2)
    env.reset(3)
    env.step(QUESTIONS["mood"][0])
    *_, unfinished = env.step(QUESTIONS["mood"][0])  # out of turns: no assessment
    assert unfinished["triage_given"] is None
    env = envs.make("intake", cases="standard", max_turns=20)
    env.reset(5)
    env.step(QUESTIONS["mood"][0])
    *_, done_info = env.step(
        "<assessment>\nDifferential:\n1. major depressive disorder\nTriage: routine\n"
        "Management:\n- psychotherapy\n</assessment>"
    )
    assert done_info["triage_given"] == "routine"
    s = summarize([unfinished, done_info, done_info], [False, True, True])
    a, b = unfinished["rubric"]["total"], done_info["rubric"]["total"]
    assert a != b
    assert s["rubric_mean"] == pytest.approx((a + 2 * b) / 3, abs=1e-12)
    assert s["assessed_rubric_mean"] == pytest.approx(b, abs=1e-12)
    assert s["assessed_components"] == pytest.approx(
        {c: done_info["rubric"][c] for c in ("history", "differential", "triage", "management", "communication")},
        abs=1e-12,
    )
    assert s["assessment_rate"] == pytest.approx(2 / 3)
    none = summarize([unfinished], [False])
    assert "assessed_rubric_mean" not in none and "assessed_components" not in none
