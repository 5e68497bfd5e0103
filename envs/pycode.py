"""pycode: answer questions by running Python in a sandbox, over several turns.

Each turn the agent either calls the tool, in toolmath's format::

    <tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>

and gets ``<tool_response>status: ok\\nstdout:\\n45\\n</tool_response>`` back, or answers
``<answer>45</answer>``, which ends the episode (reward 1 when it is exactly right).
Each call runs in a fresh sandboxed subprocess (`envs.sandbox`: wall-clock, CPU, memory,
file-size, open-file and process limits, a temporary directory removed afterwards, no
network, a read-only file system under bubblewrap); its status, stdout and stderr are
returned truncated. The reset info says which isolation is in use (``isolation``).

Tasks are built from the seed: one of `TEMPLATES`, with parameters drawn so that the
answer is tedious by hand and a few lines of code. The answer is computed here, in
this process, by a function written separately from the expert's program (the expert
calls the tool with its program, then answers with what it printed).
"""

from __future__ import annotations

import random
from typing import Any

from envs.core import InvalidAction, TextEnv
from envs.sandbox import Limits, require_isolation, run_python
from envs.toolmath import parse_turn
from envs.verify import answers_match

TEMPLATES = ("prime_sum", "fib_mod", "digit_sum_count", "collatz_longest", "word_rank", "product_residues")

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "do", "fu", "gi", "ha", "je", "pa", "zo")


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def make_task(template: str, rng: random.Random) -> tuple[str, dict]:
    """(question, params) of a template."""
    p: dict[str, Any]
    if template == "prime_sum":
        p = {"n": rng.randint(2_000, 60_000)}
        return f"What is the sum of all prime numbers below {p['n']}?", p
    if template == "fib_mod":
        p = {"n": rng.randint(500, 5_000), "m": rng.randint(1_000, 99_999)}
        return (f"Let F(0) = 0, F(1) = 1 and F(k) = F(k-1) + F(k-2). What is F({p['n']}) modulo {p['m']}?"), p
    if template == "digit_sum_count":
        a = rng.randint(1, 50_000)
        p = {"a": a, "b": a + rng.randint(1_000, 60_000), "k": rng.randint(3, 13)}
        return (
            f"How many integers from {p['a']} to {p['b']} (both included) have a digit sum that is "
            f"divisible by {p['k']}?"
        ), p
    if template == "collatz_longest":
        p = {"n": rng.randint(200, 3_000)}
        return (
            f"The Collatz step maps x to x/2 if x is even and to 3x+1 if x is odd. Which starting number "
            f"from 1 to {p['n']} takes the most steps to reach 1? (On a tie, the smallest.)"
        ), p
    if template == "word_rank":
        p = {"words": _words(rng, rng.randint(12, 20))}
        p["k"] = rng.randint(1, len(p["words"]))
        return (
            f"Sort these words by length, and words of the same length alphabetically: "
            f"{' '.join(p['words'])}. Which word is at position {p['k']} (counting from 1)?"
        ), p
    if template == "product_residues":
        p = {"n": rng.randint(20, 120), "m": rng.randint(50, 500)}
        return (f"How many distinct values does (i * j) mod {p['m']} take for integers 1 <= i, j <= {p['n']}?"), p
    raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")


def solve(template: str, p: dict) -> str:
    """The exact answer, computed in this process."""
    if template == "prime_sum":
        n = p["n"]
        sieve = bytearray([1]) * n
        sieve[:2] = b"\0\0"
        for i in range(2, int(n**0.5) + 1):
            if sieve[i]:
                sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
        return str(sum(i for i in range(n) if sieve[i]))
    if template == "fib_mod":
        a, b = 0, 1
        for _ in range(p["n"]):
            a, b = b, (a + b) % p["m"]
        return str(a)
    if template == "digit_sum_count":
        return str(sum(1 for x in range(p["a"], p["b"] + 1) if sum(map(int, str(x))) % p["k"] == 0))
    if template == "collatz_longest":
        best, best_steps = 1, 0
        for start in range(1, p["n"] + 1):
            x, steps = start, 0
            while x != 1:
                x = x // 2 if x % 2 == 0 else 3 * x + 1
                steps += 1
            if steps > best_steps:
                best, best_steps = start, steps
        return str(best)
    if template == "word_rank":
        return sorted(p["words"], key=lambda w: (len(w), w))[p["k"] - 1]
    if template == "product_residues":
        return str(len({(i * j) % p["m"] for i in range(1, p["n"] + 1) for j in range(1, p["n"] + 1)}))
    raise ValueError(f"unknown template {template!r}")


