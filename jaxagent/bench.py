"""`jaxagent bench update`: the W2 policy-update benchmark, run from the repository.

Runs `benchmarks/w2_model_step.py` (W2 of `benchmarks/README.md`: one GRPO/PPO update of the tiny
Qwen2, forward + backward + AdamW, jaxagent vs PyTorch vs Tunix on the same weights and
batch) with this Python, passing the options through; its JSON lines go to stdout (and,
with `--out`, are appended to that file). The benchmarks live in the repository, not in
the installed package: this works from a checkout (an editable install) and says so
otherwise.

    jaxagent bench update [--repeats N] [--quick] [--out JSONL] [--systems jax,torch,tunix]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

WORKLOADS = {"update": "w2_model_step.py"}
DEFAULT_SYSTEMS = "jax,torch,tunix"


def benchmarks_dir() -> Path:
    """`<repo>/benchmarks` next to the `jaxagent` package of this checkout."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=sorted(WORKLOADS),
                        help="update: W2, one policy update (forward + backward + AdamW) of the tiny Qwen2")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help="timed steps per system, interleaved (default 5; 3 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 2, few repeats")
    parser.add_argument("--out", metavar="JSONL", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help=f"comma list of jax, torch, tunix (default {DEFAULT_SYSTEMS}); "
                             "a peer that is not installed is reported as skipped")


def command(args: argparse.Namespace) -> list[str]:
    """The benchmark's command line for parsed `args`."""
    cmd = [sys.executable, str(benchmarks_dir() / WORKLOADS[args.workload]), "--systems", args.systems]
    if args.repeats is not None:
        cmd += ["--repeats", str(args.repeats)]
    if args.quick:
        cmd.append("--quick")
    if args.out:
        cmd += ["--out", str(Path(args.out).resolve())]
    return cmd


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; its exit status (2 with a message when it cannot be found)."""
    script = benchmarks_dir() / WORKLOADS[args.workload]
    if not script.is_file():
        print(f"jaxagent bench: error: {script} not found: the benchmarks are in the jaxagent repository, "
              "not in the installed package; run this from a checkout (pip install -e .)", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print("jaxagent bench: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    return subprocess.run(command(args), cwd=script.parents[1]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxagent bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
