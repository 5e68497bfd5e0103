"""Agent programs in processes of their own (`agent.processes`): `ProgramProcesses`.

A program runs user code, and the trainer must outlive it. In the trainer's own process
a program that calls `os._exit`, crashes the interpreter, or blocks its event loop (a
`time.sleep`, a busy loop: no timeout can fire while the loop is blocked) would stop or
hang the run. Here each of `n` worker processes (`python -m
jaxagent.gateway.program_worker`, started on first use and kept between batches) runs
its share of a batch's sessions in its own event loop, each session a client of the
gateway as in the trainer's process; what can go wrong costs the sessions of that
process, never the run:

- a process that exits before it answers (`os._exit`, a crash, the OOM killer): its
  sessions fail as "crashed", with its exit code and its last lines of output;
- a process that has not answered `deadline` seconds after its batch was sent (its
  sessions' own timeouts could not fire): it is killed, its sessions fail as "timeout";
- a program that cannot be loaded in the worker: its sessions fail as "raised".

A dead or killed process is started again for the next batch. The programs' output
(stdout and stderr) is forwarded to the trainer's stderr, each line marked with the
worker. It also moves the programs' client work (the `openai` client's request building
and parsing, HTTP) off the trainer's interpreter, which then serves the gateway and
drives the device without sharing its lock with them.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from jaxagent.failures import CRASHED, RAISED, TIMEOUT
from jaxagent.gateway.program import SessionOutcome
from jaxagent.gateway.program_worker import read_message, write_message

#: seconds a worker gets past its sessions' own time limits before it is killed
GRACE_S = 30.0
#: lines of a worker's output kept for a "crashed" message
TAIL_LINES = 20


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxagent.gateway.program_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._forward = threading.Thread(target=self._forward_output, daemon=True, name=f"program-worker-{index}-err")
        self._forward.start()

    def _forward_output(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            print(f"[agent program {self.index}] {line}", file=sys.stderr, flush=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self._forward.join(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        """End of input: the worker returns; killed if it does not within 10 s."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class ProgramProcesses:
    """`n` worker processes that run agent programs' sessions (module docstring)."""

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ProgramProcesses: n must be an int >= 1, got {n!r}")
        self.n = n
        self._workers: list[_Worker | None] = [None] * n
        #: workers started (the first ones and every restart)
        self.started = 0

    def _worker(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            w = self._workers[i] = _Worker(i)
            self.started += 1
        return w

    def run(
        self,
        program: str,
        imports: Sequence[str],
        tasks: Sequence[tuple[str, int, dict]],
        *,
        urls: dict[str, str],
        api_key: str,
        concurrency: int,
        timeout_s: float,
    ) -> list[SessionOutcome]:
        """The sessions `tasks` (`(session_id, seed, task)`) of `program` ("module:function",
        with `imports`), spread over the workers (session k to worker k mod n, at most
        `concurrency` at once in all), each a client of `urls[session_id]`; their outcomes
        in the order of `tasks` (no "no_calls" check: `program.check_calls`)."""
        shares = [list(tasks[i :: self.n]) for i in range(self.n)]
        busy = [i for i in range(self.n) if shares[i]]
        each = max(1, math.ceil(concurrency / max(len(busy), 1)))
        answers: dict[int, Any] = {}
        readers = []
        for i in busy:
            w = self._worker(i)
            batch = {
                "program": program,
                "imports": list(imports),
                "sys_path": [p for p in sys.path if p and os.path.isdir(p)],
                "tasks": shares[i],
                "urls": {sid: urls[sid] for sid, _, _ in shares[i]},
                "api_key": api_key,
                "concurrency": each,
                "timeout_s": timeout_s,
            }
            try:
                assert w.proc.stdin is not None
                write_message(w.proc.stdin, batch)
            except OSError:  # it died before it could take the batch: its reader sees the end
                pass

            def read(i=i, w=w) -> None:
                try:
                    assert w.proc.stdout is not None
                    answers[i] = read_message(w.proc.stdout)
                except Exception as err:  # noqa: BLE001 - a garbled answer is a crash
                    answers[i] = err

            t = threading.Thread(target=read, daemon=True, name=f"program-worker-{i}-read")
            t.start()
            readers.append((i, t))
        out: dict[str, SessionOutcome] = {}
        sent = time.monotonic()
        for i, t in readers:
            rounds = math.ceil(len(shares[i]) / each)  # sessions wait for each other past `each`
            limit = rounds * timeout_s + GRACE_S
            t.join(timeout=max(0.0, sent + limit - time.monotonic()))
            wk = self._workers[i]
            assert wk is not None
            answer = answers.get(i)
            if t.is_alive():  # no answer in time: a program blocks its process
                wk.kill()
                t.join(timeout=5)
                kind = TIMEOUT
                message = (
                    f"the agent programs' process {i} did not finish its {len(shares[i])} sessions within "
                    f"{limit:g} s and was stopped (a program that blocks its event loop, "
                    "e.g. with time.sleep or a busy loop, holds up every session of its process)"
                )
                failed = _failed(shares[i], kind, message)
            elif isinstance(answer, dict) and "outcomes" in answer:
                failed = list(answer["outcomes"])
            elif isinstance(answer, dict) and "error" in answer:
                failed = _failed(shares[i], RAISED, answer["error"], answer.get("traceback", ""))
            else:  # the end of its output (or a garbled answer): it died
                try:
                    wk.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    wk.kill()
                code = wk.proc.poll()
                wk._forward.join(timeout=5)
                last = "\n".join(list(wk.tail)[-5:])
                message = f"the agent programs' process {i} exited (code {code}) before its sessions ended" + (
                    f"; its last output:\n{last}" if last else ""
                )
                failed = _failed(shares[i], CRASHED, message)
            for o in failed:
                out[o.session_id] = o
        return [out[sid] for sid, _, _ in tasks]

    def close(self) -> None:
        for i, w in enumerate(self._workers):
            if w is not None:
                w.close()
            self._workers[i] = None

    def __enter__(self) -> ProgramProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _failed(share, kind: str, message: str, tb: str = "") -> list[SessionOutcome]:
    return [
        SessionOutcome(session_id=sid, seed=seed, failure_kind=kind, failure_message=message, traceback=tb)
        for sid, seed, _ in share
    ]
