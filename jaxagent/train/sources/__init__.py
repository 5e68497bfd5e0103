"""Where a run's episodes come from: `RolloutSource`, chosen once by `build.rollout_source`.

A source is everything that differs between ways of producing episodes, behind one
contract, so that the trainer, evaluation, the warm start, the tokenizer and the memory
check never ask which one they have:

- `EnvSource` (`sources.env`): the policy acts in the run's env (`env:`), an
  `envs.EnvPool` of worker processes driven by `jaxagent.rollout.AgentLoop`.
- `ProgramSource` (`sources.program`): the user's agent program (`agent.program`) calls
  the policy through the gateway, one session per row (`jaxagent.gateway.loop.ProgramLoop`).

What a source provides: `check` (named errors within seconds, before anything is
compiled), `pools` (the training and the held-out pool, a context manager that closes
what it started), `loop` (an `jaxagent.rollout.loop_base.EpisodeLoop`), the warm start's
`demonstrations`, the corpus of a "bpe" tokenizer (`tokenizer_texts`), and the facts
the memory check and the tokenizer need (`packed_sequences`, `partial_rounds`,
`chat_template`). Batch collection (`collect`) and the overlap thread (`overlap`) run
any source's loop. A new producer (the asynchronous one) is a subclass here and one line
in `build.rollout_source`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

from jaxagent.rollout.loop_base import EpisodeLoop, EpisodePool


@dataclasses.dataclass(frozen=True)
class Pools:
    """What a run plays in: `train` (the training stream's tasks) and `held_out` (the
    evaluation's; the same pool when the source has no separate held-out set)."""

    train: EpisodePool
    held_out: EpisodePool


class RolloutSource(abc.ABC):
    """How a run produces episodes (module docstring). `config` is the run's
    `TrainerConfig`."""

    #: rows may pack several sequences of one episode (`Trajectory.segment_ids`): the
    #: compiled passes the memory check measures carry segment ids
    packed_sequences: ClassVar[bool] = False
    #: the sampler is called with fewer rows than it has (a gateway's rounds): the memory
    #: check counts the decode-scatter of such calls
    partial_rounds: ClassVar[bool] = False
    #: the chat template of a tokenizer the run makes itself (`model.path` null: "byte" or
    #: "bpe"); None = the tokenizer's own
    chat_template: ClassVar[str | None] = None

    def __init__(self, config: Any):
        self.config = config

    @abc.abstractmethod
    def check(self) -> str | None:
        """Builds what can be checked in seconds (an env reset, a task source's first
        task, the program's import) so a bad config is a `ConfigError` naming its key
        before anything is compiled. Returns the env's code-sandbox isolation ("bwrap",
        ...), or None when no code runs in a sandbox."""

    @abc.abstractmethod
    def open_pools(self, slots: int) -> contextlib.AbstractContextManager[Pools]:
        """The training and held-out pools of `slots` rows each; leaving the context
        closes what they started (env worker processes)."""

    @abc.abstractmethod
    def loop(self, params, model_config, tokenizer, *, rows: int, mesh) -> EpisodeLoop:
        """The run's `EpisodeLoop` over `params` (the sampler's copy), sampling on `mesh`
        (None: unsharded); `rows`: the most rows one `run` plays (this process's)."""

    @abc.abstractmethod
    def demonstrations(self, tokenizer, log) -> list:
        """The warm start's demonstrations (fresh runs with `warm_start` on), played once
        (a second call returns the same list). `tokenizer`: the run's, for a source whose
        demonstrations are recorded in tokens; None before it exists."""

    @abc.abstractmethod
    def tokenizer_texts(self, log) -> list[str]:
        """The corpus a "bpe" tokenizer is trained on (fresh runs): the text the policy
        will read and write."""

    def summarizer(self):
        """The source's own summary of evaluated or trained episodes, `fn(per_episode) ->
        dict` (an env's `summarize`: intake's rubric means and triage rates), or None."""
        return None

    @property
    def demonstrations_need_tokenizer(self) -> bool:
        """Whether `demonstrations` needs the run's tokenizer (else they are played first,
        so a "bpe" tokenizer can be trained on them)."""
        return False


@contextlib.contextmanager
def same_pool(pool) -> Iterator[Pools]:
    """`Pools` of one pool for training and evaluation, closed on exit."""
    with pool:
        yield Pools(train=pool, held_out=pool)
