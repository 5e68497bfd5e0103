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
episode stops as truncated when a limit is hit, with the reason recorded. An env whose
step info holds `if_cut` (`{"reward": r, "info": {...}}`: what the episode scores if it
is cut off now) has that reward added to the last turn and that info recorded when the
loop cuts the episode (intake: the rubric without an assessment), so that filling the
context is never a way around the env's own truncation score.

Overlap (`AgentLoopConfig.pipeline_groups = N > 1`): the episodes are split into N
contiguous sub-batches (slot ranges, so each spans the pool's workers), each with its
own sampler state (row keys are still `fold_in(seed, episode index)`), and each turn
of each sub-batch is pipelined against the others with the pool's non-blocking
`submit_step` / `collect`:

    dispatch decode(B)  ->  collect step(A)  ->  append(A) (async)  ->
    wait for decode(B)  ->  submit step(B)   ->  dispatch decode(A)  -> ...

so the envs step A's actions while the device decodes B's (JAX dispatch is async: the
host collects and tokenizes A's observations while B decodes). The trajectories are
those of `pipeline_groups=1` for the same seeds: every token, action, observation,
reward, end and failure; log-probs agree to float32 rounding (XLA:CPU's results for a
row can differ in the last bits with the batch shape, as they do when `shrink_batch`
re-buckets). A sub-batch whose episodes all end leaves the pipeline. Worth it when env
steps take as long as decodes; with `num_workers=0` (envs in this process) there is
nothing to overlap. `AgentLoop.timings` has the per-phase seconds of the last run.

Continuous scheduling (`AgentLoopConfig.slots = S > 0`): episodes do not wait for
each other. The sampler has S rows; episode `i` is admitted to a free row when one is
free (in episode order), its reset is sent to the pool (`EnvPool.send`), and its row
is emptied and given the key `fold_in(seed, i)`. Each round:

    take in the env results that have arrived (`EnvPool.poll`)  ->  once every live
    episode is ready, or the first ready one has waited as long as the last decode
    took, append the ready episodes' prompts / observations and decode their rows,
    together, in one call that touches only those rows (`Sampler.decode_rows`)  ->
    send those actions

An episode whose env step is in flight keeps its KV cache in its row and is simply
not decoded until its observation arrives; the others go on without it after at
most one decode's time (a round of few rows costs nearly as much as a full one, as
the weights are read once a token for the whole batch, so rounds are kept full). A finished episode
frees its row for the next episode not yet started. The trajectories are those of the
turn-synchronous loop for the same seeds (every token, action, observation, reward,
end and failure; log-probs to float32 rounding): sampling depends only on a row's key
and history. Rows are never re-bucketed (`shrink_batch` does not apply). Worth it when
env steps take uneven times: one slow step holds only its own episode (and the other
slots of its pool worker, which runs its slots' items one after another).

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

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import time
from typing import Any, Hashable, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from jaxagent.models.config import DecoderConfig
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.sampler import Sampler, SamplingConfig, bucket
from jaxagent.rollout.trajectory import Trajectory, rewards_at_turn_ends


#: continuous scheduling: before the first decode round is timed, a round waits this
#: long at most for episodes that are not ready yet
MIN_LINGER_S = 0.05


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
      pipeline_groups: 1 = one device batch, decode and env step in turn. N > 1 splits
        the episodes into N contiguous sub-batches, each with its own sampler state,
        and pipelines them: while the envs step one sub-batch's actions, the device
        decodes the next sub-batch's (see the module docstring). Same trajectories.
      slots: 0 = turn-synchronous (or `pipeline_groups`). S > 0 = continuous
        scheduling with S sampler rows (at most the batch): each episode moves on as
        soon as its own env step is back (see the module docstring). Same trajectories.
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
    shrink_batch: bool = True
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
            raise ValueError(f"AgentLoopConfig: slots={self.slots} (continuous scheduling) and pipeline_groups="
                             f"{self.pipeline_groups} are two ways of overlapping env steps; choose one")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"AgentLoopConfig.sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"AgentLoopConfig.stop_strings must be non-empty strings, got {self.stop_strings!r}")


def episode_success(done: bool, rewards: Sequence[float], info: dict | None) -> bool:
    """Success of an episode, the one definition metrics, evaluations, demonstrations and
    transcripts share: the env's own `info["success"]` on its last step when it reports
    one, else "the env terminated it with a last reward > 0" (true of the built-in games)."""
    if info and "success" in info:
        return bool(info["success"])
    return bool(done and rewards and rewards[-1] > 0)


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
    #: for a failed episode: the pool's failure kind (exception, crash, timeout ...) and traceback
    failure_kind: str = ""
    failure_traceback: str = ""
    system_prompt: str | None = None
    state_key: Hashable = None
    #: the env's info dict of the episode's last step ({} before the first step)
    info: dict = dataclasses.field(default_factory=dict)
    #: steps the env answered with `info["invalid_action"]` (a malformed action)
    invalid_actions: int = 0
    #: steps the env answered with `info["noop"]` (a valid action that changed nothing)
    noop_actions: int = 0

    @property
    def finished(self) -> bool:
        return self.done or self.truncated or self.failed

    @property
    def success(self) -> bool:
        """`episode_success` of this episode."""
        return episode_success(self.done, self.rewards, self.info)

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

    def fail(self, info: dict) -> None:
        """Ends the episode as failed with what the pool's `info` says about the failure."""
        self.end(failed=True, reason="env_failed", failure=str(info.get("failure", "")))
        self.failure_kind = str(info.get("failure_kind", "") or "")
        self.failure_traceback = str(info.get("traceback", "") or "")


def _cut(ep: Episode, reason: str) -> None:
    """Ends `ep` truncated by the loop (`reason`: the context or turn limit). When the
    env's last info says what a cut-off episode scores (`info["if_cut"]`: `{"reward": r,
    "info": {...}}`, e.g. intake's rubric without an assessment), its last turn gets that
    reward and the episode that info: a policy cannot escape the env's truncation score
    by filling the context."""
    cut = ep.info.get("if_cut") if isinstance(ep.info, dict) else None
    if isinstance(cut, dict) and ep.rewards:
        ep.rewards[-1] += float(cut.get("reward", 0.0))
        ep.info = dict(cut.get("info") or {})
    ep.end(truncated=True, reason=reason)


class AgentLoop:
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

    def __init__(self, params, model_config: DecoderConfig, tokenizer, config: AgentLoopConfig,
                 observation_role: str = "user", *, profile: bool = False, mesh=None, rules=None):
        self.config = config
        #: also measure when the device is idle (a thread per rollout waits on each decode)
        self.profile = profile
        #: seconds per phase of the last `run` (see `_Clock`): dispatch_s, decode_wait_s,
        #: submit_s, env_wait_s, append_s, host_s (the rest), rollout_s; with `profile`,
        #: device_busy_s, device_idle_s and device_idle_env_wait_s
        self.timings: dict[str, float] = {}
        self.chat = ChatFormat(tokenizer, observation_role=observation_role)
        self.sampler = Sampler(params, model_config, max_len=config.max_context, min_bucket=config.min_bucket,
                               pad_id=config.pad_id, mesh=mesh,
                               **({} if rules is None else {"rules": rules}))
        self.stop_sequences = [self.chat.encode(s) for s in config.stop_strings]
        #: None, or `fn(episodes)` called on a batch's finished episodes before they are
        #: packed (it may change their rewards or fail them: e.g. a judge's reward,
        #: `jaxagent.rewards.JudgeReward`)
        self.reward_fn = None

    @property
    def params(self):
        return self.sampler.params

    def set_params(self, params) -> None:
        """Use new policy parameters (same shapes: no recompilation)."""
        self.sampler.params = params

    # ---------------------------------------------------------------- rollout
    def run(self, pool, seeds: Sequence[Any], group_ids: Sequence[int] | None = None, *,
            seed: int | None = None, sampling: SamplingConfig | None = None,
            row_offset: int = 0) -> tuple[Trajectory, list[Episode]]:
        """Play one episode per pool slot (`len(seeds) == len(pool)`), return the batch.

        seed, sampling: this rollout's sampling seed and settings (None = the config's).
        row_offset: the global index of this batch's first row; episode `i` samples with
          the key `fold_in(seed, row_offset + i)`, so processes that each play a slice
          of one global batch together sample what one process playing it all would.
        """
        cfg = self.config
        seed = cfg.seed if seed is None else seed
        sampling = cfg.sampling if sampling is None else sampling
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"AgentLoop.run: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if not isinstance(row_offset, (int, np.integer)) or row_offset < 0:
            raise ValueError(f"AgentLoop.run: row_offset must be an int >= 0, got {row_offset!r}")
        B = len(seeds)
        if B != len(pool):
            raise ValueError(f"AgentLoop.run: got {B} seeds for a pool of {len(pool)} slots")
        if group_ids is None:
            group_ids = list(range(B))
        if len(group_ids) != B:
            raise ValueError(f"AgentLoop.run: group_ids has {len(group_ids)} entries, expected {B}")
        eps = [Episode(index=i, seed=s, group_id=int(g)) for i, (s, g) in enumerate(zip(seeds, group_ids))]
        clock = _Clock(self.profile)
        self.timings = clock.totals
        if cfg.slots:
            self._run_continuous(pool, eps, seed, sampling, int(row_offset), clock)
            clock.close()
            if self.reward_fn is not None:
                self.reward_fn(eps)
            return self._pack(eps), eps

        # ---- reset and first prompts
        prompts: list[list[int] | None] = [None] * B
        with clock.phase("env_wait_s"):
            reset_results = pool.reset(list(seeds))
        for ep, res in zip(eps, reset_results):
            prompts[ep.index] = self._start_episode(ep, res)

        # ---- the sub-batches: contiguous slot ranges, so each spans the pool's workers
        groups = []
        for part in np.array_split(np.arange(B), min(cfg.pipeline_groups, B)):
            rows = part.tolist()
            with clock.phase("append_s"):
                if cfg.share_prompts:
                    state = self.sampler.prefill([prompts[i] for i in rows], seed, row_ids=part + int(row_offset))
                else:
                    state = self.sampler.init_state(len(rows), seed, row_ids=part + int(row_offset))
                    state = self.sampler.append(state, [prompts[i] for i in rows])
                clock.dispatched()
            groups.append(_Group(rows=rows, state=state))

        # ---- the pipeline (one group: plain decode -> step -> append per turn)
        lost: dict[int, tuple] = {}  # episode -> a failure reported in another group's call
        queue = collections.deque(groups)  # groups whose next move is a decode
        inflight: _InFlight | None = None  # a group's env step the pool is running
        while queue or inflight is not None:
            dec = None
            while queue and dec is None:  # dispatch the next decode (async): the device runs it
                t = time.perf_counter()
                with clock.phase("dispatch_s"):
                    dec = self._dispatch_decode(queue.popleft(), eps, sampling)
                if dec is not None:
                    clock.watch(dec.gen.num_tokens_B, t)
            if inflight is not None:  # meanwhile the envs finish the previous group's step
                g, turn, stepped, known = inflight.group, inflight.turn, inflight.stepped, inflight.known
                with clock.phase("env_wait_s"):
                    results = pool.collect(inflight.handle)
                inflight = None
                stepped_eps = {s.episode for s in stepped}
                for i, res in enumerate(results):
                    if res is not None and i not in stepped_eps and not eps[i].finished \
                            and res[-1].get("failed"):
                        lost[i] = res  # its worker restarted and its replay failed
                results = list(results)
                for i, res in known.items():
                    results[i] = res
                self._finish_step(g, turn, stepped, results, eps, clock)
                queue.append(g)
            if dec is not None:
                g, turn = dec.group, dec.turn
                with clock.phase("decode_wait_s"):
                    lists = Sampler.to_lists(dec.gen)
                actions, stepped, known = self._take_actions(dec, lists, eps, lost, len(pool))
                if any(a is not None for a in actions):
                    with clock.phase("submit_s"):
                        inflight = _InFlight(pool.submit_step(actions), g, turn, stepped, known)
                else:  # nothing for the envs: every action was cut by the context or is known
                    results = [None] * len(pool)
                    for i, res in known.items():
                        results[i] = res
                    self._finish_step(g, turn, stepped, results, eps, clock)
                    queue.append(g)
        for ep in eps:
            if not ep.finished:  # pragma: no cover - every path above ends the episode
                ep.end(truncated=True, reason="max_turns")
        clock.close()
        if self.reward_fn is not None:
            self.reward_fn(eps)
        return self._pack(eps), eps

    def _start_episode(self, ep: Episode, res) -> list[int] | None:
        """Take in an episode's reset result; its prompt tokens, or None if it ended."""
        obs, info = res
        if info.get("failed"):
            ep.fail(info)
            return None
        ep.system_prompt = info.get("system_prompt")
        ep.state_key = info.get("state_key")
        ep.observations.append(obs)
        if "if_cut" in info:   # the score of an episode cut off in its first turn
            ep.info = {"if_cut": info["if_cut"]}
        toks = self.chat.prompt_tokens(ep.system_prompt, obs)
        if len(toks) >= self.config.max_context:
            ep.end(truncated=True, reason="context_full")
            return None
        ep.add("prompt", toks)
        return toks

    def _run_continuous(self, pool, eps: list[Episode], seed: int, sampling: SamplingConfig,
                        row_offset: int, clock: "_Clock") -> None:
        """Continuous scheduling (`AgentLoopConfig.slots`; see the module docstring)."""
        cfg = self.config
        B = len(eps)
        S = min(cfg.slots, B)
        with clock.phase("append_s"):
            state = self.sampler.init_state(S, seed, row_ids=np.arange(S) + row_offset)
        free = collections.deque(range(S))     # rows with no episode
        queued = collections.deque(range(B))   # episodes not started yet
        row: dict[int, int] = {}               # live episode -> its row
        sent: dict[int, _Stepped | None] = {}  # episode -> its step in flight (None: its reset)
        turns = [0] * B                        # policy turns played per episode
        ready: list[int] = []                  # live episodes whose next move is a decode
        appends: dict[int, list[int]] = {}     # a ready episode's tokens not yet in its row
        lost: dict[int, tuple] = {}            # a live episode's failure reported while it decoded
        known: dict[int, tuple] = {}           # results of sent steps known without the pool
        stop_tokens = list(self.chat.stop_token_ids)
        ready_since = 0.0  # when the oldest ready episode became ready
        last_decode_s = 0.0  # wall time of the last decode round
        while True:
            admit = {}
            while free and queued:
                i = queued.popleft()
                row[i] = free.popleft()
                admit[i] = ("reset", eps[i].seed)
                sent[i] = None
            if admit:
                with clock.phase("submit_s"):
                    pool.send(admit)
            if not ready and not known and not pool.in_flight():
                break  # nothing live and nothing queued (a free row would have admitted it)
            timeout = None
            if known:
                timeout = 0.0
            elif ready:  # a round waits for the other live episodes for at most one decode's
                # time: a decode costs far from in proportion to its rows (the weights are read
                # once a token for the whole batch), so many small rounds cost more than they save
                timeout = 0.0 if len(ready) == len(row) else max(
                    0.0, ready_since + max(last_decode_s, MIN_LINGER_S) - time.perf_counter())
            with clock.phase("env_wait_s"):
                results = pool.poll(timeout)
            results.update(known)
            known = {}
            resets = []
            for i, res in sorted(results.items()):
                ep = eps[i]
                if i not in sent:
                    # its worker restarted while it waited for a decode, and its replay
                    # failed: the failure is its next step's result (as in `run`'s loop)
                    if i in row and not ep.finished:
                        lost[i] = res
                    continue
                stepped = sent.pop(i)
                if stepped is None:
                    toks = self._start_episode(ep, res)
                    if toks is not None:
                        resets.append(i)
                else:
                    toks = self._apply_step(ep, stepped.after_eot, res, turns[i] - 1)
                if toks is None:
                    free.append(row.pop(i))
                    continue
                appends[i] = toks
                if not ready:
                    ready_since = time.perf_counter()
                ready.append(i)
            if resets:
                with clock.phase("append_s"):
                    state = self.sampler.reset_rows(state, [row[i] for i in resets], seed,
                                                    [row_offset + i for i in resets])
                    clock.dispatched()
            if not ready:
                continue
            if (len(ready) < len(row) and pool.in_flight() and not known
                    and time.perf_counter() < ready_since + max(last_decode_s, MIN_LINGER_S)):
                continue  # wait a little longer for the others (above)
            # append and decode the ready rows only, in one call: the work is that of a
            # batch of their number
            max_new = [min(cfg.max_tokens_per_turn, cfg.max_context - len(eps[i].tokens)) for i in ready]
            t = time.perf_counter()
            with clock.phase("dispatch_s"):
                state, gen = self.sampler.decode_rows(
                    state, [row[i] for i in ready], max_new_tokens=cfg.max_tokens_per_turn, sampling=sampling,
                    max_new=max_new, stop_tokens=stop_tokens, stop_sequences=self.stop_sequences or None,
                    tokens=[appends.pop(i) for i in ready])
            clock.watch(gen.num_tokens_B, t)
            with clock.phase("decode_wait_s"):
                toks, logps, reasons = Sampler.to_lists(gen)
            last_decode_s = time.perf_counter() - t
            steps = {}
            for j, i in enumerate(ready):
                r, ep = row[i], eps[i]
                action = self._record_turn(ep, toks[j], logps[j], reasons[j], turns[i])
                turns[i] += 1
                if action is None:  # cut by the context limit: not sent
                    free.append(row.pop(i))
                    continue
                sent[i] = _Stepped(r, i, reasons[j] == "stop_token" and toks[j][-1] == self._eot_id())
                if i in lost:
                    known[i] = lost.pop(i)
                else:
                    steps[i] = ("step", action)
            ready = []
            if steps:
                with clock.phase("submit_s"):
                    pool.send(steps)

    def _record_turn(self, ep: Episode, toks: list[int], logps: list[float], reason: str, turn: int) -> str | None:
        """Record a decoded turn of `ep`; its action text, or None when the context limit
        cut it (the episode ends truncated; nothing goes to the env)."""
        cfg = self.config
        ep.add("policy", toks, logps, turn=turn)
        ep.finish_reasons.append(reason)
        ep.state_keys.append(ep.state_key)
        ep.rewards.append(0.0)
        if reason == "cache_full" or (reason == "max_new_tokens" and len(toks) < cfg.max_tokens_per_turn):
            _cut(ep, "context_full")
            return None
        action = self.chat.action_text(toks)
        ep.actions.append(action)
        return action

    def _apply_step(self, ep: Episode, after_eot: bool, res, turn: int) -> list[int] | None:
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
            _cut(ep, "max_turns")
            return None
        seg = self.chat.observation_tokens(obs, after_end_of_turn=after_eot)
        if len(ep.tokens) + len(seg) >= cfg.max_context:  # no room for the next action
            _cut(ep, "context_full")
            return None
        ep.add("observation", seg)
        return seg

    def _dispatch_decode(self, g: "_Group", eps: list[Episode], sampling: SamplingConfig) -> "_Decode | None":
        """Start the decode of group `g`'s live rows; None when the group has finished."""
        cfg = self.config
        if g.turn >= cfg.max_turns:
            return None
        live = [i for i in g.rows if i >= 0 and not eps[i].finished]
        if not live:
            return None
        if cfg.shrink_batch and bucket(len(live), 1) < len(g.rows):
            new_b = bucket(len(live), 1)
            keep = live + [live[0]] * (new_b - len(live))
            g.state = self.sampler.select_rows(g.state, [g.rows.index(i) for i in keep])
            g.rows = live + [-1] * (new_b - len(live))
        active = [i >= 0 and not eps[i].finished for i in g.rows]
        room = [cfg.max_context - len(eps[i].tokens) if a else 0 for i, a in zip(g.rows, active)]
        max_new = [min(cfg.max_tokens_per_turn, r) for r in room]
        stop_seqs = [self.stop_sequences for _ in g.rows] if self.stop_sequences else None
        g.state, gen = self.sampler.decode(
            g.state, max_new_tokens=cfg.max_tokens_per_turn, sampling=sampling, active=active,
            max_new=max_new, stop_tokens=list(self.chat.stop_token_ids), stop_sequences=stop_seqs)
        return _Decode(g, g.turn, active, gen)

    def _take_actions(self, dec: "_Decode", lists, eps: list[Episode], lost: dict, num_slots: int):
        """Record a decoded turn; returns the pool's actions, the stepped rows
        (`_Stepped`) and the results known without stepping."""
        g, turn, active = dec.group, dec.turn, dec.active
        toks, logps, reasons = lists
        actions: list[str | None] = [None] * num_slots
        stepped, known = [], {}
        for r, i in enumerate(g.rows):
            if not active[r]:
                continue
            action = self._record_turn(eps[i], toks[r], logps[r], reasons[r], turn)
            if action is None:  # the action was cut by the context limit: not sent
                continue
            stepped.append(_Stepped(r, i, reasons[r] == "stop_token" and toks[r][-1] == self._eot_id()))
            if i in lost:  # the pool lost this episode while another group stepped
                known[i] = lost.pop(i)
            else:
                actions[i] = action
        return actions, stepped, known

    def _finish_step(self, g: "_Group", turn: int, stepped, results, eps: list[Episode], clock) -> None:
        """Apply a group's step results and append its observations (async)."""
        appends: list[list[int] | None] = [None] * len(g.rows)
        for r, i, after_eot in stepped:  # _Stepped(row, episode, after_end_of_turn)
            appends[r] = self._apply_step(eps[i], after_eot, results[i], turn)
        g.turn = turn + 1
        if any(a for a in appends):
            with clock.phase("append_s"):
                g.state = self.sampler.append(g.state, appends)
                clock.dispatched()

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
        turn_rew = np.zeros((B, K), np.float32)
        turn_mask = np.zeros((B, K), bool)
        for b, ep in enumerate(eps):
            n = len(ep.tokens)
            tokens[b, :n], attn[b, :n] = ep.tokens, 1
            loss[b, :n], logp[b, :n], tid[b, :n] = ep.loss_mask, ep.logp, ep.turn_ids
            for k, r in enumerate(ep.rewards):
                turn_rew[b, k], turn_mask[b, k] = r, True
        rew = rewards_at_turn_ends(turn_rew, tid)
        anchor = anchor_ids(eps, K)
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


@dataclasses.dataclass
class _Group:
    """One sub-batch of the pipeline: its device rows and its own sampler state."""

    rows: list[int]  # device row -> episode index (-1 = padding row)
    state: Any
    turn: int = 0


class _Stepped(NamedTuple):
    """A row whose action went to the env this turn."""

    row: int           # device row in its group
    episode: int       # episode index (pool slot)
    after_eot: bool    # the action ended with the end-of-turn token


@dataclasses.dataclass
class _Decode:
    """A dispatched decode of one group's live rows."""

    group: _Group
    turn: int
    active: list[bool]  # per device row: decoding this turn
    gen: Any            # the sampler's `Generation` (device arrays, not yet fetched)


@dataclasses.dataclass
class _InFlight:
    """A group's env step running in the pool."""

    handle: Any                     # `EnvPool.submit_step`'s handle
    group: _Group
    turn: int
    stepped: list[_Stepped]
    known: dict[int, tuple]         # episode -> result known without the pool (lost earlier)


def _ready_at(x) -> float:
    x.block_until_ready()
    return time.perf_counter()


class _Clock:
    """Host time per phase of a rollout; with `profile`, also when the device is idle.

    The device is taken as busy from the first dispatch of a chain of kernels (append,
    select, decode) until a thread waiting on the chain's decode output sees it ready;
    idle is the rest of the rollout. This over-counts busy time by any queueing on the
    device, so the idle figures are lower bounds.
    """

    def __init__(self, profile: bool):
        self.profile = profile
        self.t0 = time.perf_counter()
        self.totals: dict[str, float] = {k: 0.0 for k in
                                         ("dispatch_s", "decode_wait_s", "submit_s", "env_wait_s", "append_s")}
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
            self.busy.append((start, self.pool.submit(_ready_at, array)))
        self.chain_start = None

    def close(self) -> None:
        end = time.perf_counter()
        self.totals["rollout_s"] = end - self.t0
        self.totals["host_s"] = self.totals["rollout_s"] - sum(
            v for k, v in self.totals.items() if k.endswith("_s") and k not in ("rollout_s", "host_s"))
        if not self.profile:
            return
        busy = sorted((s, f.result()) for s, f in self.busy)
        self.pool.shutdown()
        merged: list[list[float]] = []
        for s, e in busy:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        busy_s = sum(e - s for s, e in merged)
        during_env = sum(we - ws for ws, we in self.env_waits) - sum(
            max(0.0, min(e, we) - max(s, ws)) for s, e in merged for ws, we in self.env_waits)
        self.totals["device_busy_s"] = busy_s
        self.totals["device_idle_s"] = self.totals["rollout_s"] - busy_s
        self.totals["device_idle_env_wait_s"] = during_env


def anchor_ids(episodes: Sequence[Episode], max_turns: int) -> np.ndarray:
    """Dense anchor-state ids `[B, K]` of a batch of episodes: turns that acted in equal
    env states (`Episode.state_keys`) share an id, numbered in order of first
    appearance; -1 where a turn was not played or its state has no key."""
    out = np.full((len(episodes), max_turns), -1, np.int32)
    table: dict = {}
    for b, ep in enumerate(episodes):
        for k, key in enumerate(ep.state_keys[:max_turns]):
            if key is not None:
                out[b, k] = table.setdefault(_stable(key), len(table))
    return out


def _stable(key: Hashable) -> str:
    """A process-independent identity of a state key (keys may come from worker processes)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()
