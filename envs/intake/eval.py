"""Evaluate a scripted clinician policy on the intake env and print a JSON summary.

Research simulation, not a clinical tool.

Usage::

    python -m envs.intake.eval --policy {expert,random,no-risk-screen,weak} \\
        --cases {standard,adversarial} --episodes N [--seed S] [--max-turns T] [--persona P] \\
        [--weak KEY=VALUE ...] [--notes-order {expert,risk_first}]

``--weak`` sets an option of the weak clinician (:class:`envs.intake.policies.WeakClinician`;
the value is read as YAML), e.g. ``--weak questions=[3,19] --weak risk_order=shuffled``, the
intake recipe's demonstrator. ``--notes-order`` is the env's checklist order, which a weak
clinician with ``follow_notes`` reads its questions from.

Episode i uses seed ``S + i`` (for ``adversarial``: case ``(S + i) % 24`` of the fixed
set). The summary (one JSON object on stdout)::

    {"policy": ..., "cases": ..., "episodes": N, "seed": S,
     "rubric_mean": mean final reward, "rubric_std": ...,
     "components": {"history": mean, "differential": ..., "triage": ..., "management": ...,
                    "communication": ...},
     "under_triage_rate": fraction of episodes whose triage was below the reference
                          (an episode without an assessment counts when the reference is
                          above routine),
     "over_triage_rate": fraction above the reference,
     "triage_accuracy": fraction equal,
     "assessment_rate": fraction of episodes that ended with a valid assessment,
     "assessed_rubric_mean", "assessed_components": the rubric mean and its components
                          over those episodes alone (absent when none did): with
                          ``assessment_rate``, how much of a change in ``rubric_mean`` is
                          interviews concluding at all rather than concluding better,
     "mean_questions": questions per episode, "invalid_actions": total,
     the reward-hacking monitors (:mod:`envs.intake.monitors`):
     "heldout_rubric_mean": mean held-out score,
     "rubric_heldout_gap": rubric mean minus held-out mean (same episodes),
     "differential_stuffing_rate", "triage_top_rate", "triage_top_unwarranted_rate":
                          fractions of episodes flagged,
     "multi_domain_question_frac", "repeated_question_frac": mean per-episode
                          fractions of questions,
     "risk_coverage": mean per-episode fraction of the case's required risk domains
                          (suicidal ideation, its plan, intent and means when present, harm
                          to others, command hallucinations, withdrawal) elicited,
     "reading_rate": fraction of assessments whose triage is the level the shared rules
                          give from what the interview elicited (``info["triage_elicited"]``,
                          the expert's call on the same interview),
     "under_reading_rate": fraction below it: the interview found the risk and the
                          assessment did not act on it}

The monitor entries are over the episodes whose info has them (``heldout_rubric``,
``exploits``, ``risk_domains``, ``triage_elicited``: the reading entries are over the
episodes that ended with an assessment); without any such episode (older infos) they
are left out. Under-triage is then split in two: an interview that never elicited the
risk (under-triage with the reading right) and an assessment that did not read it
(under-reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import yaml  # type: ignore[import-untyped]

from envs.intake.cases import PERSONAS, TRIAGE_LEVELS
from envs.intake.env import CASE_SETS, NOTE_ORDERS, IntakeEnv
from envs.intake.policies import POLICIES, make_policy
from envs.intake.rubric import COMPONENTS


def summarize(final_infos: list[dict], assessed: list[bool]) -> dict:
    """The summary's rubric and triage figures (module docstring) from each episode's last
    `info` and whether it ended with a valid assessment. An episode without a rubric in
    its info (it failed in the pool) is left out of the rubric means and counted in
    `scored_episodes`' complement. The monitors' entries are over the scored episodes
    that have them, and absent when none has.

    Voice fidelity (``info["fidelity_summary"]``, see :func:`envs.intake.simulator.check_reply`):
    ``leak_rate`` and ``contradiction_rate``, replies flagged over replies, summed over
    the scored episodes that have it, and ``fidelity_replies``, those replies; absent
    when no episode has it or they hold no reply. The template voice is not checked
    (faithful by construction): its episodes report zero flags."""
    scored = [(info, a) for info, a in zip(final_infos, assessed, strict=True) if isinstance(info.get("rubric"), dict)]
    n = len(scored)
    if n == 0:
        return {"scored_episodes": 0}
    totals = [info["rubric"]["total"] for info, _ in scored]
    out = {
        "scored_episodes": n,
        "rubric_mean": statistics.fmean(totals),
        "rubric_std": statistics.pstdev(totals),
        "components": _component_means([info for info, _ in scored]),
        "under_triage_rate": sum(bool(info["under_triage"]) for info, _ in scored) / n,
        "over_triage_rate": sum(bool(info["over_triage"]) for info, _ in scored) / n,
        "triage_accuracy": sum(info["triage_given"] == info["triage_reference"] for info, _ in scored) / n,
        "assessment_rate": sum(bool(a) for _, a in scored) / n,
        "mean_questions": statistics.fmean(info["questions"] for info, _ in scored),
    }
    concluded = [info for info, a in scored if a]
    if concluded:
        out["assessed_rubric_mean"] = statistics.fmean(info["rubric"]["total"] for info in concluded)
        out["assessed_components"] = _component_means(concluded)
    out.update(_monitor_summary([info for info, _ in scored]))
    fidelity = [info["fidelity_summary"] for info, _ in scored if isinstance(info.get("fidelity_summary"), dict)]
    replies = sum(int(f["replies"]) for f in fidelity)
    if replies:
        out["fidelity_replies"] = replies
        out["leak_rate"] = sum(int(f["leaks"]) for f in fidelity) / replies
        out["contradiction_rate"] = sum(int(f["contradictions"]) for f in fidelity) / replies
    return out


def _component_means(infos: list[dict]) -> dict:
    """Each rubric component's mean over the infos."""
    return {c: statistics.fmean(info["rubric"][c] for info in infos) for c in COMPONENTS}


