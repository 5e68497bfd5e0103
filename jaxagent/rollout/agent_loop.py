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
3. Finished episodes leave the batch: the sampler's batch shrinks to the next
   power-of-two bucket when at most half its rows are still live.

Limits (`AgentLoopConfig`): `max_turns`, `max_tokens_per_turn`, `max_context` (the
whole episode, prompt included: it is the KV-cache size and the trajectory width). An
episode stops as truncated when a limit is hit, with the reason recorded.

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
import hashlib
from typing import Any, Hashable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxagent.models.config import DecoderConfig
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.sampler import Sampler, SamplingConfig, bucket
from jaxagent.rollout.trajectory import Trajectory


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
      shrink_batch: re-bucket the device batch as episodes finish.
      min_bucket: smallest padded length of an appended segment.
      pad_id: token id used for padding in the trajectory.
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 128
    max_context: int = 2048
    sampling: SamplingConfig = SamplingConfig()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    shrink_batch: bool = True
    min_bucket: int = 16
    pad_id: int = 0

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "min_bucket"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be a positive int, got {v!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"AgentLoopConfig.sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"AgentLoopConfig.stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclasses.dataclass
class Episode:
    """Host record of one episode (also returned for logging and debugging).

    `segments` lists the token segments in order as `(kind, tokens)` with kind
    "prompt", "policy" or "observation"; `actions`, `observations` are the texts
    exchanged; `state_keys[k]` is the env state turn k acted in; `finish_reasons[k]` the
    sampler's reason for ending turn k; `end_reason` why the episode ended.
    """

    index: int
    seed: Any
    group_id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    segments: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    state_keys: list[Hashable] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)
    observations: list[Any] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    done: bool = False
    truncated: bool = False
    failed: bool = False
    end_reason: str = ""
    failure: str = ""
    system_prompt: str | None = None
    state_key: Hashable = None
    #: the env's info dict of the episode's last step ({} before the first step)
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.done or self.truncated or self.failed

    def add(self, kind: str, tokens: Sequence[int], logp: Sequence[float] | None = None, turn: int = -1):
        tokens = [int(t) for t in tokens]
        policy = kind == "policy"
        self.segments.append((kind, tokens))
        self.tokens += tokens
        self.loss_mask += [1 if policy else 0] * len(tokens)
        self.logp += [float(x) for x in logp] if policy else [0.0] * len(tokens)
        self.turn_ids += [turn if policy else -1] * len(tokens)

    def end(self, *, done=False, truncated=False, failed=False, reason: str, failure: str = ""):
        self.done, self.truncated, self.failed = bool(done), bool(truncated), bool(failed)
        self.end_reason, self.failure = reason, failure


