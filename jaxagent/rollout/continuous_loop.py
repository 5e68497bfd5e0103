"""The continuous scheduler (`AgentLoopConfig.slots = S > 0`): episodes do not wait for
each other.

The sampler has S rows; episode `i` is admitted to a free row when one is free (in
episode order), its reset is sent to the pool (`EnvPool.send`), and its row is emptied
and given the key `fold_in(seed, i)`. Each round:

    take in the env results that have arrived (`EnvPool.poll`)  ->  once every live
    episode is ready, or the first ready one has waited as long as the last decode
    took, append the ready episodes' prompts / observations and decode their rows,
    together, in one call that touches only those rows (`Sampler.decode_rows`)  ->
    send those actions

An episode whose env step is in flight keeps its KV cache in its row and is simply not
decoded until its observation arrives; the others go on without it after at most one
decode's time (a round of few rows costs nearly as much as a full one, as the weights
are read once a token for the whole batch, so rounds are kept full). A finished episode
frees its row for the next episode not yet started. The trajectories are those of the
turn-synchronous scheduler for the same seeds (every token, action, observation,
reward, end and failure; log-probs to float32 rounding): sampling depends only on a
row's key and history. Rows are never re-bucketed (the turn-synchronous batch's shrinking does not apply).
Worth it when env steps take uneven times: one slow step holds only its own episode
(and the other slots of its pool worker, which runs its slots' items one after another).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.scheduling import Rollout, Stepped

#: before the first decode round is timed, a round waits this long at most for episodes
#: that are not ready yet
MIN_LINGER_S = 0.05


@dataclasses.dataclass
class ContinuousState:
    """The continuous scheduler's state: its S sampler rows and where each episode is."""

    #: the sampler's state of the S rows
    state: Any
    #: rows with no episode
    free: collections.deque[int]
    #: episodes not started yet
    queued: collections.deque[int]
    #: policy turns played per episode
    turns: list[int]
    #: live episode -> its row
    row: dict[int, int] = dataclasses.field(default_factory=dict)
    #: episode -> its step in flight (None: its reset)
    sent: dict[int, Stepped | None] = dataclasses.field(default_factory=dict)
    #: live episodes whose next move is a decode
    ready: list[int] = dataclasses.field(default_factory=list)
    #: a ready episode's tokens not yet in its row
    appends: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    #: a live episode's failure reported while it decoded
    lost: dict[int, tuple] = dataclasses.field(default_factory=dict)
    #: results of sent steps known without the pool
    known: dict[int, tuple] = dataclasses.field(default_factory=dict)
    #: when the oldest ready episode became ready
    ready_since: float = 0.0
    #: wall time of the last decode round
    last_decode_s: float = 0.0

    def linger_until(self) -> float:
        """Until when a round waits for the episodes that are not ready yet."""
        return self.ready_since + max(self.last_decode_s, MIN_LINGER_S)


def run(ro: Rollout) -> None:
    """Play `ro`'s episodes with `slots` sampler rows (see the module docstring)."""
    B = len(ro.episodes)
    S = min(ro.config.slots, B)
    with ro.clock.phase("append_s"):
        state = ro.sampler.init_state(S, ro.seed, row_ids=np.arange(S) + ro.row_offset)
    st = ContinuousState(
        state=state, free=collections.deque(range(S)), queued=collections.deque(range(B)), turns=[0] * B
    )
    while True:
        _admit(ro, st)
        if not st.ready and not st.known and not ro.pool.in_flight():
            break  # nothing live and nothing queued (a free row would have admitted it)
        with ro.clock.phase("env_wait_s"):
            results = ro.pool.poll(_poll_timeout(st))
        results.update(st.known)
        st.known = {}
        _take_in(ro, st, results)
        if not st.ready:
            continue
        if (
            len(st.ready) < len(st.row)
            and ro.pool.in_flight()
            and not st.known
            and time.perf_counter() < st.linger_until()
        ):
            continue  # wait a little longer for the others (`_poll_timeout`)
        _decode_round(ro, st)


