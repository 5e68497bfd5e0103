"""Countdown: combine the given numbers with + - * / to reach a target.

Each seed draws ``num_numbers`` numbers from 1..``max_number`` and builds a random
expression over them (every number exactly once when ``use_all=True``, the default;
otherwise a random subset) whose value is an integer in 1..``max_target``: that value
is the target, so every instance is solvable.

The answer is an arithmetic expression, e.g. ``<answer>(25 - 5) * 3 + 4</answer>``
(without the tags, the last line that looks like an expression is taken; a trailing
``= target`` is ignored; ``×`` and ``÷`` are accepted). It is verified exactly: its
numbers must be the given ones (each exactly once with ``use_all``, at most once
otherwise) and its value, computed with fractions, must equal the target. Division
may produce fractions along the way.

Reward 1.0 for a correct expression, 0.0 for a wrong one, ``invalid_penalty`` for
text that is not an expression. With ``max_attempts > 1`` a wrong answer gets
feedback and another try.

Expert: an exhaustive search over pairwise combinations (with memoisation), which
finds a solution for every instance.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from envs.arith import ExpressionError, evaluate, normalize, numbers_in
from envs.core import InvalidAction, TextEnv, last_tagged

_OPS = "+-*/"


def _combine(a: Fraction, b: Fraction, op: str) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b != 0 else None


def generate(
    rng: random.Random, num_numbers: int, max_number: int, max_target: int, use_all: bool
) -> tuple[tuple[int, ...], int]:
    """(numbers, target) with a target reachable by construction."""
    for _ in range(100_000):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        k = num_numbers if use_all else rng.randint(2, num_numbers)
        pool = [Fraction(n) for n in rng.sample(numbers, k)]
        while len(pool) > 1:
            a = pool.pop(rng.randrange(len(pool)))
            b = pool.pop(rng.randrange(len(pool)))
            v = _combine(a, b, rng.choice(_OPS))
            if v is None:
                break
            pool.append(v)
        if len(pool) == 1 and pool[0].denominator == 1 and 1 <= pool[0] <= max_target:
            return tuple(numbers), int(pool[0])
    raise ValueError(
        f"no Countdown instance with {num_numbers} numbers in 1..{max_number} reaches a "
        f"target in 1..{max_target}; raise max_target or max_number"
    )


def solve(numbers, target: int, use_all: bool = True) -> str | None:
    """An expression over ``numbers`` equal to ``target``, or None if there is none."""
    goal = Fraction(target)
    items = [(Fraction(n), str(n)) for n in numbers]
    if not use_all:
        for v, e in items:
            if v == goal:
                return e
    failed: set = set()

    def search(items):
        key = tuple(sorted(v for v, _ in items))
        if key in failed:
            return None
        n = len(items)
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                (a, ea), (b, eb) = items[i], items[j]
                rest = [items[k] for k in range(n) if k != i and k != j]
                for op in _OPS:
                    if op in "+*" and i > j:
                        continue  # commutative: one order is enough
                    v = _combine(a, b, op)
                    if v is None:
                        continue
                    expr = f"({ea} {op} {eb})"
                    if (not use_all or not rest) and v == goal:
                        return expr
                    if rest:
                        found = search(rest + [(v, expr)])
                        if found:
                            return found
        failed.add(key)
        return None

    found = search(items)
    if found and found.startswith("(") and found.endswith(")"):
        inner = found[1:-1]
        depth = 0
        for ch in inner:  # drop the outer parentheses if they enclose everything
            depth += (ch == "(") - (ch == ")")
            if depth < 0:
                break
        else:
            found = inner
    return found


class Countdown(TextEnv):
    """The Countdown numbers game; see the module docstring.

    Args:
      num_numbers: how many numbers are given (2..6).
      max_number: numbers are drawn from 1..max_number.
      max_target: targets lie in 1..max_target.
      use_all: every number must be used exactly once (else at most once).
      max_attempts: answers allowed; 1 makes it single-turn.
      invalid_penalty: reward for a response with no expression in it.
    """

    has_expert = True

    def __init__(
        self,
        num_numbers: int = 4,
        max_number: int = 50,
        max_target: int = 200,
        use_all: bool = True,
        max_attempts: int = 1,
        invalid_penalty: float = -0.1,
    ):
        if not isinstance(num_numbers, int) or not 2 <= num_numbers <= 6:
            raise ValueError(f"num_numbers must be an int in 2..6, got {num_numbers!r}")
        if not isinstance(max_number, int) or max_number < 2:
            raise ValueError(f"max_number must be an int >= 2, got {max_number!r}")
        if not isinstance(max_target, int) or max_target < 1:
            raise ValueError(f"max_target must be an int >= 1, got {max_target!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        super().__init__(max_steps=max_attempts, invalid_penalty=invalid_penalty)
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.use_all, self.max_attempts = bool(use_all), max_attempts
        self.numbers: tuple[int, ...] = ()
        self.target = 0
        self._solution: str | None = None

    @property
    def system_prompt(self) -> str:
        rule = "every number exactly once" if self.use_all else "each number at most once"
        return (
            "You play Countdown: combine the given numbers with +, -, * and / and parentheses "
            f"to make an expression equal to the target, using {rule}. Division may give "
            f"fractions along the way. {self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return "Give the expression inside answer tags, e.g. <answer>(25 - 5) * 3 + 4</answer>."

    def _reset(self, seed: int):
        rng = random.Random(seed)
        self.numbers, self.target = generate(rng, self.num_numbers, self.max_number, self.max_target, self.use_all)
        self._solution = None
        nums = ", ".join(map(str, self.numbers))
        return (f"Numbers: {nums}\nTarget: {self.target}", {"numbers": list(self.numbers), "target": self.target})

    def _parse(self, action: str) -> str:
        tagged = last_tagged(action, "answer")
        if tagged is not None:
            expr = tagged
        else:
            lines = [ln for ln in action.strip().splitlines() if re.search(r"\d\s*[-+*/×÷x]\s*[\d(]", ln)]
            if not lines:
                raise InvalidAction("no expression found")
            expr = lines[-1]
            expr = re.sub(r"^[^\d(]*", "", expr)  # leading words such as "Answer:"
        expr = re.sub(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])", "*", expr)
        expr = re.split(r"=", expr)[0].strip().rstrip(".")
        if not expr:
            raise InvalidAction("the answer is empty")
        return normalize(expr)

    def check(self, expr: str) -> tuple[bool, str]:
        """(correct, feedback) for an expression text."""
        try:
            used = numbers_in(expr)
            value = evaluate(expr, allow_pow=False, allow_unary=False)
        except ExpressionError as e:
            return False, f"Your expression cannot be evaluated: {e}."
        given = Counter(Fraction(n) for n in self.numbers)
        used_count = Counter(used)
        extra = used_count - given
        if extra:
            bad = ", ".join(str(n) for n in sorted(extra.elements()))
            return False, f"Your expression uses numbers that are not available: {bad}."
        if self.use_all and used_count != given:
            missing = ", ".join(str(n) for n in sorted((given - used_count).elements()))
            return False, f"Your expression does not use every number; missing: {missing}."
        if value != self.target:
            return False, f"Your expression equals {value}, not {self.target}."
        return True, f"Correct: {expr} = {self.target}."

    def _step(self, action: str):
        expr = self._parse(action)
        try:
            numbers_in(expr)
        except ExpressionError as e:
            raise InvalidAction(str(e)) from None
        ok, feedback = self.check(expr)
        last = self._steps >= self.max_attempts
        info = {"expression": expr, "success": ok}
        if ok:
            return feedback, 1.0, True, info
        if not last:
            feedback += f" Try again ({self.max_attempts - self._steps} attempts left)."
        return feedback, 0.0, last, info

    def state_key(self):
        return ("countdown", self.numbers, self.target, self._steps)

    def expert_action(self) -> str:
        if self._solution is None:
            self._solution = solve(self.numbers, self.target, self.use_all) or ""
        return f"<answer>{self._solution}</answer>"
