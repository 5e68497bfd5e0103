"""Rollout: the jitted KV-cache sampler and the token-exact multi-turn agent loop.

- `sampler`: `Sampler`, the host side (prefill / append / on-device decode over a
  per-row KV cache, shape buckets, compile counting); `kernels`: the jitted kernels,
  `SamplerState` and `Generation` (tokens, log-probs, finish reasons); `sampling`:
  `SamplingConfig` (greedy, temperature, top-k, top-p, min-p) and the draw.
- `chat`: `ChatFormat`, the chat template cut into token-exact segments.
- `agent_loop`: `AgentLoop` drives an `envs.EnvPool` and returns a `Trajectory`; `run`
  dispatches to one scheduler: `sync_loop` (turn-synchronous), `pipelined_loop`
  (`pipeline_groups`), `continuous_loop` (`slots`). What they share: `scheduling`
  (a rollout's per-episode bookkeeping, the clock, the one epilogue) and `episode`
  (`Episode`, the loop's cut, packing into a `Trajectory`).
- `trajectory`: the `Trajectory` pytree the trainer consumes.
"""

from jaxagent.rollout.agent_loop import AgentLoop, AgentLoopConfig
from jaxagent.rollout.chat import ChatFormat, ChatTemplateError
from jaxagent.rollout.episode import Episode
from jaxagent.rollout.kernels import FINISH_REASONS, Generation, SamplerState, decode_step
from jaxagent.rollout.sampler import Sampler, bucket
from jaxagent.rollout.sampling import GREEDY, SamplingConfig, processed_logits, sample_tokens
from jaxagent.rollout.trajectory import Trajectory, trim_padding

__all__ = [
    "AgentLoop",
    "AgentLoopConfig",
    "ChatFormat",
    "ChatTemplateError",
    "Episode",
    "FINISH_REASONS",
    "GREEDY",
    "Generation",
    "Sampler",
    "SamplerState",
    "SamplingConfig",
    "Trajectory",
    "trim_padding",
    "bucket",
    "decode_step",
    "processed_logits",
    "sample_tokens",
]