def _admit(ro: Rollout, st: ContinuousState) -> None:
    """Give free rows to the next episodes not started yet and send their resets."""
    admit = {}
    while st.free and st.queued:
        i = st.queued.popleft()
        st.row[i] = st.free.popleft()
        admit[i] = ("reset", ro.episodes[i].seed)
        st.sent[i] = None
    if admit:
        with ro.clock.phase("submit_s"):
            ro.pool.send(admit)


def _poll_timeout(st: ContinuousState) -> float | None:
    """How long to wait for env results: not at all with results already known, or every
    live episode ready; with some ready, until the round's linger ends; else until one
    arrives (None)."""
    if st.known:
        return 0.0
    if st.ready:  # a round waits for the other live episodes for at most one decode's
        # time: a decode costs far from in proportion to its rows (the weights are read
        # once a token for the whole batch), so many small rounds cost more than they save
        return 0.0 if len(st.ready) == len(st.row) else max(0.0, st.linger_until() - time.perf_counter())
    return None


def _take_in(ro: Rollout, st: ContinuousState, results: dict[int, tuple]) -> None:
    """Apply the env results (resets and steps) that arrived: an episode that goes on is
    ready, with its tokens to append; one that ended frees its row. Rows of new episodes
    are emptied and keyed (`Sampler.reset_rows`)."""
    eps = ro.episodes
    resets = []
    for i, res in sorted(results.items()):
        ep = eps[i]
        if i not in st.sent:
            # its worker restarted while it waited for a decode, and its replay failed:
            # the failure is its next step's result (as in the turn-synchronous scheduler)
            if i in st.row and not ep.finished:
                st.lost[i] = res
            continue
        stepped = st.sent.pop(i)
        if stepped is None:
            toks = ro.start_episode(ep, res)
            if toks is not None:
                resets.append(i)
        else:
            toks = ro.apply_step(ep, stepped.after_eot, res, st.turns[i] - 1)
        if toks is None:
            st.free.append(st.row.pop(i))
            continue
        st.appends[i] = toks
        if not st.ready:
            st.ready_since = time.perf_counter()
        st.ready.append(i)
    if resets:
        with ro.clock.phase("append_s"):
            st.state = ro.sampler.reset_rows(
                st.state, [st.row[i] for i in resets], ro.seed, [ro.row_offset + i for i in resets]
            )
            ro.clock.dispatched()


def _decode_round(ro: Rollout, st: ContinuousState) -> None:
    """Append and decode the ready rows only, in one call (the work is that of a batch of
    their number), record their turns and send their actions."""
    cfg, eps, clock = ro.config, ro.episodes, ro.clock
    ready = st.ready
    max_new = [min(cfg.max_tokens_per_turn, cfg.max_context - len(eps[i].tokens)) for i in ready]
    t = time.perf_counter()
    with clock.phase("dispatch_s"):
        st.state, gen = ro.sampler.decode_rows(
            st.state,
            [st.row[i] for i in ready],
            max_new_tokens=cfg.max_tokens_per_turn,
            sampling=ro.sampling,
            max_new=max_new,
            stop_tokens=list(ro.chat.stop_token_ids),
            stop_sequences=ro.stop_sequences or None,
            tokens=[st.appends.pop(i) for i in ready],
        )
    clock.watch(gen.num_tokens_B, t)
    with clock.phase("decode_wait_s"):
        toks, logps, reasons = Sampler.to_lists(gen)
    st.last_decode_s = time.perf_counter() - t
    steps = {}
    for j, i in enumerate(ready):
        r, ep = st.row[i], eps[i]
        action = ro.record_turn(ep, toks[j], logps[j], reasons[j], st.turns[i])
        st.turns[i] += 1
        if action is None:  # cut by the context limit: not sent
            st.free.append(st.row.pop(i))
            continue
        st.sent[i] = ro.stepped(r, i, toks[j], reasons[j])
        if i in st.lost:
            st.known[i] = st.lost.pop(i)
        else:
            steps[i] = ("step", action)
    st.ready = []
    if steps:
        with clock.phase("submit_s"):
            ro.pool.send(steps)
