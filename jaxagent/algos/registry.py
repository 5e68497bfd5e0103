"""Select estimators and losses by name (what configs say).

``get_advantage_estimator("grpo")`` returns the function; an unknown name raises a
``ValueError`` that lists the registered ones. Projects can add their own with
``register_advantage_estimator`` / ``register_policy_loss``.

An estimator also declares what it consumes (``get_estimator_spec(name)``): the names of
its positional arguments, in order, and of its keyword arguments, each one of
``ESTIMATOR_INPUTS``. A trainer dispatches on that declaration alone, so an estimator
registered from outside the package trains by name like a built-in one::

    register_advantage_estimator("my_adv", my_adv, inputs=("rewards", "mask", "group_ids"))

``returns=True`` says the function returns ``(advantages, returns)`` (the returns are the
critic's value targets). An estimator whose inputs include a turn-level array (``[B, K]``)
returns turn-level advantages; the trainer spreads them onto each turn's tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from . import advantages as _adv
from . import losses as _loss

#: what an estimator may consume: name -> meaning (shapes: B rows, T tokens, K turns).
ESTIMATOR_INPUTS: dict[str, str] = {
    "rewards": "[B, T] float: each turn's reward at the turn's last policy token, 0 elsewhere",
    "mask": "[B, T] float: 1 on the policy tokens that train (failed / filtered episodes removed)",
    "group_ids": "[B] int: the episode's group (episodes of one task share it)",
    "values": "[B, T] float: the critic's value of every token (the trainer then trains a critic)",
    "turn_rewards": "[B, K] float: each turn's reward",
    "turn_mask": "[B, K] bool: turns played by episodes that did not fail",
    "anchor_ids": "[B, K] int: the env state each turn acted in (equal ids = same state), -1 = none",
    "turn_values": "[B, K] float: the critic's value at each turn's first policy token",
    "baselines": "[B] float: a per-episode baseline reward (e.g. of a greedy rollout)",
    "gamma": "float: the discount",
    "lam": "float: the GAE lambda",
}
#: inputs with a turn axis: an estimator that takes one returns per-turn advantages.
TURN_INPUTS = ("turn_rewards", "turn_mask", "anchor_ids", "turn_values")


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator consumes and returns (see the module docstring).

    inputs: the positional arguments, in order (names of ``ESTIMATOR_INPUTS``); None =
      not declared (the function can be called, but not dispatched by a trainer).
    keywords: inputs passed by keyword, under their own names.
    returns: the function returns ``(advantages, returns)`` rather than advantages.
    """

    fn: Callable
    inputs: tuple[str, ...] | None = None
    keywords: tuple[str, ...] = ()
    returns: bool = False

    def __post_init__(self):
        for field in ("inputs", "keywords"):
            names = getattr(self, field)
            if names is None:
                continue
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"estimator {field} must be a sequence of input names, got {names!r}")
            unknown = [n for n in names if n not in ESTIMATOR_INPUTS]
            if unknown:
                raise ValueError(f"estimator {field}: unknown input(s) {unknown}; known: {list(ESTIMATOR_INPUTS)}")
            object.__setattr__(self, field, tuple(names))

    @property
    def consumes(self) -> tuple[str, ...]:
        """Every input the estimator reads (positional, then keyword)."""
        return (self.inputs or ()) + self.keywords

    @property
    def turn_level(self) -> bool:
        """Its advantages are per turn (`[B, K]`), not per token."""
        return any(n in TURN_INPUTS for n in self.consumes)


_OUTCOME = ("rewards", "mask", "group_ids")
_ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(_adv.gae, ("rewards", "values", "mask", "gamma", "lam"), returns=True),
    "grpo": EstimatorSpec(_adv.grpo, _OUTCOME),
    "dr_grpo": EstimatorSpec(_adv.dr_grpo, _OUTCOME),
    "rloo": EstimatorSpec(_adv.rloo, _OUTCOME),
    "reinforce_pp": EstimatorSpec(_adv.reinforce_pp, ("rewards", "mask", "gamma"), returns=True),
    "reinforce_pp_baseline": EstimatorSpec(_adv.reinforce_pp_baseline, _OUTCOME),
    "remax": EstimatorSpec(_adv.remax, ("rewards", "mask", "baselines"), returns=True),
    "gigpo": EstimatorSpec(_adv.gigpo, ("turn_rewards", "turn_mask", "group_ids", "anchor_ids"), keywords=("gamma",)),
    "turn_gae": EstimatorSpec(
        _adv.turn_gae, ("turn_rewards", "turn_values", "turn_mask", "gamma", "lam"), returns=True
    ),
    "turn_returns": EstimatorSpec(_adv.turn_returns, ("turn_rewards", "turn_mask", "gamma")),
    "turn_loo": EstimatorSpec(_adv.turn_loo, ("turn_rewards", "turn_mask", "group_ids", "gamma")),
}

_POLICY_LOSSES: dict[str, Callable] = {
    "ppo": _loss.ppo_loss,
    "gspo": _loss.gspo_loss,
    "cispo": _loss.cispo_loss,
}


_T = TypeVar("_T")


def _lookup(table: dict[str, _T], kind: str, name: str) -> _T:
    try:
        return table[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def _register(table: dict[str, _T], kind: str, name: str, fn: _T, overwrite: bool) -> _T:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    if not callable(fn) and not isinstance(fn, EstimatorSpec):
        raise TypeError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
    if name in table and not overwrite:
        raise ValueError(f"{kind} {name!r} is already registered (pass overwrite=True to replace it)")
    table[name] = fn
    return fn


def get_advantage_estimator(name: str) -> Callable:
    return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name).fn


def get_estimator_spec(name: str) -> EstimatorSpec:
    """The estimator `name` with what it consumes (`EstimatorSpec`)."""
    return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def list_advantage_estimators() -> list[str]:
    return sorted(_ADVANTAGE_ESTIMATORS)


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def register_advantage_estimator(
    name: str, fn: Callable, *, inputs=None, keywords=(), returns: bool = False, overwrite: bool = False
) -> Callable:
    """Registers `fn` under `name`; `inputs`, `keywords`, `returns` declare what it
    consumes and returns (`EstimatorSpec`), which a trainer needs to train with it."""
    if not callable(fn):
        raise TypeError(f"advantage estimator {name!r} must be callable, got {type(fn).__name__}")
    spec = EstimatorSpec(fn, inputs, keywords, bool(returns))
    _register(_ADVANTAGE_ESTIMATORS, "advantage estimator", name, spec, overwrite)
    return fn


def register_policy_loss(name: str, fn: Callable, *, overwrite: bool = False) -> Callable:
    return _register(_POLICY_LOSSES, "policy loss", name, fn, overwrite)
