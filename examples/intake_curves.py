"""The intake recipe's comparison and monitor figures, from the runs' metrics.jsonl and
summary.json (nothing is re-evaluated).

    python examples/intake_curves.py turn-credit --iterations 10 \\
        --arm grpo=runs/intake_s0,runs/intake_s1,runs/intake_s2 \\
        --arm turn_loo=runs/intake_loo_s0,runs/intake_loo_s1,runs/intake_loo_s2 \\
        --arm turn_gae=runs/intake_gae_s0,runs/intake_gae_s1,runs/intake_gae_s2 \\
        --out docs/assets/intake_turn_credit.png
    python examples/intake_curves.py monitors runs/intake_s0 runs/intake_s1 runs/intake_s2 \\
        --out docs/assets/intake_monitors.png

`turn-credit`: the held-out rubric (128 standard cases, sampled and greedy) at iteration
0 and every evaluation up to `--iterations`, one line per arm (the mean over its seeds,
each seed a faint line), and a markdown table at that iteration. A run longer than
`--iterations` contributes its first `--iterations` iterations (the recipe's learning
rate is constant after warm-up, so they are what a run of that length does).

`monitors`: the reward-hacking monitors of every iteration's training episodes: the
training rubric against the held-out scorer, their gap, the exploit counters and, where
the runs have it, the input dependence of the responses (template collapse).
A research simulation, not a clinical tool.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

MEASURES = ("rubric_mean", "heldout_rubric_mean", "under_triage_rate", "over_triage_rate", "assessment_rate")


def read(run_dir: Path) -> tuple[list[dict], dict]:
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return metrics, summary


def evaluations(run_dir: Path, upto: int, greedy: bool) -> dict[int, dict]:
    """{iteration: the env summary of the held-out evaluation then} for iterations <= upto."""
    metrics, summary = read(run_dir)
    sfx = "_greedy" if greedy else ""
    pre = "eval_greedy_env_" if greedy else "eval_env_"
    out = {0: summary[f"eval_before_rl{sfx}"]["env_summary"]}
    for m in metrics:
        if m["iteration"] <= upto and f"{pre}rubric_mean" in m:
            out[m["iteration"]] = {k: m[f"{pre}{k}"] for k in MEASURES if f"{pre}{k}" in m}
    last = summary.get("iterations_at_eval", metrics[-1]["iteration"] if metrics else 0)
    if last <= upto and f"eval_after_rl{sfx}" in summary:
        out[last] = summary[f"eval_after_rl{sfx}"]["env_summary"]
    return out


def seconds_per_iteration(run_dir: Path, upto: int) -> float:
    metrics, _ = read(run_dir)
    return float(np.mean([m["time_iteration_s"] for m in metrics if m["iteration"] <= upto]))


def turn_credit(arms: dict[str, list[Path]], upto: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    rows = []
    # strict=False: the palette may have more colours than there are arms
    for color, (name, runs) in zip(("C0", "C1", "C2", "C3", "C4"), arms.items(), strict=False):
        row = {"arm": name, "seeds": len(runs)}
        for ax, greedy in zip(axes, (False, True), strict=True):
            per_seed = [evaluations(r, upto, greedy) for r in runs]
            steps = sorted(set.intersection(*(set(e) for e in per_seed)))
            for e in per_seed:
                ax.plot(steps, [e[s]["rubric_mean"] for s in steps], color=color, alpha=0.25, lw=1)
            mean = [float(np.mean([e[s]["rubric_mean"] for e in per_seed])) for s in steps]
            ax.plot(steps, mean, color=color, lw=2.2, marker="o", label=f"{name} ({len(runs)} seeds)")
            key = "greedy" if greedy else "sampled"
            if steps[-1] != upto:
                raise SystemExit(f"{name}: not every run has an evaluation at iteration {upto} (have {steps})")
            for k in MEASURES:
                row[f"{key}_{k}_0"] = float(np.mean([e[0][k] for e in per_seed]))
                row[f"{key}_{k}"] = float(np.mean([e[upto][k] for e in per_seed]))
            row[f"{key}_rubric_per_seed"] = [round(e[upto]["rubric_mean"], 3) for e in per_seed]
        row["s_per_iteration"] = float(np.mean([seconds_per_iteration(r, upto) for r in runs]))
        rows.append(row)
    for ax, title in zip(axes, ("sampled (temperature 1)", "greedy"), strict=True):
        ax.set_title(f"held-out rubric, 128 standard cases, {title}")
        ax.set_xlabel("RL iteration (64 interviews each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rubric")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"intake: turn-level credit against GRPO, same warm start, {upto} iterations")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    print(f"\nheld-out standard cases, iteration 0 -> {upto} (mean over seeds)")
    print(
        "| estimator | rubric sampled | rubric greedy | per seed (sampled / greedy) | held-out scorer sampled "
        "| under-triage sampled | over-triage sampled | s / iteration |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:

        def ch(k, r=r):
            return f"{r[k + '_0']:.3f} -> {r[k]:.3f}"

        print(
            f"| {r['arm']} | {ch('sampled_rubric_mean')} | {ch('greedy_rubric_mean')} | "
            f"{r['sampled_rubric_per_seed']} / {r['greedy_rubric_per_seed']} | {ch('sampled_heldout_rubric_mean')} | "
            f"{ch('sampled_under_triage_rate')} | {ch('sampled_over_triage_rate')} | {r['s_per_iteration']:.1f} |"
        )


MONITORS = (
    ("training rubric vs held-out scorer", ("train_env_rubric_mean", "train_env_heldout_rubric_mean")),
    ("rubric - held-out scorer", ("train_env_rubric_heldout_gap",)),
    ("emergent triage (all / unwarranted)", ("train_env_triage_top_rate", "train_env_triage_top_unwarranted_rate")),
    ("differential stuffing (5+ conditions)", ("train_env_differential_stuffing_rate",)),
    ("questions hitting 3+ domains", ("train_env_multi_domain_question_frac",)),
    ("repeated questions", ("train_env_repeated_question_frac",)),
    ("input dependence (template collapse)", ("input_dependence",)),
)


def monitors(runs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [read(r)[0] for r in runs]
    panels = [(t, keys) for t, keys in MONITORS if any(k in m for d in data for m in d for k in keys)]
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):  # the grid may have spare (hidden) axes
        for ls, key in zip(("-", "--"), keys, strict=False):  # a panel has one or two keys, two line styles
            # strict=False: the palette may have more colours than there are runs (one data per run)
            for color, run, d in zip(("C0", "C1", "C2", "C3", "C4", "C5"), runs, data, strict=False):
                pts = [(m["iteration"], m[key]) for m in d if key in m]
                if pts:
                    x, y = zip(*pts, strict=True)
                    ax.plot(x, y, ls, color=color, lw=1.4, label=f"{run.name} {key.replace('train_env_', '')}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=6)
    fig.suptitle("intake: reward-hacking monitors on the training interviews, per iteration")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    tc = sub.add_parser("turn-credit")
    tc.add_argument("--arm", action="append", required=True, help="NAME=RUN_DIR,RUN_DIR,...")
    tc.add_argument("--iterations", type=int, default=10)
    tc.add_argument("--out", type=Path, default=Path("docs/assets/intake_turn_credit.png"))
    mo = sub.add_parser("monitors")
    mo.add_argument("run_dir", nargs="+", type=Path)
    mo.add_argument("--out", type=Path, default=Path("docs/assets/intake_monitors.png"))
    args = p.parse_args(argv)
    if args.what == "turn-credit":
        arms = {}
        for spec in args.arm:
            name, _, dirs = spec.partition("=")
            if not name or not dirs:
                p.error(f"--arm wants NAME=RUN_DIR[,RUN_DIR...], got {spec!r}")
            arms[name] = [Path(d) for d in dirs.split(",")]
            missing = [str(d) for d in arms[name] if not (d / "summary.json").exists()]
            if missing:
                p.error(f"--arm {name}: no summary.json in {', '.join(missing)} (is the run finished?)")
        turn_credit(arms, args.iterations, args.out)
    else:
        monitors(args.run_dir, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
