"""Command line: ``jaxagent <command>`` (also ``python -m jaxagent``)."""

from __future__ import annotations

import argparse
import sys

TRAINER_PENDING = (
    "jaxagent train: the trainer (rollout + update loop) is not built yet; it lands with\n"
    "the trainer issue. What works today: the RL kernels in `jaxagent.algos`\n"
    "(see README.md) and their tests (`make test`)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxagent", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("train", help="train an agent (the embedded default demo without --config)")
    sub.add_parser("envs", help="list the environments envs.make knows")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "train":
        print(TRAINER_PENDING)
        return 0
    if args.command == "envs":
        import envs

        for name in envs.known_envs():
            if name.startswith("testing/"):
                continue   # fault-injection envs for the pool's own tests
            print(name)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
