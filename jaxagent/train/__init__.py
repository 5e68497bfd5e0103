"""Training: the trainer loop on top of a few sub-packages, one job each.

- `trainer`: `Trainer`, the loop (its iteration as named phases) and `build`, which
  builds a run's parts from its `TrainerConfig` and picks its rollout source once.
- `config`: `TrainerConfig` and its sections, one module per group (`model`, `env`,
  `rollout`, `algo`, `warm_start`, `agent`, `step`, `update`, `run`).
- `sources`: where episodes come from (`sources.RolloutSource`: the env path and the
  agent-program path), the task stream and rollout (`collect`), the overlap thread.
- `update`: the jitted update (`update.PaddedUpdate`, `update.trimmed.TrimmedUpdate`), its
  losses, batch, state and advantages.
- `rundir`: the run's files: the run directory, checkpoints, the run log, trackers, the
  episode store and plots.
- `placement` (one device, a mesh, several processes), `memory` / `compiled` (the memory
  check), `warmstart`, `evaluate`, `metrics`, `stop`, `runtools`.
"""
