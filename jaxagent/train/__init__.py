"""Training: the jitted update, checkpoints, and the loop over small libraries.

- The update, one job per module: `step_config` (`OptimizerConfig`, `LossConfig`,
  `StepConfig`), `batch` (`UpdateBatch` / `SFTBatch`, `Denominators`), `state`
  (`TrainState`, `Grads`, the optimizer, `init_train_state`), `losses` (the policy,
  value and SFT loss-and-grads), `update` (`train_step` / `sft_step`, jitted once, state
  donated; `make_train_step` / `make_sharded_train_step`, explicit in/out shardings;
  the accumulation and apply they are made of), `trimmed` (`TrimmedTrainStep`: each
  micro-batch cut to its rows' length; `TrimmedUpdate`, the trimmed update strategy,
  beside `update.PaddedUpdate`).
- `checkpoint`: `CheckpointManager` (async, keep-N, atomic, exact restore,
  incompatibility check) and `export_policy` (Hugging Face dir).
- `config`: `TrainerConfig` and its sections (typed, for `jaxagent.config.load_config`).
- `build`: tokenizer, policy, critic, KL reference, RL state, env factory, agent loop.
- `placement`: `Placement`, one device / a mesh / several processes.
- `collect`: the task stream, the rollout, dynamic sampling.
- `advantages`: reward shaping and estimator dispatch by declared inputs.
- `metrics`, `rundir`, `warmstart`, `evaluate`, `runtools` (read back, restore and export a
  run), `overlap`, `memory`, `runlog` (`RunLogger`), `plot`.
- `trainer`: `Trainer`, the loop (rollout -> advantages -> updates -> metrics ->
  checkpoint, exact resume).
"""

from jaxagent.train.batch import (
    Denominators,
    SFTBatch,
    UpdateBatch,
    batch_denominators,
    last_turn_mask,
)
from jaxagent.train.checkpoint import (
    CheckpointManager,
    IncompatibleCheckpointError,
    export_policy,
)
from jaxagent.train.config import TrainerConfig
from jaxagent.train.losses import critic_values, policy_loss_and_grads, sft_loss_and_grads
from jaxagent.train.state import (
    Grads,
    TrainState,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)
from jaxagent.train.step_config import SCHEDULES, LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.trainer import Trainer
from jaxagent.train.trimmed import TrimmedTrainStep, length_groups, row_lengths
from jaxagent.train.update import (
    accumulated_grads,
    make_sharded_train_step,
    make_train_step,
    sft_step,
    train_step,
)

__all__ = [
    "SCHEDULES",
    "CheckpointManager",
    "Denominators",
    "Grads",
    "IncompatibleCheckpointError",
    "LossConfig",
    "OptimizerConfig",
    "SFTBatch",
    "StepConfig",
    "TrainState",
    "TrimmedTrainStep",
    "UpdateBatch",
    "accumulated_grads",
    "batch_denominators",
    "critic_values",
    "export_policy",
    "init_train_state",
    "last_turn_mask",
    "learning_rate_schedule",
    "length_groups",
    "make_optimizer",
    "make_sharded_train_step",
    "make_train_step",
    "policy_loss_and_grads",
    "row_lengths",
    "sft_loss_and_grads",
    "sft_step",
    "state_shardings",
    "train_step",
    "Trainer",
    "TrainerConfig",
]
