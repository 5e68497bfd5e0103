"""What the three schedulers of `AgentLoop` share: one rollout's inputs and its
per-episode bookkeeping (`Rollout`: start an episode from its reset, record a decoded
turn, apply an env step), the per-phase clock (`Clock`), and the one epilogue (`finish`).

A scheduler (`sync_loop`, `pipelined_loop`, `continuous_loop`) only decides which rows
decode when and when the pool steps; what a reset, a turn or a step does to an
`Episode` is written here once, so the three produce the same trajectories.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.episode import CUT_KEY, Episode, pack
from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.sampling import SamplingConfig
from jaxagent.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from jaxagent.rollout.agent_loop import AgentLoopConfig


class Stepped(NamedTuple):
    """A row whose action went to the env this turn."""

    row: int  # device row (in its group, or the continuous scheduler's row)
    episode: int  # episode index (pool slot)
    after_eot: bool  # the action ended with the end-of-turn token


@dataclasses.dataclass
class Rollout:
    """One call of `AgentLoop.run`: what every scheduler reads, and the bookkeeping of an
    episode's reset, turns and steps that they share.

    Attributes:
      config: the loop's `AgentLoopConfig`.
      sampler, chat: the loop's `Sampler` and `ChatFormat`.
      stop_sequences: the config's stop strings, tokenized.
      pool: the `envs.EnvPool` the episodes play in (one slot per episode).
      episodes: the batch's records, episode `i` in pool slot `i`.
      seed, sampling: this rollout's sampling seed and settings.
      row_offset: the global index of episode 0 (its row key is `fold_in(seed, row_offset)`).
      clock: the per-phase timings of this rollout.
    """

    config: AgentLoopConfig
    sampler: Sampler
    chat: ChatFormat
    stop_sequences: list[list[int]]
    pool: Any
    episodes: list[Episode]
    seed: int
    sampling: SamplingConfig
    row_offset: int
    clock: Clock

    @property
    def eot_id(self) -> int:
        """The chat template's end-of-turn token id, or -1 without one."""
        return self.chat.stop_token_ids[0] if self.chat.end_of_turn_text is not None else -1

    def stepped(self, row: int, episode: int, toks: list[int], reason: str) -> Stepped:
        """The `Stepped` of a turn that ended with `toks` for `reason`."""
        return Stepped(row, episode, reason == "stop_token" and toks[-1] == self.eot_id)

    def start_episode(self, ep: Episode, res) -> list[int] | None:
        """Take in an episode's reset result; its prompt tokens, or None if it ended."""
        obs, info = res
        if info.get("failed"):
            ep.fail(info)
            return None
        ep.system_prompt = info.get("system_prompt")
        ep.state_key = info.get("state_key")
        ep.observations.append(obs)
        if CUT_KEY in info:  # the env's cut outcome, for an episode cut off in its first turn
            ep.info = {CUT_KEY: info[CUT_KEY]}
        toks = self.chat.prompt_tokens(ep.system_prompt, obs)
        if len(toks) >= self.config.max_context:
            ep.end(truncated=True, reason="context_full")
            return None
        ep.add("prompt", toks)
        return toks

    def record_turn(self, ep: Episode, toks: list[int], logps: list[float], reason: str, turn: int) -> str | None:
        """Record a decoded turn of `ep`; its action text, or None when the context limit
        cut it (the episode ends truncated; nothing goes to the env)."""
        cfg = self.config
        ep.add("policy", toks, logps, turn=turn)
        ep.finish_reasons.append(reason)
        ep.state_keys.append(ep.state_key)
        ep.rewards.append(0.0)
        if reason == "cache_full" or (reason == "max_new_tokens" and len(toks) < cfg.max_tokens_per_turn):
            ep.cut("context_full")
            return None
        action = self.chat.action_text(toks)
        ep.actions.append(action)
        return action

    def apply_step(self, ep: Episode, after_eot: bool, res, turn: int) -> list[int] | None:
        """Apply the env's result of `ep`'s turn `turn`; the observation tokens to append,
        or None when the episode ended."""
        cfg = self.config
        obs, reward, terminated, truncated, info = res
        ep.rewards[-1] = float(reward)
        ep.info = dict(info)
        ep.invalid_actions += "invalid_action" in info
        ep.noop_actions += bool(info.get("noop"))
        if info.get("failed"):
            ep.fail(info)
            return None
        ep.observations.append(obs)
        ep.state_key = info.get("state_key")
        if terminated:
            ep.end(done=True, reason="terminated")
            return None
        if truncated:
            ep.end(truncated=True, reason="env_truncated")
            return None
        if turn + 1 >= cfg.max_turns:
            ep.cut("max_turns")
            return None
        seg = self.chat.observation_tokens(obs, after_end_of_turn=after_eot)
        if len(ep.tokens) + len(seg) >= cfg.max_context:  # no room for the next action
            ep.cut("context_full")
            return None
        ep.add("observation", seg)
        return seg