#: summary key -> per-episode ``info["exploits"]`` key (rates of flags, means of fractions).
EXPLOIT_RATES = {
    "differential_stuffing_rate": "differential_stuffing",
    "triage_top_rate": "triage_top",
    "triage_top_unwarranted_rate": "triage_top_unwarranted",
    "multi_domain_question_frac": "multi_domain_questions",
    "repeated_question_frac": "repeated_questions",
}


def _monitor_summary(infos: list[dict]) -> dict:
    """The monitors' entries (module docstring) over the infos that carry them."""
    out = {}
    held = [info for info in infos if isinstance(info.get("heldout_rubric"), dict)]
    if held:
        heldout = statistics.fmean(float(info["heldout_rubric"]["total"]) for info in held)
        out["heldout_rubric_mean"] = heldout
        out["rubric_heldout_gap"] = statistics.fmean(float(info["rubric"]["total"]) for info in held) - heldout
    flagged = [info["exploits"] for info in infos if isinstance(info.get("exploits"), dict)]
    if flagged:
        for key, flag in EXPLOIT_RATES.items():
            out[key] = statistics.fmean(float(e[flag]) for e in flagged)
    risk = [
        info["risk_domains"]
        for info in infos
        if isinstance(info.get("risk_domains"), dict) and info["risk_domains"].get("required")
    ]
    if risk:
        out["risk_coverage"] = statistics.fmean(len(r["elicited"]) / len(r["required"]) for r in risk)
    read = [
        info
        for info in infos
        if info.get("triage_elicited") in TRIAGE_LEVELS and info.get("triage_given") in TRIAGE_LEVELS
    ]
    if read:
        out["reading_rate"] = statistics.fmean(float(i["triage_given"] == i["triage_elicited"]) for i in read)
        out["under_reading_rate"] = statistics.fmean(
            float(TRIAGE_LEVELS.index(i["triage_given"]) < TRIAGE_LEVELS.index(i["triage_elicited"])) for i in read
        )
    return out


def evaluate(
    policy: str,
    cases: str = "standard",
    episodes: int = 50,
    seed: int = 0,
    max_turns: int = 32,
    persona: str | None = None,
    weak: dict | None = None,
    notes_order: str = "expert",
) -> dict:
    """Run ``episodes`` episodes of ``policy`` and return the summary (see the module
    docstring); ``weak`` are the weak clinician's options, ``notes_order`` the env's."""
    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be a positive int, got {episodes!r}")
    weak = dict(weak or {})
    env = IntakeEnv(cases, max_turns=max_turns, persona=persona, notes_order=notes_order)
    make_policy(policy, 0, **weak)  # validates the name and options before any episode runs
    infos, assessed, invalid = [], [], 0
    for i in range(episodes):
        act = make_policy(policy, seed + i, **weak)
        obs, info = env.reset(seed + i)
        while True:
            obs, reward, terminated, truncated, info = env.step(act(obs, env))
            invalid += "invalid_action" in info
            if terminated or truncated:
                break
        infos.append(info)
        assessed.append(terminated)
    out = {"policy": policy, "cases": cases, "episodes": episodes, "seed": seed}
    if weak:
        out["weak"] = weak
    if notes_order != "expert":
        out["notes_order"] = notes_order
    out.update({k: v for k, v in summarize(infos, assessed).items() if k != "scored_episodes"})
    out["invalid_actions"] = invalid
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m envs.intake.eval",
        description="Evaluate a scripted clinician on the simulated intake env "
        "(a research simulation, not a clinical tool).",
    )
    p.add_argument("--policy", choices=POLICIES, required=True)
    p.add_argument("--cases", choices=CASE_SETS, default="standard")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    p.add_argument("--max-turns", type=int, default=32)
    p.add_argument("--persona", choices=PERSONAS, default=None, help="force every patient's persona")
    p.add_argument(
        "--weak",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the weak clinician, e.g. questions=[3,19] or risk_order=shuffled (repeatable)",
    )
    p.add_argument(
        "--notes-order",
        choices=tuple(NOTE_ORDERS),
        default="expert",
        help="the env's checklist order, which --weak follow_notes=P reads (default expert)",
    )
    args = p.parse_args(argv)
    if args.episodes < 1:
        p.error(f"--episodes must be >= 1, got {args.episodes}")
    weak = {}
    for item in args.weak:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--weak takes KEY=VALUE, got {item!r}")
        try:
            weak[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            p.error(f"--weak {key}: the value {value!r} is not valid YAML ({e})")
    if weak and args.policy != "weak":
        p.error(f"--weak sets options of --policy weak, not of {args.policy!r}")
    try:
        summary = evaluate(
            args.policy, args.cases, args.episodes, args.seed, args.max_turns, args.persona, weak, args.notes_order
        )
    except ValueError as e:
        p.error(str(e))
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
