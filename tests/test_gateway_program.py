"""`jaxagent.gateway.program`: loading an agent program and its tasks, and running its
sessions with a fake client (a counter of calls): the concurrency bound, the timeout
that cancels, each failure kind and its message, outcomes in input order."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading

import pytest

from jaxagent.failures import PROGRAM_KINDS
from jaxagent.gateway.program import (
    SessionOutcome,
    TaskSource,
    load_program,
    parse_result,
    run_sessions,
    run_sessions_blocking,
)


class FakeClient:
    """Stands in for the `openai.AsyncOpenAI` of one session: counts its calls."""

    def __init__(self, session_id: str, calls: dict[str, int], closed: list[str]):
        self.session_id, self._calls, self._closed = session_id, calls, closed

    async def complete(self) -> str:
        await asyncio.sleep(0)
        self._calls[self.session_id] = self._calls.get(self.session_id, 0) + 1
        return "ok"

    async def close(self) -> None:
        self._closed.append(self.session_id)


class Harness:
    def __init__(self):
        self.calls: dict[str, int] = {}
        self.closed: list[str] = []

    def make_client(self, session_id: str) -> FakeClient:
        return FakeClient(session_id, self.calls, self.closed)

    def calls_made(self, session_id: str) -> int:
        return self.calls.get(session_id, 0)

    def run(self, program, tasks, *, concurrency=4, timeout_s=5.0) -> list[SessionOutcome]:
        return run_sessions_blocking(
            program,
            tasks,
            self.make_client,
            concurrency=concurrency,
            timeout_s=timeout_s,
            calls_made=self.calls_made,
        )


def _tasks(n: int) -> list[tuple[str, int, dict]]:
    return [(f"s{i}", i, {"i": i}) for i in range(n)]


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Writes modules into a directory on sys.path (forgotten afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ---------------------------------------------------------------- run_sessions


def test_successful_sessions_return_reward_and_metrics_in_input_order():
    async def program(client, task):
        await asyncio.sleep(0.02 * (5 - task["i"]))  # the later tasks finish first
        await client.complete()
        return task["i"] if task["i"] % 2 else {"reward": task["i"] / 10, "turns": 3, "solved": True}

    h = Harness()
    out = h.run(program, _tasks(5), concurrency=5)
    assert [o.session_id for o in out] == ["s0", "s1", "s2", "s3", "s4"]
    assert [o.seed for o in out] == [0, 1, 2, 3, 4]
    assert all(o.ok and o.failure_kind is None and o.failure_message == "" for o in out)
    assert [o.reward for o in out] == [0.0, 1.0, 0.2, 3.0, 0.4]
    assert out[2].metrics == {"turns": 3.0, "solved": 1.0}  # a bool metric counts as 0 / 1
    assert out[1].metrics == {}
    assert all(isinstance(o.reward, float) and o.seconds > 0 for o in out)
    assert sorted(h.closed) == ["s0", "s1", "s2", "s3", "s4"]  # every client closed


def test_the_concurrency_bound_is_respected():
    active = peak = 0

    async def program(client, task):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        await client.complete()
        active -= 1
        return 1.0

    out = Harness().run(program, _tasks(12), concurrency=3)
    assert all(o.ok for o in out)
    assert peak == 3  # reached, never passed
    peak = 0
    Harness().run(program, _tasks(5), concurrency=64)
    assert peak == 5


def test_a_timeout_cancels_the_program_and_it_does_not_go_on():
    after: list[str] = []
    cancelled: list[str] = []

    async def program(client, task):
        await client.complete()
        if task["i"] == 1:
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                cancelled.append("s1")
                raise
            after.append("s1")  # must never run
        return 1.0

    async def main():
        h = Harness()
        out = await run_sessions(
            program, _tasks(3), h.make_client, concurrency=3, timeout_s=0.1, calls_made=h.calls_made
        )
        await asyncio.sleep(0.6)  # had it kept running, it would have finished by now
        return out, h

    out, h = asyncio.run(main())
    assert [o.failure_kind for o in out] == [None, "timeout", None]
    assert "timeout_s=0.1" in out[1].failure_message and "cancelled" in out[1].failure_message
    assert cancelled == ["s1"] and after == []
    assert out[1].reward == 0.0 and 0.09 < out[1].seconds < 0.45
    assert "s1" in h.closed  # its client is closed too


def test_a_program_that_swallows_its_cancellation_still_times_out():
    async def program(client, task):
        await client.complete()
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            pass
        return 1.0

    (out,) = Harness().run(program, _tasks(1), timeout_s=0.05)
    assert out.failure_kind == "timeout"


def test_raised_keeps_the_traceback_and_spares_the_others():
    async def program(client, task):
        await client.complete()
        if task["i"] == 1:
            raise KeyError("no such tool")
        if task["i"] == 2:
            raise TimeoutError("the program's own timeout, not agent.timeout_s")
        return 0.5

    out = Harness().run(program, _tasks(4), timeout_s=5.0)
    assert [o.failure_kind for o in out] == [None, "raised", "raised", None]
    assert out[1].failure_message == "KeyError: 'no such tool'"
    assert "Traceback" in out[1].traceback and 'raise KeyError("no such tool")' in out[1].traceback
    assert out[2].failure_message.startswith("TimeoutError: the program's own")
    assert out[0].reward == out[3].reward == 0.5 and out[0].traceback == ""


def test_a_cancelled_error_of_the_program_own_is_raised_not_the_batch():
    async def program(client, task):
        await client.complete()
        if task["i"] == 0:
            inner = asyncio.ensure_future(asyncio.sleep(10))
            inner.cancel()
            await inner  # raises CancelledError in the program, not from outside
        return 1.0

    out = Harness().run(program, _tasks(2))
    assert [o.failure_kind for o in out] == ["raised", None]
    assert out[0].failure_message == "CancelledError"


@pytest.mark.parametrize(
    "value, words",
    [
        ("1.0", ["str", "'1.0'"]),
        (None, ["NoneType", "None"]),
        (float("nan"), ["float", "nan"]),
        (float("inf"), ["inf"]),
        (True, ["bool", "True"]),
        ({"score": 1.0}, ["without 'reward'", "'score'"]),
        ({"reward": "high"}, ["reward 'high'", "str"]),
        ({"reward": float("nan")}, ["reward nan"]),
        ({"reward": 1.0, "turns": "three"}, ["metric 'turns'", "'three'"]),
        ({"reward": 1.0, 3: 1.0}, ["metric named 3"]),
        ([1.0], ["list", "[1.0]"]),
    ],
)
def test_an_invalid_result_names_what_was_returned(value, words):
    async def program(client, task):
        await client.complete()
        return value

    (out,) = Harness().run(program, _tasks(1))
    assert out.failure_kind == "invalid_result" and out.reward == 0.0 and out.metrics == {}
    for w in words:
        assert w in out.failure_message, (w, out.failure_message)
    assert "expected a finite number" in out.failure_message


def test_parse_result_accepts_numbers_and_reward_dicts():
    import numpy as np

    assert parse_result(1) == (1.0, {})
    assert parse_result(np.float32(0.5)) == (0.5, {})
    assert parse_result({"reward": np.int64(2), "len": 4}) == (2.0, {"len": 4.0})


def test_no_calls_is_a_failure_and_the_counter_is_per_session():
    async def program(client, task):
        if task["i"] != 1:
            await client.complete()
        return 1.0

    out = Harness().run(program, _tasks(3))
    assert [o.failure_kind for o in out] == [None, "no_calls", None]
    assert "0 calls" in out[1].failure_message and "'s1'" in out[1].failure_message


def test_make_client_failing_is_that_session_raised_and_close_errors_are_ignored():
    h = Harness()

    class BadClose(FakeClient):
        async def close(self):
            raise RuntimeError("close failed")

    def make_client(session_id):
        if session_id == "s0":
            raise ConnectionError("gateway down")
        return BadClose(session_id, h.calls, h.closed)

    async def program(client, task):
        await client.complete()
        return 1.0

    out = run_sessions_blocking(program, _tasks(2), make_client, concurrency=2, timeout_s=1.0, calls_made=h.calls_made)
    assert [o.failure_kind for o in out] == ["raised", None]
    assert "ConnectionError: gateway down" == out[0].failure_message


def test_run_sessions_checks_its_arguments_and_the_failure_kinds():
    async def program(client, task):
        return 1.0

    h = Harness()
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        h.run(program, _tasks(1), concurrency=0)
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
        h.run(program, _tasks(1), timeout_s=0)
    with pytest.raises(ValueError, match="distinct"):
        h.run(program, [("a", 0, {}), ("a", 1, {})])
    assert PROGRAM_KINDS == ("raised", "timeout", "invalid_result", "no_calls", "crashed", "stale")
    assert h.run(program, []) == []


def test_both_worker_pools_fail_episodes_in_the_words_of_jaxagent_failures():
    """The trainer counts failed episodes per kind (`failed_<kind>`), whichever worker pool
    failed them: each way a program's session fails reports a kind of `PROGRAM_KINDS`,
    each fault the env pool's chaos env injects is reported as one of `ENV_POOL_KINDS`
    (`envs.testing.CHAOS_REPORTED_AS`, which the fault soak checks against the trainer's
    metrics), a failure both pools can have is one word (so one metric), and every word
    the module names is in a tuple and makes a plain metric name."""
    from envs.testing import CHAOS_REPORTED_AS
    from jaxagent import failures

    async def program(client, task):
        if task["i"] == 3:
            await asyncio.sleep(2)
        if task["i"] != 2:
            await client.complete()
        if task["i"] == 0:
            raise ValueError("boom")
        return "no number" if task["i"] == 1 else 1.0

    kinds = [o.failure_kind for o in Harness().run(program, _tasks(4), timeout_s=0.3)]
    assert kinds == [failures.RAISED, failures.INVALID_RESULT, failures.NO_CALLS, failures.TIMEOUT]
    assert set(kinds) <= set(PROGRAM_KINDS) and failures.PROGRAM_KINDS is PROGRAM_KINDS
    assert set(CHAOS_REPORTED_AS.values()) <= set(failures.ENV_POOL_KINDS)
    assert set(failures.CAUGHT_KINDS) <= set(failures.ENV_POOL_KINDS)
    shared = set(failures.PROGRAM_KINDS) & set(failures.ENV_POOL_KINDS)
    assert shared == {failures.RAISED, failures.CRASHED, failures.TIMEOUT, failures.INVALID_RESULT}
    every = failures.PROGRAM_KINDS + failures.ENV_POOL_KINDS
    named = {v for n, v in vars(failures).items() if n.isupper() and isinstance(v, str)}
    assert named == set(every)
    for kinds_of_a_pool in (failures.PROGRAM_KINDS, failures.ENV_POOL_KINDS):
        assert len(set(kinds_of_a_pool)) == len(kinds_of_a_pool)
    assert all(k.isidentifier() and k == k.lower() for k in every), every


def test_the_blocking_form_runs_on_a_worker_thread():
    async def program(client, task):
        await client.complete()
        return 2.0

    results = []
    t = threading.Thread(target=lambda: results.append(Harness().run(program, _tasks(2))))
    t.start()
    t.join(10)
    assert [o.reward for o in results[0]] == [2.0, 2.0]


# ---------------------------------------------------------------- load_program


def test_load_program_finds_an_async_function(modules):
    modules(
        "agent_ok",
        """
        async def rollout(client, task):
            return 1.0

        class Agents:
            @staticmethod
            async def run(client, task, extra=None):
                return 2.0
        """,
    )
    assert load_program("agent_ok:rollout").__name__ == "rollout"
    assert load_program("agent_ok:Agents.run").__name__ == "run"


def test_load_program_errors_name_the_spec_and_the_problem(modules):
    modules(
        "agent_bad",
        """
        def sync_rollout(client, task):
            return 1.0

        async def one_param(client):
            return 1.0

        async def three_params(client, task, more):
            return 1.0

        NOT_CALLABLE = 3
        """,
    )
    modules("agent_broken", "import no_such_dependency_xyz\n")
    with pytest.raises(ValueError, match=r"agent.program 'no_such_module_xyz:rollout': no module named"):
        load_program("no_such_module_xyz:rollout")
    with pytest.raises(ValueError, match=r"'agent_broken:f': importing 'agent_broken' failed: ModuleNotFoundError"):
        load_program("agent_broken:f")
    with pytest.raises(ValueError, match=r"module 'agent_bad' has no attribute 'missing'"):
        load_program("agent_bad:missing")
    with pytest.raises(ValueError, match=r"must look like 'module:function'"):
        load_program("agent_bad.rollout")
    with pytest.raises(TypeError, match=r"'agent_bad:sync_rollout' is not a coroutine function"):
        load_program("agent_bad:sync_rollout")
    with pytest.raises(TypeError, match=r"'agent_bad:NOT_CALLABLE' is a int"):
        load_program("agent_bad:NOT_CALLABLE")
    for name in ("one_param", "three_params"):
        with pytest.raises(TypeError, match=rf"'agent_bad:{name}' must take 2 parameters \(client, task\)"):
            load_program(f"agent_bad:{name}")


def test_imports_add_directories_and_import_modules(tmp_path):
    pkg = tmp_path / "agents_dir"
    pkg.mkdir()
    (pkg / "agent_in_dir.py").write_text("async def rollout(client, task):\n    return 1.0\n")
    (pkg / "agent_side_effect.py").write_text("import builtins\nbuiltins._agent_side_effect = True\n")
    try:
        assert load_program("agent_in_dir:rollout", imports=[str(pkg), "agent_side_effect"])
        import builtins

        assert builtins._agent_side_effect is True
        with pytest.raises(ValueError, match=r"imports: cannot import 'no_such_dir_or_module'"):
            load_program("agent_in_dir:rollout", imports=["no_such_dir_or_module"])
    finally:
        sys.path.remove(str(pkg))
        for name in ("agent_in_dir", "agent_side_effect"):
            sys.modules.pop(name, None)


# ---------------------------------------------------------------- TaskSource


def test_jsonl_tasks_cycle_by_seed_and_are_fresh_copies(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"q": "a", "tags": [1]}\n\n   \n{"q": "b"}\n{"q": "c"}\n')
    src = TaskSource(str(path))
    assert src.size == 3
    assert [src.task(k)["q"] for k in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    t = src.task(0)
    t["tags"].append(2)
    t["q"] = "changed"
    assert src.task(0) == {"q": "a", "tags": [1]} and src.task(3) == {"q": "a", "tags": [1]}
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        src.task(-1)


def test_jsonl_errors_name_the_file_and_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a"}\n\n{"q": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not valid JSON"):
        TaskSource(str(bad))
    bad.write_text('{"q": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: a task must be a JSON object, got list"):
        TaskSource(str(bad))
    bad.write_text("\n\n")
    with pytest.raises(ValueError, match="has no tasks"):
        TaskSource(str(bad))
    with pytest.raises(ValueError, match=r"agent.tasks: task file not found: .*missing\.jsonl"):
        TaskSource(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"eval.tasks must be a path to a .jsonl file or 'module:function'"):
        TaskSource(str(tmp_path / "tasks.json"), what="eval.tasks")


def test_function_tasks(modules):
    modules(
        "agent_tasks",
        """
        def make(seed):
            return {"seed": seed, "q": f"question {seed}"}

        def not_a_dict(seed):
            return [seed]

        def fails(seed):
            raise KeyError(seed)

        async def async_make(seed):
            return {}

        def two(a, b):
            return {}
        """,
    )
    src = TaskSource("agent_tasks:make")
    assert src.size is None
    assert src.task(7) == {"seed": 7, "q": "question 7"}
    with pytest.raises(TypeError, match=r"'agent_tasks:not_a_dict' returned list \[5\] for seed 5"):
        TaskSource("agent_tasks:not_a_dict").task(5)
    with pytest.raises(ValueError, match=r"'agent_tasks:fails' raised for seed 4: KeyError"):
        TaskSource("agent_tasks:fails").task(4)
    with pytest.raises(TypeError, match="must be a plain function"):
        TaskSource("agent_tasks:async_make")
    with pytest.raises(TypeError, match=r"must take 1 parameter \(the seed\)"):
        TaskSource("agent_tasks:two")
    with pytest.raises(ValueError, match=r"agent.tasks 'agent_tasks:nope': module 'agent_tasks' has no attribute"):
        TaskSource("agent_tasks:nope")


def test_the_module_imports_neither_jax_nor_openai_at_module_level():
    """At module level `program` imports no jax, numpy or openai, and of `jaxagent` only
    `jaxagent.failures` (the failure kinds, a module that imports nothing: the one
    exception to "nothing of jaxagent"); `jaxagent.specs` it imports where it is used."""
    import ast

    import jaxagent.failures as failures
    import jaxagent.gateway.program as program

    def module_level_imports(path: str) -> set[str]:
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        return names

    names = module_level_imports(program.__file__)
    top = {n.split(".")[0] for n in names}
    assert top and not top & {"jax", "jaxlib", "flax", "numpy", "openai"}, top
    assert [n for n in names if n.split(".")[0] == "jaxagent"] == ["jaxagent.failures"], names
    assert module_level_imports(failures.__file__) == set()


def test_a_real_async_openai_client_can_be_closed(tmp_path):
    """The client the trainer makes is `openai.AsyncOpenAI` (when installed): its async
    close() is awaited by run_sessions."""
    openai = pytest.importorskip("openai")
    h = Harness()

    def make_client(session_id):
        return openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")

    async def program(client, task):
        h.calls[task["sid"]] = 1
        return {"reward": 1.0, "base": float(str(client.base_url).startswith("http://127.0.0.1:9"))}

    out = run_sessions_blocking(
        program, [("a", 0, {"sid": "a"})], make_client, concurrency=1, timeout_s=5, calls_made=h.calls_made
    )
    assert out[0].ok and out[0].metrics == {"base": 1.0}
    json.dumps([o.__dict__ for o in out])  # an outcome is JSON-able as it is


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_a_program_worker_outlives_neither_its_trainer_nor_a_ctrl_c():
    """A trainer killed outright (SIGKILL) while its worker runs a program that blocks
    for an hour: the worker exits by itself within seconds. The worker ignores SIGINT
    (a terminal's Ctrl-C reaches the whole process group; the trainer decides)."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    tests = str(Path(__file__).parent)
    script = textwrap.dedent(
        f"""
        import sys, threading, time
        from jaxagent.gateway.processes import ProgramProcesses
        p = ProgramProcesses(1)
        w = p._worker(0)
        print(w.proc.pid, flush=True)
        threading.Thread(target=p.run, args=("gateway_programs:blocking_rollout", [{tests!r}],
            [("s", 0, {{"seed": 0}})]), kwargs=dict(urls={{"s": "http://127.0.0.1:9/v1"}}, api_key="k" * 16,
            concurrency=1, timeout_s=3600.0), daemon=True).start()
        time.sleep(3600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(2.0)  # the batch is in, its program blocks
        os.kill(worker, signal.SIGINT)
        time.sleep(0.5)
        assert not _gone(worker)  # Ctrl-C: ignored
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(worker), "the worker outlived its trainer"
