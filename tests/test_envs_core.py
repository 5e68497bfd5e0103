"""The Env protocol, the registry, the missing-extra errors, exact arithmetic and answer checks."""

import os
import subprocess
import sys
from fractions import Fraction

import pytest

import envs
from envs.arith import ExpressionError, evaluate, format_number
from envs.core import MissingExtraError
from envs.verify import answers_match, extract_answer, parse_number, score_math


def test_make_knows_builtins_and_families_and_names_bad_input():
    names = envs.known_envs()
    for n in (
        "frozenlake",
        "sokoban",
        "countdown",
        "toolmath",
        "gymnasium/<...>",
        "textworld/<...>",
        "textarena/<...>",
        "reasoning_gym/<...>",
        "qa/<...>",
    ):
        assert n in names
    with pytest.raises(ValueError, match="unknown env 'chess'"):
        envs.make("chess")
    with pytest.raises(ValueError, match="lacks the part after 'gymnasium/'"):
        envs.make("gymnasium/")
    with pytest.raises(TypeError, match="max_steps|unexpected keyword"):
        envs.make("sokoban", colour="red")
    with pytest.raises(ValueError, match="unknown task source 'qa/csv'"):
        envs.make("qa/csv")
    env = envs.make("countdown")
    assert env.name == "countdown" and isinstance(env, envs.Env)


def test_register_custom_env():
    class Echo(envs.TextEnv):
        system_prompt = "Echo."
        action_format = "Any text."

        def __init__(self):
            super().__init__(max_steps=2)

        def _reset(self, seed):
            return f"hello {seed}", {}

        def _step(self, action):
            return action.upper(), 1.0, False, {}

        def state_key(self):
            return ("echo", self._steps)

    envs.register("test-echo", Echo)
    env = envs.make("test-echo")
    assert env.reset(4) == ("hello 4", {"seed": 4})
    assert env.step("hi") == ("HI", 1.0, False, False, {"step": 1})
    obs, r, term, trunc, info = env.step("again")
    assert trunc and not term and "step limit (2)" in obs
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("more")
    env.reset(1)
    obs, r, term, trunc, info = env.step(12)
    assert r == -0.1 and "must be text" in obs and info["invalid_action"]


@pytest.mark.parametrize(
    "name, module, extra",
    [
        ("gymnasium/Taxi-v4", "gymnasium", "envs-gym"),
        ("reasoning_gym/leg_counting", "reasoning_gym", "envs-reasoning"),
        ("textworld/tw-simple", "textworld", "envs-textworld"),
        ("textarena/TowerOfHanoi-v0", "textarena", "envs-textarena"),
    ],
)
def test_missing_extra_names_the_extra(monkeypatch, name, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(MissingExtraError, match=rf"pip install 'jaxagent\[{extra}\]'") as e:
        envs.make(name)
    assert e.value.extra == extra and name in str(e.value)


def test_missing_tfds_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(MissingExtraError, match=r"jaxagent\[envs-tfds\]"):
        envs.make("qa/tfds", name="gsm8k")


def test_envs_imports_without_jax_jaxagent_or_extras():
    """`import envs` (and playing a built-in env) loads no JAX, numpy or optional extra, and
    of `jaxagent` only the package (`jaxagent/__init__.py`, standard library at import) and
    `jaxagent.failures` (the pools' failure kinds, a module that imports nothing);
    `jaxagent.specs`, also standard library only, it loads when a task file is read."""
    code = (
        "import sys, envs; e = envs.make('sokoban'); e.reset(0); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxagent', 'gymnasium', "
        "'textworld', 'textarena', 'reasoning_gym', 'tensorflow_datasets', 'numpy') "
        "and m not in ('jaxagent', 'jaxagent.failures')]; print(bad)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_evaluate_is_exact_and_rejects_non_arithmetic():
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("(25 - 5) × 3 + 4") == 64
    assert evaluate("1,234 * 2") == 2468
    assert evaluate("2^10") == 1024
    assert evaluate("-3 + 1") == -2
    assert evaluate("7 / 4") == Fraction(7, 4)
    for bad, msg in [
        ("__import__('os')", "not allowed"),
        ("2 ** 1000", "exponents"),
        ("1/0", "division by zero"),
        ("", "empty"),
        ("3 +", "not a valid"),
        ("1 % 2", "Mod"),
    ]:
        with pytest.raises(ExpressionError, match=msg):
            evaluate(bad)
    with pytest.raises(ExpressionError, match="unary"):
        evaluate("-3", allow_unary=False)
    assert [format_number(Fraction(x)) for x in ("3", "7/4", "1/3", "-5/2", "1157.625")] == [
        "3",
        "1.75",
        "1/3",
        "-2.5",
        "1157.625",
    ]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so the total is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("nested \\boxed{2^{10}} ok", "2^{10}"),
        ("<answer> 42 </answer>", "42"),
        ("work...\n#### 1,234", "1,234"),
        ("The answer is 17.", "17"),
        ("we get 3 then 5 then 8", "8"),
        ("no digits here", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_answers_match_exactly():
    assert answers_match("0.50", "1/2") and answers_match("$1,234", "1234")
    assert answers_match("\\frac{3}{4}", "0.75") and answers_match("75%", "75")
    assert not answers_match("0.3333", "1/3") and not answers_match(None, "1")
    assert answers_match("Paris", "paris") and not answers_match("Paris", "Lyon")
    assert answers_match("18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18")
    assert parse_number("1,000,000") == 1_000_000 and parse_number("abc") is None
    assert score_math("I think \\boxed{18}", "#### 18") == 1.0 and score_math("17", "18") == 0.0
