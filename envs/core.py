"""The Env protocol, the name registry behind `envs.make`, and shared parsing helpers.

An environment speaks text. ``reset(seed)`` returns ``(observation, info)`` and
``step(action_text)`` returns ``(observation, reward, terminated, truncated, info)``,
the Gymnasium convention with text in and out:

- ``observation``: a ``str`` (the text the agent sees next), or a list of chat
  messages ``[{"role": ..., "content": ...}, ...]`` for envs that speak in messages.
- ``reward``: a finite float for this step.
- ``terminated``: the episode reached a terminal state (won, lost, answered).
- ``truncated``: the episode was cut short (step limit, failure) without a terminal state.
- ``info``: a dict of plain Python values (it crosses process boundaries).

Beyond Gymnasium, each env gives:

- ``system_prompt``: the task, rules and how to answer, for the first chat message.
- ``action_format``: a short description of a well-formed action; observations that
  reject a malformed action repeat it.
- ``state_key()``: a hashable, picklable key of the current state (tuples of str/int),
  equal for equal states across episodes of the same seed: the anchor state that
  step-level group estimators (GiGPO) group turns by.
- ``expert_action()``: the action an expert policy takes now (when ``has_expert``), for
  warm-start demonstrations and tests.
- ``cut_outcome(info)`` (optional): what the episode scores if the rollout cuts it off
  now (its context or turn limit), as ``(reward, final_info)``; None (the default) when
  a cut episode just ends truncated. :class:`TextEnv` puts it in the info of the reset
  and of every step the episode goes on after, as ``info["if_cut"] = {"reward": r,
  "info": {...}}`` (:data:`CUT_KEY`); the agent loop adds that reward to the last turn
  and records that info when it cuts the episode, so that filling the context is no
  way around the env's own truncation score. Envs run in worker processes: the loop
  sees only the info, so an env that is not a :class:`TextEnv` writes the key itself.

A malformed action never raises: it is parsed leniently where its meaning is
unambiguous, and otherwise answered with an observation that says what was wrong,
the env's ``invalid_penalty`` as reward, and ``info["invalid_action"]`` set to the
message. Calling ``step`` on a finished episode is a programming error and raises.
"""

from __future__ import annotations

import abc
import importlib
import math
import numbers
import re
from collections.abc import Callable, Hashable
from typing import Any

Observation = Any  # str | list[dict[str, str]]
StepResult = tuple[Observation, float, bool, bool, dict]

#: The info key that carries an env's :meth:`Env.cut_outcome` to the agent loop.
CUT_KEY = "if_cut"


class InvalidAction(Exception):
    """Raised inside an env's ``_step`` when an action cannot be understood.

    :class:`TextEnv` turns it into an observation with the message and the env's
    penalty; it never leaves ``step``.
    """


class MissingExtraError(ImportError):
    """An optional dependency of an adapter is not installed."""

    def __init__(self, what: str, package: str, extra: str):
        super().__init__(
            f"{what} needs the optional package {package!r}, which is not installed; "
            f"install the extra with: pip install 'jaxagent[{extra}]'"
        )
        self.package = package
        self.extra = extra


def require(module: str, what: str, package: str, extra: str):
    """Import ``module`` or raise :class:`MissingExtraError` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports broke
        raise MissingExtraError(what, package, extra) from e


class Env(abc.ABC):
    """A text environment; see the module docstring for the protocol."""

    #: Registered name, e.g. ``"sokoban"`` or ``"gymnasium/Taxi-v4"``.
    name: str = ""
    #: Whether :meth:`expert_action` is available (in the current state; may be a property).
    has_expert: bool = False
    #: A finite action vocabulary (well-formed action texts) for envs that have one,
    #: e.g. the four moves of a grid game; ``()`` when actions are open text. Used for
    #: random and noisy-expert policies.
    random_actions: tuple[str, ...] = ()

    @property
    @abc.abstractmethod
    def system_prompt(self) -> str:
        """The task, its rules and the answer format, for the first (system) message."""

    @property
    @abc.abstractmethod
    def action_format(self) -> str:
        """A short description of one well-formed action."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[Observation, dict]:
        """Start a new episode, fully determined by ``seed``."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the agent's action text; never raises on a malformed action."""

    @abc.abstractmethod
    def state_key(self) -> Hashable:
        """A hashable key of the current state (see the module docstring)."""

    def expert_action(self) -> str:
        """The expert's action text in the current state."""
        raise NotImplementedError(f"{type(self).__name__} has no expert policy")

    def cut_outcome(self, info: dict) -> tuple[float, dict] | None:
        """Optional: what the current episode scores if the rollout cuts it off now (its
        context or turn limit), given this step's (or the reset's) ``info``:
        ``(reward, final_info)``, the reward added to the last step's and the episode's
        final info. None (the default): a cut episode just ends truncated. See the
        module docstring for how it reaches the agent loop."""
        return None

    def close(self) -> None:  # noqa: B027 (a no-op default on purpose, not abstract: most envs hold nothing)
        """Release resources (subprocesses, files). Idempotent."""


