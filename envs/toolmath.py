"""Tool-use math: multi-step word problems solved with a calculator tool over several turns.

Each seed picks one of the problem templates (``shop``, ``warehouse``, ``interest``,
``trip``) and draws its quantities; the exact answer is computed with fractions at
generation. The agent works in turns. Each turn is either

- a tool call, in the JSON-in-tags format most chat models are trained on::

      <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7.25"}}</tool_call>

  answered by the env with ``<tool_response>87</tool_response>`` (the exact value: an
  integer, a terminating decimal, or ``a/b``), or with ``<tool_response>error:
  ...</tool_response>`` if the expression cannot be computed; or
- the final answer, ``<answer>87</answer>`` (``\\boxed{87}`` is accepted too), which
  ends the episode: reward 1.0 if it equals the exact answer (as numbers: ``$``,
  commas and trailing zeros do not matter), else 0.0.

Calculator expressions: numbers, ``+ - * /``, ``**`` (integer exponents),
parentheses (see :mod:`envs.arith`). Lenient parsing: single-quoted (Python-style)
dicts and ``arguments`` given as a JSON string are accepted. A turn that is neither a
well-formed tool call nor an answer, or that holds both, gets an explanation and
``invalid_penalty``. After ``max_turns`` turns without an answer the episode is
truncated.

Expert: calls the calculator for each step of the template's solution that it has
not yet seen a result for, then answers with the last result.
"""

from __future__ import annotations

import ast
import json
import random
import re
from fractions import Fraction

from envs.arith import ExpressionError, evaluate, format_number
from envs.core import InvalidAction, TextEnv, last_tagged
from envs.verify import answers_match, extract_answer, parse_number

TEMPLATES = ("shop", "warehouse", "interest", "trip")


def _f(x) -> str:
    return format_number(Fraction(x))


def _price(rng: random.Random, lo: int, hi: int) -> Fraction:
    return Fraction(rng.randint(lo * 4, hi * 4), 4)  # quarter-dollar prices