class AgentLoop:
    """Runs batches of episodes with a `Sampler` (see the module docstring).

    Args:
      params, model_config: the policy.
      tokenizer: a transformers tokenizer with a chat template.
      config: an `AgentLoopConfig`.
      observation_role: chat role of text observations.
    """

    def __init__(self, params, model_config: DecoderConfig, tokenizer, config: AgentLoopConfig,
                 observation_role: str = "user"):
        self.config = config
        self.chat = ChatFormat(tokenizer, observation_role=observation_role)
        self.sampler = Sampler(params, model_config, max_len=config.max_context, min_bucket=config.min_bucket,
                               pad_id=config.pad_id)
        self.stop_sequences = [self.chat.encode(s) for s in config.stop_strings]

    @property
    def params(self):
        return self.sampler.params

    def set_params(self, params) -> None:
        """Use new policy parameters (same shapes: no recompilation)."""
        self.sampler.params = params

    # ---------------------------------------------------------------- rollout
    def run(self, pool, seeds: Sequence[Any], group_ids: Sequence[int] | None = None
            ) -> tuple[Trajectory, list[Episode]]:
        """Play one episode per pool slot (`len(seeds) == len(pool)`), return the batch."""
        cfg = self.config
        B = len(seeds)
        if B != len(pool):
            raise ValueError(f"AgentLoop.run: got {B} seeds for a pool of {len(pool)} slots")
        if group_ids is None:
            group_ids = list(range(B))
        if len(group_ids) != B:
            raise ValueError(f"AgentLoop.run: group_ids has {len(group_ids)} entries, expected {B}")
        eps = [Episode(index=i, seed=s, group_id=int(g)) for i, (s, g) in enumerate(zip(seeds, group_ids))]

        # ---- reset and first prompts
        prompts: list[list[int] | None] = [None] * B
        for ep, res in zip(eps, pool.reset(list(seeds))):
            obs, info = res
            if info.get("failed"):
                ep.end(failed=True, reason="env_failed", failure=str(info.get("failure", "")))
                continue
            ep.system_prompt = info.get("system_prompt")
            ep.state_key = info.get("state_key")
            ep.observations.append(obs)
            toks = self.chat.prompt_tokens(ep.system_prompt, obs)
            if len(toks) >= cfg.max_context:
                ep.end(truncated=True, reason="context_full")
                continue
            ep.add("prompt", toks)
            prompts[ep.index] = toks

        rows = list(range(B))  # device row -> episode index (-1 = padding row)
        state = self.sampler.init_state(B, cfg.seed, row_ids=np.arange(B))
        state = self.sampler.append(state, prompts)

        for turn in range(cfg.max_turns):
            live = [i for i in rows if i >= 0 and not eps[i].finished]
            if not live:
                break
            if cfg.shrink_batch and bucket(len(live), 1) < len(rows):
                new_b = bucket(len(live), 1)
                keep = live + [live[0]] * (new_b - len(live))
                state = self.sampler.select_rows(state, [rows.index(i) for i in keep])
                rows = live + [-1] * (new_b - len(live))
            active = [i >= 0 and not eps[i].finished for i in rows]
            room = [cfg.max_context - len(eps[i].tokens) if a else 0 for i, a in zip(rows, active)]
            max_new = [min(cfg.max_tokens_per_turn, r) for r in room]
            stop_seqs = [self.stop_sequences for _ in rows] if self.stop_sequences else None
            state, gen = self.sampler.decode(
                state, max_new_tokens=cfg.max_tokens_per_turn, sampling=cfg.sampling, active=active,
                max_new=max_new, stop_tokens=list(self.chat.stop_token_ids), stop_sequences=stop_seqs)
            toks, logps, reasons = Sampler.to_lists(gen)

            actions: list[str | None] = [None] * len(pool)
            stepped = []
            for r, i in enumerate(rows):
                if not active[r]:
                    continue
                ep = eps[i]
                ep.add("policy", toks[r], logps[r], turn=turn)
                ep.finish_reasons.append(reasons[r])
                ep.state_keys.append(ep.state_key)
                ep.rewards.append(0.0)
                ended_by_context = reasons[r] == "cache_full" or (
                    reasons[r] == "max_new_tokens" and len(toks[r]) < cfg.max_tokens_per_turn)
                if ended_by_context:  # the action was cut by the context limit: not sent
                    ep.end(truncated=True, reason="context_full")
                    continue
                actions[i] = self.chat.action_text(toks[r])
                ep.actions.append(actions[i])
                stepped.append((r, i, reasons[r] == "stop_token" and toks[r][-1] == self._eot_id()))

            results = pool.step(actions) if stepped else [None] * len(pool)
            appends: list[list[int] | None] = [None] * len(rows)
            for r, i, after_eot in stepped:
                ep = eps[i]
                obs, reward, terminated, truncated, info = results[i]
                ep.rewards[-1] = float(reward)
                ep.info = dict(info)
                if info.get("failed"):
                    ep.end(failed=True, reason="env_failed", failure=str(info.get("failure", "")))
                    continue
                ep.observations.append(obs)
                ep.state_key = info.get("state_key")
                if terminated:
                    ep.end(done=True, reason="terminated")
                    continue
                if truncated:
                    ep.end(truncated=True, reason="env_truncated")
                    continue
                if turn + 1 >= cfg.max_turns:
                    ep.end(truncated=True, reason="max_turns")
                    continue
                seg = self.chat.observation_tokens(obs, after_end_of_turn=after_eot)
                if len(ep.tokens) + len(seg) >= cfg.max_context:  # no room for the next action
                    ep.end(truncated=True, reason="context_full")
                    continue
                ep.add("observation", seg)
                appends[r] = seg
            if any(a for a in appends):
                state = self.sampler.append(state, appends)
        for ep in eps:
            if not ep.finished:  # pragma: no cover - every path above ends the episode
                ep.end(truncated=True, reason="max_turns")
        return self._pack(eps), eps

    def _eot_id(self) -> int:
        return self.chat.stop_token_ids[0] if self.chat.end_of_turn_text is not None else -1

    # ---------------------------------------------------------------- packing
    def _pack(self, eps: list[Episode]) -> Trajectory:
        cfg = self.config
        B, T, K = len(eps), cfg.max_context, cfg.max_turns
        tokens = np.full((B, T), cfg.pad_id, np.int32)
        attn = np.zeros((B, T), np.int32)
        loss = np.zeros((B, T), np.float32)
        logp = np.zeros((B, T), np.float32)
        tid = np.full((B, T), -1, np.int32)
        rew = np.zeros((B, T), np.float32)
        turn_rew = np.zeros((B, K), np.float32)
        turn_mask = np.zeros((B, K), bool)
        anchor = np.full((B, K), -1, np.int32)
        table: dict = {}
        for b, ep in enumerate(eps):
            n = len(ep.tokens)
            tokens[b, :n], attn[b, :n] = ep.tokens, 1
            loss[b, :n], logp[b, :n], tid[b, :n] = ep.loss_mask, ep.logp, ep.turn_ids
            for k, r in enumerate(ep.rewards):
                turn_rew[b, k], turn_mask[b, k] = r, True
                where = np.nonzero(tid[b, :n] == k)[0]
                if where.size:
                    rew[b, where[-1]] = r
                key = ep.state_keys[k]
                if key is not None:
                    anchor[b, k] = table.setdefault(_stable(key), len(table))
        return Trajectory(
            tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attn), loss_mask=jnp.asarray(loss),
            rollout_logp=jnp.asarray(logp), turn_ids=jnp.asarray(tid), rewards=jnp.asarray(rew),
            group_ids=jnp.asarray(np.array([ep.group_id for ep in eps], np.int32)),
            turn_rewards=jnp.asarray(turn_rew), turn_mask=jnp.asarray(turn_mask), anchor_ids=jnp.asarray(anchor),
            episode_return=jnp.asarray(turn_rew.sum(axis=1)),
            lengths=jnp.asarray(np.array([len(ep.tokens) for ep in eps], np.int32)),
            num_turns=jnp.asarray(turn_mask.sum(axis=1).astype(np.int32)),
            done=jnp.asarray(np.array([ep.done for ep in eps])),
            truncated=jnp.asarray(np.array([ep.truncated for ep in eps])),
            failed=jnp.asarray(np.array([ep.failed for ep in eps])),
        )


def _stable(key: Hashable) -> str:
    """A process-independent identity of a state key (keys may come from worker processes)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()
