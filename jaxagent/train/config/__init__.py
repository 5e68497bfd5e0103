"""The training run's config: `TrainerConfig` and its sections, validated on construction.

Load with `jaxagent.dataclass_yaml.load_config(TrainerConfig, path, overrides)`; every key is
listed by `jaxagent config` (the keys, their defaults and these docstrings). Sections
that configure a component embed that component's own config where there is one
(`optim`: `jaxagent.train.config.step`; `mesh`: `jaxagent.parallel.MeshConfig`) and
build it where the trainer's keys are fewer, from the fields of the same names
(`RolloutSection.loop_config()` is the `jaxagent.rollout.AgentLoopConfig`; `loss` is the
`LossConfig` less its temperature, which `step_config` takes from the rollout). Simple
bounds are declared in the fields' types (`jaxagent.dataclass_yaml.Bound`) and checked on
construction; the `__post_init__` methods hold the other rules.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

from jaxagent.dataclass_yaml import Bound, Bounded, field_values
from jaxagent.parallel import MeshConfig
from jaxagent.train.config.agent import AgentSection
from jaxagent.train.config.algo import AlgoSection, RewardSection
from jaxagent.train.config.env import EnvSection
from jaxagent.train.config.model import ModelSection
from jaxagent.train.config.rollout import RolloutSection
from jaxagent.train.config.run import DistributedSection, EvalSection, LoggingSection, OverlapSection
from jaxagent.train.config.step import LossConfig, LossSection, OptimizerConfig, StepConfig
from jaxagent.train.config.update import UpdateSection, check_mesh_rows
from jaxagent.train.config.warm_start import WarmStartSection

#: config keys a resumed run may not change: they define the policy, the task stream
#: and whether there is a critic (everything else, e.g. `iterations` or `optim.lr`, may change)
RESUME_FIXED = (
    "model",
    "env.name",
    "env.kwargs",
    "env.group_size",
    "env.tasks_per_iteration",
    "env.seed",
    "agent.program",
    "agent.tasks",
    "algo.advantage",
)


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Bounded):
    """Everything a training run needs; load with `jaxagent.dataclass_yaml.load_config`.

    critic_optim: the critic's optimizer (`OptimizerConfig`), for estimators that train
      one (e.g. "gae", "turn_gae"); None = the same settings as `optim`.
    loss, optim, critic_optim: `jaxagent.train.config.step.LossSection` / `OptimizerConfig` (the
      critic's defaults to `optim`). The update's log-probs are computed at
      `rollout.temperature` (those of the sampling distribution; 1 for a greedy rollout).
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
    loss: LossSection = LossSection()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    update: UpdateSection = UpdateSection()
    iterations: Annotated[int, Bound(ge=1)] = 2
    seed: Annotated[int, Bound(ge=0)] = 0
    run_dir: str = "runs/default"
    checkpoint_every: Annotated[int, Bound(ge=1)] = 1
    keep_checkpoints: Annotated[int, Bound(ge=1)] = 3
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedSection = DistributedSection()
    device_memory_gb: Annotated[float | None, Bound(gt=0)] = None
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
        super().__post_init__()
        if isinstance(self.loss, LossConfig):  # its temperature would be ignored: it is the rollout's
            raise ValueError(
                f"loss must be a LossSection (the loss: keys), got a LossConfig (temperature "
                f"{self.loss.temperature}): the update's temperature is rollout.temperature"
            )
        if self.jit_cache_dir is not None and (not isinstance(self.jit_cache_dir, str) or not self.jit_cache_dir):
            raise ValueError(f'jit_cache_dir must be "auto", a directory or null (off), got {self.jit_cache_dir!r}')
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
        if self.algo.uses_groups and self.env.group_size < 2:
            raise ValueError(f"env.group_size must be >= 2 for the group estimator {self.algo.advantage!r}")
        if not self.run_dir:
            raise ValueError("run_dir must be a non-empty path")
        if self.overlap.off_policy:
            if self.loss.tis_cap is None:
                raise ValueError(
                    "overlap.off_policy needs loss.tis_cap (e.g. 2.0): the rollouts are one update "
                    "stale and the update corrects them by truncated importance sampling"
                )
            if self.algo.dynamic_sampling:
                raise ValueError("overlap.off_policy and algo.dynamic_sampling cannot be combined")
        if -1 not in self.mesh.shape.values():  # else `placement._make_mesh` checks the mesh it makes
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
        """The update's static config; its loss computes the log-probs at `rollout.temperature`
        (those of the sampling distribution), at 1 for a greedy rollout (which has none)."""
        temperature = self.rollout.temperature if self.rollout.temperature > 0 else 1.0
        return StepConfig(
            loss=LossConfig(**field_values(self.loss, LossConfig), temperature=temperature),
            optim=self.optim,
            critic_optim=self.critic_optim,
            num_micro_batches=self.update.micro_batches,
            remat=self.model.remat,
            compute_dtype=self.model.compute_dtype,
        )
