"""jaxagent bench WORKLOAD: the repository's benchmarks from one command.

Each workload is a script of benchmarks/ (docs/results/benchmarks.md has what each
measures and its results), run with this Python and the options passed through; its
JSON lines go to stdout (and, with --out, are appended to that file):

    generate    W1  batched generation: jaxagent vs Tunix vs Hugging Face        w1_generate.py
    update      W2  one policy update (forward + backward + AdamW) vs PyTorch, Tunix   w2_model_step.py
    multiturn   W3  multi-turn rollouts with env steps between turns            w3_multiturn.py
    advantages  W4  the advantage kernels vs NumPy / PyTorch references         w4_advantages.py
    envpool     W5  EnvPool throughput and overhead                              w5_envpool.py
    overlap     W7  env steps overlapped with decoding (pipeline_groups)         w7_overlap.py
    iteration   W8  a whole GRPO iteration vs Tunix's GRPOLearner                w8_iteration.py
    rollout     W9  episodes of uneven latency: continuous vs turn-synchronous   w9_uneven.py
    lora        W10 a LoRA update of SmolLM2-135M vs PyTorch + peft              w10_lora_update.py
    ragged      W11 an update on episodes of uneven length: trimmed micro-batches  w11_ragged_update.py
    prompt      W12 a group's shared prompt prefilled once vs once per row       w12_shared_prompt.py
    gateway     W13 agent programs through the gateway vs the agent loop         w13_gateway.py
    device      --  the accelerator check, 8 minutes on one GPU: the device, the    device_check.py
                    accelerator tests, W6 against measured peaks, a recipe's iterations

--systems is for the workloads that compare systems (generate, update, multiturn,
iteration, lora); --small and --budget for the device check (--small, like --quick, is its
CPU smoke run), whose day-of-a-device command is

    jaxagent bench device --out benchmarks/results/device_check.jsonl

The benchmarks live in the repository, not in the installed package: this works from a
checkout (an editable install) and says so otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

#: workload -> its script in benchmarks/
WORKLOADS = {
    "generate": "w1_generate.py",
    "update": "w2_model_step.py",
    "multiturn": "w3_multiturn.py",
    "advantages": "w4_advantages.py",
    "envpool": "w5_envpool.py",
    "overlap": "w7_overlap.py",
    "iteration": "w8_iteration.py",
    "rollout": "w9_uneven.py",
    "lora": "w10_lora_update.py",
    "ragged": "w11_ragged_update.py",
    "prompt": "w12_shared_prompt.py",
    "gateway": "w13_gateway.py",
    "device": "device_check.py",
}
#: the workloads that take --systems, and its default for each
SYSTEMS = {
    "generate": "jaxagent,tunix,hf",
    "update": "jax,torch,tunix",
    "multiturn": None,
    "iteration": "jaxagent,tunix",
    "lora": "jax,peft",
}
DEFAULT_SYSTEMS = SYSTEMS["update"]


def benchmarks_dir() -> Path:
    """`<repo>/benchmarks` next to the `jaxagent` package of this checkout."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "workload",
        choices=sorted(WORKLOADS),
        help="generate (W1), update (W2), multiturn (W3), advantages (W4), envpool (W5), "
        "overlap (W7), iteration (W8), rollout (W9), lora (W10), ragged (W11), prompt (W12), "
        "gateway (W13), device (the accelerator check); see docs/results/benchmarks.md",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help="timed steps per system, interleaved (default 5; 3 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 2, few repeats")
    parser.add_argument("--out", metavar="JSONL", default=None, help="also append the JSON lines to this file")
    parser.add_argument(
        "--systems",
        default=None,
        help="generate, update, multiturn, iteration, lora: the comma list of systems to compare "
        "(default: the "
        f"script's; update: {DEFAULT_SYSTEMS}); a peer that is not installed is reported "
        "as skipped",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="device: the check's CPU smoke run (tiny shapes, a handful of tests; as --quick)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="device: the whole check's time budget (default 480; 300 with --small); each part "
        "gets a share and is stopped when it overruns",
    )


def command(args: argparse.Namespace) -> list[str]:
    """The benchmark's command line for parsed `args`."""
    cmd = [sys.executable, str(benchmarks_dir() / WORKLOADS[args.workload])]
    systems = args.systems if args.systems is not None else SYSTEMS.get(args.workload)
    if systems is not None:
        cmd += ["--systems", systems]
    if args.repeats is not None:
        cmd += ["--repeats", str(args.repeats)]
    if args.quick:
        cmd.append("--quick")
    if getattr(args, "small", False):
        cmd.append("--small")
    if getattr(args, "budget", None) is not None:
        cmd += ["--budget", str(args.budget)]
    if args.out:
        cmd += ["--out", str(Path(args.out).resolve())]
    return cmd


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; its exit status (2 with a message when it cannot be found)."""
    script = benchmarks_dir() / WORKLOADS[args.workload]
    if not script.is_file():
        print(
            f"jaxagent bench: error: {script} not found: the benchmarks are in the jaxagent repository, "
            "not in the installed package; run this from a checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    if args.repeats is not None and args.repeats < 1:
        print("jaxagent bench: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.systems is not None and args.workload not in SYSTEMS:
        print(
            f"jaxagent bench: error: the {args.workload} workload compares no systems: drop --systems "
            f"(it is for {', '.join(sorted(SYSTEMS))})",
            file=sys.stderr,
        )
        return 2
    device_only = [
        flag
        for flag, given in (
            ("--small", getattr(args, "small", False)),
            ("--budget", getattr(args, "budget", None) is not None),
        )
        if given
    ]
    if device_only and args.workload != "device":
        print(
            f"jaxagent bench: error: {' and '.join(device_only)} are for the device check "
            f"(jaxagent bench device), not {args.workload}",
            file=sys.stderr,
        )
        return 2
    if args.workload == "device" and args.repeats is not None:
        print(
            "jaxagent bench: error: the device check takes no --repeats (its parts are sized to its --budget)",
            file=sys.stderr,
        )
        return 2
    if args.workload == "device" and args.budget is not None and not args.budget > 0:
        print("jaxagent bench: error: --budget must be positive", file=sys.stderr)
        return 2
    return subprocess.run(command(args), cwd=script.parents[1]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxagent bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
