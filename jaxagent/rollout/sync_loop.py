"""The turn-synchronous scheduler (`AgentLoopConfig.pipeline_groups = 1`, `slots = 0`).

One device batch of every episode, turn by turn:

    decode every live row  ->  send the actions to the pool and wait for all the
    results  ->  append the observations (async)  ->  decode ...

Each episode's first prompt is prefilled once (equal prompts once, their cache rows
copied, with `share_prompts`); finished episodes leave the batch, which shrinks to the
next power-of-two bucket when at most half its rows are still live.

The pieces of a turn (`Group`, `start_groups`, `dispatch_decode`, `take_actions`,
`take_results`, `finish_step`) are those of the pipelined scheduler too, which runs
several such groups interleaved (`pipelined_loop`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jaxagent.rollout.sampler import Sampler, bucket
from jaxagent.rollout.scheduling import Rollout, Stepped


@dataclasses.dataclass
class Group:
    """A sub-batch of episodes decoded together: its device rows and its own sampler state."""

    rows: list[int]  # device row -> episode index (-1 = padding row)
    state: Any
    turn: int = 0


@dataclasses.dataclass
class Decode:
    """A dispatched decode of one group's live rows."""

    group: Group
    turn: int
    active: list[bool]  # per device row: decoding this turn
    gen: Any  # the sampler's `Generation` (device arrays, not yet fetched)


@dataclasses.dataclass
class SyncState:
    """The turn-synchronous scheduler's state."""

    group: Group
    #: episode -> a failure the pool reported for it outside its own step (its worker restarted)
    lost: dict[int, tuple] = dataclasses.field(default_factory=dict)


def run(ro: Rollout) -> None:
    """Play `ro`'s episodes turn by turn in one device batch (see the module docstring)."""
    (group,) = start_groups(ro, 1)
    st = SyncState(group)
    clock = ro.clock
    while True:
        t = time.perf_counter()
        with clock.phase("dispatch_s"):
            dec = dispatch_decode(ro, st.group)
        if dec is None:
            return
        clock.watch(dec.gen.num_tokens_B, t)
        with clock.phase("decode_wait_s"):
            lists = Sampler.to_lists(dec.gen)
        actions, stepped, known = take_actions(ro, dec, lists, st.lost)
        if any(a is not None for a in actions):
            with clock.phase("submit_s"):
                handle = ro.pool.submit_step(actions)
            with clock.phase("env_wait_s"):
                results = ro.pool.collect(handle)
            results = take_results(ro, results, stepped, known, st.lost)
        else:  # nothing for the envs: every action was cut by the context or is known
            results = take_results(ro, [None] * len(ro.pool), stepped, known, None)
        finish_step(ro, dec.group, dec.turn, stepped, results)


def start_groups(ro: Rollout, n: int) -> list[Group]:
    """Reset every episode in the pool, then prefill their first prompts in `n` groups:
    contiguous slot ranges, so each spans the pool's workers."""
    cfg, clock, eps = ro.config, ro.clock, ro.episodes
    B = len(eps)
    prompts: list[list[int] | None] = [None] * B
    with clock.phase("env_wait_s"):
        reset_results = ro.pool.reset([ep.seed for ep in eps])
    for ep, res in zip(eps, reset_results, strict=True):
        prompts[ep.index] = ro.start_episode(ep, res)
    groups = []
    for part in np.array_split(np.arange(B), min(n, B)):
        rows = part.tolist()
        with clock.phase("append_s"):
            if cfg.share_prompts:
                state = ro.sampler.prefill([prompts[i] for i in rows], ro.seed, row_ids=part + ro.row_offset)
            else:
                state = ro.sampler.init_state(len(rows), ro.seed, row_ids=part + ro.row_offset)
                state = ro.sampler.append(state, [prompts[i] for i in rows])
            clock.dispatched()
        groups.append(Group(rows=rows, state=state))
    return groups


def dispatch_decode(ro: Rollout, g: Group) -> Decode | None:
    """Start the decode of group `g`'s live rows; None when the group has finished."""
    cfg, eps = ro.config, ro.episodes
    if g.turn >= cfg.max_turns:
        return None
    live = [i for i in g.rows if i >= 0 and not eps[i].finished]
    if not live:
        return None
    if bucket(len(live), 1) < len(g.rows):
        new_b = bucket(len(live), 1)
        keep = live + [live[0]] * (new_b - len(live))
        g.state = ro.sampler.select_rows(g.state, [g.rows.index(i) for i in keep])
        g.rows = live + [-1] * (new_b - len(live))
    active = [i >= 0 and not eps[i].finished for i in g.rows]
    room = [cfg.max_context - len(eps[i].tokens) if a else 0 for i, a in zip(g.rows, active, strict=True)]
    max_new = [min(cfg.max_tokens_per_turn, r) for r in room]
    stop_seqs = [ro.stop_sequences for _ in g.rows] if ro.stop_sequences else None
    g.state, gen = ro.sampler.decode(
        g.state,
        max_new_tokens=cfg.max_tokens_per_turn,
        sampling=ro.sampling,
        active=active,
        max_new=max_new,
        stop_tokens=list(ro.chat.stop_token_ids),
        stop_sequences=stop_seqs,
    )
    return Decode(g, g.turn, active, gen)


def take_actions(ro: Rollout, dec: Decode, lists, lost: dict[int, tuple]):
    """Record a decoded turn; returns the pool's actions (one per slot, None = no step),
    the stepped rows (`Stepped`) and the results known without stepping (an episode the
    pool reported failed in `lost`: taken out of it)."""
    g, turn, active = dec.group, dec.turn, dec.active
    toks, logps, reasons = lists
    actions: list[str | None] = [None] * len(ro.pool)
    stepped, known = [], {}
    for r, i in enumerate(g.rows):
        if not active[r]:
            continue
        action = ro.record_turn(ro.episodes[i], toks[r], logps[r], reasons[r], turn)
        if action is None:  # the action was cut by the context limit: not sent
            continue
        stepped.append(ro.stepped(r, i, toks[r], reasons[r]))
        if i in lost:  # the pool lost this episode while another step ran
            known[i] = lost.pop(i)
        else:
            actions[i] = action
    return actions, stepped, known


def take_results(
    ro: Rollout, results, stepped: list[Stepped], known: dict[int, tuple], lost: dict[int, tuple] | None
) -> list:
    """A step's results per slot, with those `known` without the pool filled in. With
    `lost`: a live episode that was not stepped but whose result says it failed (its
    worker restarted and its replay failed) is put in `lost`, its next step's result."""
    if lost is not None:
        stepped_eps = {s.episode for s in stepped}
        for i, res in enumerate(results):
            if res is not None and i not in stepped_eps and not ro.episodes[i].finished and res[-1].get("failed"):
                lost[i] = res
    results = list(results)
    for i, res in known.items():
        results[i] = res
    return results


def finish_step(ro: Rollout, g: Group, turn: int, stepped: list[Stepped], results) -> None:
    """Apply a group's step results and append its observations (async)."""
    appends: list[list[int] | None] = [None] * len(g.rows)
    for r, i, after_eot in stepped:
        appends[r] = ro.apply_step(ro.episodes[i], after_eot, results[i], turn)
    g.turn = turn + 1
    if any(a for a in appends):
        with ro.clock.phase("append_s"):
            g.state = ro.sampler.append(g.state, appends)
            ro.clock.dispatched()
