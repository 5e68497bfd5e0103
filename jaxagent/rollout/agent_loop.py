"""The multi-turn agent loop: B episodes against an `envs.EnvPool`, token in, token out.

Per rollout (`AgentLoop.run`):

1. `pool.reset(seeds)`; each episode's first prompt (system prompt + first
   observation, rendered by the chat template) is tokenized once and prefilled.
2. Each turn: the sampler decodes every live episode's action on device (stopping at
   the template's end-of-turn token, a stop string, the per-turn token limit or the
   context limit); the actions are decoded to text and stepped in the pool; each
   observation that continues an episode is tokenized as a continuation segment
   (`ChatFormat`) and appended to that episode's live KV cache. History is never
   re-encoded.
3. Finished episodes leave the batch.

Which rows decode when, and when the pool steps, is the scheduler's; `AgentLoop.run`
checks its arguments and dispatches to one of three, each in its own module, with its
state in a dataclass:

- turn-synchronous (`sync_loop`, the default): one device batch, decode and env step in
  turn; the batch shrinks to the next power-of-two bucket when at most half its rows are
  still live.
- pipelined (`pipeline_groups = N > 1`, `pipelined_loop`): N sub-batches, one's env
  step overlapping another's decode.
- continuous (`slots = S > 0`, `continuous_loop`): S sampler rows, each episode moves on
  as soon as its own env step is back; a finished episode's row takes the next one.

The three produce the same trajectories for the same seeds (every token, action,
observation, reward, end and failure; log-probs to float32 rounding): what a reset, a
decoded turn and an env step do to an episode is written once (`scheduling.Rollout`),
and so is the epilogue (`scheduling.finish`: the clock, `reward_fn`, `episode.pack`).
`AgentLoop.timings` has the per-phase seconds of the last run.

Limits (`AgentLoopConfig`): `max_turns`, `max_tokens_per_turn`, `max_context` (the
whole episode, prompt included: it is the KV-cache size and the trajectory width). An
episode stops as truncated when a limit is hit, with the reason recorded. An env that
says what its episode scores if cut off now (the env protocol's optional
`envs.Env.cut_outcome`, carried in its info as `if_cut`) has that reward added to the
last turn and that info recorded when the loop cuts the episode (`Episode.cut`; intake:
the rubric without an assessment), so that filling the context is never a way around
the env's own truncation score.

Robustness: an env that fails (EnvPool reports `info["failed"]`: exception, crash,
timeout, invalid result) ends only that episode, marked `failed` (its turns so far
are kept; the trainer masks failed episodes out). A malformed action is the env's
business (it answers with an invalid-action observation and a penalty); the loop
never parses actions.

Token-exactness: see `ChatFormat`. The trajectory's policy tokens and log-probs are
the sampler's output verbatim; its observation tokens are each segment's own
tokenization; `loss_mask` is 1 exactly on the policy tokens.
"""

from __future__ import annotations

import dataclasses

from jaxagent.models.config import DecoderConfig
from jaxagent.rollout import continuous_loop, pipelined_loop, sync_loop
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.episode import Episode
from jaxagent.rollout.loop_base import EpisodeLoop
from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.sampling import SamplingConfig
from jaxagent.rollout.scheduling import Clock, Rollout, finish
from jaxagent.rollout.trajectory import Trajectory

__all__ = ["AgentLoop", "AgentLoopConfig", "loop_sampler"]


