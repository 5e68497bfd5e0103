"""The update's old single module, kept so that existing imports keep working: its names
now live by job in `step_config` (the configs), `batch` (the batch pytrees and
denominators), `state` (the train state and optimizer), `losses` (the loss-and-grads),
`update` (accumulation, apply, the jitted and sharded steps) and `trimmed` (the ragged
update). Import from those modules, or from `jaxagent.train`, in new code.
"""
from jaxagent.train.batch import (
    Denominators,
    SFTBatch,
    UpdateBatch,
    batch_denominators,
    last_turn_mask,
)
from jaxagent.train.losses import LossSums, critic_values, for_compute, policy_loss_and_grads, sft_loss_and_grads
from jaxagent.train.state import (
    DECAYED_LEAVES,
    Grads,
    TrainState,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)
from jaxagent.train.step_config import KL_TURNS, SCHEDULES, TIS_LEVELS, LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.trimmed import (  # noqa: F401  (private names still imported from here)
    TrimmedTrainStep,
    _micro_add,
    _trimmed_finish,
    _trimmed_prepare,
    length_groups,
    row_lengths,
)
from jaxagent.train.trimmed import length_runs as _length_runs  # noqa: F401  (placement.py imports it)
from jaxagent.train.update import accumulated_grads, make_sharded_train_step, make_train_step, sft_step, train_step

__all__ = [
    "DECAYED_LEAVES", "KL_TURNS", "SCHEDULES", "TIS_LEVELS",
    "Denominators", "Grads", "LossConfig", "LossSums", "OptimizerConfig", "SFTBatch", "StepConfig", "TrainState",
    "TrimmedTrainStep", "UpdateBatch",
    "accumulated_grads", "batch_denominators", "critic_values", "for_compute", "init_train_state", "last_turn_mask",
    "learning_rate_schedule", "length_groups", "make_optimizer", "make_sharded_train_step", "make_train_step",
    "policy_loss_and_grads", "row_lengths", "sft_loss_and_grads", "sft_step", "state_shardings", "train_step",
]
