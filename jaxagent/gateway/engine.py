"""The gateway's engine: the calls of many sessions batched on one `Sampler`, each
session's KV cache kept live between its calls.

The engine owns a sampler state of `slots` rows and one thread that runs *rounds*. A
session (`open`) takes a row at its first call and keeps it while rows last; the row
holds the session's last sequence (prompt + completion, every sampled token cached).
A call (`submit`: a session's whole prompt ids, as `SessionLedger.prompt` built them)
waits for the next round. Each round:

    take the waiting calls (at most `slots`, oldest first)  ->  give each a row: its
    session's, else a free one, else the least recently used row of a session that is
    not in this round (that session's cache is dropped: its next call is prefilled)  ->
    per call, keep the longest prefix its row holds of the new prompt (at most all but
    the prompt's last token: the next token's logits come from appending), cut the row
    back to it (`Sampler.truncate_rows`) or empty it (`Sampler.reset_rows`), and append
    only the rest (emptied rows whose prompts agree but for the last token, a group's
    sessions of one task, prefill that prefix once and copy it: `Sampler.copy_rows`)
    ->  decode the round's rows together (`Sampler.decode_rows`, which touches only
    those rows; one decode per distinct sampling setting and stop list)

A round starts once every open session has a call waiting, or once calls stop arriving
(none for `arrival_gap_s`, or for a quarter of the last round's duration when that is
longer: waiting costs less than the extra round a split would), or when the oldest
waiting call has waited `max_wait_s`:
calls that arrive while a round decodes join the next one. Replies of one round reach
their programs at about the same time and their next calls come back one after another
(each through HTTP, JSON and the program's own code), so a round that started at the
first of them would leave the rest to the next round, and the rounds would fragment
into many small ones, each costing a decode of its own; waiting while calls keep
arriving gives one round per turn of the sessions. So a session whose calls extend one another is never re-encoded: each
call appends only its new messages to the row's live cache.

Randomness: a session's row is (re)keyed `fold_in(key(seed), key_id)` whenever it is
emptied, and the sampler draws the token at position p with `fold_in(row key, p)`: what
a session samples depends on its `key_id`, its tokens and the policy, never on its row,
on the other sessions in its round, or on whether its cache was kept (the kept prefix is
the same tokens at the same positions).

Policy versions: `set_params(params, version)` takes effect at the next round boundary;
each `Completion` carries the version that sampled it.

Failures: a round that raises fails its own calls' futures (with that exception) and
starts the engine over from an empty state (every session's cache dropped); the next
calls are prefilled. Nothing here parses text: prompts in, tokens out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxagent.rollout.kernels import FINISH_REASONS
from jaxagent.rollout.sampler import Sampler, bucket
from jaxagent.rollout.sampling import SamplingConfig

#: a round waits for more calls while the last one arrived less than this long ago ...
ARRIVAL_GAP_S = 0.02
#: ... or less than this fraction of the last round's duration ago
ROUND_FRACTION = 0.25
#: ... but no call waits longer than this for its round to start (the default `max_wait_s`)
MAX_WAIT_S = 1.0


class EngineClosed(RuntimeError):
    """The engine (or the call's session) was closed: no more calls."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One call's sampled completion.

    `ids` / `logprobs`: the sampled tokens (the stop token included when one was sampled)
    and the sampler's log-prob of each; `reason`: the sampler's finish reason
    (`FINISH_REASONS`: stop_token, stop_sequence, max_new_tokens, cache_full);
    `policy_version`: the weights' version that sampled it; `reused`: prompt tokens whose
    KV was kept from the session's earlier calls (the rest were appended);
    `queued_s` / `round_s`: seconds waiting for its round, and the round's duration.
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reason: str
    policy_version: int
    reused: int
    queued_s: float = 0.0
    round_s: float = 0.0

    @property
    def stopped(self) -> bool:
        """Ended by a stop token or stop sequence (OpenAI's "stop"), not by a length limit."""
        return self.reason in ("stop_token", "stop_sequence")


@dataclasses.dataclass
class _Session:
    key_id: int
    row: int | None = None
    held: tuple[int, ...] = ()  # the tokens the row's cache holds for this session
    used: float = 0.0
    busy: bool = False  # a call waiting or in a round


@dataclasses.dataclass
class _Job:
    session: str
    prompt: tuple[int, ...]
    max_new: int
    sampling: SamplingConfig
    stop_sequences: tuple[tuple[int, ...], ...]
    future: concurrent.futures.Future
    submitted: float


class Engine:
    """Batches sessions' calls on `sampler` (see the module docstring).

    Args:
      sampler: the policy's `Sampler` (its `max_len` is a session's context).
      slots: sampler rows, i.e. sessions decoded together and caches kept at once.
      stop_token_ids: tokens that end a completion (the chat template's end of turn, eos).
      seed: the sampling seed; a session's row key is `fold_in(key(seed), key_id)`.
      policy_version: the version of the sampler's current params.
      max_new_min: the smallest static decode width (the per-call budgets are padded up to
        a power of two of at least this, so decodes compile for few widths).
      arrival_gap_s, max_wait_s: when a round starts before every open session has a
        call waiting (module docstring).
    """

    def __init__(
        self,
        sampler: Sampler,
        *,
        slots: int,
        stop_token_ids: Sequence[int],
        seed: int = 0,
        policy_version: int = 0,
        max_new_min: int = 16,
        arrival_gap_s: float = ARRIVAL_GAP_S,
        max_wait_s: float = MAX_WAIT_S,
    ):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"Engine: slots must be a positive int, got {slots!r}")
        self.sampler = sampler
        self.slots = slots
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.seed = int(seed)
        self.max_new_min = int(max_new_min)
        if not (0 <= arrival_gap_s <= max_wait_s):
            raise ValueError(
                f"Engine: need 0 <= arrival_gap_s <= max_wait_s, got arrival_gap_s={arrival_gap_s!r}, "
                f"max_wait_s={max_wait_s!r}"
            )
        self.arrival_gap_s, self.max_wait_s = float(arrival_gap_s), float(max_wait_s)
        self._version = int(policy_version)
        self._pending_params: tuple[Any, int] | None = None
        self._cv = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._sessions: dict[str, _Session] = {}
        self._rows: list[str | None] = [None] * slots
        self._state: Any = sampler.init_state(slots, self.seed)
        self._closed = False
        self._last_round_s = 0.0
        #: counters: rounds, calls, prompt_tokens, appended_tokens (prefilled), reused_tokens,
        #: completion_tokens, evictions, failed_rounds
        self.stats: collections.Counter = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="jaxagent-gateway-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public
    @property
    def max_context(self) -> int:
        return self.sampler.max_len

    @property
    def policy_version(self) -> int:
        with self._cv:
            return self._pending_params[1] if self._pending_params is not None else self._version

    def set_params(self, params, version: int | None = None) -> int:
        """New policy params (same shapes), used from the next round on; returns their
        version (default: the current one + 1)."""
        with self._cv:
            current = self._pending_params[1] if self._pending_params is not None else self._version
            v = current + 1 if version is None else int(version)
            self._pending_params = (params, v)
            return v

    def open(self, session_id: str, key_id: int) -> None:
        """Register a session that will call (its sampling key `fold_in(key(seed), key_id)`)."""
        with self._cv:
            self._check_open()
            if session_id in self._sessions:
                raise ValueError(f"Engine.open: session {session_id!r} is already open")
            self._sessions[session_id] = _Session(key_id=int(key_id))

    def close_session(self, session_id: str) -> None:
        """Forget a session (its row is freed); a no-op for an unknown one."""
        with self._cv:
            sess = self._sessions.pop(session_id, None)
            if sess is not None and sess.row is not None and self._rows[sess.row] == session_id:
                self._rows[sess.row] = None
            for job in [j for j in self._queue if j.session == session_id]:  # its waiting call ends too
                self._queue.remove(job)
                job.future.set_exception(EngineClosed(f"session {session_id!r} was closed while its call waited"))
            self._cv.notify_all()  # one session fewer to wait for

    def submit(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig,
        stop_sequences: Sequence[Sequence[int]] = (),
    ) -> concurrent.futures.Future:
        """Queue a call of an open session; a future of its `Completion`. Raises ValueError
        for an empty prompt, one with no room for a token (`len >= max_context`), a
        non-positive budget, or a session with a call already waiting."""
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError("Engine.submit: the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"Engine.submit: a prompt of {len(prompt)} tokens leaves no room in a context of {self.max_context}"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"Engine.submit: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"Engine.submit: sampling must be a SamplingConfig, got {type(sampling).__name__}")
        stops = tuple(tuple(int(t) for t in s) for s in stop_sequences if len(s))
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._check_open()
            sess = self._sessions.get(session_id)
            if sess is None:
                raise ValueError(f"Engine.submit: session {session_id!r} is not open")
            if sess.busy:
                raise ValueError(f"Engine.submit: session {session_id!r} already has a call waiting")
            sess.busy = True
            budget = min(max_new_tokens, self.max_context - len(prompt))
            self._queue.append(_Job(session_id, prompt, budget, sampling, stops, future, time.perf_counter()))
            self._cv.notify_all()
        return future

    def close(self) -> None:
        """Stop the engine thread; waiting calls fail with `EngineClosed`."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        while self._queue:
            self._queue.popleft().future.set_exception(EngineClosed("the gateway engine was closed"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ the thread
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("the gateway engine was closed")

    def _loop(self) -> None:
        while True:
            jobs: list[_Job] = []
            try:
                with self._cv:
                    got = self._wait_for_round()
                    if got is None:
                        return
                    jobs = got
                    if self._pending_params is not None:
                        self.sampler.params, self._version = self._pending_params
                        self._pending_params = None
                    version = self._version
                    plans = self._assign_rows(jobs)
                t0 = time.perf_counter()
                results = self._round(jobs, plans)
            except Exception as err:  # the round's calls fail; the engine starts over
                self._start_over(jobs, err)
                continue
            took = time.perf_counter() - t0
            self._last_round_s = took
            with self._cv:
                for job, (ids, _, _, _) in zip(jobs, results, strict=True):
                    done = self._sessions.get(job.session)
                    if done is not None:
                        done.busy = False
                    self.stats["completion_tokens"] += len(ids)
            for job, (ids, lps, reason, reused) in zip(jobs, results, strict=True):
                job.future.set_result(Completion(ids, lps, reason, version, reused, t0 - job.submitted, took))

    def _start_over(self, jobs: list[_Job], err: Exception) -> None:
        """A failed round: its calls get `err`, every session's cache is dropped."""
        self.stats["failed_rounds"] += 1
        with self._cv:
            self._state = self.sampler.init_state(self.slots, self.seed)
            self._rows = [None] * self.slots
            for sess in self._sessions.values():
                sess.row, sess.held = None, ()
            for job in jobs:
                if job.session in self._sessions:
                    self._sessions[job.session].busy = False
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(err)

    def _share_prefills(self, state, jobs: list[_Job], rows: list[int], reused: list[int], feed: list):
        """Fresh rows (nothing kept) whose prompts are equal but for the last token (a
        group's sessions of one task) prefill that prefix once, in one row, and the others
        copy it (`Sampler.copy_rows`); `feed` is left with each one's last token."""
        groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        for i, job in enumerate(jobs):
            if reused[i] == 0 and len(job.prompt) > 1:
                groups[job.prompt[:-1]].append(i)
        shared = {prefix: members for prefix, members in groups.items() if len(members) > 1}
        if not shared:
            return state
        leaders = [members[0] for members in shared.values()]
        state = self.sampler.append_rows(state, [rows[i] for i in leaders], [jobs[i].prompt[:-1] for i in leaders])
        src = [rows[members[0]] for members in shared.values() for _ in members[1:]]
        dst = [rows[i] for members in shared.values() for i in members[1:]]
        state = self.sampler.copy_rows(state, src, dst)
        for members in shared.values():
            for i in members:
                feed[i] = jobs[i].prompt[-1:]
        self.stats["shared_prefill_tokens"] += sum(len(p) * (len(m) - 1) for p, m in shared.items())
        return state

    def _wait_for_round(self) -> list[_Job] | None:
        """Under the lock: the next round's calls, or None when closed."""
        while True:
            if self._closed:
                return None
            if self._queue:
                now = time.perf_counter()
                waited = now - self._queue[0].submitted
                quiet = now - self._queue[-1].submitted
                gap = min(max(self.arrival_gap_s, ROUND_FRACTION * self._last_round_s), self.max_wait_s)
                everyone = len(self._queue) >= min(len(self._sessions), self.slots)
                if everyone or quiet >= gap or waited >= self.max_wait_s:
                    n = min(len(self._queue), self.slots)
                    return [self._queue.popleft() for _ in range(n)]
                self._cv.wait(timeout=min(gap - quiet, self.max_wait_s - waited))
            else:
                self._cv.wait()

    def _assign_rows(self, jobs: list[_Job]) -> list[tuple[int, tuple[int, ...], int]]:
        """Under the lock: per call, its row, what the row holds of its session, and the
        session's key id (module docstring); read here so that a session closed while
        its round decodes changes nothing the round reads."""
        now = time.perf_counter()
        in_round = {job.session for job in jobs}
        plans = []
        for job in jobs:
            sess = self._sessions[job.session]
            if sess.row is None or self._rows[sess.row] != job.session:
                row = self._free_row(in_round)
                owner = self._rows[row]
                if owner is not None and owner in self._sessions:
                    evicted = self._sessions[owner]
                    evicted.row, evicted.held = None, ()
                    self.stats["evictions"] += 1
                self._rows[row] = job.session
                sess.row, sess.held = row, ()
            sess.used = now
            assert sess.row is not None
            plans.append((sess.row, sess.held, sess.key_id))
        return plans

    def _free_row(self, in_round: set[str]) -> int:
        for r, owner in enumerate(self._rows):
            if owner is None or owner not in self._sessions:
                return r
        idle = [
            (self._sessions[owner].used, r) for r, owner in enumerate(self._rows) if owner and owner not in in_round
        ]
        return min(idle)[1]

    def _round(self, jobs: list[_Job], plans: list[tuple[int, tuple[int, ...], int]]):
        """Decode the round's calls; per call `(ids, logprobs, reason, reused)`."""
        sampler = self.sampler
        feed: list[tuple[int, ...]] = []
        cut_rows, cut_to, empty_rows, empty_keys = [], [], [], []
        reused = []
        rows = [row for row, _, _ in plans]
        for job, (row, held, key_id) in zip(jobs, plans, strict=True):
            k = 0
            limit = min(len(held), len(job.prompt) - 1)
            while k < limit and held[k] == job.prompt[k]:
                k += 1
            if k == 0:
                empty_rows.append(row)
                empty_keys.append(key_id)
            elif k < len(held):
                cut_rows.append(row)
                cut_to.append(k)
            feed.append(job.prompt[k:])
            reused.append(k)
            self.stats["prompt_tokens"] += len(job.prompt)
            self.stats["reused_tokens"] += k
            self.stats["appended_tokens"] += len(job.prompt) - k
        state = self._state
        self._state = None  # donated below; a failed round leaves nothing half-written
        if empty_rows:
            state = sampler.reset_rows(state, empty_rows, self.seed, empty_keys)
        if cut_rows:
            state = sampler.truncate_rows(state, cut_rows, cut_to)
        state = self._share_prefills(state, jobs, rows, reused, feed)
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.sampling, job.stop_sequences)].append(i)
        out: list[Any] = [None] * len(jobs)
        for (sampling, stops), members in groups.items():
            width = min(bucket(max(jobs[i].max_new for i in members), self.max_new_min), self.max_context)
            state, gen = sampler.decode_rows(
                state,
                [rows[i] for i in members],
                max_new_tokens=width,
                sampling=sampling,
                max_new=[jobs[i].max_new for i in members],
                stop_tokens=list(self.stop_token_ids),
                stop_sequences=[list(s) for s in stops] or None,
                tokens=[list(feed[i]) for i in members],
            )
            toks, lps, reasons = Sampler.to_lists(gen)
            for j, i in enumerate(members):
                out[i] = (tuple(toks[j]), tuple(lps[j]), reasons[j], reused[i])
        lengths = np.asarray(jax.device_get(state.cache.lengths))
        self._state = state
        with self._cv:
            for job, row, (ids, _, _, _) in zip(jobs, rows, out, strict=True):
                owner = self._sessions.get(job.session)
                if owner is not None and owner.row == row:
                    owner.held = (job.prompt + ids)[: int(lengths[row])]
            self.stats["rounds"] += 1
            self.stats["calls"] += len(jobs)
        assert all(r in FINISH_REASONS for _, _, r, _ in out)
        return out
