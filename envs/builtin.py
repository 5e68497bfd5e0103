"""Registers the built-in envs and the adapter families with :func:`envs.make`.

Adapters are imported only when one of their envs is made, so ``import envs`` works
without any optional extra.
"""

from __future__ import annotations

import importlib

from envs.core import register


def _lazy(module: str, attr: str):
    def factory(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    factory.__qualname__ = factory.__name__ = f"make_{attr}"
    return factory


register("frozenlake", _lazy("envs.frozenlake", "FrozenLake"))
register("sokoban", _lazy("envs.sokoban", "Sokoban"))
register("countdown", _lazy("envs.countdown", "Countdown"))
register("toolmath", _lazy("envs.toolmath", "ToolMath"))
register("pycode", _lazy("envs.pycode", "PyCode"))
register("intake", _lazy("envs.intake", "IntakeEnv"))
register("qa", _lazy("envs.tasks", "QAEnv"))
register("testing/faulty", _lazy("envs.testing", "FaultyEnv"))
register("testing/uneven", _lazy("envs.testing", "UnevenEnv"))
register("testing/null", _lazy("envs.testing", "NullEnv"))
register("testing/busy", _lazy("envs.testing", "BusyEnv"))
register("testing/chaos", _lazy("envs.testing", "ChaosEnv"))

_QA_FAMILY = {"jsonl": "make_jsonl", "tfds": "make_tfds", "reasoning_gym": "make_reasoning_gym"}


def _qa_family(kind: str, **kwargs):
    if kind not in _QA_FAMILY:
        raise ValueError(f"unknown task source 'qa/{kind}'; known: {', '.join('qa/' + k for k in _QA_FAMILY)}")
    if kind == "reasoning_gym":
        if "dataset" not in kwargs:
            raise ValueError("qa/reasoning_gym needs dataset=<name>")
        return importlib.import_module("envs.tasks").make_reasoning_gym(kwargs.pop("dataset"), **kwargs)
    return getattr(importlib.import_module("envs.tasks"), _QA_FAMILY[kind])(**kwargs)


register("qa", _qa_family, prefix=True)
register("gymnasium", _lazy("envs.adapters.gym_text", "make"), prefix=True)
register("reasoning_gym", _lazy("envs.tasks", "make_reasoning_gym"), prefix=True)
register("textworld", _lazy("envs.adapters.textworld_env", "make"), prefix=True)
register("textarena", _lazy("envs.adapters.textarena_env", "make"), prefix=True)
