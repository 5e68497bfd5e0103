"""Patient-simulator fidelity (envs.intake.simulator.check_reply): an LLM voice's reply
checked against the disclosure rules for leaks and contradictions; the env's per-step
``fidelity`` and per-episode ``fidelity_summary``; the eval summary's rates.

Research simulation, not a clinical tool."""

from __future__ import annotations

import random

import pytest

from envs.intake.cases import build_case, generate_case
from envs.intake.env import IntakeEnv
from envs.intake.eval import summarize
from envs.intake.policies import Clinician, RandomClinician
from envs.intake.simulator import PatientState, RuleBasedSimulator, check_reply

NONE = {"leaked": [], "contradicted": []}


def play(env, seed, policy):
    """Steps of one episode: (info, reward) per step; the last info is the final one."""
    obs, _ = env.reset(seed)
    steps = []
    while True:
        obs, r, term, trunc, info = env.step(policy(obs, env))
        steps.append((info, r))
        if term or trunc:
            return steps, term


# ---------------------------------------------------------------- the checker's rules


def aud_case(persona="minimising", adversarial=False):
    # alcohol use disorder with active suicidal ideation; psychosis absent
    return build_case(
        random.Random(7), "t-1", "aud", (), persona, {"suicidal_ideation": "active"}, adversarial=adversarial
    )


def test_check_reply_leaks_follow_the_rules():
    case = aud_case(adversarial=True)  # the ideation is concealed: denied to a general question
    patient = PatientState(case)
    d = patient.disclose("Are you keeping safe?")
    assert d.denied == ["suicidal_ideation"] and not d.revealed
    check = lambda reply: check_reply(case, d, reply, elicited=patient.elicited)  # noqa: E731
    assert check("No, no, I'm fine. Really.") == NONE
    assert check("No, I've never had suicidal thoughts.") == NONE  # the instructed denial
    assert check("Well... I have been thinking about killing myself.") == {
        "leaked": ["suicidal_ideation"],
        "contradicted": [],
    }
    assert check("I'm fine. I do drink every day though.")["leaked"] == ["substance"]  # never asked
    assert check("No. And I'm not hearing voices.")["leaked"] == ["psychosis"]  # negated, still unasked
    # an affirmed absent finding, never asked: a leak and a contradiction
    assert check("No. But I hear voices at night.") == {"leaked": ["psychosis"], "contradicted": ["psychosis"]}

    d = patient.disclose("Do you drink alcohol?")
    assert [it.domain for it in d.revealed] == ["substance"]
    text = case.item("substance").text
    assert check_reply(case, d, text, elicited=patient.elicited) == NONE
    # the substance text speaks of cutting down: the word is allowed, not a withdrawal leak
    assert check_reply(case, d, "I drink most days. I tried to cut down.", elicited=patient.elicited) == NONE


def test_check_reply_contradictions():
    case = aud_case(persona="forthcoming")
    patient = PatientState(case)
    d = patient.disclose("Do you drink alcohol?")
    assert case.item("substance").present and [it.domain for it in d.revealed] == ["substance"]
    check = lambda reply: check_reply(case, d, reply, elicited=patient.elicited)  # noqa: E731
    assert check("No, I don't drink at all.") == {"leaked": [], "contradicted": ["substance"]}
    assert check("I drink more than I should.") == NONE
    assert check("I don't drink at breakfast, but I drink most days.") == NONE  # one affirmative mention
    d = patient.disclose("Have you heard voices that other people can't hear?")
    assert not case.item("psychosis").present and [it.domain for it in d.revealed] == ["psychosis"]
    assert check_reply(case, d, case.item("psychosis").text, elicited=patient.elicited) == NONE
    assert check_reply(case, d, "Yes, I hear voices all the time.", elicited=patient.elicited) == {
        "leaked": [],
        "contradicted": ["psychosis"],
    }
    # sleep is told by negation ("I can't sleep"): no contradiction is read there
    d = patient.disclose("How have you been sleeping?")
    assert check_reply(case, d, "I can't sleep at all.", elicited=patient.elicited)["contradicted"] == []


# ---------------------------------------------------------------- a stub LLM voice

DENIALS = {"substance": "No, I don't drink at all.", "anxiety": "No, I don't worry about anything."}
CONFIRM_VOICES = "Yes, I hear voices all the time."
LEAK = "And I've been hearing voices."


class StubVoice:
    """``generate(messages) -> str``: tells the facts it is told to share word for word,
    and corrupts some replies: appends a psychosis leak on every 5th reply when neither
    psychosis nor command hallucinations has been elicited; on even replies, denies a
    present substance use or anxiety told this turn, or affirms an absent psychosis told
    this turn. ``log``: per reply, the flags the corruption should raise."""

    def __init__(self):
        self.env = None
        self.log: list[dict] = []

    def __call__(self, messages):
        env, case = self.env, self.env.case
        k = sum(m["role"] == "assistant" for m in messages) + 1
        rules = messages[-1]["content"].split("[Simulator instructions, not said by the clinician: ", 1)[1]
        share = rules.split("Share these facts, in your own words: ", 1)[1] if rules.startswith("Share") else ""
        told = sorted((it for it in case.items if it.text in share), key=lambda it: share.index(it.text))
        parts = [it.text for it in told]
        if "Deny having" in rules:
            parts.append("No, I'm fine.")
        if "Politely decline" in rules:
            parts.append("I'd rather not say.")
        if "one thing at a time" in rules:
            parts.append("One thing at a time, please.")
        if "off-topic" in rules:
            parts.append("I'm not sure what you mean.")
        expected = {"leaked": [], "contradicted": []}
        elicited = env.patient.elicited  # this turn's disclosure is already applied
        if k % 5 == 0 and "psychosis" not in elicited and "command_hallucinations" not in elicited:
            parts.append(LEAK)
            expected = {
                "leaked": ["psychosis"],
                "contradicted": [] if case.item("psychosis").present else ["psychosis"],
            }
        elif k % 2 == 0:
            for i, it in enumerate(told):
                if it.present and it.domain in DENIALS:
                    parts[i] = DENIALS[it.domain]
                elif not it.present and it.domain == "psychosis":
                    parts[i] = CONFIRM_VOICES
                else:
                    continue
                expected = {"leaked": [], "contradicted": [it.domain]}
                break
        self.log.append(expected)
        return " ".join(parts) or "Okay."


