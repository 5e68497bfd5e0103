"""EnvPool: many text envs stepped in batches by host worker processes, fault-tolerant.

Slot ``i`` of the pool holds one env built from ``env_fns[i]`` (an env name for
:func:`envs.make`, or a zero-argument callable returning an env) in worker process
``i % num_workers``. ``reset(seeds)`` and ``step(actions)`` act on all slots at once
(``None`` in a slot's place leaves it alone) and return one result per slot, in slot
order. ``submit_reset`` / ``submit_step`` / ``collect`` split a call in two so the
caller can decode the next actions on the device while the envs step: ``submit_*``
sends the work to the workers and returns a :class:`PoolCall` handle at once,
``ready(handle)`` says without blocking whether its results are all in, and
``collect(handle)`` waits for them. One call is in flight at a time (a pipelined
caller alternates sub-batches: submit A, decode B, collect A, submit B, ...); every
guarantee below (timeouts, fault isolation, replay, determinism) holds the same
whether the caller collects at once or later, since timeouts are measured from when
each item starts in its worker, not from when the caller collects.

Episodes that do not wait for each other: ``send({slot: (op, arg), ...})`` starts
resets (``("reset", seed)``) and steps (``("step", action)``) of some slots while
other slots' calls are still running, and ``poll(timeout)`` returns ``{slot: result}``
for those finished so far (waiting up to ``timeout`` for the first). A worker runs its
slots' items one after another, so a slow step holds the other slots of its worker
only; an item sent to a busy worker starts when the worker's current batch is done.
The guarantees below hold for ``send`` / ``poll`` too, and the results are those
``reset`` / ``step`` would give. While ``send`` calls are outstanding the calls above
are refused, and the other way round.

Faults end only the episode that caused them. A step that raises, returns something
that is not a valid 5-tuple (see ``envs.core``), returns a result that cannot be
pickled, runs past ``step_timeout``, or kills its worker process (segfault,
``os._exit``, OOM kill) returns, for that slot only::

    ("", 0.0, False, True, {"failed": True, "failure_kind": KIND, "failure": MESSAGE,
                            "traceback": TEXT_OR_NONE})

with KIND one of ``exception``, ``invalid_result``, ``unpicklable``, ``timeout``,
``crash``, ``memory_limit``, ``cpu_limit`` (the optional per-worker resource limits),
``replay_diverged``, ``worker_lost`` (a reset failure returns
``("", info)`` with the same info). The worker process is then restarted (after an
exception too, unless ``restart_on_exception=False``, which keeps the process and
drops only the faulty env). Every other episode of that worker is rebuilt in the new
worker by replaying its seed and actions; the observations the replay produces are
checked against digests of those first seen, so a healthy episode's transcript is
exactly that of a fault-free run (an env that is not deterministic given its seed and
actions is reported as ``replay_diverged`` instead of silently continuing).

Results are deterministic given the seeds and actions: they do not depend on the
number of workers or on faults in other slots. This asks of an env what replay needs
anyway: that it be deterministic given its seed and actions, keeping its randomness
per instance (``random.Random(seed)``) rather than in process-global state, and that
its expert (``expert_actions``) be a function of the state.

Process hygiene: workers are started with the ``spawn`` context (never ``fork``: the
parent may have JAX and its threads loaded), ignore SIGINT (the parent shuts them
down, also after Ctrl-C, through ``close``, a context manager, or at interpreter
exit), and exit by themselves within ``PARENT_POLL_S`` when the parent process dies.
A call interrupted in the parent (Ctrl-C during ``collect``) closes the pool, since
results still in flight could otherwise be credited to a later call. A pool is used
from one thread.

Cost: one message to and one from each worker per call (all its slots' items
together); see ``benchmarks/w5_envpool.py`` for the measured overhead.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import numbers
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Sequence

from envs.core import Env

PARENT_POLL_S = 0.2
_MAX_SILENT_DEATHS = 3

# Item ops sent to workers.
_RESET, _STEP, _REPLAY, _EXPERT = "reset", "step", "replay", "expert"
_ASYNC = "send"  # `_inflight` while send() calls are outstanding


class EnvPoolError(RuntimeError):
    """The pool itself cannot go on (e.g. workers cannot be started at all)."""


# ---------------------------------------------------------------- shared by worker and in-process


def _digest(result) -> bytes:
    """Digest of what a transcript records of a result (info excluded: it may hold timings)."""
    if len(result) == 2:
        key = repr(result[0])
    else:
        key = repr((result[0], result[1], result[2], result[3]))
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _check_observation(obs, where: str) -> None:
    if isinstance(obs, str):
        return
    if isinstance(obs, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obs):
        return
    raise _BadResult(f"{where}: the observation must be a str or a list of "
                     f"{{'role': str, 'content': str}} messages, got {_short(obs)}")


class _BadResult(Exception):
    pass


def _short(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _validate_reset(result):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise _BadResult(f"reset must return (observation, info), got {_short(result)}")
    obs, info = result
    _check_observation(obs, "reset")
    if not isinstance(info, dict):
        raise _BadResult(f"reset: info must be a dict, got {_short(info)}")
    return obs, dict(info)


def _validate_step(result):
    if not (isinstance(result, tuple) and len(result) == 5):
        raise _BadResult("step must return (observation, reward, terminated, truncated, info), "
                         f"got {_short(result)}")
    obs, reward, terminated, truncated, info = result
    _check_observation(obs, "step")
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(reward):
        raise _BadResult(f"step: reward must be a finite number, got {_short(reward)}")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not (isinstance(flag, bool) or type(flag).__name__ == "bool_"):
            raise _BadResult(f"step: {name} must be a bool, got {_short(flag)}")
    if not isinstance(info, dict):
        raise _BadResult(f"step: info must be a dict, got {_short(info)}")
    return obs, float(reward), bool(terminated), bool(truncated), dict(info)


def _build_env(env_fn) -> Env:
    if isinstance(env_fn, str):
        from envs.core import make
        env = make(env_fn)
    else:
        env = env_fn()
    if not isinstance(env, Env):
        missing = [m for m in ("reset", "step", "state_key") if not callable(getattr(env, m, None))]
        if missing:
            raise TypeError(f"the env factory returned {type(env).__name__}, which lacks {missing}")
    return env


class _SlotRunner:
    """Runs items for the slots one process owns (a worker, or the pool in-process)."""

    def __init__(self, env_fns: dict[int, Any], pickled: bool):
        self.env_fns = env_fns  # slot -> env_fn, or its pickle bytes
        self.pickled = pickled
        self.envs: dict[int, Env] = {}

    def _env(self, slot: int, fresh: bool) -> Env:
        env = self.envs.get(slot)
        if env is not None and not fresh:
            return env
        if env is not None:
            self.drop(slot)
        fn = self.env_fns[slot]
        if self.pickled:
            fn = pickle.loads(fn)
        env = _build_env(fn)
        self.envs[slot] = env
        return env

    def drop(self, slot: int) -> None:
        env = self.envs.pop(slot, None)
        if env is not None:
            try:
                env.close()
            except Exception:
                pass

    def _with_extras(self, env: Env, result, reset: bool):
        info = result[-1]
        info["state_key"] = env.state_key()
        if reset:
            info.setdefault("system_prompt", env.system_prompt)
            info.setdefault("action_format", env.action_format)
        return result

    def run(self, slot: int, op: str, arg):
        """Returns ("ok", payload, digest) or ("fail", kind, message, traceback)."""
        try:
            if op == _RESET:
                env = self._env(slot, fresh=slot not in self.envs)
                res = self._with_extras(env, _validate_reset(env.reset(seed=arg)), True)
                return ("ok", res, _digest(res))
            if op == _STEP:
                env = self.envs[slot]
                res = self._with_extras(env, _validate_step(env.step(arg)), False)
                return ("ok", res, _digest(res))
            if op == _EXPERT:
                env = self.envs[slot]
                if not getattr(env, "has_expert", False):
                    return ("ok", None, b"")
                action = env.expert_action()
                if not isinstance(action, str):
                    raise _BadResult(f"expert_action must return a str, got {_short(action)}")
                return ("ok", action, b"")
            if op == _REPLAY:
                seed, actions, digests = arg
                env = self._env(slot, fresh=True)
                res = self._with_extras(env, _validate_reset(env.reset(seed=seed)), True)
                if _digest(res) != digests[0]:
                    return self._diverged(slot, "the reset observation")
                for t, action in enumerate(actions):
                    res = self._with_extras(env, _validate_step(env.step(action)), False)
                    if _digest(res) != digests[t + 1]:
                        return self._diverged(slot, f"step {t + 1}")
                return ("ok", None, b"")
            raise ValueError(f"unknown op {op!r}")
        except _BadResult as e:
            self.drop(slot)
            return ("fail", "invalid_result", str(e), None)
        except MemoryError as e:  # past the worker's memory limit (or the host's)
            self.drop(slot)
            return ("fail", "memory_limit", f"the env ran out of memory (MemoryError: {e}); the worker's "
                    "address space is limited by memory_limit_mb", traceback.format_exc())
        except Exception as e:
            self.drop(slot)
            return ("fail", "exception", f"{type(e).__name__}: {e}", traceback.format_exc())

    def _diverged(self, slot: int, where: str):
        self.drop(slot)
        return ("fail", "replay_diverged",
                f"replaying the episode into a restarted worker gave a different result at {where}: "
                "the env is not deterministic given its seed and actions", None)

    def close(self) -> None:
        for slot in list(self.envs):
            self.drop(slot)


# ---------------------------------------------------------------- worker process


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the pool's process dies, even mid-step.

    Waits on the parent's sentinel (a pipe that closes when it dies; with forkserver the
    parent is the pool's process, not the fork server) and, with spawn, also polls
    getppid, which changes when the parent dies and the worker is re-parented.
    """
    parent = mp.parent_process()
    spawned_by_pool = os.getppid() == parent_pid
    while True:
        if parent is not None:
            parent.join(PARENT_POLL_S)
            if not parent.is_alive():
                os._exit(3)
        else:
            time.sleep(PARENT_POLL_S)
        if spawned_by_pool and os.getppid() != parent_pid:
            os._exit(3)


