"""Running a user's agent program against the gateway (`agent.program`, issue 52).

An agent program is an existing agent written against the OpenAI client, named in the
config as `agent.program: "module:function"`::

    async def rollout(client: openai.AsyncOpenAI, task: dict) -> float | dict: ...

What it gets: `client`, an `openai.AsyncOpenAI` already pointed at the run's gateway for
this episode's session (its calls are the episode: each completion the gateway samples
is recorded token for token and trained on), and `task`, one task dict of `agent.tasks`
(`TaskSource`: a line of a JSONL file, or what a `module:function` makes of the
episode's seed; a fresh copy each time, the program may change it). Any `model=` name is
accepted, and the run's sampling settings (`rollout.temperature`, `top_p`, `top_k`, the
token limits) decide how the policy samples, not the request's: an agent's own
`temperature=` or `max_tokens=` does not change what is trained on.

What it returns: the episode's reward, a finite number, or a dict with a finite numeric
`reward` and further keys, the episode's metrics: finite numbers, or bools counted as 1 / 0
(`{"reward": 1.0, "turns": 3, "solved": True}`).

How an episode fails (`SessionOutcome.failure_kind`, one of `jaxagent.failures.PROGRAM_KINDS`
but "stale", which `ProgramLoop` adds; the words are the env pool's too where both pools
fail alike; a failed episode is left out of the update, never the run, and one
session's failure never touches another's):

- "raised": the program raised an exception (its traceback is kept);
- "timeout": it ran longer than `agent.timeout_s`; it is cancelled, and has stopped when
  `run_sessions` returns;
- "invalid_result": it returned something else than a finite number or a dict with a finite
  numeric `reward` and numeric metrics (the message names what it returned);
- "no_calls": it returned without one call through its client (a program that builds
  its own client, or reaches another endpoint, trains nothing).
- "crashed": the process running it (`agent.processes`) exited before its session ended
  (the program called `os._exit`, crashed the interpreter, or was killed); the
  process's other sessions fail with it, and the next batch starts a new process. A
  process that does not finish its sessions in time (a program that blocks its event
  loop holds up every session of its process) is stopped, its unfinished sessions
  failed as "timeout".

`load_program` imports the program (and `agent.imports`) with errors naming what is
wrong; `run_sessions` runs the sessions of one batch at most `agent.concurrency` at a
time, and `run_sessions_blocking` does so on the calling thread in a fresh event loop
(the trainer calls it from a worker thread). Pure Python: no JAX, and `openai` is the
caller's (the client factory's) import, not this module's; of `jaxagent` it imports
only `jaxagent.failures` (standard library only) at module level, `jaxagent.specs` where
a spec is resolved or a task file read.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib
import inspect
import math
import numbers
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from jaxagent.failures import INVALID_RESULT, NO_CALLS, RAISED, TIMEOUT

Program = Callable[[Any, dict], Awaitable[Any]]


def add_import_paths(imports: Iterable[str] = ()) -> None:
    """Makes `imports` (`agent.imports`) importable: each entry that is a directory is
    added to `sys.path`; any other entry is a module name, imported now (as `env.imports`
    are). The current directory is on the path too, so that "module:function" finds a
    module next to the config. `ValueError` names an entry that cannot be imported."""
    if isinstance(imports, str):
        raise ValueError(f"imports: expected a list of module names or directories, got the string {imports!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for entry in imports:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"imports: expected module names or directories, got {entry!r}")
        if os.path.isdir(entry):
            path = os.path.abspath(entry)
            if path not in sys.path:
                sys.path.append(path)
            continue
        try:
            importlib.import_module(entry)
        except Exception as err:  # noqa: BLE001 - any import-time error, named
            raise ValueError(
                f"imports: cannot import {entry!r} (not a directory either): {type(err).__name__}: {err}"
            ) from None


def resolve(spec: str, what: str, imports: Iterable[str]) -> Any:
    """The object "module:function" names (`jaxagent.specs.resolve_spec`), after
    `add_import_paths(imports)`; `ValueError` naming `what` and the spec when it is
    malformed or the module or the attribute is missing."""
    from jaxagent.specs import is_spec, resolve_spec

    if is_spec(spec):  # a malformed spec is named before any of `imports` is tried
        add_import_paths(imports)
    return resolve_spec(spec, what, form="module:function", where="sys.path, the current directory and agent.imports")


def _is_async(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - an object with an `async def __call__`
    return not inspect.isfunction(fn) and not inspect.ismethod(fn) and inspect.iscoroutinefunction(call)


def _takes(fn: Any, n: int) -> bool | None:
    """Whether `fn` can be called with `n` positional arguments (None: no signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def load_program(spec: str, imports: Iterable[str] = ()) -> Program:
    """The agent program `spec` ("module:function", `agent.program`) names, imported
    after `agent.imports` (`add_import_paths`). `ValueError` when the spec is malformed or
    the module or attribute is missing, `TypeError` when it is not an `async def` function
    taking two parameters `(client, task)`; each names the spec."""
    fn = resolve(spec, "agent.program", imports)
    if not callable(fn):
        raise TypeError(f"agent.program {spec!r} is a {type(fn).__name__}, not an async def function")
    if not _is_async(fn):
        raise TypeError(
            f"agent.program {spec!r} is not a coroutine function: it must be `async def {spec.split(':')[1]}"
            f"(client, task)` (an agent written against openai.AsyncOpenAI)"
        )
    if _takes(fn, 2) is False:
        raise TypeError(
            f"agent.program {spec!r} must take 2 parameters (client, task); its signature is {inspect.signature(fn)}"
        )
    return fn


class TaskSource:
    """The tasks of `agent.tasks` (or `eval.tasks`), by episode seed: `task(seed)`.

    spec: a path to a `.jsonl` file, one task (a JSON object) a line (blank lines are
      ignored; a line that is not a JSON object is an error naming the file and line),
      read once here; seed `k` plays line `k % n` of its `n` tasks (the tasks cycle: a
      run longer than the file plays each again). Or "module:function" (imported after
      `imports`, `add_import_paths`): `function(seed)` returns the seed's task dict.
    Every `task(seed)` is a fresh copy for the JSONL form, so a program that changes its
    task does not change another episode's.
    """

    def __init__(self, spec: str, imports: Iterable[str] = (), *, what: str = "agent.tasks"):
        from jaxagent.specs import is_spec, read_jsonl_tasks

        self.spec, self.what = spec, what
        self._tasks: list[dict] | None = None
        self._fn: Callable[[int], Any] | None = None
        if isinstance(spec, str) and spec.endswith(".jsonl"):
            self._tasks = [task for _, task in read_jsonl_tasks(spec, what)]
        elif is_spec(spec):
            fn = resolve(spec, what, imports)
            if not callable(fn) or _is_async(fn):
                raise TypeError(f"{what} {spec!r} must be a plain function seed -> task dict, got {fn!r}")
            if _takes(fn, 1) is False:
                raise TypeError(
                    f"{what} {spec!r} must take 1 parameter (the seed); its signature is {inspect.signature(fn)}"
                )
            self._fn = fn
        else:
            raise ValueError(f"{what} must be a path to a .jsonl file or 'module:function', got {spec!r}")

    @property
    def size(self) -> int | None:
        """How many tasks the JSONL file has (None for a function)."""
        return None if self._tasks is None else len(self._tasks)

    def task(self, seed: int) -> dict:
        """The task of episode seed `seed` (an int >= 0)."""
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"{self.what}: a task seed must be an int >= 0, got {seed!r}")
        seed = int(seed)
        if self._tasks is not None:
            return copy.deepcopy(self._tasks[seed % len(self._tasks)])
        assert self._fn is not None
        try:
            task = self._fn(seed)
        except Exception as err:
            raise ValueError(f"{self.what} {self.spec!r} raised for seed {seed}: {type(err).__name__}: {err}") from err
        if not isinstance(task, dict):
            raise TypeError(
                f"{self.what} {self.spec!r} returned {type(task).__name__} {_short(task)} for seed {seed}; "
                f"a task must be a dict"
            )
        return task

    def __repr__(self) -> str:
        return f"TaskSource({self.spec!r})"