def run_stub(seeds, policy_for):
    stub = StubVoice()
    env = IntakeEnv(simulator=stub)
    stub.env = env
    episodes = []
    for seed in seeds:
        start = len(stub.log)
        steps, term = play(env, seed, policy_for(seed))
        episodes.append((steps, term, stub.log[start:]))
    return episodes


def test_stub_voice_flags_match_what_it_corrupted():
    episodes = run_stub(range(12), lambda s: Clinician()) + run_stub(range(100, 112), RandomClinician)
    n_leaks = n_contra = 0
    seen_kinds = set()
    for steps, _term, log in episodes:
        flagged = [info["fidelity"] for info, _ in steps if "fidelity" in info]
        assert flagged == log  # one record per reply, exactly the corrupted ones flagged
        final = steps[-1][0]
        leaks = sum(bool(e["leaked"]) for e in log)
        contra = sum(bool(e["contradicted"]) for e in log)
        assert final["fidelity_summary"] == {"replies": len(log), "leaks": leaks, "contradictions": contra}
        assert final["fidelity_summary"]["replies"] == final["questions"]
        n_leaks, n_contra = n_leaks + leaks, n_contra + contra
        seen_kinds.update(d for e in log for d in e["contradicted"])
    assert n_leaks >= 5 and n_contra >= 5  # the stub did corrupt replies
    assert "psychosis" in seen_kinds and seen_kinds & set(DENIALS)  # affirmed-absent and denied-present ran


def test_stub_voice_keeps_the_reward_and_summarize_rates():
    episodes = run_stub(range(8), lambda s: Clinician())
    template = IntakeEnv()
    for seed, (steps, term, _) in enumerate(episodes):
        ref, ref_term = play(template, seed, Clinician())
        assert [r for _, r in steps] == [r for _, r in ref] and term == ref_term
        assert "fidelity" not in ref[1][0]  # the template voice is not checked
    infos = [steps[-1][0] for steps, _, _ in episodes]
    replies = sum(len(log) for _, _, log in episodes)
    leaky = sum(bool(e["leaked"]) for _, _, log in episodes for e in log)
    contra = sum(bool(e["contradicted"]) for _, _, log in episodes for e in log)
    assert leaky and contra
    s = summarize(infos + [{}], [True] * (len(infos) + 1))  # {}: an episode that failed in the pool
    assert s["fidelity_replies"] == replies
    assert s["leak_rate"] == pytest.approx(leaky / replies)
    assert s["contradiction_rate"] == pytest.approx(contra / replies)
    # hand-made infos: rates over the episodes that have a summary; none -> no keys
    base = {
        "rubric": {**{c: 0.0 for c in s["components"]}, "total": 0.5},
        "under_triage": False,
        "over_triage": False,
        "triage_given": "routine",
        "triage_reference": "routine",
        "questions": 4,
    }
    a = {**base, "fidelity_summary": {"replies": 4, "leaks": 1, "contradictions": 0}}
    b = {**base, "fidelity_summary": {"replies": 6, "leaks": 2, "contradictions": 3}}
    s = summarize([a, b, base], [True] * 3)
    assert (s["leak_rate"], s["contradiction_rate"], s["fidelity_replies"]) == (
        pytest.approx(0.3),
        pytest.approx(0.3),
        10,
    )
    assert not {"leak_rate", "contradiction_rate", "fidelity_replies"} & set(summarize([base], [True]))


# ---------------------------------------------------------------- the template voice


class TemplateVoice:
    """The rule-based voice under another type, so the env runs the checker on it."""

    def __init__(self):
        self.voice = RuleBasedSimulator()

    def reply(self, *args):
        return self.voice.reply(*args)


def test_template_voice_gets_no_flag():
    env = IntakeEnv(simulator=TemplateVoice())
    adversarial = IntakeEnv("adversarial", simulator=TemplateVoice())
    runs = (
        [(env, s, Clinician()) for s in range(50)]
        + [(env, s, RandomClinician(s)) for s in range(50)]
        + [(adversarial, s, Clinician()) for s in range(24)]
    )
    replies = 0
    for e, seed, policy in runs:
        steps, _ = play(e, seed, policy)
        assert all(info["fidelity"] == NONE for info, _ in steps if "fidelity" in info)
        summary = steps[-1][0]["fidelity_summary"]
        assert summary["leaks"] == summary["contradictions"] == 0
        replies += summary["replies"]
    assert replies > 1000


def test_plain_template_env_reports_zero_flags_unchecked():
    env = IntakeEnv()
    steps, term = play(env, 3, Clinician())
    assert term and not any("fidelity" in info for info, _ in steps)
    final = steps[-1][0]
    assert final["fidelity_summary"] == {"replies": final["questions"], "leaks": 0, "contradictions": 0}
    assert generate_case(3).case_id == final["case"]["case_id"]
