"""Training: the jitted update, checkpoints, and the loop over small libraries.

- `step`: `TrainState`, `UpdateBatch` / `SFTBatch`, configs (`OptimizerConfig`,
  `LossConfig`, `StepConfig`), `train_step` / `sft_step` (jitted once, state donated),
  `make_train_step` / `make_sharded_train_step` (explicit in/out shardings), the pure
  pieces they are made of; `TrimmedTrainStep` (each micro-batch cut to its rows' length).
- `checkpoint`: `CheckpointManager` (async, keep-N, atomic, exact restore,
  incompatibility check) and `export_policy` (Hugging Face dir).
- `config`: `TrainerConfig` and its sections (typed, for `jaxagent.config.load_config`).
- `build`: tokenizer, policy, critic, KL reference, RL state, env factory, agent loop.
- `placement`: `Placement`, one device / a mesh / several processes.
- `collect`: the task stream, the rollout, dynamic sampling.
- `advantages`: reward shaping and estimator dispatch by declared inputs.
- `metrics`, `rundir`, `warmstart`, `evaluate`, `overlap`, `memory`, `logging`, `plot`.
- `trainer`: `Trainer`, the loop (rollout -> advantages -> updates -> metrics ->
  checkpoint, exact resume).
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
    TrimmedTrainStep,
    UpdateBatch,
    accumulated_grads,
    batch_denominators,
    critic_values,
    init_train_state,
    last_turn_mask,
    learning_rate_schedule,
    length_groups,
    make_optimizer,
    make_sharded_train_step,
    make_train_step,
    policy_loss_and_grads,
    row_lengths,
    sft_loss_and_grads,
    sft_step,
    state_shardings,
    train_step,
)
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

__all__ = [
    "SCHEDULES", "CheckpointManager", "Denominators", "Grads", "IncompatibleCheckpointError",
    "LossConfig", "OptimizerConfig", "SFTBatch", "StepConfig", "TrainState", "TrimmedTrainStep", "UpdateBatch",
    "accumulated_grads", "batch_denominators", "critic_values", "export_policy",
    "init_train_state", "last_turn_mask", "learning_rate_schedule", "length_groups", "make_optimizer", "make_sharded_train_step", "make_train_step",
    "policy_loss_and_grads", "row_lengths", "sft_loss_and_grads", "sft_step", "state_shardings", "train_step",
    "Trainer", "TrainerConfig",
]