@dataclasses.dataclass
class SessionOutcome:
    """How one session (one episode) of an agent program ended.

    session_id, seed: the session and its task's seed.
    reward: the reward the program returned (0.0 when it failed).
    metrics: the other numeric keys of a dict it returned (float values).
    failure_kind: None (it succeeded) or one of `jaxagent.failures.PROGRAM_KINDS` but
      "stale".
    failure_message: what went wrong, one line ("" on success).
    traceback: the exception's traceback for "raised" ("" otherwise).
    seconds: how long the session ran (from its start under the concurrency bound).
    """

    session_id: str
    seed: int
    reward: float = 0.0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    failure_kind: str | None = None
    failure_message: str = ""
    traceback: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure_kind is None


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _finite(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def parse_result(result: Any) -> tuple[float, dict[str, float]]:
    """The (reward, metrics) of what a program returned; `ValueError` saying what is
    wrong with it (the "invalid_result" message)."""
    if _finite(result):
        return float(result), {}
    expected = "expected a finite number (the reward) or a dict with a finite numeric 'reward' and numeric metrics"
    if isinstance(result, dict):
        if "reward" not in result:
            raise ValueError(f"the program returned a dict without 'reward' ({_short(result)}); {expected}")
        if not _finite(result["reward"]):
            raise ValueError(
                f"the program returned reward {_short(result['reward'])} "
                f"({type(result['reward']).__name__}), not a finite number; {expected}"
            )
        metrics = {}
        for key, value in result.items():
            if key == "reward":
                continue
            if not isinstance(key, str):
                raise ValueError(f"the program returned a metric named {key!r}, not a string; {expected}")
            if isinstance(value, bool):
                value = float(value)  # a flag metric (`solved: True`) counts as 1 / 0
            if not _finite(value):
                raise ValueError(
                    f"the program returned metric {key!r} = {_short(value)} ({type(value).__name__}), "
                    f"not a finite number; {expected}"
                )
            metrics[key] = float(value)
        return float(result["reward"]), metrics
    raise ValueError(f"the program returned {type(result).__name__} {_short(result)}; {expected}")


async def _close(client: Any) -> None:
    close = getattr(client, "close", None)
    if close is None or not inspect.iscoroutinefunction(close):
        return
    try:
        await close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


async def run_sessions(
    program: Program,
    tasks: Sequence[tuple[str, int, dict]],
    make_client: Callable[[str], Any],
    *,
    concurrency: int,
    timeout_s: float,
    calls_made: Callable[[str], int] | None,
) -> list[SessionOutcome]:
    """Runs `program(make_client(session_id), task)` for each `(session_id, seed, task)`
    of `tasks`, at most `concurrency` at once, each within `timeout_s` seconds, and
    returns their `SessionOutcome`s in the order of `tasks`.

    A program that raises fails as "raised", one past `timeout_s` is cancelled (and has
    stopped by the time this returns) and fails as "timeout", one that returns a bad
    value as "invalid_result", and one that returns after `calls_made(session_id) == 0` calls
    as "no_calls" (see the module's docstring; `calls_made` None: the caller checks that,
    `check_calls`). Each client is closed (its async
    `close()`, errors ignored) when its session ends.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    if isinstance(timeout_s, bool) or not _finite(timeout_s) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    ids = [session_id for session_id, _, _ in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("run_sessions: the session ids must be distinct (calls are counted by session id)")
    limit = asyncio.Semaphore(concurrency)

    async def one(session_id: str, seed: int, task: dict) -> SessionOutcome:
        async with limit:
            out = SessionOutcome(session_id=session_id, seed=seed)
            start = time.monotonic()
            client = None
            scope = asyncio.timeout(timeout_s)
            result: Any = None
            try:
                async with scope:
                    client = make_client(session_id)
                    result = await program(client, task)
                if scope.expired():  # the program swallowed its cancellation and returned
                    raise TimeoutError
            except TimeoutError:
                if scope.expired():
                    out.failure_kind = TIMEOUT
                    out.failure_message = (
                        f"the program ran longer than timeout_s={timeout_s:g} s and was cancelled "
                        f"(session {session_id!r})"
                    )
                else:  # the program's own TimeoutError
                    _raised(out)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # run_sessions itself is cancelled
                _raised(out)  # a CancelledError of the program's own (e.g. a task of its that was cancelled)
            except Exception:  # noqa: BLE001 - the program's failure is its session's, never the batch's
                _raised(out)
            finally:
                if client is not None:
                    await _close(client)
                out.seconds = time.monotonic() - start
            if out.failure_kind is None:
                try:
                    out.reward, out.metrics = parse_result(result)
                except ValueError as err:
                    out.failure_kind, out.failure_message = INVALID_RESULT, str(err)
            if calls_made is not None:
                check_calls([out], calls_made)
            if out.failure_kind is not None:
                out.reward, out.metrics = 0.0, {}
            return out

    return list(await asyncio.gather(*(one(*item) for item in tasks)))


def check_calls(outcomes: Sequence[SessionOutcome], calls_made: Callable[[str], int]) -> None:
    """Fails as "no_calls" each outcome that would have succeeded but whose session made
    no call (`calls_made(session_id) == 0`); its reward and metrics are dropped."""
    for out in outcomes:
        if out.failure_kind is None and calls_made(out.session_id) == 0:
            out.failure_kind = NO_CALLS
            out.failure_message = (
                f"the program returned without calling the model through its client (session "
                f"{out.session_id!r} made 0 calls); it must use the client it is given (any model= name)"
            )
            out.reward, out.metrics = 0.0, {}


def _raised(out: SessionOutcome) -> None:
    err = sys.exc_info()[1]
    out.failure_kind = RAISED
    out.failure_message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    out.traceback = traceback.format_exc()


def run_sessions_blocking(
    program: Program,
    tasks: Sequence[tuple[str, int, dict]],
    make_client: Callable[[str], Any],
    *,
    concurrency: int,
    timeout_s: float,
    calls_made: Callable[[str], int] | None,
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> list[SessionOutcome]:
    """`run_sessions` in a fresh event loop on the calling thread (`asyncio.run`): what the
    trainer calls from its worker thread (a thread with a running loop cannot). `cleanup`
    is awaited in that loop after the sessions (e.g. closing an HTTP client they shared)."""

    async def main() -> list[SessionOutcome]:
        try:
            return await run_sessions(
                program, tasks, make_client, concurrency=concurrency, timeout_s=timeout_s, calls_made=calls_made
            )
        finally:
            if cleanup is not None:
                await cleanup()

    return asyncio.run(main())


@functools.cache
def _shared_http_class():
    import httpx

    class SharedHTTP(httpx.AsyncClient):
        """An HTTP client the sessions of one run share: a session's `client.close()`
        leaves it open; the run closes it (`close_pool`)."""

        async def aclose(self) -> None:
            return None

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedHTTP


def run_openai_sessions(
    program: Program,
    tasks: Sequence[tuple[str, int, dict]],
    *,
    base_url: Callable[[str], str],
    api_key: str,
    concurrency: int,
    timeout_s: float,
    calls_made: Callable[[str], int] | None,
) -> list[SessionOutcome]:
    """`run_sessions_blocking` with each session's client an `openai.AsyncOpenAI` pointed
    at `base_url(session_id)` with `api_key` (no retries; `timeout_s`). The sessions share
    one HTTP connection pool (`concurrency` + 8 connections), made in their event loop
    and closed after them: an `AsyncOpenAI` of its own each would build its own `httpx`
    client and TLS context (about 25 ms a session)."""
    import httpx
    import openai

    shared: dict[str, Any] = {}
    SharedHTTP = _shared_http_class()

    def make_client(session_id: str):
        if "http" not in shared:
            n = concurrency + 8
            shared["http"] = SharedHTTP(
                timeout=timeout_s, limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)
            )
        return openai.AsyncOpenAI(
            base_url=base_url(session_id),
            api_key=api_key,
            max_retries=0,
            timeout=timeout_s,
            http_client=shared["http"],
        )

    async def cleanup() -> None:
        if "http" in shared:
            await shared["http"].close_pool()

    return run_sessions_blocking(
        program,
        tasks,
        make_client,
        concurrency=concurrency,
        timeout_s=timeout_s,
        calls_made=calls_made,
        cleanup=cleanup,
    )
