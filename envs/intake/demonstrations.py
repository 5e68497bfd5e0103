"""The intake recipe's conclusion demonstrations: a warm-start demonstration source.

The trainer's warm start plays `warm_start.episodes` expert episodes and can add the
demonstrations of a source its config names (`warm_start.extra: {source: module:Class,
...options}`). `Conclusions` is the intake recipe's: episodes played by a demonstrator
(by default the warm start's own expert) of which supervised fine-tuning teaches only the
final action, the assessment. They teach how to conclude from whatever an interview
elicited, on interviews the policy is not taught to conduct: the intake recipe uses them
so that a warm start that interviews like the weak clinician still reads a longer
interview's answers (docs/results/intake.md).

    warm_start:
      extra:
        source: envs.intake.demonstrations:Conclusions
        n: 512
        expert: {style: weak, questions: [5, 19], risk_screen: 0.7}
        balance: 'Triage: (\\w+)'

A source is any object with `seeds()` (the first seed and how many seeds it may play:
the trainer checks the range against its training, demonstration and held-out seeds),
`rows` (how many demonstrations it gives at most: the memory check's SFT batch) and
`collect(play, log)`; `play(seeds, *, expert=None, final_only=False, skip_final=0)`
is the trainer's expert player for the run's env (`expert=None`: the warm start's own
expert options). Plain Python: this module imports neither JAX nor the trainer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

#: With `balance`, the most seeds drawn, as a multiple of `n` (the seed range the trainer
#: checks against its other seeds is that long).
BALANCE_DRAWS = 16


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Conclusions:
    """`n` conclusion demonstrations, one per seed `seed, seed + 1, ...`.

    n: how many (>= 1).
    seed: the first seed played.
    expert: keyword arguments of the env's `expert_action` for these episodes (None:
      the warm start's `expert`).
    skip_tokens: the assessment's first tokens that are not taught (its end-of-turn
      token always is). They are where the policy decides to conclude (`<assessment>` is
      one token), and a conclusion demonstration stops wherever its demonstrator chose:
      taught, they would pull the policy toward concluding at those points.
    balance: a regular expression with one group (e.g. `'Triage: (\\w+)'`), or None: the
      demonstrations are balanced over the values the group takes in their final
      actions. The classes are those of the first `n` seeds; seeds are then drawn on, in
      order, until every class has `n // classes` demonstrations (at most
      `BALANCE_DRAWS * n` seeds, else an error naming the short class); a final action
      the expression does not match is left out. Where a conclusion is rarely the
      answer (8% emergent) the warm start otherwise never learns to give it, and RL
      cannot learn an answer the policy never samples (docs/results/intake.md).
    max_draws: the most seeds `balance` draws (None: `BALANCE_DRAWS * n`).
    """

    n: int
    seed: int = 1_100_000
    expert: dict[str, Any] | None = None
    skip_tokens: int = 1
    balance: str | None = None
    max_draws: int | None = None

    def __post_init__(self):
        _check_int("n", self.n, 1)
        _check_int("seed", self.seed, 0)
        _check_int("skip_tokens", self.skip_tokens, 0)
        if self.max_draws is not None:
            _check_int("max_draws", self.max_draws, 1)
        if self.expert is not None and not isinstance(self.expert, dict):
            raise ValueError(
                f"expert must be a mapping of expert_action keyword arguments (or null for the "
                f"warm start's expert), got {self.expert!r}"
            )
        if self.balance is not None:
            if not isinstance(self.balance, str):
                raise ValueError(f"balance must be a regular expression with one group (or null), got {self.balance!r}")
            try:
                groups = re.compile(self.balance).groups
            except re.error as e:
                raise ValueError(f"balance {self.balance!r} is not a regular expression: {e}") from None
            if groups != 1:
                raise ValueError(f"balance {self.balance!r} must have exactly one group (the class), it has {groups}")

    @property
    def rows(self) -> int:
        return self.n

    @property
    def draws(self) -> int:
        """The most seeds played."""
        if self.balance is None:
            return self.n
        return BALANCE_DRAWS * self.n if self.max_draws is None else self.max_draws

    def seeds(self) -> tuple[int, int]:
        return self.seed, self.draws

    def collect(self, play: Callable[..., list], log: Callable[[str], Any] | None = None) -> list:
        """The demonstrations (in seed order), each `final_only` with `skip_final =
        skip_tokens`; with `balance`, logs the count of each class."""

        def take(start: int, count: int) -> list:
            return play(range(start, start + count), expert=self.expert, final_only=True, skip_final=self.skip_tokens)

        if self.balance is None:
            return take(self.seed, self.n)
        demos, counts = balanced(take, self.seed, self.n, self.balance, self.draws, log)
        if log is not None:
            log(
                f"warm start: {len(demos)} conclusion demonstrations balanced over {self.balance!r}: "
                + ", ".join(f"{k} {v}" for k, v in counts.items())
            )
        return demos


def balanced(
    take: Callable[[int, int], Sequence],
    start: int,
    n: int,
    pattern: str,
    max_draws: int,
    log: Callable[[str], Any] | None = None,
) -> tuple[list, dict[str, int]]:
    """`n` demonstrations balanced over the classes that `pattern` (a regular expression
    with one group) finds in their final actions: `n // k` of each of the `k` classes
    seen in seeds `start .. start + n - 1`, drawn from seeds `start, start + 1, ...` in
    order (`take(first_seed, count)` plays them), at most `max_draws` seeds. A final
    action that `pattern` does not match is left out. Returns the demonstrations (in seed
    order) and `{class: count, "seeds_drawn": seeds}`; raises ValueError naming a class
    still short after `max_draws` seeds."""
    rx = re.compile(pattern)
    if rx.groups != 1:
        raise ValueError(f"balance {pattern!r} must have exactly one group, it has {rx.groups}")
    if n < 1:
        raise ValueError(f"balanced conclusions: n must be >= 1, got {n}")

    def label(d) -> str | None:
        m = rx.search(d.actions[-1]) if d.actions else None
        return None if m is None else m.group(1)

    first = list(take(start, min(n, max_draws)))
    classes = sorted({c for c in map(label, first) if c is not None})
    if not classes:
        raise ValueError(
            f"warm_start.extra.balance {pattern!r} matches none of the first {len(first)} "
            f"conclusion demonstrations' final actions (e.g. {first[0].actions[-1]!r:.200})"
        )
    quota = n // len(classes)
    if quota < 1:
        raise ValueError(
            f"warm_start.extra.n ({n}) is fewer than the {len(classes)} classes that balance "
            f"finds ({', '.join(classes)})"
        )
    kept: dict[str, list] = {c: [] for c in classes}

    def keep(demos) -> None:
        for d in demos:
            c = label(d)
            if c in kept and len(kept[c]) < quota:
                kept[c].append(d)

    keep(first)
    drawn = len(first)
    while drawn < max_draws and any(len(v) < quota for v in kept.values()):
        chunk = min(n, max_draws - drawn)
        keep(take(start + drawn, chunk))
        drawn += chunk
        if log is not None:
            log(
                f"warm start: balancing conclusions: {drawn} seeds drawn, "
                + ", ".join(f"{c} {len(v)}/{quota}" for c, v in kept.items())
            )
    short = {c: len(v) for c, v in kept.items() if len(v) < quota}
    if short:
        raise ValueError(
            f"warm_start.extra.balance: after {drawn} seeds from {start}, "
            + ", ".join(f"class {c!r} has {k} of {quota}" for c, k in short.items())
            + " conclusion demonstrations; lower warm_start.extra.n or change warm_start.extra.expert"
        )
    out = sorted((d for v in kept.values() for d in v), key=lambda d: d.seed)
    return out, {**{c: len(v) for c, v in kept.items()}, "seeds_drawn": drawn}
