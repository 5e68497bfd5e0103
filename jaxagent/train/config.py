"""The training run's config: `TrainerConfig` and its sections, validated on construction.

Load with `jaxagent.config.load_config(TrainerConfig, path, overrides)`; every key is
listed by `jaxagent config` (the keys, their defaults and these docstrings). Sections
that configure a component embed that component's own config where there is one
(`loss`, `optim`: `jaxagent.train.step_config`; `mesh`: `jaxagent.parallel.MeshConfig`) and
build it where the trainer's keys are fewer (`RolloutSection.loop_config()` is the
`jaxagent.rollout.AgentLoopConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jaxagent.parallel import MeshConfig
from jaxagent.train.agent_section import AgentSection, check_tasks_spec

# the sections of jaxagent.train.sections, importable from here
from jaxagent.train.sections import (  # noqa: F401
    CRITIC_INPUTS,
    MATMUL_PRECISIONS,
    MODEL_TYPES,
    PROVIDED_INPUTS,
    RESUME_FIXED,
    TRUNCATION_MODES,
    AlgoSection,
    EnvSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    WarmStartSection,
    _check_int,
    demonstration_source,
    import_env_modules,
)
from jaxagent.train.step_config import LossConfig, OptimizerConfig, StepConfig


@dataclasses.dataclass(frozen=True)
class EvalSection:
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

    episodes: int = 0
    seed: int = 2_000_000
    temperature: float | None = None
    every: int = 0
    greedy: bool = False
    tasks: str | None = None

    def __post_init__(self):
        if self.tasks is not None:
            check_tasks_spec("tasks", self.tasks)
        _check_int("episodes", self.episodes, 0)
        _check_int("seed", self.seed, 0)
        _check_int("every", self.every, 0)
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 or null, got {self.temperature!r}")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (`jaxagent.parallel.initialize`, JAX's multi-controller runtime).

    All None / False (the default) = one process, unless the environment says otherwise:
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or
    `JAXAGENT_DISTRIBUTED=auto` (fields given here take precedence).
    coordinator_address: "host:port" of process 0.
    num_processes, process_id: world size and this process's rank.
    auto: JAX's cluster detection (TPU pod slices, SLURM, Open MPI, Kubernetes).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    def __post_init__(self):
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, 1)
        if self.process_id is not None:
            _check_int("process_id", self.process_id, 0)
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(f"process_id must be < num_processes ({self.num_processes}), got {self.process_id!r}")


@dataclasses.dataclass(frozen=True)
class OverlapSection:
    """One-step off-policy overlap of rollout and update.

    off_policy: while the update of iteration n runs, a background thread already
      collects the rollout of iteration n+1 with the pre-update params (so that batch is
      one update stale). The update corrects for it with truncated importance sampling,
      `min(exp(old_logp - rollout_logp), loss.tis_cap)` (required), where `old_logp` is
      recomputed with the params being updated and `rollout_logp` are the sampler's.
    max_staleness: updates a rollout may lag behind (only 1 is supported).
    """

    off_policy: bool = False
    max_staleness: int = 1

    def __post_init__(self):
        if self.max_staleness != 1:
            raise ValueError(f"max_staleness: only 1 (one-step off-policy) is supported, got {self.max_staleness!r}")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Run logging besides `metrics.jsonl` (`jaxagent.train.runlog.RunLogger`).

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
    episodes_per_iteration, episodes_max_mb: the episode store (`jaxagent.train.episodes`):
      that many episodes of each iteration, with tokens, texts, rewards and per-token
      signals, in `<run_dir>/episodes/` (0 = off), at most `episodes_max_mb` MiB a run
      (past it, evenly spaced iterations are kept: every 2nd, then every 4th, ...).
    trackers: experiment trackers besides TensorBoard that get every scalar
      (`jaxagent.train.trackers`): `wandb` and/or `mlflow` (their extras must be installed).
    wandb_project, wandb_mode: the W&B project, and `offline` (files in
      `<run_dir>/wandb/`, `wandb sync` uploads them) or `online`.
    mlflow_tracking_uri, mlflow_experiment: where MLflow records the run (null: the file
      store `<run_dir>/mlruns`) and under which experiment.
    """

    tensorboard: bool = True
    progress: bool = True
    transcripts_every: int = 1
    transcripts_per_iteration: int = 2
    collapse_entropy: float = 0.05
    collapse_window: int = 3
    template_collapse_below: float = 0.0
    heldout_metric: str | None = None
    episodes_per_iteration: int = 8
    episodes_max_mb: float = 64.0
    trackers: tuple[str, ...] = ()
    wandb_project: str = "jaxagent"
    wandb_mode: str = "offline"
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "jaxagent"

    def __post_init__(self):
        from jaxagent.train.trackers import KNOWN

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
        _check_int("episodes_per_iteration", self.episodes_per_iteration, 0)
        if not (
            isinstance(self.episodes_max_mb, (int, float))
            and not isinstance(self.episodes_max_mb, bool)
            and math.isfinite(self.episodes_max_mb)
            and self.episodes_max_mb > 0
        ):
            raise ValueError(f"episodes_max_mb must be a number > 0, got {self.episodes_max_mb!r}")
        _check_int("transcripts_every", self.transcripts_every, 0)
        _check_int("transcripts_per_iteration", self.transcripts_per_iteration, 0)
        _check_int("collapse_window", self.collapse_window, 1)
        if not (
            isinstance(self.collapse_entropy, (int, float))
            and not isinstance(self.collapse_entropy, bool)
            and math.isfinite(self.collapse_entropy)
            and self.collapse_entropy >= 0
        ):
            raise ValueError(f"collapse_entropy must be a number >= 0, got {self.collapse_entropy!r}")
        if not (
            isinstance(self.template_collapse_below, (int, float))
            and not isinstance(self.template_collapse_below, bool)
            and 0 <= self.template_collapse_below <= 1
        ):
            raise ValueError(
                f"template_collapse_below must be a number in [0, 1], got {self.template_collapse_below!r}"
            )
        if self.heldout_metric is not None and not (isinstance(self.heldout_metric, str) and self.heldout_metric):
            raise ValueError(f"heldout_metric must be a metric name or null, got {self.heldout_metric!r}")


