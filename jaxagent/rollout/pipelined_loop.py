"""The pipelined scheduler (`AgentLoopConfig.pipeline_groups = N > 1`).

The episodes are split into N contiguous sub-batches (slot ranges, so each spans the
pool's workers), each with its own sampler state (row keys are still `fold_in(seed,
episode index)`), and each turn of each sub-batch is pipelined against the others with
the pool's non-blocking `submit_step` / `collect`:

    dispatch decode(B)  ->  collect step(A)  ->  append(A) (async)  ->
    wait for decode(B)  ->  submit step(B)   ->  dispatch decode(A)  -> ...

so the envs step A's actions while the device decodes B's (JAX dispatch is async: the
host collects and tokenizes A's observations while B decodes). The trajectories are
those of the turn-synchronous scheduler for the same seeds: every token, action,
observation, reward, end and failure; log-probs agree to float32 rounding (XLA:CPU's
results for a row can differ in the last bits with the batch shape, as they do when
the turn-synchronous batch shrinks). A sub-batch whose episodes all end leaves the pipeline.
Worth it when env steps take as long as decodes; with `num_workers=0` (envs in this
process) there is nothing to overlap.

A sub-batch's turn is the turn-synchronous scheduler's (`sync_loop`'s pieces); only the
order in which the groups decode and step is this module's.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.scheduling import Rollout, Stepped
from jaxagent.rollout.sync_loop import (
    Decode,
    Group,
    dispatch_decode,
    finish_step,
    start_groups,
    take_actions,
    take_results,
)


@dataclasses.dataclass
class InFlight:
    """A group's env step running in the pool."""

    handle: Any  # `EnvPool.submit_step`'s handle
    group: Group
    turn: int
    stepped: list[Stepped]
    known: dict[int, tuple]  # episode -> result known without the pool (lost earlier)


@dataclasses.dataclass
class PipelineState:
    """The pipelined scheduler's state."""

    #: groups whose next move is a decode
    queue: collections.deque[Group]
    #: a group's env step the pool is running
    inflight: InFlight | None = None
    #: episode -> a failure the pool reported for it in another group's step
    lost: dict[int, tuple] = dataclasses.field(default_factory=dict)


def run(ro: Rollout) -> None:
    """Play `ro`'s episodes in `pipeline_groups` interleaved sub-batches (see the module
    docstring)."""
    st = PipelineState(collections.deque(start_groups(ro, ro.config.pipeline_groups)))
    while st.queue or st.inflight is not None:
        dec = _dispatch_next(ro, st)
        if st.inflight is not None:  # meanwhile the envs finish the previous group's step
            _collect(ro, st)
        if dec is not None:
            _submit(ro, st, dec)


def _dispatch_next(ro: Rollout, st: PipelineState) -> Decode | None:
    """Dispatch the next queued group's decode (async: the device runs it); groups that
    have finished leave the queue. None when no group has a decode to run."""
    dec = None
    while st.queue and dec is None:
        t = time.perf_counter()
        with ro.clock.phase("dispatch_s"):
            dec = dispatch_decode(ro, st.queue.popleft())
        if dec is not None:
            ro.clock.watch(dec.gen.num_tokens_B, t)
    return dec


def _collect(ro: Rollout, st: PipelineState) -> None:
    """Wait for the step in flight, apply its results and queue its group's next decode."""
    inflight, st.inflight = st.inflight, None
    assert inflight is not None  # `run` calls this only with a step in flight
    with ro.clock.phase("env_wait_s"):
        results = ro.pool.collect(inflight.handle)
    results = take_results(ro, results, inflight.stepped, inflight.known, st.lost)
    finish_step(ro, inflight.group, inflight.turn, inflight.stepped, results)
    st.queue.append(inflight.group)


def _submit(ro: Rollout, st: PipelineState, dec: Decode) -> None:
    """Wait for a decode, record its turn and send its actions to the pool (or, when
    nothing goes to the envs, apply the known results at once)."""
    with ro.clock.phase("decode_wait_s"):
        lists = Sampler.to_lists(dec.gen)
    actions, stepped, known = take_actions(ro, dec, lists, st.lost)
    if any(a is not None for a in actions):
        with ro.clock.phase("submit_s"):
            st.inflight = InFlight(ro.pool.submit_step(actions), dec.group, dec.turn, stepped, known)
    else:  # nothing for the envs: every action was cut by the context or is known
        results = take_results(ro, [None] * len(ro.pool), stepped, known, None)
        finish_step(ro, dec.group, dec.turn, stepped, results)
        st.queue.append(dec.group)
