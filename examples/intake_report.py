"""The intake recipe's report: standard cases before and after RL (from each run's
summary.json) and the 24 adversarial cases before (checkpoint 0, the warm start) and
after RL (the last checkpoint), sampled and greedy.

    python examples/intake_report.py runs/intake_s0 runs/intake_s1 runs/intake_s2 [--out report.jsonl]

Prints one markdown table per measure and, with --out, one JSON line per run. A research
simulation, not a clinical tool.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMPONENTS = ("history", "differential", "triage", "management", "communication")


def adversarial(run_dir: Path, step: int | None, temperature: float) -> dict:
    from jaxagent.train.evaluate import evaluate_run

    res = evaluate_run(
        run_dir,
        step=step,
        episodes=24,
        temperature=temperature,
        overrides=["env.kwargs.cases=adversarial"],
        log=lambda *_: None,
    )
    return res["env_summary"]


def report(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    out = {"run_dir": str(run_dir)}
    for when in ("before_rl", "after_rl"):
        for suffix, temp in (("", 1.0), ("_greedy", 0.0)):
            out[f"standard_{when}{suffix}"] = s[f"eval_{when}{suffix}"]["env_summary"]
            out[f"adversarial_{when}{suffix}"] = adversarial(run_dir, 0 if when == "before_rl" else None, temp)
    return out


def fmt(x) -> str:
    return f"{x:.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [report(d) for d in args.run_dir]
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode in ("", "_greedy"):
        label = "greedy" if mode else "sampled (temperature 1)"
        print(f"\nstandard cases (held-out), {label}: rubric and components, before -> after RL")
        print("| run | rubric | " + " | ".join(COMPONENTS) + " |")
        print("|---|---|" + "---|" * len(COMPONENTS))
        for r in rows:
            b, a = r[f"standard_before_rl{mode}"], r[f"standard_after_rl{mode}"]
            cells = [f"{fmt(b['rubric_mean'])} -> {fmt(a['rubric_mean'])}"]
            cells += [f"{fmt(b['components'][c])} -> {fmt(a['components'][c])}" for c in COMPONENTS]
            print(f"| {Path(r['run_dir']).name} | " + " | ".join(cells) + " |")
        print(f"\nstandard cases (held-out), {label}: the interviews that concluded, before -> after RL")
        print("| run | assessment rate | rubric of those | triage component of those |")
        print("|---|---|---|---|")
        for r in rows:
            b, a = r[f"standard_before_rl{mode}"], r[f"standard_after_rl{mode}"]
            cells = [f"{fmt(b['assessment_rate'])} -> {fmt(a['assessment_rate'])}"]
            cells += [
                f"{fmt(b[k][c] if c else b[k])} -> {fmt(a[k][c] if c else a[k])}" if k in b and k in a else "n/a"
                for k, c in (("assessed_rubric_mean", None), ("assessed_components", "triage"))
            ]
            print(f"| {Path(r['run_dir']).name} | " + " | ".join(cells) + " |")
        print(f"\nadversarial set (24 cases), {label}, before -> after RL")
        print(
            "| run | rubric | under-triage | over-triage | assessment rate | held-out scorer | risk coverage "
            "| reading | under-reading |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            b, a = r[f"adversarial_before_rl{mode}"], r[f"adversarial_after_rl{mode}"]
            cells = [
                f"{fmt(b[k])} -> {fmt(a[k])}" if k in b and k in a else "n/a"
                for k in (
                    "rubric_mean",
                    "under_triage_rate",
                    "over_triage_rate",
                    "assessment_rate",
                    "heldout_rubric_mean",
                    "risk_coverage",
                    "reading_rate",
                    "under_reading_rate",
                )
            ]
            print(f"| {Path(r['run_dir']).name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
