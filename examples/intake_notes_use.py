"""Does an intake policy read the clinician's notes? For every question turn of the
stored training episodes (`RUN_DIR/episodes/iter_N.jsonl`, runs with
`env.kwargs.notes=true`), the domain it asked is compared with the checklist the
observation before it ended with (`To ask: ...`): how often it is the list's first
item, and how often it is on the list at all (a domain not on it was answered
already, or is a follow-up whose finding was never told).

    python examples/intake_notes_use.py runs/cnotes_s0 runs/notes_s0 --iterations 1 20

Prints one line per run and iteration. A research simulation, not a clinical tool.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from envs.intake.env import NOTE_LABELS
from envs.intake.policies import QUESTIONS

_LIST = re.compile(r"To ask: ([^.]*)\.")
_LABEL_DOMAIN = {label: dom for dom, label in NOTE_LABELS.items()}


def checklist(observation: str) -> list[str] | None:
    """The domains of the observation's last `To ask:` line (None: it has none)."""
    found = _LIST.findall(observation)
    if not found:
        return None
    return [] if found[-1] == "nothing" else [_LABEL_DOMAIN[w] for w in found[-1].split()]


def asked_domain(action: str) -> str | None:
    """The domain of a scripted question (either wording), or None (an assessment, or
    text that is not exactly one of the scripted questions)."""
    text = action.replace("<|im_end|>", "").strip()
    hits = [d for d, pair in QUESTIONS.items() if any(text.endswith(q) for q in pair)]
    return hits[0] if len(hits) == 1 else None


def count(pairs) -> dict:
    """`pairs`: (observation, action) of question turns, in order. Returns the counts
    of scripted questions read against the list before them."""
    out = {"questions": 0, "first": 0, "listed": 0}
    for observation, action in pairs:
        todo, dom = checklist(observation), asked_domain(action)
        if todo is None or dom is None:
            continue
        out["questions"] += 1
        out["first"] += bool(todo) and dom == todo[0]
        out["listed"] += dom in todo
    return out


def episode_pairs(episode: dict):
    """(observation, action) for each policy turn of a stored episode (its segments)."""
    last = ""
    for seg in episode["segments"]:
        if seg["kind"] == "policy":
            yield last, seg["text"]
        else:
            last = seg["text"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--iterations", nargs="+", type=int, default=[1])
    args = ap.parse_args(argv)
    for run in args.runs:
        for it in args.iterations:
            path = run / "episodes" / f"iter_{it:06d}.jsonl"
            if not path.is_file():
                print(f"{path}: no stored episodes (logging.episodes_per_iteration, or the iteration)", file=sys.stderr)
                return 2
            total = count(pair for line in path.read_text().splitlines() for pair in episode_pairs(json.loads(line)))
            n = total["questions"]
            if not n:
                print(f"{run} iteration {it}: no question read against a checklist (was env.kwargs.notes on?)")
                continue
            print(
                f"{run} iteration {it}: {n} questions | first item {total['first'] / n:.2f} | "
                f"on the list {total['listed'] / n:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
