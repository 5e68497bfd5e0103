"""The parent side of the pool: :class:`EnvPool`, its slots and its calls.

One asynchronous core: ``_send`` gives items to slots (a worker runs its slots' items
in batches, one batch at a time) and ``_poll`` takes in what the workers answer, applies
the timeouts and turns faults into failed results. The public ``send`` / ``poll`` are
that core with their checks; the batch calls (``reset``, ``step``, ``expert_actions``
and their split form ``submit_*`` / ``ready`` / ``collect``) are written on top of it:
``_send`` of every slot's item, then ``_poll`` until every worker is answered. What the
pool guarantees is in the package's doc (``envs.pool``).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import numbers
import pickle
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from envs.core import Env
from envs.pool.process import Timeouts, WorkerProcess, shutdown
from envs.pool.protocol import EXPERT, REPLAY, RESET, STEP
from envs.pool.worker import SlotRunner
from jaxagent.failures import CAUGHT_KINDS, CPU_LIMIT, CRASHED, TIMEOUT, WORKER_LOST

_MAX_SILENT_DEATHS = 3


class PoolCall:
    """Handle of one submitted reset / step (returned by ``submit_*``, given to ``collect``)."""

    __slots__ = ("kind", "number")

    def __init__(self, kind: str, number: int):
        self.kind, self.number = kind, number

    def __repr__(self) -> str:
        return f"PoolCall({self.kind!r}, #{self.number})"


class _Slot:
    __slots__ = ("index", "worker", "status", "seed", "actions", "digests", "pending")

    def __init__(self, index: int, worker: int):
        self.index = index
        self.worker = worker
        self.status = "new"  # new | running | done | failed
        self.seed: int | None = None
        self.actions: list[str] = []
        self.digests: list[bytes] = []
        self.pending: tuple[str, Any] | None = None  # the op sent, not yet answered


class EnvPool:
    """A batch of env slots stepped by ``num_workers`` host processes (see ``envs.pool``).

    Args:
      env_fns: one per slot: an env name for ``envs.make`` or a picklable
        zero-argument callable that builds an env (``functools.partial(envs.make,
        "sokoban", height=8, width=8)``, a module-level function; not a lambda).
      num_workers: worker processes; ``0`` runs the envs in this process (no
        timeouts and no crash isolation: for debugging and as a baseline).
      step_timeout: seconds one env step may take before its episode fails.
      reset_timeout: seconds one reset may take (default: ``step_timeout``).
      startup_timeout: seconds a worker process may take to start.
      restart_on_exception: restart the worker after an env raised (the safe
        default); ``False`` keeps the process and drops only the faulty env.
      mp_context: ``"spawn"`` (default) or ``"forkserver"``.
      memory_limit_mb: each worker's address-space limit (``RLIMIT_AS``; None = none):
        an env that allocates past it fails its episode as ``memory_limit``.
      cpu_limit_s: CPU seconds one env call may use (``RLIMIT_CPU``, re-armed before each
        call; None = none): past it the worker is ended and the episode fails as
        ``cpu_limit``. Unlike ``step_timeout`` (wall clock) it also stops a call that
        burns several cores. Both limits apply to processes the env starts, too.
    """

    def __init__(
        self,
        env_fns: Sequence[str | Callable[[], Env]],
        num_workers: int = 1,
        step_timeout: float = 30.0,
        reset_timeout: float | None = None,
        startup_timeout: float = 120.0,
        restart_on_exception: bool = True,
        mp_context: str = "spawn",
        memory_limit_mb: float | None = None,
        cpu_limit_s: float | None = None,
    ):
        env_fns = list(env_fns)
        if not env_fns:
            raise ValueError("env_fns is empty: give at least one env name or factory")
        from envs.core import is_known

        for i, fn in enumerate(env_fns):
            if isinstance(fn, str):
                if not is_known(fn):
                    raise ValueError(f"env_fns[{i}]: unknown env name {fn!r}")
            elif not callable(fn):
                raise TypeError(
                    f"env_fns[{i}] must be an env name or a zero-argument callable, got {type(fn).__name__}"
                )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        for name, val in (
            ("step_timeout", step_timeout),
            ("startup_timeout", startup_timeout),
            ("reset_timeout", step_timeout if reset_timeout is None else reset_timeout),
        ):
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {val!r}")
        for name, limit in (("memory_limit_mb", memory_limit_mb), ("cpu_limit_s", cpu_limit_s)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
                raise ValueError(f"{name} must be a positive number or None (no limit), got {limit!r}")
        self.memory_limit_mb = memory_limit_mb
        self.cpu_limit_s = cpu_limit_s
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(
                f"mp_context must be 'spawn' or 'forkserver' (fork is unsafe with JAX loaded), got {mp_context!r}"
            )
        self.num_slots = len(env_fns)
        self.num_workers = min(num_workers, self.num_slots)
        self.step_timeout = float(step_timeout)
        self.reset_timeout = float(step_timeout if reset_timeout is None else reset_timeout)
        self.startup_timeout = float(startup_timeout)
        self.restart_on_exception = restart_on_exception
        self._timeouts = Timeouts(self.step_timeout, self.reset_timeout, self.startup_timeout)
        self._poll_s = min(0.25, self.step_timeout / 10)
        #: Counters: worker restarts, failures by kind.
        self.stats: dict[str, int] = {"restarts": 0}
        self._closed = False
        self._results: dict[int, Any] = {}  # results taken in, not yet handed out
        self._call: PoolCall | None = None  # the batch call in flight
        self._call_results: dict[int, Any] = {}
        self._calls = 0
        self._env_fns = env_fns
        nw = max(self.num_workers, 1)
        self._slots = [_Slot(i, i % nw) for i in range(self.num_slots)]
        self._workers: list[WorkerProcess] = []
        self._runner: SlotRunner | None = None
        if self.num_workers == 0:
            self._runner = SlotRunner(dict(enumerate(env_fns)), pickled=False)
            self._finalizer: weakref.finalize[..., EnvPool] = weakref.finalize(self, self._runner.close)
            return
        self._pickled = {}
        for i, fn in enumerate(env_fns):
            try:
                self._pickled[i] = pickle.dumps(fn)
            except Exception as e:
                raise TypeError(
                    f"env_fns[{i}] ({fn!r}) cannot be pickled for the worker processes: "
                    f"{e}; use an env name, a module-level function or functools.partial"
                ) from e
        self._ctx = mp.get_context(mp_context)
        self._workers = [
            WorkerProcess(w, [s.index for s in self._slots if s.worker == w]) for w in range(self.num_workers)
        ]
        self._finalizer = weakref.finalize(self, shutdown, self._workers)
        try:
            for w in self._workers:
                self._start(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ the asynchronous API

    def send(self, ops: dict[int, tuple[str, Any]]) -> None:
        """Start resets and steps of some slots, whatever other slots are doing; returns at
        once. ``ops`` maps a slot to ``("reset", seed)`` or ``("step", action)``; a slot
        must not have a call in flight. Results come from :meth:`poll`. With
        ``num_workers=0`` the envs run here, before it returns."""
        self._check_open()
        if self._call is not None:
            raise RuntimeError(f"a {self._call.kind} is still in flight: collect() it first")
        if not isinstance(ops, dict):
            raise TypeError(f"send: ops must be a dict slot -> (op, arg), got {type(ops).__name__}")
        checked = {}
        for i, op in ops.items():
            self._check_slot_index(i)
            slot = self._slots[i]
            if slot.pending is not None or i in self._results:
                what = slot.pending[0] if slot.pending is not None else "result not polled"
                raise ValueError(f"send: slot {i} already has a {what} in flight; poll() its result first")
            if not (isinstance(op, tuple) and len(op) == 2 and op[0] in (RESET, STEP)):
                raise ValueError(f"send: slot {i}: an op is ('reset', seed) or ('step', action), got {op!r}")
            kind, arg = op
            if kind == RESET and (not isinstance(arg, numbers.Integral) or isinstance(arg, bool)):
                raise TypeError(f"send: slot {i}: the seed must be an int, got {type(arg).__name__} {arg!r}")
            if kind == STEP:
                if slot.status != "running":
                    raise ValueError(
                        f"send: slot {i} has no episode in progress (status {slot.status!r}); reset it first"
                    )
                if not isinstance(arg, str):
                    raise TypeError(f"send: slot {i}: the action must be a str, got {type(arg).__name__}")
            checked[i] = (kind, int(arg) if kind == RESET else arg)
        self._send(checked)

    def poll(self, timeout: float | None = None) -> dict[int, Any]:
        """Results of :meth:`send` calls finished since the last poll, ``{slot: result}``
        (shaped as ``reset`` / ``step`` results; failures as ``envs.pool`` describes them).
        Waits up to ``timeout`` seconds (None: as long as it takes) for the first one when
        none is in; ``{}`` when nothing was sent. A slot whose episode was lost (its worker
        restarted and its replay failed) comes back failed though nothing was sent to it."""
        self._check_open()
        if self._call is not None:
            raise RuntimeError(f"a {self._call.kind} is in flight: collect() it, not poll()")
        try:
            return self._poll(timeout)
        except BaseException:
            self.close()
            raise

    def in_flight(self) -> list[int]:
        """The slots with a :meth:`send` call whose result :meth:`poll` has not returned."""
        return [s.index for s in self._slots if s.pending is not None or s.index in self._results]

    # ------------------------------------------------------------ batch calls, on top of it

    def reset(self, seeds: Sequence[int | None]) -> list[tuple[Any, dict] | None]:
        """Reset every slot whose seed is not None; returns ``(observation, info)`` per slot."""
        self.submit_reset(seeds)
        return self.collect()

    def step(self, actions: Sequence[str | None]) -> list[tuple | None]:
        """Step every slot whose action is not None; returns a 5-tuple per slot."""
        self.submit_step(actions)
        return self.collect()

    def expert_actions(self, slots: Sequence[int] | None = None) -> list[str | None]:
        """The expert's next action for each running slot (None: no expert, or not running).

        Experts must not change their env's observable state.
        """
        self._check_idle()
        wanted = range(self.num_slots) if slots is None else slots
        ops = {}
        for i in wanted:
            self._check_slot_index(i)
            if self._slots[i].status == "running":
                ops[i] = (EXPERT, None)
        self._submit(dict(sorted(ops.items())), "expert")
        return self.collect()

    def submit_reset(self, seeds: Sequence[int | None]) -> PoolCall:
        """Start resetting; returns at once; results come from :meth:`collect`."""
        self._check_idle()
        seeds = self._check_len(seeds, "seeds")
        ops = {}
        for i, seed in enumerate(seeds):
            if seed is None:
                continue
            if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
                raise TypeError(f"seeds[{i}] must be an int or None, got {type(seed).__name__} {seed!r}")
            ops[i] = (RESET, int(seed))
        return self._submit(ops, "reset")

    def submit_step(self, actions: Sequence[str | None]) -> PoolCall:
        """Start stepping; returns at once (the workers step meanwhile); results come from
        :meth:`collect`. With ``num_workers=0`` the envs step here, before it returns."""
        self._check_idle()
        actions = self._check_len(actions, "actions")
        ops = {}
        for i, action in enumerate(actions):
            if action is None:
                continue
            slot = self._slots[i]
            if slot.status != "running":
                raise ValueError(
                    f"actions[{i}]: slot {i} has no episode in progress (status "
                    f"{slot.status!r}); pass None for it or reset it first"
                )
            if not isinstance(action, str):
                raise TypeError(f"actions[{i}] must be a str or None, got {type(action).__name__}")
            ops[i] = (STEP, action)
        return self._submit(ops, "step")

    def ready(self, handle: PoolCall | None = None) -> bool:
        """True when :meth:`collect` would return without waiting (never blocks; it takes
        in the results that have arrived and applies the timeouts that are due)."""
        self._check_call(handle, "ready")
        try:
            self._call_results.update(self._poll(0.0))
            return not self._busy()
        except BaseException:
            self.close()
            raise

    def collect(self, handle: PoolCall | None = None) -> list:
        """Wait for the submitted call (``handle``: the one ``submit_*`` returned; it is
        checked to be the call in flight); one result per slot, None where nothing was
        asked, except that a slot whose episode was lost (its worker restarted and the
        replay failed) comes back failed even if the call did not touch it."""
        self._check_call(handle, "collect")
        try:
            results = self._call_results
            while True:  # every worker answered: a lost episode's replay belongs to this call
                results.update(self._poll(None))
                if not self._busy():
                    return [results.get(i) for i in range(self.num_slots)]
        except BaseException:
            # Interrupted mid-call (Ctrl-C): results may still arrive from the workers and
            # would be misattributed to a later call, so the pool cannot go on.
            self.close()
            raise
        finally:
            self._call, self._call_results = None, {}

    def _submit(self, ops: dict[int, tuple[str, Any]], kind: str) -> PoolCall:
        self._check_idle()
        self._calls += 1
        self._call = PoolCall(kind, self._calls)
        self._send(ops)
        for w in self._workers:  # restarts due (an env raised) happen within this call
            if w.needs_restart and not w.busy:
                self._restart(w)
        return self._call

    # ------------------------------------------------------------ state

    def status(self, slot: int) -> str:
        """``new``, ``running``, ``done`` or ``failed``."""
        self._check_slot_index(slot)
        return self._slots[slot].status

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty in-process)."""
        procs = [w.proc for w in self._workers]
        return [p.pid for p in procs if p is not None and p.is_alive() and p.pid is not None]

    def close(self) -> None:
        """Stop all workers (idempotent); the pool cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.num_slots

    # ------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the EnvPool is closed")

    def _check_len(self, values, name: str) -> list:
        values = list(values)
        if len(values) != self.num_slots:
            raise ValueError(f"{name} has {len(values)} entries; the pool has {self.num_slots} slots")
        return values

    def _check_slot_index(self, i) -> None:
        if not isinstance(i, int) or not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i!r} is out of range for a pool of {self.num_slots} slots")

    def _check_idle(self) -> None:
        """Before a batch call: nothing in flight (a batch call, or send() results)."""
        self._check_open()
        if self._call is not None:
            raise RuntimeError(f"a {self._call.kind} is still in flight: collect() it first")
        if self.in_flight():
            raise RuntimeError("send() calls are outstanding: poll() their results first")
        if self._busy():  # only a restarted worker's replay is still running: it belongs to no call
            try:
                self._wait_all()
            except BaseException:
                self.close()
                raise
            self._results.clear()

    def _check_call(self, handle: PoolCall | None, what: str) -> None:
        if self._call is None:
            if self.in_flight() or self._busy():
                raise RuntimeError(f"{what}() while send() calls are outstanding: poll() them")
            raise RuntimeError(f"{what}() without a submitted reset/step")
        if handle is not None and handle is not self._call:
            raise RuntimeError(
                f"{what}({handle!r}): that call is not the one in flight ({self._call!r}); it was collected already"
            )

    # ------------------------------------------------------------ the core: send and poll

    def _busy(self) -> bool:
        return any(w.busy for w in self._workers)

    def _send(self, ops: dict[int, tuple[str, Any]]) -> None:
        """Give each slot of ``ops`` its item: run at once in-process, else sent to its
        worker now if the worker is idle, or when its current batch is answered."""
        for i, op in ops.items():
            self._slots[i].pending = op
        if self._runner is not None:
            for i in ops:
                self._record(self._slots[i], self._runner.run(i, *ops[i]))
            return
        for w in sorted({self._slots[i].worker for i in ops}):
            self._advance(self._workers[w])

    def _poll(self, timeout: float | None) -> dict[int, Any]:
        """The results taken in so far; waits up to ``timeout`` (None: as long as it takes)
        for the first one while some worker is busy (at least one pass over the workers)."""
        if self._runner is None:
            end = None if timeout is None else time.monotonic() + max(0.0, timeout)
            first = True
            while not self._results and self._busy():
                now = time.monotonic()
                if end is not None and now >= end and not first:
                    break
                first = False
                self._wait_once(self._poll_s if end is None else max(0.0, min(self._poll_s, end - now)))
            for s in self._slots:  # cannot happen unless a worker vanished mid-call
                if s.pending is not None and not self._workers[s.worker].busy:
                    self._fail(s, WORKER_LOST, "no result came back for this slot", None)
        out, self._results = self._results, {}
        return out

    def _advance(self, w: WorkerProcess) -> None:
        """Give an idle worker the items its slots have waiting."""
        if w.busy or not any(self._slots[i].pending is not None for i in w.slots):
            return
        if w.needs_restart:
            self._restart(w)
        else:
            w.send_batch(self._ops_for(w))

    def _ops_for(self, w: WorkerProcess, replay: bool = False) -> list:
        items = []
        if replay:
            for i in w.slots:
                s = self._slots[i]
                needs_env = s.status == "running" and (s.pending is None or s.pending[0] != RESET)
                if needs_env:
                    items.append((i, REPLAY, (s.seed, list(s.actions), list(s.digests))))
        for i in w.slots:
            s = self._slots[i]
            if s.pending is not None:
                items.append((i, *s.pending))
        return items

    # ------------------------------------------------------------ worker lifecycle

    def _start(self, w: WorkerProcess) -> None:
        w.start(self._ctx, {i: self._pickled[i] for i in w.slots}, self.memory_limit_mb, self.cpu_limit_s)

    def _restart(self, w: WorkerProcess) -> None:
        """Replace the worker process and rebuild its healthy episodes by replay."""
        w.stop(grace=0.2)
        self.stats["restarts"] += 1
        self._start(w)
        w.send_batch(self._ops_for(w, replay=True))

    # ------------------------------------------------------------ taking results in

    def _wait_all(self) -> None:
        """Take in results until every worker's batch is answered."""
        while self._busy():
            self._wait_once(self._poll_s)

    def _wait_once(self, wait: float) -> None:
        """One pass: wait up to ``wait`` seconds (less if a deadline is due) for workers'
        answers, take in those that arrived, and apply the timeouts that are due."""
        waiting = [w for w in self._workers if w.busy or not w.ready]
        if not any(w.busy for w in waiting):
            return
        by_handle: dict[Connection | int, WorkerProcess] = {}
        for w in waiting:
            assert w.conn is not None and w.proc is not None  # waiting: started
            by_handle[w.conn] = w
            by_handle[w.proc.sentinel] = w
        now = time.monotonic()
        # Deadlines move as workers go from item to item (a short step after a long
        # replay), so look again at least every poll interval.
        deadline = min(w.deadline(self._timeouts) for w in waiting)
        ready = mpc.wait(list(by_handle), timeout=min(max(0.0, deadline - now), wait))
        handled = set()
        for h in ready:
            w = by_handle[cast("Connection | int", h)]  # one of the handles it was given
            if w.index in handled:
                continue
            handled.add(w.index)
            self._on_ready(w)
        now = time.monotonic()
        for w in waiting:
            if w.index not in handled and (w.busy or not w.ready) and w.deadline(self._timeouts) <= now:
                self._on_timeout(w)

    def _on_ready(self, w: WorkerProcess) -> None:
        assert w.proc is not None
        try:
            answered = w.receive(self.step_timeout)
            if answered is not None:
                self._on_done(w, *answered)
                return
        except (EOFError, OSError):
            w.proc.join(2.0)  # the pipe closed: the process is exiting
        if not w.proc.is_alive():
            self._on_death(w, None)

    def _on_done(self, w: WorkerProcess, batch: list, results: list) -> None:
        caught = False
        for (i, op, _), res in zip(batch, results, strict=True):
            slot = self._slots[i]
            if op == REPLAY:
                if res[0] == "fail":
                    self._fail(slot, res[1], "while replaying into a restarted worker: " + res[2], res[3])
                continue
            if slot.status == "failed" and op != RESET:
                continue
            self._record(slot, res)
            if res[0] == "fail" and res[1] in CAUGHT_KINDS:
                caught = True
        if caught and self.restart_on_exception:
            w.needs_restart = True
        self._advance(w)

    def _on_timeout(self, w: WorkerProcess) -> None:
        assert w.conn is not None
        if w.conn.poll():  # its answer arrived after all
            self._on_ready(w)
            return
        if not w.ready:
            self._on_death(w, f"the worker did not start within startup_timeout={self.startup_timeout}s")
            return
        k = w.running()
        op = w.batch[k][1] if w.batch is not None and 0 <= k < len(w.batch) else None
        if op is None:
            what = "the worker did not answer in time"
        elif op == RESET:
            what = f"reset took longer than reset_timeout={self.reset_timeout}s"
        elif op == REPLAY:
            what = "replaying the episode took longer than its timeout"
        else:
            what = f"{op} took longer than step_timeout={self.step_timeout}s"
        self._abort_batch(w, k, TIMEOUT, what)

    def _on_death(self, w: WorkerProcess, reason: str | None) -> None:
        k = w.running()
        code = w.proc.exitcode if w.proc is not None else None
        kind = CRASHED
        if reason is None:
            reason = f"the worker process died (exit code {code}"
            if code is not None and code < 0:
                try:
                    reason += f", {signal.Signals(-code).name}"
                except ValueError:
                    pass
            reason += ")"
            if code == -signal.SIGXCPU and self.cpu_limit_s is not None:
                kind = CPU_LIMIT
                reason = f"the env call used more than cpu_limit_s={self.cpu_limit_s} CPU seconds ({reason})"
        self._abort_batch(w, k, kind, reason)

    def _abort_batch(self, w: WorkerProcess, k: int, kind: str, reason: str) -> None:
        """Worker ``w`` died or hung at item ``k`` of its batch: fail that item's slot,
        restart the worker, rebuild the other slots, re-run their pending ops."""
        batch = w.batch or []
        if 0 <= k < len(batch):
            slot = self._slots[batch[k][0]]
            self._fail(slot, kind, reason + (" during replay" if batch[k][1] == REPLAY else ""), None)
            w.silent_deaths = 0
        else:
            w.silent_deaths += 1
            if w.silent_deaths >= _MAX_SILENT_DEATHS:
                for i in w.slots:
                    s = self._slots[i]
                    if s.pending is not None or s.status == "running":
                        self._fail(
                            s,
                            WORKER_LOST,
                            f"{reason}, {w.silent_deaths} times in a row without running any env",
                            None,
                        )
                w.silent_deaths = 0
        self._restart(w)

    def _fail(self, slot: _Slot, kind: str, message: str, tb: str | None) -> None:
        self.stats[kind] = self.stats.get(kind, 0) + 1
        info = {"failed": True, "failure_kind": kind, "failure": message, "traceback": tb}
        # The result has the shape of the slot's op; a slot with none can fail too (its
        # episode could not be rebuilt in a restarted worker): the batch call's shape, or
        # a step's.
        op = slot.pending[0] if slot.pending is not None else (self._call.kind if self._call else STEP)
        if op == RESET:
            self._results[slot.index] = ("", info)
        elif op == EXPERT:
            self._results[slot.index] = None
        else:
            self._results[slot.index] = ("", 0.0, False, True, info)
        slot.status = "failed"
        slot.pending = None
        slot.actions, slot.digests = [], []
        if self._runner is not None:
            self._runner.drop(slot.index)

    def _record(self, slot: _Slot, res) -> None:
        if slot.pending is None:
            return
        op, arg = slot.pending
        if res[0] == "fail":
            self._fail(slot, res[1], res[2], res[3])
            return
        payload, digest = res[1], res[2]
        if op == RESET:
            slot.seed, slot.actions, slot.digests = arg, [], [digest]
            slot.status = "running"
        elif op == STEP:
            slot.actions.append(arg)
            slot.digests.append(digest)
            if payload[2] or payload[3]:
                slot.status = "done"
        self._results[slot.index] = payload
        slot.pending = None
