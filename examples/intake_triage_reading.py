"""Does an intake policy read an interview into its triage?

For held-out cases (seeds from 2,000,000, never trained on), a scripted clinician holds
the interview (the expert by default: it asks every domain and follows every admitted
risk up); its assessment is cut after the triage level, and the policy scores the three
versions that differ only in that level (routine, urgent, emergent): the sum of the
log-probabilities of the assessment's tokens, in the agent loop's token layout. The
reference is the clinician's own level, which the shared rules
(``envs.intake.cases.triage_level``) give from what the interview elicited, so a policy
that reads the interview puts most of its probability on it. The interview is the
clinician's, not the policy's: this measures the reading alone, not whether the policy
would have asked.

    python examples/intake_triage_reading.py runs/concl_ws0 runs/bal_ws0 [--episodes 96] [--notes]
        [--notes-order risk_first] [--out F.jsonl]

Each MODEL is an exported directory (``jaxagent export RUN_DIR OUT --step N``). Prints
one line per model: the accuracy of the most probable level, the mean probability on the
reference level, and, per reference level, how often each level is the most probable
(a confusion matrix); with --out, one JSON line per model. A research simulation, not a
clinical tool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from envs.intake.cases import TRIAGE_LEVELS as LEVELS  # low to high
from envs.intake.env import NOTE_ORDERS


def cut_after_triage(assessment: str, level: str) -> str:
    """The assessment up to its triage line, with `level` as the level (nothing after)."""
    head, sep, _ = assessment.partition("\nTriage: ")
    if not sep:
        raise ValueError(f"the clinician's assessment has no triage line: {assessment!r}")
    return f"{head}\nTriage: {level}"


def reference_level(assessment: str) -> str:
    level = assessment.partition("\nTriage: ")[2].split("\n", 1)[0].strip()
    if level not in LEVELS:
        raise ValueError(f"the clinician's triage level {level!r} is not one of {LEVELS}")
    return level


def score(model_dir: str, demos, max_context: int, batch: int = 24) -> np.ndarray:
    """`[len(demos), 3]` log-probabilities of each triage version, in LEVELS order."""
    import jax
    import jax.numpy as jnp

    from jaxagent.models.hf import load_pretrained
    from jaxagent.models.logprobs import token_logprobs
    from jaxagent.models.tokenizer import load_tokenizer
    from jaxagent.rollout.chat import ChatFormat
    from jaxagent.train.warmstart import demonstration_tokens

    model = load_pretrained(model_dir)
    chat = ChatFormat(load_tokenizer(model_dir))
    rows = []
    for d in demos:
        for level in LEVELS:
            variant = dataclasses.replace(d, actions=d.actions[:-1] + [cut_after_triage(d.actions[-1], level)])
            tokens, mask = demonstration_tokens(chat, variant, max_context)
            if not any(mask):
                raise ValueError(f"seed {d.seed}: the assessment lies past max_context {max_context}")
            mask[len(mask) - 1 - mask[::-1].index(1)] = 0  # the end-of-turn token: the cut is not an end
            rows.append((tokens, mask))
    width = -(-max(len(t) for t, _ in rows) // 64) * 64
    logp_fn = jax.jit(lambda p, t, a: token_logprobs(p, model.config, t, attention_mask_BxT=a)[0])
    out = []
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        chunk = chunk + [chunk[-1]] * (batch - len(chunk))  # one compiled shape
        tok = np.zeros((batch, width), np.int32)
        msk = np.zeros((batch, width), np.float32)
        att = np.zeros((batch, width), np.int32)
        for j, (t, m) in enumerate(chunk):
            tok[j, : len(t)], msk[j, : len(m)], att[j, : len(t)] = t, m, 1
        lp = np.asarray(logp_fn(model.params, jnp.asarray(tok), jnp.asarray(att)))
        out.extend((lp * msk).sum(axis=1)[: min(batch, len(rows) - i)])
    return np.asarray(out, np.float64).reshape(len(demos), len(LEVELS))


def summarise(logp: np.ndarray, refs: list[str]) -> dict:
    probs = np.exp(logp - logp.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ref_idx = np.array([LEVELS.index(r) for r in refs])
    top = probs.argmax(axis=1)
    confusion = {
        r: {c: int(((ref_idx == i) & (top == j)).sum()) for j, c in enumerate(LEVELS)} for i, r in enumerate(LEVELS)
    }
    return {
        "cases": len(refs),
        "accuracy": float((top == ref_idx).mean()),
        "p_reference": float(probs[np.arange(len(refs)), ref_idx].mean()),
        "p_level": {c: float(probs[:, j].mean()) for j, c in enumerate(LEVELS)},
        "confusion": confusion,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="exported model directories")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--seed", type=int, default=2_000_000, help="first held-out seed")
    ap.add_argument("--cases", default="standard", choices=("standard", "adversarial"))
    ap.add_argument(
        "--clinician", default="{}", help="JSON keyword arguments of the env's expert_action (default: the expert)"
    )
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument(
        "--notes",
        action="store_true",
        help="the env's checklist ends each observation (env.kwargs.notes, for policies trained with it)",
    )
    ap.add_argument(
        "--notes-order",
        default="expert",
        choices=tuple(NOTE_ORDERS),
        help="the checklist's order (env.kwargs.notes_order; with --notes)",
    )
    ap.add_argument("--out", help="write one JSON line per model here")
    a = ap.parse_args(argv)
    if a.notes_order != "expert" and not a.notes:
        ap.error("--notes-order orders the checklist that --notes shows; give --notes too")
    if a.episodes < 1:
        ap.error(f"--episodes must be >= 1, got {a.episodes}")
    try:
        expert = json.loads(a.clinician)
    except json.JSONDecodeError as e:
        ap.error(f"--clinician is not JSON: {e}")
    if not isinstance(expert, dict):
        ap.error(f"--clinician must be a JSON object, got {a.clinician!r}")

    from jaxagent.train.warmstart import collect_demonstrations

    kw = {"cases": a.cases, "max_turns": 20, "notes": a.notes, "notes_order": a.notes_order}
    n = min(a.episodes, 24) if a.cases == "adversarial" else a.episodes
    demos = collect_demonstrations(
        "intake", kw, range(a.seed, a.seed + n), max_turns=20, final_only=True, expert=expert
    )
    demos = [d for d in demos if "\nTriage: " in d.actions[-1]]
    refs = [reference_level(d.actions[-1]) for d in demos]
    print(
        f"{len(demos)} interviews; reference levels: " + ", ".join(f"{c} {refs.count(c)}" for c in LEVELS),
        file=sys.stderr,
    )
    lines = []
    for m in a.models:
        res = {
            "model": m,
            "cases_kind": a.cases,
            "clinician": expert,
            "notes": a.notes,
            **({"notes_order": a.notes_order} if a.notes else {}),
            **summarise(score(m, demos, a.max_context), refs),
        }
        lines.append(res)
        conf = "; ".join(f"{r}: " + " ".join(f"{res['confusion'][r][c]}" for c in LEVELS) for r in LEVELS)
        print(
            f"{m}: accuracy {res['accuracy']:.3f} | p(reference) {res['p_reference']:.3f} | "
            f"top level by reference (routine urgent emergent) {conf}"
        )
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