def make_problem(template: str, rng: random.Random) -> tuple[str, list[str], Fraction]:
    """(question, calculator steps, exact answer). Each step uses only numbers from the
    question and results of earlier steps."""
    if template == "shop":
        n1, n2 = rng.randint(3, 29), rng.randint(3, 29)
        p1, p2 = _price(rng, 2, 40), _price(rng, 2, 40)
        a, b = n1 * p1, n2 * p2
        total = a + b
        cash = (int(total) // 50 + 1 + rng.randint(0, 3)) * 50
        q = (
            f"A customer buys {n1} notebooks at ${_f(p1)} each and {n2} pens at ${_f(p2)} each, "
            f"and pays with ${cash}. How much change, in dollars, does the customer get?"
        )
        steps = [f"{n1} * {_f(p1)}", f"{n2} * {_f(p2)}", f"{_f(a)} + {_f(b)}", f"{cash} - {_f(total)}"]
        return q, steps, cash - total
    if template == "warehouse":
        crates, per = rng.randint(23, 97), rng.randint(12, 48)
        stores = rng.randint(3, 9)
        stock = crates * per
        shipped = rng.randint(1, stock // 2)
        shipped += (stock - shipped) % stores
        q = (
            f"A warehouse holds {crates} crates with {per} items in each. {shipped} items are "
            f"shipped out, and the remaining items are split evenly among {stores} stores. "
            "How many items does each store get?"
        )
        rest = stock - shipped
        steps = [f"{crates} * {per}", f"{stock} - {shipped}", f"{rest} / {stores}"]
        return q, steps, Fraction(rest, stores)
    if template == "interest":
        principal = rng.randint(10, 90) * 100
        rate = rng.randint(2, 9)
        years = rng.randint(2, 4)
        q = (
            f"${principal} is deposited at {rate}% interest per year, compounded yearly. What is "
            f"the balance, in dollars, after {years} years? Give the exact amount without rounding."
        )
        steps, value = [], Fraction(principal)
        for _ in range(years):
            steps.append(f"{_f(value)} * (1 + {rate} / 100)")
            value = value * (1 + Fraction(rate, 100))
        return q, steps, value
    if template == "trip":
        v1, v2 = rng.randint(40, 120), rng.randint(40, 120)
        t1, t2 = Fraction(rng.randint(2, 12), 4), Fraction(rng.randint(2, 12), 4)
        q = (
            f"A car drives at {v1} km/h for {_f(t1)} hours and then at {v2} km/h for {_f(t2)} hours. "
            "How many kilometres does it travel in total?"
        )
        d1, d2 = v1 * t1, v2 * t2
        steps = [f"{v1} * {_f(t1)}", f"{v2} * {_f(t2)}", f"{_f(d1)} + {_f(d2)}"]
        return q, steps, d1 + d2
    raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")


#: limits on a tool call's text, checked before it is parsed (a call within them cannot
#: make the JSON or Python parser raise anything but a syntax error)
MAX_TOOL_CALL_CHARS = 4000
MAX_TOOL_CALL_DEPTH = 16


def _nesting(text: str) -> int:
    """The deepest bracket nesting of `text` (strings are not skipped: an upper bound)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]})":
            depth = max(depth - 1, 0)
    return deepest


def parse_tool_call(text: str) -> tuple[str, dict]:
    """(name, arguments) from the body of a ``<tool_call>`` tag; raises InvalidAction."""
    body = text.strip()
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", body)
    if len(body) > MAX_TOOL_CALL_CHARS:
        raise InvalidAction(f"the tool call is longer than {MAX_TOOL_CALL_CHARS} characters")
    if _nesting(body) > MAX_TOOL_CALL_DEPTH:
        raise InvalidAction(f"the tool call nests brackets deeper than {MAX_TOOL_CALL_DEPTH} levels")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer past Python's digit limit
        try:
            call = ast.literal_eval(body)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise InvalidAction(
                'the tool call is not valid JSON: write {"name": "calculator", "arguments": {"expression": "..."}}'
            ) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise InvalidAction('the tool call must be a JSON object with a "name" and "arguments"')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = {"expression": args}
    if not isinstance(args, dict):
        raise InvalidAction('"arguments" must be a JSON object')
    return call["name"], args


def parse_turn(action: str, tool: str, *, boxed: bool = False) -> tuple[dict | None, str | None]:
    """`(arguments, None)` for a turn that calls `tool` once, `(None, answer)` for a turn that
    answers in `<answer>` tags (or `\\boxed{}` with `boxed`; the answer is then None and
    `extract_answer` reads it); `InvalidAction` for anything else: both at once, several
    calls, another tool's name, no call and no answer."""
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", action, re.DOTALL | re.IGNORECASE)
    tagged = last_tagged(action, "answer")
    answered = tagged is not None or (boxed and "\\boxed{" in action)
    if calls and answered:
        raise InvalidAction("a turn holds either one tool call or the final answer, not both")
    if len(calls) > 1:
        raise InvalidAction("make one tool call per turn")
    if calls:
        name, args = parse_tool_call(calls[0])
        if name != tool:
            raise InvalidAction(f"there is no tool named {name!r}; the only tool is {tool!r}")
        return args, None
    if not answered:
        raise InvalidAction("make a tool call or give the final answer in <answer></answer> tags")
    return None, tagged


class ToolMath(TextEnv):
    """Word problems with a calculator tool; see the module docstring.

    Args:
      templates: which problem templates to draw from (default: all).
      max_turns: turns (tool calls and answers) before truncation.
      invalid_penalty: reward for a malformed turn.
    """

    has_expert = True

    def __init__(self, templates=TEMPLATES, max_turns: int = 10, invalid_penalty: float = -0.1):
        templates = tuple(templates)
        unknown = [t for t in templates if t not in TEMPLATES]
        if not templates or unknown:
            raise ValueError(f"templates must be a non-empty subset of {TEMPLATES}, got {templates!r}")
        super().__init__(max_steps=max_turns, invalid_penalty=invalid_penalty)
        self.templates = templates
        self.question = ""
        self.template = ""
        self.steps: list[str] = []
        self.answer = Fraction(0)
        self._seen: list[Fraction] = []

    @property
    def system_prompt(self) -> str:
        return (
            "Solve the word problem. You have a calculator tool; call it as many times as you "
            "need, one call per turn. It evaluates expressions of numbers, + - * /, ** and "
            "parentheses exactly, and returns the result in <tool_response></tool_response> "
            f"tags. {self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return (
            'Each turn, either call the calculator: <tool_call>{"name": "calculator", "arguments": '
            '{"expression": "12 * 7.25"}}</tool_call>, or give the final answer as a number: '
            "<answer>87</answer>."
        )

    def _reset(self, seed: int):
        rng = random.Random(seed)
        self.template = self.templates[rng.randrange(len(self.templates))]
        self.question, self.steps, self.answer = make_problem(self.template, rng)
        self._seen = []
        return self.question, {"template": self.template}

    def _step(self, action: str):
        args, _ = parse_turn(action, "calculator", boxed=True)
        if args is not None:
            expr = args.get("expression")
            if not isinstance(expr, str):
                raise InvalidAction('the calculator needs an "expression" argument (a string)')
            try:
                value = evaluate(expr)
            except ExpressionError as e:
                return f"<tool_response>error: {e}</tool_response>", 0.0, False, {"tool_error": str(e)}
            self._seen.append(value)
            return f"<tool_response>{format_number(value)}</tool_response>", 0.0, False, {"tool_call": expr}
        given = extract_answer(action)
        if given is None or parse_number(given) is None:
            raise InvalidAction(f"the answer {given!r} is not a number")
        ok = answers_match(given, format_number(self.answer))
        feedback = "Correct." if ok else "Incorrect."
        return feedback, 1.0 if ok else 0.0, True, {"success": ok, "answer": given}

    def state_key(self):
        return ("toolmath", self.question, tuple(format_number(v) for v in self._seen))

    def expert_action(self) -> str:
        results = [evaluate(s) for s in self.steps]
        for step, result in zip(self.steps, results, strict=True):
            if result not in self._seen:
                call = json.dumps({"name": "calculator", "arguments": {"expression": step}})
                return f"<tool_call>{call}</tool_call>"
        return f"<answer>{format_number(results[-1])}</answer>"
