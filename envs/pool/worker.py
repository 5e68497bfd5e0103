"""The worker side of the pool: what runs the env calls.

:class:`SlotRunner` builds the envs of the slots one process owns and runs their items,
turning every fault it can catch into a failed result (see ``protocol``); it runs in a
worker process, or in the pool's own process with ``num_workers=0``.
:func:`worker_main` is the worker process: it takes batches from the pipe, runs them
with a runner under the optional memory and CPU limits, and records its progress for
the parent's timeouts. It is started by ``multiprocessing`` (``spawn`` or
``forkserver``), so everything here must stay importable by its module path.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import numbers
import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

from envs.core import Env
from envs.pool.protocol import (
    DONE,
    EXIT,
    EXPERT,
    ITEMS,
    PARENT_POLL_S,
    PROGRESS_DONE,
    PROGRESS_ITEM,
    PROGRESS_STARTED,
    READY,
    REPLAY,
    RESEND,
    RESET,
    STEP,
)
from jaxagent.failures import INVALID_RESULT, MEMORY_LIMIT, RAISED, REPLAY_DIVERGED, UNPICKLABLE

# ---------------------------------------------------------------- checking what an env returns


def digest(result) -> bytes:
    """Digest of what a transcript records of a result (info excluded: it may hold timings)."""
    if len(result) == 2:
        key = repr(result[0])
    else:
        key = repr((result[0], result[1], result[2], result[3]))
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _BadResult(Exception):
    pass


def _short(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _check_observation(obs, where: str) -> None:
    if isinstance(obs, str):
        return
    if isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs
    ):
        return
    raise _BadResult(
        f"{where}: the observation must be a str or a list of "
        f"{{'role': str, 'content': str}} messages, got {_short(obs)}"
    )


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
        raise _BadResult(f"step must return (observation, reward, terminated, truncated, info), got {_short(result)}")
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


# ---------------------------------------------------------------- running items


class SlotRunner:
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
            if op == RESET:
                env = self._env(slot, fresh=slot not in self.envs)
                res = self._with_extras(env, _validate_reset(env.reset(seed=arg)), True)
                return ("ok", res, digest(res))
            if op == STEP:
                env = self.envs[slot]
                res = self._with_extras(env, _validate_step(env.step(arg)), False)
                return ("ok", res, digest(res))
            if op == EXPERT:
                env = self.envs[slot]
                if not getattr(env, "has_expert", False):
                    return ("ok", None, b"")
                action = env.expert_action()
                if not isinstance(action, str):
                    raise _BadResult(f"expert_action must return a str, got {_short(action)}")
                return ("ok", action, b"")
            if op == REPLAY:
                seed, actions, digests = arg
                env = self._env(slot, fresh=True)
                res = self._with_extras(env, _validate_reset(env.reset(seed=seed)), True)
                if digest(res) != digests[0]:
                    return self._diverged(slot, "the reset observation")
                for t, action in enumerate(actions):
                    res = self._with_extras(env, _validate_step(env.step(action)), False)
                    if digest(res) != digests[t + 1]:
                        return self._diverged(slot, f"step {t + 1}")
                return ("ok", None, b"")
            raise ValueError(f"unknown op {op!r}")
        except _BadResult as e:
            self.drop(slot)
            return ("fail", INVALID_RESULT, str(e), None)
        except MemoryError as e:  # past the worker's memory limit (or the host's)
            self.drop(slot)
            return (
                "fail",
                MEMORY_LIMIT,
                f"the env ran out of memory (MemoryError: {e}); the worker's "
                "address space is limited by memory_limit_mb",
                traceback.format_exc(),
            )
        except Exception as e:
            self.drop(slot)
            return ("fail", RAISED, f"{type(e).__name__}: {e}", traceback.format_exc())

    def _diverged(self, slot: int, where: str):
        self.drop(slot)
        return (
            "fail",
            REPLAY_DIVERGED,
            f"replaying the episode into a restarted worker gave a different result at {where}: "
            "the env is not deterministic given its seed and actions",
            None,
        )

    def close(self) -> None:
        for slot in list(self.envs):
            self.drop(slot)


# ---------------------------------------------------------------- the worker process


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when the pool's process dies, even mid-step.

    Waits on the parent's sentinel (a pipe that closes when it dies; with forkserver the
    parent is the pool's process, not the fork server) and, with spawn, also polls
    getppid, which changes when the parent dies and the worker is re-parented.

    The agent programs' workers have their own watchdog
    (``jaxagent.gateway.program_worker``), polling getppid alone: they are plain
    ``python -m`` subprocesses, with no ``multiprocessing`` parent and so no sentinel,
    while here getppid alone would miss a pool's death under forkserver (the fork server
    is the parent then). Nor could one function serve both: ``envs`` imports nothing of
    ``jaxagent``, and the gateway nothing of ``envs``.
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


def worker_main(
    conn,
    progress,
    env_fns: dict[int, bytes],
    parent_pid: int,
    memory_limit_mb: float | None = None,
    cpu_limit_s: float | None = None,
) -> None:
    """The worker process's loop: run each batch from ``conn`` and send its results back,
    recording in ``progress`` (shared with the parent, see ``protocol``) which item runs
    since when, for the parent's timeouts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a group-wide SIGTERM: the trainer closes the pool
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _set_memory_limit(memory_limit_mb)
    runner = SlotRunner(env_fns, pickled=True)
    items: list[tuple[int, str, Any]] = []
    results: list[tuple] = []
    try:
        conn.send((READY, os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == EXIT:
                break
            if msg[0] == RESEND:  # the parent could not unpickle the batch: item by item
                conn.send((ITEMS, _pickle_results(results, items, runner)))
                continue
            seq, items = msg[1], msg[2]
            results = []
            for k, (slot, op, arg) in enumerate(items):
                _cpu_budget(cpu_limit_s, 1 + len(arg[1]) if op == REPLAY else 1)
                progress[PROGRESS_STARTED] = time.monotonic()
                progress[PROGRESS_ITEM] = k
                results.append(runner.run(slot, op, arg))
            progress[PROGRESS_DONE] = seq
            progress[PROGRESS_ITEM] = -1
            try:
                conn.send((DONE, results))
            except (EOFError, OSError):
                break
            except Exception:  # some result cannot be pickled: send them one by one
                conn.send((ITEMS, _pickle_results(results, items, runner)))
    finally:
        runner.close()


def _pickle_results(results: list, items: list, runner: SlotRunner) -> list[bytes]:
    """A batch's results (one per item), each pickled on its own (`_pickle_result`)."""
    return [_pickle_result(r, slot, op, runner) for r, (slot, op, _) in zip(results, items, strict=True)]


def _pickle_result(res, slot: int, op: str, runner: SlotRunner) -> bytes:
    """Each result is pickled on its own, so one that cannot be fails only its slot."""
    try:
        return pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        runner.drop(slot)
        return pickle.dumps(
            (
                "fail",
                UNPICKLABLE,
                f"the {op} result cannot be pickled to leave the worker: {type(e).__name__}: {e}",
                traceback.format_exc(),
            )
        )
