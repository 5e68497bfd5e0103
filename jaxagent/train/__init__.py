"""Training: the jitted update (`step`), orbax checkpoints (`checkpoint`) and the loop (`trainer`).

`step`: `TrainState`, `UpdateBatch` / `SFTBatch`, configs (`OptimizerConfig`,
`LossConfig`, `StepConfig`), `train_step` / `sft_step` (jitted once, state donated),
the pure pieces they are made of. `checkpoint`: `CheckpointManager` (async, keep-N,
atomic, exact restore, incompatibility check) and `export_policy` (Hugging Face dir).
`trainer`: `TrainerConfig` (typed, for `jaxagent.config.load_config`) and `Trainer`
(rollout -> advantages -> updates -> metrics -> checkpoint, exact resume).
"""
from jaxagent.train.checkpoint import (
    CheckpointManager,
    IncompatibleCheckpointError,
    export_policy,
)
from jaxagent.train.step import (
    SCHEDULES,
    Denominators,
    Grads,
    LossConfig,
    OptimizerConfig,
    SFTBatch,
    StepConfig,
    TrainState,
    UpdateBatch,
    accumulated_grads,
    batch_denominators,
    critic_values,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    make_train_step,
    policy_loss_and_grads,
    sft_loss_and_grads,
    sft_step,
    state_shardings,
    train_step,
)
from jaxagent.train.trainer import Trainer, TrainerConfig

__all__ = [
    "SCHEDULES", "CheckpointManager", "Denominators", "Grads", "IncompatibleCheckpointError",
    "LossConfig", "OptimizerConfig", "SFTBatch", "StepConfig", "TrainState", "UpdateBatch",
    "accumulated_grads", "batch_denominators", "critic_values", "export_policy",
    "init_train_state", "learning_rate_schedule", "make_optimizer", "make_train_step",
    "policy_loss_and_grads", "sft_loss_and_grads", "sft_step", "state_shardings", "train_step",
    "Trainer", "TrainerConfig",
]
