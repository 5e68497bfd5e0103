"""The run config's sections of what happens around the update: held-out evaluation
(`EvalSection`), processes (`DistributedSection`), rollout/update overlap
(`OverlapSection`) and logging (`LoggingSection`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

from jaxagent.dataclass_yaml import Bound, Bounded
from jaxagent.train.config.agent import check_tasks_spec


@dataclasses.dataclass(frozen=True)
class EvalSection(Bounded):
    """Held-out evaluation (`episodes: 0` = none): seeds `seed, seed + 1, ...`, disjoint
    from the training stream and the demonstrations (checked).

    Run before RL (after any warm start) and after the last iteration; their success
    rates are `success_before_rl` / `success_after_rl` of `<run_dir>/summary.json`, and
    every `every` iterations in between (0 = never) as `eval_*` metrics.

    episodes: held-out episodes per evaluation (0 = no evaluation).
    seed: the first held-out env seed; episode i plays seed `seed + i`.
    every: also evaluate every this many iterations (0 = only before and after RL).
    temperature: sampling temperature of the evaluation (None = `rollout.temperature`;
      0 = greedy).
    greedy: also evaluate with greedy decoding before and after RL (and every `every`
      iterations, as `eval_greedy_*` metrics)
      (`success_before_rl_greedy` / `success_after_rl_greedy`): whether RL taught the
      policy something its most likely actions did not already do.
    tasks: with `agent.program`, the held-out tasks: a `.jsonl` file or "module:function",
      as `agent.tasks` (episode i plays seed `seed + i`); None = `agent.tasks` itself at
      the held-out seeds (with a JSONL file, seed k plays line `k % n`: the training
      lines, so name a held-out file here for a held-out evaluation).
    """

    episodes: Annotated[int, Bound(ge=0)] = 0
    seed: Annotated[int, Bound(ge=0)] = 2_000_000
    temperature: Annotated[float | None, Bound(ge=0)] = None
    every: Annotated[int, Bound(ge=0)] = 0
    greedy: bool = False
    tasks: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.tasks is not None:
            check_tasks_spec("tasks", self.tasks)


@dataclasses.dataclass(frozen=True)
class DistributedSection(Bounded):
    """Multi-host runs (`jaxagent.parallel.initialize`, JAX's multi-controller runtime).

    All None / False (the default) = one process, unless the environment says otherwise:
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or
    `JAXAGENT_DISTRIBUTED=auto` (fields given here take precedence).
    coordinator_address: "host:port" of process 0.
    num_processes, process_id: world size and this process's rank.
    auto: JAX's cluster detection (TPU pod slices, SLURM, Open MPI, Kubernetes).
    """

    coordinator_address: str | None = None
    num_processes: Annotated[int | None, Bound(ge=1)] = None
    process_id: Annotated[int | None, Bound(ge=0)] = None
    auto: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ValueError(f"process_id must be < num_processes ({self.num_processes}), got {self.process_id!r}")


@dataclasses.dataclass(frozen=True)
class OverlapSection:
    """One-step off-policy overlap of rollout and update.

    off_policy: while the update of iteration n runs, a background thread already
      collects the rollout of iteration n+1 with the pre-update params (so that batch is
      one update stale). The update corrects for it with truncated importance sampling,
      `min(exp(old_logp - rollout_logp), loss.tis_cap)` (required), where `old_logp` is
      recomputed with the params being updated and `rollout_logp` are the sampler's.
      The lag is one update, never more.
    """

    off_policy: bool = False

    #: keys taken out: old key -> why (`load_config` refuses them in a config a person
    #: writes and drops them from a run's saved config.yaml)
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "max_staleness": "overlap.off_policy lags the rollout by exactly one update (the one value "
        "max_staleness took); leave the key out",
    }


@dataclasses.dataclass(frozen=True)
class LoggingSection(Bounded):
    """Run logging besides `metrics.jsonl` (`jaxagent.train.rundir.runlog.RunLogger`).

    tensorboard: event files in `<run_dir>/tensorboard/`.
    progress: a live progress line on stderr (one plain line per iteration when stderr
      is not a terminal); off = the trainer prints a summary line per iteration.
    transcripts_every, transcripts_per_iteration: readable transcripts of that many
      episodes every N iterations in `<run_dir>/transcripts/` (0 = never).
    collapse_entropy, collapse_window: print a warning (counted in `collapse_warnings`)
      when the token entropy is below `collapse_entropy` while training success over the
      last `collapse_window` iterations is not above the window before (0 = off).
    template_collapse_below: print a warning (counted in `template_collapse_warnings`)
      when the batch's `input_dependence` (`jaxagent.train.metrics.input_dependence`:
      whether an episode's responses tell which task it played) has stayed below this
      for `collapse_window` iterations: RAGEN-2's template collapse (0 = off).
    heldout_metric: a metric of every iteration that scores the training episodes with
      a scorer the policy is not trained on (e.g. intake's
      `train_env_heldout_rubric_mean`); a warning (counted in `hacking_warnings`) is
      printed when the training reward rose over the last `collapse_window` iterations
      against the window before while this fell (null = off; a name the iterations do
      not have is an error at the run's first iteration, listing the ones they have; an
      iteration without it, e.g. one whose episodes all failed, is skipped).
    episodes_per_iteration, episodes_max_mb: the episode store (`jaxagent.train.rundir.episodes`):
      that many episodes of each iteration, with tokens, texts, rewards and per-token
      signals, in `<run_dir>/episodes/` (0 = off), at most `episodes_max_mb` MiB a run
      (past it, evenly spaced iterations are kept: every 2nd, then every 4th, ...).
    trackers: experiment trackers besides TensorBoard that get every scalar
      (`jaxagent.train.rundir.trackers`): `wandb` and/or `mlflow` (their extras must be installed).
    wandb_project, wandb_mode: the W&B project, and `offline` (files in
      `<run_dir>/wandb/`, `wandb sync` uploads them) or `online`.
    mlflow_tracking_uri, mlflow_experiment: where MLflow records the run (null: the file
      store `<run_dir>/mlruns`) and under which experiment.
    """

    tensorboard: bool = True
    progress: bool = True
    transcripts_every: Annotated[int, Bound(ge=0)] = 1
    transcripts_per_iteration: Annotated[int, Bound(ge=0)] = 2
    collapse_entropy: Annotated[float, Bound(ge=0)] = 0.05
    collapse_window: Annotated[int, Bound(ge=1)] = 3
    template_collapse_below: Annotated[float, Bound(ge=0, le=1)] = 0.0
    heldout_metric: str | None = None
    episodes_per_iteration: Annotated[int, Bound(ge=0)] = 8
    episodes_max_mb: Annotated[float, Bound(gt=0)] = 64.0
    trackers: tuple[str, ...] = ()
    wandb_project: str = "jaxagent"
    wandb_mode: str = "offline"
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "jaxagent"

    def __post_init__(self):
        from jaxagent.train.rundir.trackers import KNOWN

        super().__post_init__()
        object.__setattr__(self, "trackers", tuple(self.trackers))
        for name in self.trackers:
            if name not in KNOWN or name == "tensorboard":
                raise ValueError(
                    f"trackers: unknown tracker {name!r} (known: wandb, mlflow; TensorBoard is logging.tensorboard)"
                )
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers: {list(self.trackers)} names a tracker twice")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"wandb_mode must be 'offline' or 'online', got {self.wandb_mode!r}")
        if self.heldout_metric is not None and not (isinstance(self.heldout_metric, str) and self.heldout_metric):
            raise ValueError(f"heldout_metric must be a metric name or null, got {self.heldout_metric!r}")