def expert_program(template: str, p: dict) -> str:
    """The expert's program for a task: it prints the answer (written apart from `solve`)."""
    if template == "prime_sum":
        return (
            f"n = {p['n']}\nprimes = [k for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1))]\n"
            "print(sum(primes))"
        )
    if template == "fib_mod":
        return (
            f"f = [0, 1]\nfor k in range(2, {p['n']} + 1):\n    f.append((f[-1] + f[-2]) % {p['m']})\n"
            f"print(f[{p['n']}] % {p['m']})"
        )
    if template == "digit_sum_count":
        return (
            f"count = 0\nfor x in range({p['a']}, {p['b']} + 1):\n    s = 0\n    while x:\n"
            f"        s += x % 10\n        x //= 10\n    count += s % {p['k']} == 0\nprint(count)"
        )
    if template == "collatz_longest":
        return (
            "from functools import lru_cache\nimport sys\nsys.setrecursionlimit(10000)\n@lru_cache(None)\n"
            "def steps(x):\n    return 0 if x == 1 else 1 + steps(x // 2 if x % 2 == 0 else 3 * x + 1)\n"
            f"print(max(range(1, {p['n']} + 1), key=lambda s: (steps(s), -s)))"
        )
    if template == "word_rank":
        return f"words = {p['words']!r}\nwords.sort()\nwords.sort(key=len)\nprint(words[{p['k']} - 1])"
    if template == "product_residues":
        return (
            f"seen = set()\nfor i in range(1, {p['n']} + 1):\n    for j in range(1, {p['n']} + 1):\n"
            f"        seen.add(i * j % {p['m']})\nprint(len(seen))"
        )
    raise ValueError(f"unknown template {template!r}")


def tool_call(code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


class PyCode(TextEnv):
    """Questions answered with a sandboxed Python tool; see the module docstring.

    Args:
      templates: which task templates to draw from (default: all).
      max_turns: turns (tool calls and answers) before truncation.
      invalid_penalty: reward for a malformed turn.
      wall_s, cpu_s, memory_mb, max_output: the sandbox's limits per call (`envs.sandbox.Limits`).
      isolation: the sandbox's isolation (`envs.sandbox`): "bwrap" (the default: the OS
        package bubblewrap) or, accepted deliberately, "unshare" (no network, but the file
        system is not isolated) or "none" (limits only). A mode that does not work on this
        machine is an error when the env is made, never a silent fallback.
    """

    has_expert = True

    def __init__(
        self,
        templates=TEMPLATES,
        max_turns: int = 6,
        invalid_penalty: float = -0.1,
        wall_s: float = 10.0,
        cpu_s: int = 10,
        memory_mb: int = 512,
        max_output: int = 1000,
        isolation: str = "bwrap",
    ):
        templates = tuple(templates)
        unknown = [t for t in templates if t not in TEMPLATES]
        if not templates or unknown:
            raise ValueError(f"templates must be a non-empty subset of {TEMPLATES}, got {templates!r}")
        super().__init__(max_steps=max_turns, invalid_penalty=invalid_penalty)
        self.templates = templates
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output=max_output)
        #: the sandbox's isolation mode, checked to work here (the trainer logs a weaker one)
        self.isolation = require_isolation(isolation, accept_less="env.kwargs.isolation: unshare (or none)")
        self.template, self.question, self.answer = "", "", ""
        self.params: dict[str, Any] = {}
        self._outputs: list[str] = []

    @property
    def system_prompt(self) -> str:
        return (
            "Answer the question. You have a Python tool: each call runs your program in a fresh "
            "sandbox (no network, no files kept between calls, a few seconds of time) and returns "
            f"what it printed in <tool_response></tool_response> tags. {self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return (
            'Each turn, either run a program: <tool_call>{"name": "python", "arguments": {"code": '
            '"print(6 * 7)"}}</tool_call>, or give the final answer: <answer>42</answer>.'
        )

    def _reset(self, seed: int):
        rng = random.Random(seed)
        self.template = self.templates[rng.randrange(len(self.templates))]
        self.question, self.params = make_task(self.template, rng)
        self.answer = solve(self.template, self.params)
        self._outputs = []
        return self.question, {"template": self.template, "isolation": self.isolation}

    def _step(self, action: str):
        args, tagged = parse_turn(action, "python")
        if args is not None:
            code = args.get("code")
            if not isinstance(code, str) or not code.strip():
                raise InvalidAction('the python tool needs a "code" argument (a non-empty string)')
            r = run_python(code, self.limits, isolation_mode=self.isolation)
            text = f"status: {r.status}\nstdout:\n{r.stdout}"
            if r.stderr.strip():
                text += f"\nstderr:\n{r.stderr}"
            self._outputs.append(r.stdout.strip())
            return (
                f"<tool_response>{text}</tool_response>",
                0.0,
                False,
                {"tool_status": r.status, "tool_seconds": round(r.seconds, 3)},
            )
        assert tagged is not None  # not a tool call: an <answer> (parse_turn raises on anything else)
        given = tagged.strip()
        ok = given == self.answer or answers_match(given, self.answer)
        return ("Correct." if ok else "Incorrect."), 1.0 if ok else 0.0, True, {"success": ok, "answer": given}

    def state_key(self):
        return ("pycode", self.question, tuple(self._outputs))

    def expert_action(self) -> str:
        # A function of the state: the program first, then the answer it printed.
        if not self._outputs:
            return tool_call(expert_program(self.template, self.params))
        return f"<answer>{self._outputs[-1]}</answer>"