class TextEnv(Env):
    """Base for envs with a step limit and a penalty for malformed actions.

    Subclasses implement ``_reset(seed) -> (observation, info)`` and
    ``_step(action) -> (observation, reward, terminated, info)``; ``_step`` raises
    :class:`InvalidAction` for an action it cannot understand, which leaves the state
    unchanged, counts as a step, and returns the message with ``invalid_penalty``.

    Args:
      max_steps: the episode is truncated after this many steps (valid or not).
      invalid_penalty: reward for a malformed action (usually <= 0).
    """

    def __init__(self, *, max_steps: int, invalid_penalty: float = -0.1):
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        if not isinstance(invalid_penalty, (int, float)) or not math.isfinite(invalid_penalty):
            raise ValueError(f"invalid_penalty must be a finite number, got {invalid_penalty!r}")
        self.max_steps = max_steps
        self.invalid_penalty = float(invalid_penalty)
        self._steps = 0
        self._done = True
        self._seed: int | None = None

    @abc.abstractmethod
    def _reset(self, seed: int) -> tuple[Observation, dict]: ...

    @abc.abstractmethod
    def _step(self, action: str) -> tuple[Observation, float, bool, dict]: ...

    def reset(self, seed: int | None = None) -> tuple[Observation, dict]:
        if seed is None:
            import secrets

            seed = secrets.randbits(31)
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        seed = int(seed)
        self._seed = seed
        self._steps = 0
        self._done = False
        obs, info = self._reset(seed)
        info = self._with_cut_outcome(dict(info))
        info.setdefault("seed", seed)
        return obs, info

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.step called on a finished episode; call reset")
        self._steps += 1
        if not isinstance(action, str):
            obs, reward, terminated, info = self._invalid(f"the action must be text, got {type(action).__name__}")
        else:
            try:
                obs, reward, terminated, info = self._step(action)
            except InvalidAction as e:
                obs, reward, terminated, info = self._invalid(str(e))
        truncated = not terminated and self._steps >= self.max_steps
        if truncated:
            obs = _join(obs, f"The step limit ({self.max_steps}) is reached; the episode ends.")
        self._done = terminated or truncated
        info = dict(info)
        if not self._done:
            info = self._with_cut_outcome(info)
        info["step"] = self._steps
        return obs, float(reward), bool(terminated), bool(truncated), info

    def _with_cut_outcome(self, info: dict) -> dict:
        """``info`` with :data:`CUT_KEY` when :meth:`cut_outcome` gives one."""
        cut = self.cut_outcome(info)
        if cut is None:
            return info
        reward, final = cut
        return {**info, CUT_KEY: {"reward": reward, "info": final}}

    def _invalid(self, message: str):
        obs = f"Invalid action: {message}. {self.action_format}"
        return obs, self.invalid_penalty, False, {"invalid_action": message}

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (or none was started)."""
        return self._done


def _join(obs: Observation, text: str) -> Observation:
    if isinstance(obs, str):
        return f"{obs}\n{text}" if obs else text
    return list(obs) + [{"role": "user", "content": text}]


# ---------------------------------------------------------------- action parsing

_TAG_RE_CACHE: dict[str, re.Pattern] = {}


def last_tagged(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text`` (stripped), or None."""
    pat = _TAG_RE_CACHE.get(tag)
    if pat is None:
        pat = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL | re.IGNORECASE)
        _TAG_RE_CACHE[tag] = pat
    found = pat.findall(text)
    return found[-1].strip() if found else None


_DIRECTION_WORDS = {
    "up": "up",
    "u": "up",
    "north": "up",
    "n": "up",
    "↑": "up",
    "down": "down",
    "d": "down",
    "south": "down",
    "s": "down",
    "↓": "down",
    "left": "left",
    "l": "left",
    "west": "left",
    "w": "left",
    "←": "left",
    "right": "right",
    "r": "right",
    "east": "right",
    "e": "right",
    "→": "right",
}
_LONG_DIRECTIONS = ("up", "down", "left", "right", "north", "south", "west", "east")