OLD_LOGPROBS = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class UpdateSection:
    """How an iteration's batch updates the policy: mini-batches, micro-batches, the
    log-prob pass before the update, and whether the update and that pass are cut to the
    rows' own lengths (the run's builder chooses the update step and the log-prob pass
    from these keys once: `jaxagent.train.build.make_placement`).

    epochs, mini_batches, micro_batches: each iteration's batch of
      `env.group_size * env.tasks_per_iteration` episodes is shuffled and cut into
      `mini_batches` updates, `epochs` times; each mini-batch is accumulated over
      `micro_batches` micro-batches.
    logprob_rows: rows per pass of the log-prob computations over an iteration's batch
      (old policy, KL reference); None = the whole batch in one pass. The passes run in
      turn, so their memory is that of `logprob_rows` rows: set it (a divisor of the batch,
      e.g. the update's micro-batch rows) when the memory check says the log-prob pass
      does not fit. Values agree with one pass to float32 rounding.
    old_logprobs: where the update's old-policy log-probs come from. "recompute" (the
      default): a forward pass of the trainer over the batch before the update, with the
      params that sampled it. "sampler": the sampler's own log-probs of the tokens it drew
      (`rollout_logp`), which are those of the same params and distribution up to float
      rounding (the `rollout_logp_gap` metric of a "recompute" run shows how close), so
      the log-prob pass is skipped: one forward pass over the batch less per iteration.
      It needs untruncated sampling (`rollout.top_k` 0, `rollout.top_p` 1) and no
      `loss.tis_cap` (whose weights compare the two).
    trim_padding: 0 = the log-prob pass and the update see every row padded to
      `rollout.max_context` (they compile once); N > 0 = each iteration's batch is cut to
      its longest episode rounded up to a multiple of N (`jaxagent.rollout.trim_padding`):
      the same losses, computed without the trailing padding, at the cost of one compile
      per distinct length. Worth it when episodes are much shorter than `max_context`.
      With several processes the batches are cut to the longest episode of all of them.
    trim_chunks: with `trim_padding` N > 0, also cut each micro-batch of the update and
      each row chunk of the log-prob pass to its own longest episode (rounded up to a
      multiple of N), the rows grouped by length (`jaxagent.train.trimmed.TrimmedUpdate`):
      the same losses (the denominators are the mini-batch's), without the padding of
      rows shorter than the batch's longest. Worth it when episode lengths vary; each
      distinct chunk length compiles once. The log-prob pass runs in chunks of
      `logprob_rows` rows, or of the update's micro-batch rows when that is unset. On a
      mesh (one process or several) data * fsdp must divide a micro-batch's rows: each
      cut micro-batch's rows are split over them, and every process cuts the same
      micro-batches from its copy of the batch.
    """

    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    logprob_rows: int | None = None
    old_logprobs: str = "recompute"
    trim_padding: int = 0
    trim_chunks: bool = False

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "micro_batches"):
            _check_int(name, getattr(self, name), 1)
        if self.logprob_rows is not None:
            _check_int("logprob_rows", self.logprob_rows, 1)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {list(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        _check_int("update.trim_padding", self.trim_padding, 0)
        if not isinstance(self.trim_chunks, bool):
            raise ValueError(f"update.trim_chunks must be true or false, got {self.trim_chunks!r}")
        if self.trim_chunks and not self.trim_padding:
            raise ValueError(
                "update.trim_chunks needs update.trim_padding > 0 (the multiple its chunk lengths "
                "are rounded up to), got update.trim_padding=0"
            )

    def check_batch(self, batch_size: int) -> None:
        """`ValueError` unless the rollout batch of `batch_size` rows splits into
        `mini_batches` mini-batches of `micro_batches` micro-batches, and into passes of
        `logprob_rows` rows."""
        B = batch_size
        if B % self.mini_batches:
            raise ValueError(
                f"update.mini_batches ({self.mini_batches}) must divide the rollout batch "
                f"env.group_size * env.tasks_per_iteration = {B}"
            )
        if (B // self.mini_batches) % self.micro_batches:
            raise ValueError(
                f"update.micro_batches ({self.micro_batches}) must divide the mini-batch size {B // self.mini_batches}"
            )
        if self.logprob_rows is not None and B % self.logprob_rows:
            raise ValueError(
                f"update.logprob_rows ({self.logprob_rows}) must divide the rollout batch "
                f"env.group_size * env.tasks_per_iteration = {B}"
            )

    def micro_batch_rows(self, batch_size: int) -> int:
        """Rows of one micro-batch of the update of a batch of `batch_size` rows."""
        return batch_size // (self.mini_batches * self.micro_batches)


def check_mesh_rows(batch_size: int, mini_batches: int, shards: int) -> None:
    """`ValueError` unless a mini-batch's rows (`batch_size / mini_batches`) split over
    `shards = mesh.data * mesh.fsdp`: the one mesh divisibility check, made on the config
    when its mesh has no -1 axis and on the mesh itself (`jaxagent.train.placement.make_mesh`)."""
    mb = batch_size // mini_batches
    if mb % shards:
        raise ValueError(
            f"mesh: the mini-batch size {mb} (env.group_size * env.tasks_per_iteration / "
            f"update.mini_batches) must be divisible by mesh.data * mesh.fsdp = {shards} (its rows "
            f"are split over them)"
        )


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Everything a training run needs; load with `jaxagent.config.load_config`.

    critic_optim: the critic's optimizer (`OptimizerConfig`), for estimators that train
      one (e.g. "gae", "turn_gae"); None = the same settings as `optim`.
    loss, optim, critic_optim: `jaxagent.train.LossConfig` / `OptimizerConfig` (the
      critic's defaults to `optim`). `loss.temperature` must equal a non-zero
      `rollout.temperature` (the log-probs are those of the sampling distribution).
    update: the update's settings (`UpdateSection`): epochs, mini- and micro-batches, the
      log-prob pass (`logprob_rows`, `old_logprobs`) and trimming (`trim_padding`,
      `trim_chunks`).
    iterations: the run's length (a resumed run continues up to it).
    seed: model initialisation and `state.rng`.
    run_dir: metrics.jsonl, config.yaml and checkpoints/ go here.
    checkpoint_every, keep_checkpoints: save every N iterations (and after the last);
      keep the newest `keep_checkpoints`.
    mesh: the device mesh `{data, fsdp, tensor}` (`jaxagent.parallel.MeshConfig`; one
      size may be -1 = the rest). All 1 (the default) = one device, exactly the
      single-device loop. Otherwise the mini-batch size must be divisible by
      `data * fsdp`; a mesh smaller than the devices uses the first ones (one process).
    distributed: multi-host set-up (`DistributedSection`); with several processes and
      an all-1 mesh, the mesh is `data = -1` (pure data parallelism over every device).
    device_memory_gb: the per-device memory for the memory check before the run, when
      the device does not report it; None = on CPU devices the host's available RAM
      shared by the local devices, elsewhere no check.
    overlap: one-step off-policy rollout/update overlap (`OverlapSection`; off by default).
    agent: an agent program written against the OpenAI client to train instead of the
      env's agent loop (`AgentSection`; off by default).
    jit_cache_dir: JAX's persistent compilation cache, so that a resumed run or the next
      run of the same shapes skips XLA's compilation: "auto" (the default) =
      `$XDG_CACHE_HOME/jaxagent/jit` (else `~/.cache/jaxagent/jit`), a path, or null = off.
      Left alone when `$JAX_COMPILATION_CACHE_DIR` is set or the process already set
      `jax_compilation_cache_dir`.
    """

    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algo: AlgoSection = AlgoSection()
    warm_start: WarmStartSection = WarmStartSection()
    reward: RewardSection = RewardSection()
    eval: EvalSection = EvalSection()
    loss: LossConfig = LossConfig()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    update: UpdateSection = UpdateSection()
    iterations: int = 2
    seed: int = 0
    run_dir: str = "runs/default"
    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedSection = DistributedSection()
    device_memory_gb: float | None = None
    overlap: OverlapSection = OverlapSection()
    logging: LoggingSection = LoggingSection()
    agent: AgentSection = AgentSection()
    jit_cache_dir: str | None = "auto"

    #: top-level keys that moved into a section: old key -> new dotted key (`load_config`
    #: refuses the old one and names the new one)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        name: f"update.{name}" for name in ("epochs", "mini_batches", "micro_batches", "logprob_rows", "old_logprobs")
    }

    def __post_init__(self):
        for name in ("iterations", "checkpoint_every", "keep_checkpoints"):
            _check_int(name, getattr(self, name), 1)
        if self.jit_cache_dir is not None and (not isinstance(self.jit_cache_dir, str) or not self.jit_cache_dir):
            raise ValueError(f'jit_cache_dir must be "auto", a directory or null (off), got {self.jit_cache_dir!r}')
        _check_int("seed", self.seed, 0)
        if self.eval.tasks is not None and not self.agent.enabled:
            raise ValueError(
                f"eval.tasks ({self.eval.tasks!r}) is for agent programs: set agent.program and agent.tasks, "
                "or leave eval.tasks null"
            )
        if self.agent.enabled and self.warm_start.episodes and self.agent.expert is None:
            raise ValueError(
                f"warm_start.episodes ({self.warm_start.episodes}) with agent.program needs agent.expert: the "
                "demonstrations are the program's episodes against that expert (module:function)"
            )
        B = self.env.batch_size
        self.update.check_batch(B)
        if self.update.old_logprobs == "sampler":
            refused = [
                (
                    self.rollout.temperature == 0,
                    "rollout.temperature is 0 (greedy decoding has no sampling distribution)",
                ),
                (self.rollout.top_k > 0, f"rollout.top_k is {self.rollout.top_k} (truncated sampling)"),
                (self.rollout.top_p < 1, f"rollout.top_p is {self.rollout.top_p} (truncated sampling)"),
                (
                    self.loss.tis_cap is not None,
                    "loss.tis_cap is set (its weights compare the sampler's log-probs with recomputed ones)",
                ),
            ]
            why = next((reason for bad, reason in refused if bad), None)
            if why:
                raise ValueError(
                    f"update.old_logprobs='sampler' takes the sampler's log-probs as the old "
                    f"policy's, but {why}; use update.old_logprobs='recompute'"
                )
        if self.rollout.temperature > 0 and self.loss.temperature != self.rollout.temperature:
            raise ValueError(
                f"loss.temperature ({self.loss.temperature}) must equal rollout.temperature "
                f"({self.rollout.temperature}): the update's log-probs are the sampler's"
            )
        if self.algo.uses_groups and self.env.group_size < 2:
            raise ValueError(f"env.group_size must be >= 2 for the group estimator {self.algo.advantage!r}")
        if not self.run_dir:
            raise ValueError("run_dir must be a non-empty path")
        if self.device_memory_gb is not None and not (
            isinstance(self.device_memory_gb, (int, float))
            and not isinstance(self.device_memory_gb, bool)
            and math.isfinite(self.device_memory_gb)
            and self.device_memory_gb > 0
        ):
            raise ValueError(f"device_memory_gb must be a number > 0 or null, got {self.device_memory_gb!r}")
        if self.overlap.off_policy:
            if self.loss.tis_cap is None:
                raise ValueError(
                    "overlap.off_policy needs loss.tis_cap (e.g. 2.0): the rollouts are one update "
                    "stale and the update corrects them by truncated importance sampling"
                )
            if self.algo.dynamic_sampling:
                raise ValueError("overlap.off_policy and algo.dynamic_sampling cannot be combined")
        if -1 not in self.mesh.shape.values():  # else `placement.make_mesh` checks the mesh it makes
            check_mesh_rows(B, self.update.mini_batches, self.mesh.data * self.mesh.fsdp)
        ranges = {
            "env.seed (the training task stream)": (self.env.seed, self.iterations * self.env.tasks_per_iteration),
            "warm_start.seed (demonstrations)": (self.warm_start.seed, self.warm_start.episodes),
            "warm_start.extra (its seeds())": (
                self.warm_start.source.seeds() if self.warm_start.source is not None else (0, 0)
            ),
            "eval.seed (held-out evaluation)": (self.eval.seed, self.eval.episodes),
        }
        items = [(k, a, n) for k, (a, n) in ranges.items() if n > 0]
        for i, (k1, a1, n1) in enumerate(items):
            for k2, a2, n2 in items[i + 1 :]:
                if a1 < a2 + n2 and a2 < a1 + n1:
                    raise ValueError(
                        f"seed ranges overlap: {k1} covers [{a1}, {a1 + n1}) and {k2} covers "
                        f"[{a2}, {a2 + n2}); held-out and demonstration seeds must not be trained on"
                    )

    @property
    def step_config(self) -> StepConfig:
        return StepConfig(
            loss=self.loss,
            optim=self.optim,
            critic_optim=self.critic_optim,
            num_micro_batches=self.update.micro_batches,
            remat=self.model.remat,
            compute_dtype=self.model.compute_dtype,
        )