def finish(rollout: Rollout, reward_fn: Callable[[list[Episode]], Any] | None) -> tuple[Trajectory, list[Episode]]:
    """The epilogue of every scheduler: close the clock, apply `reward_fn` (if any) to the
    finished episodes, pack them."""
    eps, cfg = rollout.episodes, rollout.config
    for ep in eps:
        if not ep.finished:  # pragma: no cover - every scheduler ends every episode
            ep.end(truncated=True, reason="max_turns")
    rollout.clock.close()
    if reward_fn is not None:
        reward_fn(eps)
    return pack(eps, max_context=cfg.max_context, max_turns=cfg.max_turns, pad_id=cfg.pad_id), eps


def _ready_at(x) -> float:
    x.block_until_ready()
    return time.perf_counter()


class Clock:
    """Host time per phase of a rollout; with `profile`, also when the device is idle.

    The device is taken as busy from the first dispatch of a chain of kernels (append,
    select, decode) until a thread waiting on the chain's decode output sees it ready;
    idle is the rest of the rollout. This over-counts busy time by any queueing on the
    device, so the idle figures are lower bounds.
    """

    def __init__(self, profile: bool):
        self.profile = profile
        self.t0 = time.perf_counter()
        self.totals: dict[str, float] = {
            k: 0.0 for k in ("dispatch_s", "decode_wait_s", "submit_s", "env_wait_s", "append_s")
        }
        self.env_waits: list[tuple[float, float]] = []
        self.chain_start: float | None = None
        self.busy: list[tuple[float, Any]] = []  # (chain start, future of the ready time)
        self.pool = concurrent.futures.ThreadPoolExecutor(2) if profile else None

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            now = time.perf_counter()
            self.totals[name] += now - t
            if name == "env_wait_s" and self.profile:
                self.env_waits.append((t, now))

    def dispatched(self) -> None:
        """Device work was queued that a later `watch`ed decode will wait for."""
        if self.profile and self.chain_start is None:
            self.chain_start = time.perf_counter()

    def watch(self, array, dispatched_at: float) -> None:
        """`array` is the output of a decode dispatched at `dispatched_at`."""
        if self.profile:
            start = dispatched_at if self.chain_start is None else min(self.chain_start, dispatched_at)
            assert self.pool is not None  # created with `profile`
            self.busy.append((start, self.pool.submit(_ready_at, array)))
        self.chain_start = None

    def close(self) -> None:
        end = time.perf_counter()
        self.totals["rollout_s"] = end - self.t0
        self.totals["host_s"] = self.totals["rollout_s"] - sum(
            v for k, v in self.totals.items() if k.endswith("_s") and k not in ("rollout_s", "host_s")
        )
        if not self.profile:
            return
        busy = sorted((s, f.result()) for s, f in self.busy)
        assert self.pool is not None  # created with `profile`
        self.pool.shutdown()
        merged: list[list[float]] = []
        for s, e in busy:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        busy_s = sum(e - s for s, e in merged)
        during_env = sum(we - ws for ws, we in self.env_waits) - sum(
            max(0.0, min(e, we) - max(s, ws)) for s, e in merged for ws, we in self.env_waits
        )
        self.totals["device_busy_s"] = busy_s
        self.totals["device_idle_s"] = self.totals["rollout_s"] - busy_s
        self.totals["device_idle_env_wait_s"] = during_env
