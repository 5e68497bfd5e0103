"""The parent's handle on one worker process: start it, send it a batch, read its
answer, tell when its running item is due, stop it.

:class:`WorkerProcess` knows the process, its pipe and its progress array (see
``protocol``); which slots' items to send and what a result or a fault means for an
episode is the pool's business (``envs.pool.pool``).
"""

from __future__ import annotations

import ctypes
import math
import os
import pickle
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

from envs.pool.protocol import (
    DONE,
    EXIT,
    ITEMS,
    PROGRESS_DONE,
    PROGRESS_ITEM,
    PROGRESS_STARTED,
    READY,
    REPLAY,
    RESEND,
    RESET,
    RUN,
)
from envs.pool.worker import worker_main
from jaxagent.failures import UNPICKLABLE


class Timeouts(NamedTuple):
    """Seconds one step, one reset and one worker start may take."""

    step: float
    reset: float
    startup: float


class WorkerProcess:
    """Worker ``index``, which owns ``slots``; at most one batch in flight."""

    __slots__ = (
        "index",
        "proc",
        "conn",
        "progress",
        "slots",
        "ready",
        "started_at",
        "batch",
        "sent_at",
        "seq",
        "needs_restart",
        "silent_deaths",
        "pid",
    )

    def __init__(self, index: int, slots: list[int]):
        self.index = index
        self.slots = slots
        self.proc: BaseProcess | None = None
        self.conn: Connection | None = None
        self.progress: ctypes.Array[ctypes.c_double] | None = None  # shared with the process
        self.ready = False  # its READY message came
        self.started_at = 0.0
        self.batch: list[tuple[int, str, Any]] | None = None  # the items sent, not yet answered
        self.sent_at = 0.0
        self.seq = 0  # number of the last batch sent
        self.needs_restart = False  # restart before its next batch
        self.silent_deaths = 0  # deaths in a row without running any env
        self.pid: int | None = None

    @property
    def busy(self) -> bool:
        return self.batch is not None

    def start(self, ctx, env_fns: dict[int, bytes], memory_limit_mb: float | None, cpu_limit_s: float | None) -> None:
        """Start the process (``ctx``, a multiprocessing context) for the pickled env
        factories of its slots; returns at once: it answers READY when it is up."""
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        progress = ctx.RawArray(ctypes.c_double, 3)
        progress[PROGRESS_ITEM] = -1.0
        progress[PROGRESS_DONE] = self.seq
        proc = ctx.Process(
            target=worker_main,
            name=f"envpool-worker-{self.index}",
            daemon=True,
            args=(child_conn, progress, env_fns, os.getpid(), memory_limit_mb, cpu_limit_s),
        )
        proc.start()
        child_conn.close()
        self.proc, self.conn, self.progress = proc, parent_conn, progress
        self.ready = False
        self.started_at = time.monotonic()
        self.needs_restart = False
        self.batch = None

    def stop(self, grace: float) -> None:
        """Ask the process to exit, then terminate / kill it after ``grace`` seconds."""
        proc, conn = self.proc, self.conn
        self.proc = self.conn = None
        stop_process(proc, conn, grace)

    def send_batch(self, items: list) -> None:
        """Send ``items`` (none: the worker stays idle)."""
        self.batch = items if items else None
        if not items:
            return
        self.sent_at = time.monotonic()
        self.seq += 1
        assert self.conn is not None, "send_batch: the worker is not started"
        try:
            self.conn.send((RUN, self.seq, items))
        except (OSError, EOFError, ValueError):
            pass  # a dead worker: found through its sentinel

    def running(self) -> int:
        """Index in the batch of the item running (-1: none, or not started)."""
        return int(self.progress[PROGRESS_ITEM]) if self.ready and self.progress is not None else -1

    def deadline(self, timeouts: Timeouts) -> float:
        """When the worker is overdue: its start, or the item it runs (its own budget
        from when it started), or a batch not started yet."""
        if not self.ready or self.progress is None:
            return self.started_at + timeouts.startup
        k = int(self.progress[PROGRESS_ITEM])
        if k < 0 or self.batch is None or k >= len(self.batch):
            if int(self.progress[PROGRESS_DONE]) == self.seq:
                return math.inf  # finished: the results are on their way (or it died: sentinel)
            return self.sent_at + timeouts.step + timeouts.reset  # not started yet
        started = self.progress[PROGRESS_STARTED]
        _, op, arg = self.batch[k]
        if op == RESET:
            budget = timeouts.reset
        elif op == REPLAY:
            budget = timeouts.reset + timeouts.step * len(arg[1])
        else:
            budget = timeouts.step
        return started + budget

    def receive(self, resend_timeout: float) -> tuple[list[tuple[int, str, Any]], list] | None:
        """Read the messages that have arrived: ``(batch, results)`` once the batch is
        answered (the worker is then idle), else None. Raises EOFError / OSError when the
        pipe closed (the process is exiting)."""
        assert self.conn is not None, "receive: the worker is not started"
        while self.conn.poll():
            msg = self._recv(resend_timeout)
            if msg is None:
                return None
            if msg[0] == READY:
                self.ready = True
                self.pid = msg[1]
                # A batch sent while the worker was starting is timed from now on.
                self.sent_at = max(self.sent_at, time.monotonic())
            elif msg[0] in (DONE, ITEMS):
                results = msg[1] if msg[0] == DONE else [unpickle_result(b) for b in msg[1]]
                batch, self.batch, self.silent_deaths = self.batch, None, 0
                assert batch is not None, "the worker answered a batch it was not sent"
                return batch, results
        return None

    def _recv(self, resend_timeout: float):
        """The next message; if it cannot be unpickled here (a result holds an object of
        a class only the worker can import), the worker resends the results one by one."""
        assert self.conn is not None and self.proc is not None
        data = self.conn.recv_bytes()
        try:
            return pickle.loads(data)
        except Exception:
            pass
        self.conn.send((RESEND,))
        if not self.conn.poll(resend_timeout):
            self.proc.kill()
            self.proc.join(2.0)
            return None
        return self.conn.recv()


def unpickle_result(data: bytes):
    """A result the worker pickled on its own: one that cannot be unpickled here fails
    only its slot."""
    try:
        return pickle.loads(data)
    except Exception as e:
        return (
            "fail",
            UNPICKLABLE,
            f"the result cannot be unpickled in the parent process: {type(e).__name__}: {e}",
            traceback.format_exc(),
        )


def stop_process(proc, conn, grace: float) -> None:
    if proc is None:
        return
    try:
        if conn is not None and proc.is_alive():
            conn.send((EXIT,))
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


def shutdown(workers: list[WorkerProcess]) -> None:
    """Stop every worker (the pool's finalizer: holds no reference to the pool)."""
    for w in workers:
        w.stop(grace=1.0)
