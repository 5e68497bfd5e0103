"""The run config's `agent:` section: training an existing agent program written against
the OpenAI client (`AgentSection`; `jaxagent.train.config` embeds it in `TrainerConfig`
as `agent` and re-exports it). The program's contract is `jaxagent.gateway.program`'s.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated

from jaxagent.dataclass_yaml import Bound, Bounded

#: "module:function" (dotted module, dotted attribute): the form of `agent.program`, and
#: of `agent.tasks` / `eval.tasks` when they name a function
_FUNCTION_SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def check_tasks_spec(name: str, value) -> None:
    """`ValueError` naming the key `name` unless `value` is a task source's spec: a path
    ending in `.jsonl` or "module:function" (`jaxagent.gateway.program.TaskSource`)."""
    if not isinstance(value, str) or not (value.endswith(".jsonl") or _FUNCTION_SPEC.match(value)):
        raise ValueError(
            f"{name} must be a path to a .jsonl file (one task object a line) or 'module:function' "
            f"(seed -> task dict), got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class AgentSection(Bounded):
    """An agent program to train (`program: null` = the env's own agent loop, `env:`).

    program: "module:function" of an `async def rollout(client, task)`: an agent written
      against `openai.AsyncOpenAI`, given a client pointed at the run's gateway for its
      episode's session (any `model=` is accepted; the run's `rollout` sampling settings
      decide, not the request's) and one task dict; it returns the episode's reward (a
      number) or a dict with `reward` and numeric metrics (`jaxagent.gateway.program`).
      An episode whose program raises, times out, returns something else or makes no
      call through its client fails (left out of the update); the run goes on.
    tasks: where the tasks come from (required with `program`): a path to a `.jsonl`
      file, one JSON object a line (episode seed `k` plays line `k % n` of its `n`
      lines), or "module:function" mapping an integer seed to a task dict. The training
      seeds are `env.seed`'s stream; held-out tasks are `eval.tasks`.
    concurrency: sessions (episodes) run at once at most.
    timeout_s: seconds one episode may take; past it the program is cancelled and the
      episode fails as `timeout`.
    imports: module names imported, or directories added to the import path, before
      `program` and `tasks` are loaded (as `env.imports`; the current directory is on the
      path too).
    processes: worker processes that run the sessions (`jaxagent.gateway.processes`;
      default 2): a program that exits the interpreter, crashes or blocks its event loop
      costs the sessions of its process ("crashed", "timeout"), never the run, and the
      programs' client work does not share the trainer's interpreter. 0: in threads of
      the trainer's process (a program can then stop or hang the run).
    max_staleness: an episode whose calls were sampled more than this many policy
      versions before the update is dropped (0 = only the current policy's episodes).
    expert: "module:function" of an expert for the warm start (with `warm_start.episodes`):
      `expert(prompt_text, *, noise, rng) -> str` gives the reply to a conversation (the
      chat template's rendering up to the generation prompt; `noise` is
      `warm_start.expert_noise`, `rng` a `random.Random` of the episode's seed). The
      program runs unchanged against it through the gateway, and its episodes are the
      SFT demonstrations (`jaxagent.gateway.demonstrations`).
    """

    program: str | None = None
    tasks: str | None = None
    concurrency: Annotated[int, Bound(ge=1)] = 64
    timeout_s: Annotated[float, Bound(gt=0, unit="seconds")] = 300.0
    imports: tuple[str, ...] = ()
    processes: Annotated[int, Bound(ge=0)] = 2
    max_staleness: Annotated[int, Bound(ge=0)] = 1
    expert: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.imports, (list, tuple)) or not all(isinstance(m, str) and m for m in self.imports):
            raise ValueError(f"imports must be a list of module names or directories, got {self.imports!r}")
        object.__setattr__(self, "imports", tuple(self.imports))
        if self.program is not None and not (isinstance(self.program, str) and _FUNCTION_SPEC.match(self.program)):
            raise ValueError(
                f"program must look like 'module:function' (an async def rollout(client, task)), got {self.program!r}"
            )
        if self.expert is not None and not (isinstance(self.expert, str) and _FUNCTION_SPEC.match(self.expert)):
            raise ValueError(f"expert must look like 'module:function' (prompt_text -> reply), got {self.expert!r}")
        if self.program is None:
            if self.expert is not None:
                raise ValueError(f"expert ({self.expert!r}) is set but program is not: the expert is a program's")
            if self.tasks is not None:
                raise ValueError(f"tasks ({self.tasks!r}) is set but program is not: tasks are an agent program's")
            return
        if self.tasks is None:
            raise ValueError(
                "tasks is required with program: a .jsonl file of task objects or 'module:function' (seed -> task)"
            )
        check_tasks_spec("tasks", self.tasks)

    @property
    def enabled(self) -> bool:
        """An agent program is trained (`program` is set)."""
        return self.program is not None
