"""The episode store: a bounded sample of each iteration's episodes with their tokens,
texts, rewards and per-token training signals, for `jaxagent view` and for reading.

    store = EpisodeStore(run_dir, per_iteration=8, max_mb=64)
    store.write(iteration, episodes, tokenizer, signals, rows=rows)

`<run_dir>/episodes/iter_000123.jsonl` holds one JSON object per stored episode of
iteration 123 (a file of an iteration that is played again is replaced; each file is
written to a temporary name and renamed, so a reader never sees half a file):

    iteration, index, seed, group_id, return, rewards (per turn), success, done,
    truncated, failed, end_reason, failure, failure_kind, invalid_actions, noop_actions,
    info (the env's info of the last step, e.g. `intake`'s rubric components),
    why (why it was kept: "failed", "truncated", "highest_return", "lowest_return",
    "sample"), system_prompt, and
    segments: [{kind: "prompt" | "policy" | "observation", turn, text, tokens}, ...]
      where a policy segment also has, per token: `pieces` (each token's text),
      `advantage`, `logp` (the trainer's log-prob before the update), `rollout_logp`
      (the sampler's), `ratio` = exp(logp - rollout_logp), `entropy` (the trainer's
      next-token entropy), and `loss_mask` (0 where the update ignores the token).

Which episodes (`select_for_store`), up to `per_iteration`: the highest- and the lowest-
return one; failed and truncated ones, up to a quarter of the slots each; one of each
task group not yet in; then the other failed and truncated ones; then the rest. The
store is bounded by `max_mb`: when it would grow past it, every other stored iteration
is deleted and from then on only every second iteration is stored (then every fourth,
...), so a long run keeps evenly spaced iterations from all of it (`EpisodeStore.write`;
the stride is in `episodes/stride`, so a resumed run goes on with it). With several
processes, the store holds the first process's episodes: "highest", "lowest" and "one
per group" are among its rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxagent.train.metrics import jsonable

#: the per-token signals of a policy segment, in the order the viewer offers them
SIGNALS = ("advantage", "logp", "rollout_logp", "ratio", "entropy")


def select_for_store(episodes: Sequence, n: int) -> list[tuple[int, str]]:
    """`(index, why)` of up to `n` episodes to store (module docstring)."""
    if n <= 0 or not episodes:
        return []
    returns = [sum(ep.rewards) for ep in episodes]
    chosen: dict[int, str] = {}

    def take(i: int, why: str) -> bool:
        if len(chosen) < n and i not in chosen:
            chosen[i] = why
            return True
        return False

    def take_some(indices, why: str, k: int) -> None:
        added = 0
        for i in indices:
            if added == k:
                break
            added += take(i, why)

    live = [i for i, ep in enumerate(episodes) if not ep.failed]
    if live:
        take(max(live, key=lambda i: returns[i]), "highest_return")
        take(min(live, key=lambda i: returns[i]), "lowest_return")
    # failed and truncated episodes: a quarter of the slots each at first (where most
    # episodes are truncated, they must not crowd out the rest), more at the end
    share = max(1, n // 4)
    failed = [i for i, ep in enumerate(episodes) if ep.failed]
    truncated = [i for i, ep in enumerate(episodes) if ep.truncated and not ep.failed]
    take_some(failed, "failed", share)
    take_some(truncated, "truncated", share)
    seen = {episodes[i].group_id for i in chosen}
    for i, ep in enumerate(episodes):
        if ep.group_id not in seen:
            seen.add(ep.group_id)
            take(i, "sample")
    for i in failed:
        take(i, "failed")
    for i in truncated:
        take(i, "truncated")
    for i in range(len(episodes)):
        take(i, "sample")
    return list(chosen.items())


def _floats(values) -> list:
    return [round(float(v), 6) if math.isfinite(float(v)) else None for v in values]


def episode_record(ep, *, iteration: int, why: str, tokenizer, signals: dict | None = None) -> dict:
    """One stored episode (module docstring). `signals` maps names of `SIGNALS` and
    `loss_mask` to this episode's row, aligned with `ep.tokens` (None: no signals);
    `ratio` is computed from `logp` and `rollout_logp` when not given."""
    segments, pos, turn = [], 0, 0
    for kind, toks in ep.segments:
        toks = [int(t) for t in toks]
        seg = {"kind": kind, "turn": turn, "tokens": toks, "text": tokenizer.decode(toks)}
        if kind == "policy":
            seg["pieces"] = [tokenizer.decode([t]) for t in toks]
            if signals is not None:
                for name, row in signals.items():
                    seg[name] = _floats(np.asarray(row, np.float64)[pos : pos + len(toks)])
                if "logp" in signals and "rollout_logp" in signals and "ratio" not in signals:
                    seg["ratio"] = _floats(
                        np.exp(np.asarray(seg["logp"], np.float64) - np.asarray(seg["rollout_logp"], np.float64))
                    )
            turn += 1
        segments.append(seg)
        pos += len(toks)
    return jsonable(
        {
            "iteration": int(iteration),
            "index": int(ep.index),
            "seed": ep.seed,
            "group_id": int(ep.group_id),
            "return": float(sum(ep.rewards)),
            "rewards": [float(r) for r in ep.rewards],
            "success": bool(ep.success),
            "done": bool(ep.done),
            "truncated": bool(ep.truncated),
            "failed": bool(ep.failed),
            "end_reason": ep.end_reason,
            "failure": ep.failure,
            "failure_kind": ep.failure_kind,
            "invalid_actions": int(ep.invalid_actions),
            "noop_actions": int(ep.noop_actions),
            "info": ep.info,
            "why": why,
            "system_prompt": ep.system_prompt,
            "segments": segments,
        }
    )


class EpisodeStore:
    """Writes the episode store of a run (module docstring).

    Args:
      run_dir: the run's directory; files go to `<run_dir>/episodes/`.
      per_iteration: episodes stored per iteration (0 = none).
      max_mb: the most the run's store may hold on disk, in MiB.
    """

    def __init__(self, run_dir, *, per_iteration: int = 8, max_mb: float = 64.0):
        if not isinstance(per_iteration, int) or isinstance(per_iteration, bool) or per_iteration < 0:
            raise ValueError(f"per_iteration must be an int >= 0, got {per_iteration!r}")
        if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not max_mb > 0:
            raise ValueError(f"max_mb must be a number > 0, got {max_mb!r}")
        self.dir = Path(run_dir) / "episodes"
        self.per_iteration = per_iteration
        self.max_bytes = int(max_mb * 2**20)
        self._stride = 1

    @property
    def stride(self) -> int:
        """Only iterations that are multiples of it are kept (it doubles when the store is
        full). Read from `episodes/stride` each time: a resumed run goes on with it, and a
        fresh start, which removes the store of a run killed before its first checkpoint,
        starts over at 1 (a file that cannot be read now: the last stride known)."""
        try:
            self._stride = self._saved_stride()
        except OSError:
            pass
        return self._stride

    def path(self, iteration: int) -> Path:
        return self.dir / f"iter_{int(iteration):06d}.jsonl"

    def _saved_stride(self) -> int:
        try:
            return max(int((self.dir / "stride").read_text().strip()), 1)
        except (FileNotFoundError, ValueError):
            return 1

    def _stored(self) -> dict[int, Path]:
        if not self.dir.is_dir():
            return {}
        return {int(p.stem[len("iter_") :]): p for p in self.dir.glob("iter_*.jsonl") if p.stem[5:].isdigit()}

    def used_bytes(self, *, besides: Path | None = None) -> int:
        return sum(p.stat().st_size for p in self._stored().values() if p != besides)

    def _thin(self) -> None:
        """Doubles the stride and deletes the stored iterations it no longer keeps (the
        stride is written first, so a crash in between leaves extra files, not a stale
        stride; `drop_after` deletes them on a resume)."""
        stride = self.stride * 2
        tmp = self.dir / "stride.tmp"
        tmp.write_text(f"{stride}\n")
        tmp.replace(self.dir / "stride")
        self._stride = stride
        for i, p in self._stored().items():
            if i % stride:
                p.unlink(missing_ok=True)

    def drop_after(self, iteration: int) -> None:
        """Deletes the stored iterations after `iteration` (a resume from that checkpoint
        plays them again), and what a run killed in a write left: the iterations a
        thinning cut off after its new stride no longer keeps (else they would count
        against the bound, and thin the store again) and half-written temporary files."""
        stride = self.stride
        for i, p in self._stored().items():
            if i > iteration or i % stride:
                p.unlink(missing_ok=True)
        if self.dir.is_dir():
            for p in self.dir.glob("*.tmp"):
                p.unlink(missing_ok=True)

    def write(
        self,
        iteration: int,
        episodes: Sequence,
        tokenizer,
        signals: dict | None = None,
        rows: Sequence[int] | None = None,
    ) -> bool:
        """Stores iteration `iteration`'s chosen episodes; True when it was stored.
        `signals[name]` is a `[B, T]` array of the batch, and episode `i` is its row
        `rows[i]` (default `i`).

        The bound: when the store would exceed `max_mb`, the stride doubles, and the
        stored iterations that are not multiples of it are deleted; an iteration that is
        not a multiple of the stride is not stored. So a long run keeps evenly spaced
        iterations over all of it (1, 2, 3, ... then 2, 4, 6, ... then 4, 8, ...)."""
        if iteration % self.stride:
            return False
        chosen = select_for_store(episodes, self.per_iteration)
        if not chosen:
            return False
        lines = []
        for i, why in chosen:
            row = i if rows is None else int(rows[i])
            sig = None if signals is None else {k: np.asarray(v)[row] for k, v in signals.items()}
            rec = episode_record(episodes[i], iteration=iteration, why=why, tokenizer=tokenizer, signals=sig)
            lines.append(json.dumps(rec, ensure_ascii=False, allow_nan=False))
        data = ("\n".join(lines) + "\n").encode("utf-8")
        if len(data) > self.max_bytes:
            return False  # one iteration alone is over the bound
        path = self.path(iteration)
        self.dir.mkdir(parents=True, exist_ok=True)
        while self.used_bytes(besides=path) + len(data) > self.max_bytes:
            self._thin()
            if iteration % self.stride:
                return False
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return True


def read_store(run_dir) -> list[dict]:
    """Every stored episode of a run, in iteration order. A store file is written whole
    (renamed into place), so a line that is not valid JSON (a middle one garbled, or the
    last one cut off), a byte that is not UTF-8 or a line that is not an episode record is
    damage: `RunFileError` (a `ValueError`) naming the file and line."""
    from jaxagent.train.rundir import RunFileError, read_text

    out = []
    for path in sorted((Path(run_dir) / "episodes").glob("iter_*.jsonl")):
        try:
            text = read_text(path)
        except FileNotFoundError:  # thinned out by the running run after the listing
            continue
        lines = text.split("\n")  # the last item: what follows the last newline ("" when whole)
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as err:
                cut = "; the file ends mid-line: truncated" if n == len(lines) else ""
                raise RunFileError(f"{path}:{n}: not valid JSON at column {err.colno} ({err.msg}){cut}") from None
        for n, rec in records:  # the whole file is JSON: then each line must be a record
            iteration = rec.get("iteration") if isinstance(rec, dict) else None
            if not isinstance(iteration, int) or isinstance(iteration, bool):
                got = f"iteration {iteration!r}" if isinstance(rec, dict) else type(rec).__name__
                raise RunFileError(
                    f"{path}:{n}: not an episode record (a JSON object with an int iteration; got {got})"
                )
            out.append(rec)
    return out
