"""``jaxagent.algos``: pure, jitted advantage estimators and policy losses.

Importable alone (it imports nothing else from jaxagent). Conventions follow the
PyTorch trainers (verl 0.9.1) on every valid position; deliberate improvements are
documented in each docstring. The formulas and their sources are in
``docs/explanations/formulas.md``.
"""

from .advantages import (
    anchor_ids_from_keys,
    dr_grpo,
    gae,
    gigpo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    turn_gae,
    turn_loo,
    turn_returns,
    turn_start_values,
    turns_to_tokens,
)
from .losses import (
    AGG_MODES,
    KL_KINDS,
    aggregate,
    cispo_loss,
    entropy,
    gspo_loss,
    kl,
    ppo_loss,
    tis_weights,
    value_loss,
)
from .masked import masked_mean, masked_var, masked_whiten
from .registry import (
    ESTIMATOR_INPUTS,
    EstimatorSpec,
    get_advantage_estimator,
    get_estimator_spec,
    get_policy_loss,
    list_advantage_estimators,
    list_policy_losses,
    register_advantage_estimator,
    register_policy_loss,
)

__all__ = [
    "AGG_MODES",
    "ESTIMATOR_INPUTS",
    "EstimatorSpec",
    "KL_KINDS",
    "get_estimator_spec",
    "aggregate",
    "anchor_ids_from_keys",
    "cispo_loss",
    "dr_grpo",
    "entropy",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "gigpo",
    "grpo",
    "gspo_loss",
    "kl",
    "list_advantage_estimators",
    "list_policy_losses",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "tis_weights",
    "turn_gae",
    "turn_loo",
    "turn_returns",
    "turn_start_values",
    "turns_to_tokens",
    "value_loss",
]
