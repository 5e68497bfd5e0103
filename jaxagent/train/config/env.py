"""The run config's `env:` section: the environment, the task stream and its worker pool
(`EnvSection`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from jaxagent.dataclass_yaml import Bound, Bounded


@dataclasses.dataclass(frozen=True)
class EnvSection(Bounded):
    """Which env, how many episodes per iteration, and the task seed stream.

    name, kwargs: `envs.make(name, **kwargs)`.
    group_size: episodes per task (G; the group of the outcome estimators).
    tasks_per_iteration: tasks per iteration; the rollout batch is their product.
    seed: task `k` of the run has env seed `seed + k`.
    num_workers: `EnvPool` worker processes (0 = in this process).
    step_timeout: seconds one env step may take before its episode fails.
    imports: Python modules imported (in this process and in every env worker) before the
      env is made, so that envs they register (`envs.register`) work from a config.
    max_failed_iterations: stop the run (with the first failure's kind and traceback) after
      this many consecutive iterations in which every episode failed (0 = never stop).
    worker_memory_mb, worker_cpu_s: each env worker's address-space limit and the CPU
      seconds one env call may use (`EnvPool`'s `memory_limit_mb` / `cpu_limit_s`; null =
      none). Past them the episode fails as `memory_limit` / `cpu_limit`, the run goes on.
    """

    name: str = "countdown"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    group_size: Annotated[int, Bound(ge=1)] = 4
    tasks_per_iteration: Annotated[int, Bound(ge=1)] = 2
    seed: Annotated[int, Bound(ge=0)] = 0
    num_workers: Annotated[int, Bound(ge=0)] = 1
    step_timeout: Annotated[float, Bound(gt=0, unit="seconds")] = 30.0
    imports: tuple[str, ...] = ()
    max_failed_iterations: Annotated[int, Bound(ge=0)] = 2
    worker_memory_mb: Annotated[float | None, Bound(gt=0)] = 16384
    worker_cpu_s: Annotated[float | None, Bound(gt=0)] = 300

    def __post_init__(self):
        import envs

        import_env_modules(self.imports)
        super().__post_init__()
        if not envs.is_known(self.name):
            raise ValueError(f"name: unknown env {self.name!r}; known: {', '.join(envs.known_envs())}")

    @property
    def batch_size(self) -> int:
        return self.group_size * self.tasks_per_iteration


def import_env_modules(modules) -> None:
    """Imports `env.imports` (`envs.import_modules`); an error names the module."""
    import envs

    envs.import_modules(modules)