def parse_direction(text: str) -> str:
    """Parse one move ``up|down|left|right`` leniently.

    Accepted: ``<action>X</action>`` (the last one wins) or bare text, where X is a
    direction word, a compass word (north/south/west/east), its initial letter, or an
    arrow, in any case, with surrounding punctuation. Bare text that names exactly one
    distinct direction as a whole word ("I will move left.") is accepted too. Raises
    :class:`InvalidAction` when there is no direction or several different ones.
    """
    tagged = last_tagged(text, "action")
    candidate = tagged if tagged is not None else text
    token = candidate.strip().strip(".!'\"`*[]() ").lower()
    if token in _DIRECTION_WORDS:
        return _DIRECTION_WORDS[token]
    words = re.findall(r"[a-z]+|[↑↓←→]", candidate.lower())
    found = {_DIRECTION_WORDS[w] for w in words if w in _LONG_DIRECTIONS or w in "↑↓←→"}
    if len(found) == 1:
        return found.pop()
    if not candidate.strip():
        raise InvalidAction("the action is empty")
    if found:
        raise InvalidAction(f"the action names several directions ({', '.join(sorted(found))})")
    raise InvalidAction(f"no direction found in {_clip(candidate)!r}")


def _clip(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ---------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., Env]] = {}
_PREFIXES: dict[str, Callable[..., Env]] = {}


def register(name: str, factory: Callable[..., Env], *, prefix: bool = False) -> None:
    """Register ``factory(**kwargs)`` under ``name`` for :func:`make`.

    With ``prefix=True``, ``name`` is a family (``"gymnasium"``) and names of the form
    ``"gymnasium/<rest>"`` call ``factory(rest, **kwargs)``. Re-registering a name
    replaces it.
    """
    if not isinstance(name, str) or not name or "/" in name and prefix:
        raise ValueError(f"bad env name to register: {name!r}")
    (_PREFIXES if prefix else _REGISTRY)[name] = factory


def _ensure_builtins() -> None:
    # Imported on first use, not at import time, so that envs.builtin (which imports
    # this module) can register into it; custom envs may be registered before.
    importlib.import_module("envs.builtin")


def make(name: str, /, **kwargs) -> Env:
    """Build the env registered as ``name`` with keyword arguments ``kwargs``.

    Names: the built-ins (``frozenlake``, ``sokoban``, ``countdown``, ``toolmath``,
    ``qa``, and the test envs in ``envs.testing``), and families
    ``gymnasium/<id>``, ``reasoning_gym/<dataset>``, ``textworld/<game type>``,
    ``textarena/<game id>``, ``qa/jsonl``, ``qa/tfds``, ``qa/reasoning_gym``.
    """
    _ensure_builtins()
    if not isinstance(name, str):
        raise TypeError(f"env name must be a str, got {type(name).__name__} {name!r}")
    if name in _REGISTRY:
        env = _REGISTRY[name](**kwargs)
    else:
        family, sep, rest = name.partition("/")
        if not sep or family not in _PREFIXES:
            raise ValueError(f"unknown env {name!r}; known: {', '.join(known_envs())}")
        if not rest:
            raise ValueError(f"env name {name!r} lacks the part after '{family}/'")
        env = _PREFIXES[family](rest, **kwargs)
    if not env.name:
        env.name = name
    return env


def known_envs() -> list[str]:
    """Registered names, families shown as ``family/<...>``."""
    _ensure_builtins()
    return sorted(_REGISTRY) + sorted(f"{p}/<...>" for p in _PREFIXES)


def import_modules(modules) -> None:
    """Imports user modules that register envs (`register`), looked up on `sys.path` and in
    the current directory; `ValueError` naming a module that cannot be imported. The
    trainer calls it in its process and in every env worker (its `env.imports`)."""
    import importlib
    import os
    import sys

    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ValueError(f"imports: expected module names, got {name!r}")
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import-time error, named
            raise ValueError(f"imports: cannot import {name!r}: {type(err).__name__}: {err}") from None


def make_with_imports(imports, name: str, kwargs: dict) -> Env:
    """`make(name, **kwargs)` after `import_modules(imports)`: a picklable env factory (with
    `functools.partial`) for pool workers, which import the modules themselves."""
    import_modules(imports)
    return make(name, **kwargs)


def is_known(name: str) -> bool:
    """Whether :func:`make` knows ``name`` (families are not checked further)."""
    _ensure_builtins()
    return name in _REGISTRY or name.partition("/")[0] in _PREFIXES and "/" in name
