"""Select estimators and losses by name (what configs say).

``get_advantage_estimator("grpo")`` returns the function; an unknown name raises a
``ValueError`` that lists the registered ones. Projects can add their own with
``register_advantage_estimator`` / ``register_policy_loss``.
"""

from __future__ import annotations

from typing import Callable

from . import advantages as _adv
from . import losses as _loss

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": _adv.gae,
    "grpo": _adv.grpo,
    "dr_grpo": _adv.dr_grpo,
    "rloo": _adv.rloo,
    "reinforce_pp": _adv.reinforce_pp,
    "reinforce_pp_baseline": _adv.reinforce_pp_baseline,
    "remax": _adv.remax,
    "gigpo": _adv.gigpo,
    "turn_gae": _adv.turn_gae,
    "turn_returns": _adv.turn_returns,
}

_POLICY_LOSSES: dict[str, Callable] = {
    "ppo": _loss.ppo_loss,
    "gspo": _loss.gspo_loss,
    "cispo": _loss.cispo_loss,
}


def _lookup(table: dict, kind: str, name: str) -> Callable:
    try:
        return table[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def _register(table: dict, kind: str, name: str, fn: Callable, overwrite: bool) -> Callable:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
    if name in table and not overwrite:
        raise ValueError(f"{kind} {name!r} is already registered (pass overwrite=True to replace it)")
    table[name] = fn
    return fn


def get_advantage_estimator(name: str) -> Callable:
    return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def list_advantage_estimators() -> list[str]:
    return sorted(_ADVANTAGE_ESTIMATORS)


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def register_advantage_estimator(name: str, fn: Callable, *, overwrite: bool = False) -> Callable:
    return _register(_ADVANTAGE_ESTIMATORS, "advantage estimator", name, fn, overwrite)


def register_policy_loss(name: str, fn: Callable, *, overwrite: bool = False) -> Callable:
    return _register(_POLICY_LOSSES, "policy loss", name, fn, overwrite)