def _set_memory_limit(memory_limit_mb: float | None) -> None:
    """The worker's address-space limit (``RLIMIT_AS``): an env that allocates past it
    gets ``MemoryError`` (failure kind ``memory_limit``) instead of taking the host down."""
    if memory_limit_mb is None:
        return
    import resource

    limit = int(memory_limit_mb * 2**20)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _cpu_budget(cpu_limit_s: float | None, ops: int = 1) -> None:
    """Arms ``RLIMIT_CPU`` so that the next ``ops`` env calls may use ``cpu_limit_s`` CPU
    seconds each (the soft limit is the process's total; past it the kernel ends the worker
    with SIGXCPU, reported as failure kind ``cpu_limit``)."""
    if cpu_limit_s is None:
        return
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_limit_s * ops)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _worker_main(conn, progress, env_fns: dict[int, bytes], parent_pid: int,
                 memory_limit_mb: float | None = None, cpu_limit_s: float | None = None) -> None:
    """Worker loop. Shared with the parent for its timeouts: ``progress[0]``, the index
    of the item running (-1 between batches); ``progress[1]``, its start time
    (time.monotonic, one clock for all processes); ``progress[2]``, the number of the
    last batch finished."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a group-wide SIGTERM: the trainer closes the pool
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _set_memory_limit(memory_limit_mb)
    runner = _SlotRunner(env_fns, pickled=True)
    items, results = [], []
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "exit":
                break
            if msg[0] == "resend":  # the parent could not unpickle the batch: item by item
                conn.send(("items", [_pickle_result(r, slot, op, runner)
                                     for r, (slot, op, _) in zip(results, items)]))
                continue
            seq, items = msg[1], msg[2]
            results = []
            for k, (slot, op, arg) in enumerate(items):
                _cpu_budget(cpu_limit_s, 1 + len(arg[1]) if op == _REPLAY else 1)
                progress[1] = time.monotonic()
                progress[0] = k
                results.append(runner.run(slot, op, arg))
            progress[2] = seq
            progress[0] = -1
            try:
                conn.send(("done", results))
            except (EOFError, OSError):
                break
            except Exception:  # some result cannot be pickled: send them one by one
                conn.send(("items", [_pickle_result(r, slot, op, runner)
                                     for r, (slot, op, _) in zip(results, items)]))
    finally:
        runner.close()


def _pickle_result(res, slot: int, op: str, runner: _SlotRunner) -> bytes:
    """Each result is pickled on its own, so one that cannot be fails only its slot."""
    try:
        return pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        runner.drop(slot)
        return pickle.dumps(("fail", "unpicklable",
                             f"the {op} result cannot be pickled to leave the worker: {type(e).__name__}: {e}",
                             traceback.format_exc()))


def _unpickle_result(data: bytes):
    try:
        return pickle.loads(data)
    except Exception as e:
        return ("fail", "unpicklable",
                f"the result cannot be unpickled in the parent process: {type(e).__name__}: {e}",
                traceback.format_exc())


# ---------------------------------------------------------------- parent side


class _Slot:
    __slots__ = ("index", "worker", "status", "seed", "actions", "digests", "pending")

    def __init__(self, index: int, worker: int):
        self.index = index
        self.worker = worker
        self.status = "new"  # new | running | done | failed
        self.seed: int | None = None
        self.actions: list[str] = []
        self.digests: list[bytes] = []
        self.pending: tuple[str, Any] | None = None


class _Worker:
    __slots__ = ("index", "proc", "conn", "progress", "slots", "ready", "started_at",
                 "batch", "sent_at", "seq", "needs_restart", "silent_deaths", "pid")

    def __init__(self, index: int, slots: list[int]):
        self.index = index
        self.slots = slots
        self.proc = None
        self.conn = None
        self.progress = None
        self.ready = False
        self.started_at = 0.0
        self.batch: list[tuple[int, str, Any]] | None = None
        self.sent_at = 0.0
        self.seq = 0
        self.needs_restart = False
        self.silent_deaths = 0
        self.pid = None


def _stop_process(proc, conn, grace: float) -> None:
    if proc is None:
        return
    try:
        if conn is not None and proc.is_alive():
            conn.send(("exit",))
    except Exception:
        pass
    proc.join(grace)
    if proc.is_alive():
        proc.terminate()
        proc.join(1.0)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)
    try:
        if conn is not None:
            conn.close()
    except Exception:
        pass
    try:
        proc.close()
    except Exception:
        pass


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        proc, conn = w.proc, w.conn
        w.proc = w.conn = None
        _stop_process(proc, conn, grace=1.0)


class PoolCall:
    """Handle of one submitted reset / step (returned by ``submit_*``, given to ``collect``)."""

    __slots__ = ("kind", "number")

    def __init__(self, kind: str, number: int):
        self.kind, self.number = kind, number

    def __repr__(self) -> str:
        return f"PoolCall({self.kind!r}, #{self.number})"


class EnvPool:
    """A batch of env slots stepped by ``num_workers`` host processes (see the module doc).

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

    def __init__(self, env_fns: Sequence[str | Callable[[], Env]], num_workers: int = 1,
                 step_timeout: float = 30.0, reset_timeout: float | None = None,
                 startup_timeout: float = 120.0, restart_on_exception: bool = True,
                 mp_context: str = "spawn", memory_limit_mb: float | None = None,
                 cpu_limit_s: float | None = None):
        env_fns = list(env_fns)
        if not env_fns:
            raise ValueError("env_fns is empty: give at least one env name or factory")
        from envs.core import is_known
        for i, fn in enumerate(env_fns):
            if isinstance(fn, str):
                if not is_known(fn):
                    raise ValueError(f"env_fns[{i}]: unknown env name {fn!r}")
            elif not callable(fn):
                raise TypeError(f"env_fns[{i}] must be an env name or a zero-argument callable, "
                                f"got {type(fn).__name__}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        for name, val in (("step_timeout", step_timeout), ("startup_timeout", startup_timeout),
                          ("reset_timeout", step_timeout if reset_timeout is None else reset_timeout)):
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {val!r}")
        for name, val in (("memory_limit_mb", memory_limit_mb), ("cpu_limit_s", cpu_limit_s)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0):
                raise ValueError(f"{name} must be a positive number or None (no limit), got {val!r}")
        self.memory_limit_mb = memory_limit_mb
        self.cpu_limit_s = cpu_limit_s
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver' (fork is unsafe with JAX "
                             f"loaded), got {mp_context!r}")
        self.num_slots = len(env_fns)
        self.num_workers = min(num_workers, self.num_slots)
        self.step_timeout = float(step_timeout)
        self.reset_timeout = float(step_timeout if reset_timeout is None else reset_timeout)
        self.startup_timeout = float(startup_timeout)
        self.restart_on_exception = restart_on_exception
        self._poll_s = min(0.25, self.step_timeout / 10)
        #: Counters: worker restarts, failures by kind.
        self.stats: dict[str, int] = {"restarts": 0}
        self._closed = False
        self._inflight: str | None = None
        self._call: PoolCall | None = None
        self._calls = 0
        self._env_fns = env_fns
        nw = max(self.num_workers, 1)
        self._slots = [_Slot(i, i % nw) for i in range(self.num_slots)]
        self._workers: list[_Worker] = []
        self._runner: _SlotRunner | None = None
        self._results: list | None = None
        if self.num_workers == 0:
            self._runner = _SlotRunner(dict(enumerate(env_fns)), pickled=False)
            self._finalizer = weakref.finalize(self, self._runner.close)
            return
        self._pickled = {}
        for i, fn in enumerate(env_fns):
            try:
                self._pickled[i] = pickle.dumps(fn)
            except Exception as e:
                raise TypeError(f"env_fns[{i}] ({fn!r}) cannot be pickled for the worker processes: "
                                f"{e}; use an env name, a module-level function or functools.partial") from e
        self._ctx = mp.get_context(mp_context)
        self._workers = [_Worker(w, [s.index for s in self._slots if s.worker == w])
                         for w in range(self.num_workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        try:
            for w in self._workers:
                self._start(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public API

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
        ops: list = [None] * self.num_slots
        for i in wanted:
            self._check_slot_index(i)
            if self._slots[i].status == "running":
                ops[i] = (_EXPERT, None)
        self._submit(ops, "expert")
        return self.collect()

    def submit_reset(self, seeds: Sequence[int | None]) -> PoolCall:
        """Start resetting; returns at once; results come from :meth:`collect`."""
        self._check_idle()
        seeds = self._check_len(seeds, "seeds")
        ops: list = [None] * self.num_slots
        for i, seed in enumerate(seeds):
            if seed is None:
                continue
            if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
                raise TypeError(f"seeds[{i}] must be an int or None, got {type(seed).__name__} {seed!r}")
            ops[i] = (_RESET, int(seed))
        return self._submit(ops, "reset")

    def submit_step(self, actions: Sequence[str | None]) -> PoolCall:
        """Start stepping; returns at once (the workers step meanwhile); results come from
        :meth:`collect`. With ``num_workers=0`` the envs step here, before it returns."""
        self._check_idle()
        actions = self._check_len(actions, "actions")
        ops: list = [None] * self.num_slots
        for i, action in enumerate(actions):
            if action is None:
                continue
            slot = self._slots[i]
            if slot.status != "running":
                raise ValueError(f"actions[{i}]: slot {i} has no episode in progress (status "
                                 f"{slot.status!r}); pass None for it or reset it first")
            if not isinstance(action, str):
                raise TypeError(f"actions[{i}] must be a str or None, got {type(action).__name__}")
            ops[i] = (_STEP, action)
        return self._submit(ops, "step")

    def ready(self, handle: PoolCall | None = None) -> bool:
        """True when :meth:`collect` would return without waiting (never blocks; it takes
        in the results that have arrived and applies the timeouts that are due)."""
        self._check_handle(handle, "ready")
        if self._runner is not None:
            return True
        try:
            return self._wait_all(block=False)
        except BaseException:
            self.close()
            raise

    def collect(self, handle: PoolCall | None = None) -> list:
        """Wait for the submitted call (``handle``: the one ``submit_*`` returned; it is
        checked to be the call in flight); one result per slot, None where nothing was
        asked, except that a slot whose episode was lost (its worker restarted and the
        replay failed) comes back failed even if the call did not touch it."""
        self._check_handle(handle, "collect")
        try:
            if self._runner is None:
                self._wait_all()
            return self._finish()
        except BaseException:
            # Interrupted mid-call (Ctrl-C): results may still arrive from the workers and
            # would be misattributed to a later call, so the pool cannot go on.
            self.close()
            raise
        finally:
            self._inflight = None
            self._call = None

    def send(self, ops: dict[int, tuple[str, Any]]) -> None:
        """Start resets and steps of some slots, whatever other slots are doing; returns at
        once. ``ops`` maps a slot to ``("reset", seed)`` or ``("step", action)``; a slot
        must not have a call in flight. Results come from :meth:`poll`. With
        ``num_workers=0`` the envs run here, before it returns."""
        if self._closed:
            raise RuntimeError("the EnvPool is closed")
        if self._inflight not in (None, _ASYNC):
            raise RuntimeError(f"a {self._inflight} is still in flight: collect() it first")
        if not isinstance(ops, dict):
            raise TypeError(f"send: ops must be a dict slot -> (op, arg), got {type(ops).__name__}")
        checked = {}
        for i, op in ops.items():
            self._check_slot_index(i)
            slot = self._slots[i]
            if slot.pending is not None or (self._inflight == _ASYNC and i in self._results):
                what = slot.pending[0] if slot.pending is not None else "result not polled"
                raise ValueError(f"send: slot {i} already has a {what} in flight; poll() its result first")
            if not (isinstance(op, tuple) and len(op) == 2 and op[0] in (_RESET, _STEP)):
                raise ValueError(f"send: slot {i}: an op is ('reset', seed) or ('step', action), got {op!r}")
            kind, arg = op
            if kind == _RESET and (not isinstance(arg, numbers.Integral) or isinstance(arg, bool)):
                raise TypeError(f"send: slot {i}: the seed must be an int, got {type(arg).__name__} {arg!r}")
            if kind == _STEP:
                if slot.status != "running":
                    raise ValueError(f"send: slot {i} has no episode in progress (status {slot.status!r}); "
                                     "reset it first")
                if not isinstance(arg, str):
                    raise TypeError(f"send: slot {i}: the action must be a str, got {type(arg).__name__}")
            checked[i] = (kind, int(arg) if kind == _RESET else arg)
        if self._inflight is None:
            self._inflight, self._results = _ASYNC, {}
        for i, op in checked.items():
            self._slots[i].pending = op
        if self._runner is not None:
            for i in checked:
                self._record(self._slots[i], self._runner.run(i, *checked[i]))
            return
        for w in {self._slots[i].worker for i in checked}:
            self._advance(self._workers[w])

    def poll(self, timeout: float | None = None) -> dict[int, Any]:
        """Results of :meth:`send` calls finished since the last poll, ``{slot: result}``
        (shaped as ``reset`` / ``step`` results; failures as described above). Waits up to
        ``timeout`` seconds (None: as long as it takes) for the first one when none is in;
        ``{}`` when nothing was sent. A slot whose episode was lost (its worker restarted
        and its replay failed) comes back failed though nothing was sent to it."""
        if self._closed:
            raise RuntimeError("the EnvPool is closed")
        if self._inflight is None:
            return {}
        if self._inflight != _ASYNC:
            raise RuntimeError(f"a {self._inflight} is in flight: collect() it, not poll()")
        try:
            if self._runner is None:
                end = None if timeout is None else time.monotonic() + max(0.0, timeout)
                first = True
                while not self._results and any(w.batch is not None for w in self._workers):
                    now = time.monotonic()
                    if end is not None and now >= end and not first:
                        break
                    first = False
                    self._wait_once(self._poll_s if end is None else max(0.0, min(self._poll_s, end - now)))
                for s in self._slots:  # cannot happen unless a worker vanished mid-call
                    if s.pending is not None and self._workers[s.worker].batch is None:
                        self._fail(s, "worker_lost", "no result came back for this slot", None)
        except BaseException:
            self.close()
            raise
        out, self._results = self._results, {}
        if not self.in_flight() and not any(w.batch is not None for w in self._workers):
            self._inflight, self._results = None, None
        return out

    def in_flight(self) -> list[int]:
        """The slots with a :meth:`send` call whose result :meth:`poll` has not returned."""
        unpolled = self._results if self._inflight == _ASYNC else {}
        return [s.index for s in self._slots if s.pending is not None or s.index in unpolled]

    def _check_handle(self, handle: PoolCall | None, what: str) -> None:
        if self._inflight == _ASYNC:
            raise RuntimeError(f"{what}() while send() calls are outstanding: poll() them")
        if self._inflight is None:
            raise RuntimeError(f"{what}() without a submitted reset/step")
        if handle is not None and handle is not self._call:
            raise RuntimeError(f"{what}({handle!r}): that call is not the one in flight ({self._call!r}); "
                               "it was collected already")

    def status(self, slot: int) -> str:
        """``new``, ``running``, ``done`` or ``failed``."""
        self._check_slot_index(slot)
        return self._slots[slot].status

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty in-process)."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.is_alive()]

    def close(self) -> None:
        """Stop all workers (idempotent); the pool cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.num_slots

    # ------------------------------------------------------------ submission

    def _check_len(self, values, name: str) -> list:
        values = list(values)
        if len(values) != self.num_slots:
            raise ValueError(f"{name} has {len(values)} entries; the pool has {self.num_slots} slots")
        return values

    def _check_slot_index(self, i) -> None:
        if not isinstance(i, int) or not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i!r} is out of range for a pool of {self.num_slots} slots")

    def _check_idle(self) -> None:
        if self._closed:
            raise RuntimeError("the EnvPool is closed")
        if self._inflight == _ASYNC:
            if self.in_flight() or self._results:
                raise RuntimeError("send() calls are outstanding: poll() their results first")
            try:  # only a restarted worker's replay is still running: it belongs to no call
                self._wait_all()
            except BaseException:
                self.close()
                raise
            self._inflight, self._results = None, None
        if self._inflight is not None:
            raise RuntimeError(f"a {self._inflight} is still in flight: collect() it first")

    def _advance(self, w: _Worker) -> None:
        """send/poll: give an idle worker the items its slots have waiting."""
        if w.batch is not None or not any(self._slots[i].pending is not None for i in w.slots):
            return
        if w.needs_restart:
            self._restart(w)
        else:
            self._send_batch(w, self._ops_for(w))

    def _submit(self, ops: list, kind: str) -> PoolCall:
        self._check_idle()
        for slot, op in zip(self._slots, ops):
            slot.pending = op
        self._results = [None] * self.num_slots
        self._inflight = kind
        self._calls += 1
        self._call = PoolCall(kind, self._calls)
        if self._runner is not None:
            for slot in self._slots:
                if slot.pending is not None:
                    self._record(slot, self._runner.run(slot.index, *slot.pending))
            return self._call
        for w in self._workers:
            if w.needs_restart:
                self._restart(w)
            else:
                self._send_batch(w, self._ops_for(w))
        return self._call

    def _ops_for(self, w: _Worker, replay: bool = False) -> list:
        items = []
        if replay:
            for i in w.slots:
                s = self._slots[i]
                needs_env = s.status == "running" and (s.pending is None or s.pending[0] != _RESET)
                if needs_env:
                    items.append((i, _REPLAY, (s.seed, list(s.actions), list(s.digests))))
        for i in w.slots:
            s = self._slots[i]
            if s.pending is not None:
                items.append((i, *s.pending))
        return items

    def _send_batch(self, w: _Worker, items: list) -> None:
        w.batch = items if items else None
        if not items:
            return
        w.sent_at = time.monotonic()
        w.seq += 1
        try:
            w.conn.send(("run", w.seq, items))
        except (OSError, EOFError, ValueError):
            pass  # a dead worker: found by _wait_all through its sentinel

    # ------------------------------------------------------------ worker lifecycle

    def _start(self, w: _Worker) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        progress = self._ctx.RawArray(ctypes.c_double, 3)
        progress[0] = -1.0
        progress[2] = w.seq
        proc = self._ctx.Process(
            target=_worker_main, name=f"envpool-worker-{w.index}", daemon=True,
            args=(child_conn, progress, {i: self._pickled[i] for i in w.slots}, os.getpid(),
                  self.memory_limit_mb, self.cpu_limit_s))
        proc.start()
        child_conn.close()
        w.proc, w.conn, w.progress = proc, parent_conn, progress
        w.ready = False
        w.started_at = time.monotonic()
        w.needs_restart = False
        w.batch = None

    def _restart(self, w: _Worker) -> None:
        """Replace the worker process and rebuild its healthy episodes by replay."""
        proc, conn = w.proc, w.conn
        w.proc = w.conn = None
        _stop_process(proc, conn, grace=0.2)
        self.stats["restarts"] += 1
        self._start(w)
        self._send_batch(w, self._ops_for(w, replay=True))

    # ------------------------------------------------------------ collection

    def _deadline(self, w: _Worker) -> float:
        if not w.ready:
            return w.started_at + self.startup_timeout
        k = int(w.progress[0])
        if k < 0 or w.batch is None or k >= len(w.batch):
            if int(w.progress[2]) == w.seq:
                return math.inf  # finished: the results are on their way (or it died: sentinel)
            return w.sent_at + self.step_timeout + self.reset_timeout  # not started yet
        started = w.progress[1]
        _, op, arg = w.batch[k]
        if op == _RESET:
            budget = self.reset_timeout
        elif op == _REPLAY:
            budget = self.reset_timeout + self.step_timeout * len(arg[1])
        else:
            budget = self.step_timeout
        return started + budget

    def _wait_all(self, block: bool = True) -> bool:
        """Take in results until every worker's batch is answered (True); with
        ``block=False``, one pass over what has arrived, then False if some is missing."""
        while True:
            if not any(w.batch is not None for w in self._workers):
                return True
            self._wait_once(self._poll_s if block else 0.0)
            if not block:
                return not any(w.batch is not None for w in self._workers)

    def _wait_once(self, wait: float) -> None:
        """One pass: wait up to ``wait`` seconds (less if a deadline is due) for workers'
        answers, take in those that arrived, and apply the timeouts that are due."""
        waiting = [w for w in self._workers if w.batch is not None or not w.ready]
        if not any(w.batch is not None for w in waiting):
            return
        by_handle = {}
        for w in waiting:
            by_handle[w.conn] = w
            by_handle[w.proc.sentinel] = w
        now = time.monotonic()
        # Deadlines move as workers go from item to item (a short step after a long
        # replay), so look again at least every poll interval.
        deadline = min(self._deadline(w) for w in waiting)
        ready = mpc.wait(list(by_handle), timeout=min(max(0.0, deadline - now), wait))
        handled = set()
        for h in ready:
            w = by_handle[h]
            if w.index in handled:
                continue
            handled.add(w.index)
            self._on_ready(w)
        now = time.monotonic()
        for w in waiting:
            if w.index not in handled and (w.batch is not None or not w.ready) \
                    and self._deadline(w) <= now:
                self._on_timeout(w)

    def _on_ready(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                msg = self._recv(w)
                if msg is None:
                    break
                if msg[0] == "ready":
                    w.ready = True
                    w.pid = msg[1]
                    # A batch sent while the worker was starting is timed from now on.
                    w.sent_at = max(w.sent_at, time.monotonic())
                elif msg[0] == "done":
                    self._on_done(w, msg[1])
                    return
                elif msg[0] == "items":
                    self._on_done(w, [_unpickle_result(b) for b in msg[1]])
                    return
        except (EOFError, OSError):
            w.proc.join(2.0)  # the pipe closed: the process is exiting
        if not w.proc.is_alive():
            self._on_death(w, None)

    def _recv(self, w: _Worker):
        """The next message; if it cannot be unpickled here (a result holds an object of
        a class only the worker can import), the worker resends the results one by one."""
        data = w.conn.recv_bytes()
        try:
            return pickle.loads(data)
        except Exception:
            pass
        w.conn.send(("resend",))
        if not w.conn.poll(self.step_timeout):
            w.proc.kill()
            w.proc.join(2.0)
            return None
        return w.conn.recv()

    def _on_done(self, w: _Worker, results: list) -> None:
        batch, w.batch = w.batch, None
        w.silent_deaths = 0
        failed_exception = False
        for (i, op, _), res in zip(batch, results):
            slot = self._slots[i]
            if op == _REPLAY:
                if res[0] == "fail":
                    self._fail(slot, res[1], "while replaying into a restarted worker: " + res[2], res[3])
                continue
            if slot.status == "failed" and op != _RESET:
                continue
            self._record(slot, res)
            if res[0] == "fail" and res[1] in ("exception", "invalid_result", "unpicklable", "memory_limit"):
                failed_exception = True
        if failed_exception and self.restart_on_exception:
            w.needs_restart = True
        if self._inflight == _ASYNC:
            self._advance(w)

    def _on_timeout(self, w: _Worker) -> None:
        if w.conn.poll():  # its answer arrived after all
            self._on_ready(w)
            return
        if not w.ready:
            self._on_death(w, f"the worker did not start within startup_timeout={self.startup_timeout}s")
            return
        k = int(w.progress[0])
        op = w.batch[k][1] if w.batch is not None and 0 <= k < len(w.batch) else None
        if op is None:
            what = "the worker did not answer in time"
        elif op == _RESET:
            what = f"reset took longer than reset_timeout={self.reset_timeout}s"
        elif op == _REPLAY:
            what = "replaying the episode took longer than its timeout"
        else:
            what = f"{op} took longer than step_timeout={self.step_timeout}s"
        self._abort_batch(w, k, "timeout", what)

    def _on_death(self, w: _Worker, reason: str | None) -> None:
        k = int(w.progress[0]) if w.ready else -1
        code = w.proc.exitcode if w.proc is not None else None
        kind = "crash"
        if reason is None:
            reason = f"the worker process died (exit code {code}"
            if code is not None and code < 0:
                try:
                    reason += f", {signal.Signals(-code).name}"
                except ValueError:
                    pass
            reason += ")"
            if code == -signal.SIGXCPU and self.cpu_limit_s is not None:
                kind = "cpu_limit"
                reason = f"the env call used more than cpu_limit_s={self.cpu_limit_s} CPU seconds ({reason})"
        self._abort_batch(w, k, kind, reason)

    def _abort_batch(self, w: _Worker, k: int, kind: str, reason: str) -> None:
        """Worker ``w`` died or hung at item ``k`` of its batch: fail that item's slot,
        restart the worker, rebuild the other slots, re-run their pending ops."""
        batch = w.batch or []
        if 0 <= k < len(batch):
            slot = self._slots[batch[k][0]]
            self._fail(slot, kind, reason + (" during replay" if batch[k][1] == _REPLAY else ""), None)
            w.silent_deaths = 0
        else:
            w.silent_deaths += 1
            if w.silent_deaths >= _MAX_SILENT_DEATHS:
                for i in w.slots:
                    s = self._slots[i]
                    if s.pending is not None or s.status == "running":
                        self._fail(s, "worker_lost", f"{reason}, {w.silent_deaths} times in a row "
                                                     "without running any env", None)
                w.silent_deaths = 0
        self._restart(w)

    def _fail(self, slot: _Slot, kind: str, message: str, tb: str | None) -> None:
        self.stats[kind] = self.stats.get(kind, 0) + 1
        info = {"failed": True, "failure_kind": kind, "failure": message, "traceback": tb}
        # The result has the shape of the call's results; a slot the call did not touch
        # can fail too (its episode could not be rebuilt in a restarted worker).
        op = slot.pending[0] if slot.pending is not None else (_STEP if self._inflight == _ASYNC else self._inflight)
        if op == _RESET:
            self._results[slot.index] = ("", info)
        elif op == _EXPERT:
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
        if op == _RESET:
            slot.seed, slot.actions, slot.digests = arg, [], [digest]
            slot.status = "running"
        elif op == _STEP:
            slot.actions.append(arg)
            slot.digests.append(digest)
            if payload[2] or payload[3]:
                slot.status = "done"
        self._results[slot.index] = payload
        slot.pending = None

    def _finish(self) -> list:
        results, self._results = self._results, None
        for s in self._slots:
            if s.pending is not None:  # cannot happen unless a worker vanished mid-call
                self._results = results
                self._fail(s, "worker_lost", "no result came back for this slot", None)
                results = self._results
                self._results = None
        return results