@dataclasses.dataclass(frozen=True)
class AgentLoopConfig:
    """Limits and sampling of a rollout.

    Attributes:
      max_turns: policy turns per episode at most.
      max_tokens_per_turn: tokens the policy may generate in one turn.
      max_context: tokens per episode (prompt + all turns + observations) at most.
      sampling: how tokens are drawn.
      stop_strings: texts that end a turn (tokenized; matched on generated tokens).
      seed: the rollout's sampling seed (episode `i` samples with `fold_in(seed, i)`).
      min_bucket: smallest padded length of an appended segment.
      pad_id: token id used for padding in the trajectory.
      pipeline_groups: 1 = one device batch, decode and env step in turn. N > 1 splits
        the episodes into N contiguous sub-batches, each with its own sampler state,
        and pipelines them: while the envs step one sub-batch's actions, the device
        decodes the next sub-batch's (`jaxagent.rollout.pipelined_loop`). Same trajectories.
      slots: 0 = turn-synchronous (or `pipeline_groups`). S > 0 = continuous
        scheduling with S sampler rows (at most the batch): each episode moves on as
        soon as its own env step is back (`jaxagent.rollout.continuous_loop`). Same trajectories.
      share_prompts: equal first prompts (a group's episodes of one task) are prefilled
        once and their cache rows copied (`Sampler.prefill`), turn-synchronous and
        pipelined; the same tokens. False = every row prefills its own.
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 128
    max_context: int = 2048
    sampling: SamplingConfig = SamplingConfig()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    min_bucket: int = 16
    pad_id: int = 0
    pipeline_groups: int = 1
    slots: int = 0
    share_prompts: bool = True

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "min_bucket", "pipeline_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be a positive int, got {v!r}")
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 0:
            raise ValueError(f"AgentLoopConfig.slots must be an int >= 0 (0 = turn-synchronous), got {self.slots!r}")
        if self.slots and self.pipeline_groups > 1:
            raise ValueError(
                f"AgentLoopConfig: slots={self.slots} (continuous scheduling) and pipeline_groups="
                f"{self.pipeline_groups} are two ways of overlapping env steps; choose one"
            )
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"AgentLoopConfig.sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"AgentLoopConfig.stop_strings must be non-empty strings, got {self.stop_strings!r}")


def loop_sampler(params, model_config: DecoderConfig, config: AgentLoopConfig, *, mesh=None, rules=None) -> Sampler:
    """The `Sampler` of a rollout with `config`'s limits (its context is a row's cache)."""
    return Sampler(
        params,
        model_config,
        max_len=config.max_context,
        min_bucket=config.min_bucket,
        pad_id=config.pad_id,
        mesh=mesh,
        **({} if rules is None else {"rules": rules}),
    )


class AgentLoop(EpisodeLoop):
    """Runs batches of episodes with a `Sampler` (see the module docstring).

    Args:
      params, model_config: the policy.
      tokenizer: a transformers tokenizer with a chat template.
      config: an `AgentLoopConfig`.
      observation_role: chat role of text observations.
      mesh, rules: sample sharded on this device mesh (of this process's devices; `Sampler`'s
        `mesh` and `rules`, rules None = `jaxagent.parallel.ROLLOUT_AXIS_RULES`); None = the
        mesh the params are laid out on, if any (`Sampler`), else unsharded.
    """

    def __init__(
        self,
        params,
        model_config: DecoderConfig,
        tokenizer,
        config: AgentLoopConfig,
        observation_role: str = "user",
        *,
        profile: bool = False,
        mesh=None,
        rules=None,
    ):
        self.config = config
        #: also measure when the device is idle (a thread per rollout waits on each decode)
        self.profile = profile
        #: seconds per phase of the last `run` (see `scheduling.Clock`): dispatch_s, decode_wait_s,
        #: submit_s, env_wait_s, append_s, host_s (the rest), rollout_s; with `profile`,
        #: device_busy_s, device_idle_s and device_idle_env_wait_s
        self.timings: dict[str, float] = {}
        self.chat = ChatFormat(tokenizer, observation_role=observation_role)
        self.sampler = loop_sampler(params, model_config, config, mesh=mesh, rules=rules)
        self.stop_sequences = [self.chat.encode(s) for s in config.stop_strings]
        #: None, or `fn(episodes)` called on a batch's finished episodes before they are
        #: packed (it may change their rewards or fail them: e.g. a judge's reward,
        #: `jaxagent.rewards.JudgeReward`)
        self.reward_fn = None

    # ---------------------------------------------------------------- rollout
    def _play(self, pool, seeds, group_ids, *, seed, sampling, row_offset) -> tuple[Trajectory, list[Episode]]:
        """Play one episode per pool slot (`EpisodeLoop.run` checked the arguments).

        The config picks the scheduler: `slots > 0` continuous, `pipeline_groups > 1`
        pipelined, else turn-synchronous (see the module docstring); the same trajectories.
        """
        cfg = self.config
        eps = [Episode(index=i, seed=s, group_id=int(g)) for i, (s, g) in enumerate(zip(seeds, group_ids, strict=True))]
        clock = Clock(self.profile)
        self.timings = clock.totals
        rollout = Rollout(
            config=cfg,
            sampler=self.sampler,
            chat=self.chat,
            stop_sequences=self.stop_sequences,
            pool=pool,
            episodes=eps,
            seed=seed,
            sampling=sampling,
            row_offset=int(row_offset),
            clock=clock,
        )
        if cfg.slots:
            continuous_loop.run(rollout)
        elif cfg.pipeline_groups > 1:
            pipelined_loop.run(rollout)
        else:
            sync_loop.run(rollout)
        return finish(rollout, self.reward_fn)
