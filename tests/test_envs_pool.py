"""EnvPool: batching, determinism, fault injection, timeouts, process hygiene."""

import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import envs
from envs import EnvPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
faulty = functools.partial(envs.make, "testing/faulty")


def _children():
    # The resource tracker and the fork server are multiprocessing's own long-lived
    # helpers (one per parent process), not workers.
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if not any(h in " ".join(p.cmdline()) for h in ("resource_tracker", "forkserver"))
    ]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = {p.pid for p in _children()}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in _children() if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[p.cmdline() for p in left]}"


def run_episodes(pool, seeds, policy=lambda slot, t: f"act {slot}.{t}"):
    """Transcripts per slot: [reset obs, (action, obs, reward, term, trunc, failed?) ...]."""
    n = len(seeds)
    out = [[r[0] if r else None] for r in pool.reset(seeds)]
    t = 0
    while True:
        actions = [policy(i, t) if pool.status(i) == "running" else None for i in range(n)]
        if all(a is None for a in actions):
            return out
        results = pool.step(actions)
        for i, (a, r) in enumerate(zip(actions, results, strict=True)):
            if a is not None:
                out[i].append((a, r[0], r[1], r[2], r[3], r[4].get("failure_kind")))
        t += 1


def reference_transcripts(fns, seeds):
    """Each env run alone, directly, in this process: what a fault-free run gives."""
    out = []
    for i, (fn, seed) in enumerate(zip(fns, seeds, strict=True)):
        env = fn()
        obs, _ = env.reset(seed)
        tr, t = [obs], 0
        while True:
            a = f"act {i}.{t}"
            o, r, term, trunc, _ = env.step(a)
            tr.append((a, o, r, term, trunc, None))
            t += 1
            if term or trunc:
                break
        out.append(tr)
    return out


def test_pool_matches_direct_play_and_is_deterministic_across_worker_counts():
    fns = [functools.partial(envs.make, name) for name in ("sokoban", "frozenlake", "countdown", "toolmath")] * 2
    seeds = list(range(10, 18))

    def expert_transcripts(pool):
        obs = pool.reset(seeds)
        trans = [[o[0]] for o in obs]
        while True:
            acts = pool.expert_actions()
            if all(a is None for a in acts):
                return trans
            for i, r in enumerate(pool.step(acts)):
                if r is not None:
                    trans[i].append((acts[i], r[0], r[1], r[2], r[3]))

    runs = {}
    for workers in (0, 1, 2):
        with EnvPool(fns, num_workers=workers) as pool:
            runs[workers] = expert_transcripts(pool)
    assert runs[0] == runs[1] == runs[2]
    # Direct play of the same envs gives the same transcripts.
    for i, (fn, seed) in enumerate(zip(fns, seeds, strict=True)):
        tr = envs.rollout(fn(), seed)
        assert [tr[0]["observation"]] + [
            (t["action"], t["observation"], t["reward"], t["terminated"], t["truncated"]) for t in tr[1:]
        ] == runs[2][i]
        assert tr[-1]["reward"] > 0 and tr[-1]["terminated"]


def test_reset_info_carries_prompt_format_and_state_key():
    with EnvPool(["sokoban", "countdown"], num_workers=1) as pool:
        (o1, i1), (o2, i2) = pool.reset([3, 4])
    env = envs.make("sokoban")
    obs, _ = env.reset(3)
    assert o1 == obs and i1["state_key"] == env.state_key()
    assert i1["system_prompt"] == env.system_prompt and i1["action_format"] == env.action_format
    assert i2["state_key"][0] == "countdown"


FAULTS = {  # slot -> fault spec; others healthy
    1: dict(fault="crash", at_step=2),
    2: dict(fault="raise", at_step=3),
    4: dict(fault="garbage", at_step=1),
    5: dict(fault="unpicklable", at_step=4),
    7: dict(fault="nan_reward", at_step=2),
    8: dict(fault="segfault", at_step=5),
    10: dict(fault="hang", at_step=3),
    11: dict(fault="unloadable", at_step=2),
}
EXPECTED_KIND = {
    1: "crashed",
    2: "raised",
    4: "invalid_result",
    5: "unpicklable",
    7: "invalid_result",
    8: "crashed",
    10: "timeout",
    11: "unpicklable",
}


@pytest.mark.parametrize("workers", [1, 3])
def test_faults_end_only_their_episode_and_healthy_transcripts_equal_a_fault_free_run(workers):
    n = 13
    fns = [functools.partial(envs.make, "testing/faulty", **FAULTS.get(i, {})) for i in range(n)]
    seeds = [100 + i for i in range(n)]
    with EnvPool(fns, num_workers=workers, step_timeout=1.0, reset_timeout=30) as pool:
        got = run_episodes(pool, seeds)
        stats = dict(pool.stats)
    ref = reference_transcripts([faulty] * n, seeds)
    for i in range(n):
        if i in FAULTS:
            at = FAULTS[i]["at_step"]
            # Steps before the fault are exactly the healthy run's; the faulty step fails.
            assert got[i][:at] == ref[i][:at], i
            assert len(got[i]) == at + 1
            a, obs, reward, term, trunc, kind = got[i][at]
            assert (obs, reward, term, trunc) == ("", 0.0, False, True)
            assert kind == EXPECTED_KIND[i], (i, kind)
        else:
            assert got[i] == ref[i], i
    assert stats["restarts"] >= 3  # crash, segfault, hang: at three different steps
    assert stats["crashed"] == 2 and stats["timeout"] == 1 and stats["raised"] == 1


def test_failure_info_has_reason_and_traceback_and_pool_goes_on():
    fns = [functools.partial(envs.make, "testing/faulty", fault="raise", at_step=1), faulty]
    with EnvPool(fns, num_workers=1) as pool:
        pool.reset([1, 2])
        (o, r, term, trunc, info), ok = pool.step(["x", "x"])
        assert info["failed"] is True and info["failure_kind"] == "raised"
        assert "injected fault at step 1 (seed 1)" in info["failure"]
        assert "RuntimeError" in info["traceback"] and "_step" in info["traceback"]
        assert not ok[4].get("failed")
        assert pool.status(0) == "failed" and pool.status(1) == "running"
        with pytest.raises(ValueError, match=r"actions\[0\]: slot 0 has no episode in progress"):
            pool.step(["again", "y"])
        # The failed slot can start a new episode; it fails again at step 1 by design.
        (obs, info), _ = pool.reset([5, None])
        assert obs == "seed 5 step 0 checksum 5" and pool.status(0) == "running"
        # Slot 1's episode went on unharmed through the restart (replayed).
        res = pool.step([None, "y"])
        env = faulty()
        env.reset(2)
        env.step("x")
        assert res[1][:4] == env.step("y")[:4]


def test_keep_worker_on_exception_drops_only_that_env():
    fns = [functools.partial(envs.make, "testing/faulty", fault="raise", at_step=1), faulty]
    with EnvPool(fns, num_workers=1, restart_on_exception=False) as pool:
        pids = pool.worker_pids()
        pool.reset([1, 2])
        out = pool.step(["x", "x"])
        assert out[0][4]["failure_kind"] == "raised" and not out[1][4].get("failed")
        pool.step([None, "y"])
        assert pool.worker_pids() == pids and pool.stats["restarts"] == 0


def test_crash_in_reset_and_replay_divergence_are_reported():
    fns = [
        functools.partial(envs.make, "testing/faulty", fault="crash_on_reset"),
        functools.partial(envs.make, "testing/faulty", fault="nondeterministic"),
        functools.partial(envs.make, "testing/faulty", fault="crash", at_step=2),
        faulty,
    ]
    with EnvPool(fns, num_workers=1) as pool:
        res = pool.reset([0, 1, 2, 3])
        assert res[0][0] == "" and res[0][1]["failure_kind"] == "crashed"
        assert "exit code 19" in res[0][1]["failure"]
        assert [r[1].get("failed") for r in res[1:]] == [None, None, None]
        pool.step([None, "a", "a", "a"])
        out = pool.step([None, "b", "b", "b"])
        # Slot 2 crashed the worker; slot 1 cannot be replayed faithfully; slot 3 is fine.
        assert out[2][4]["failure_kind"] == "crashed"
        assert out[1][4]["failure_kind"] == "replay_diverged"
        assert out[3][0] == "seed 3 step 2 checksum " + str(_checksum(3, ["a", "b"]))


def _checksum(seed, actions):
    c = seed
    for a in actions:
        for ch in a:
            c = (c * 31 + ord(ch)) % 1_000_003
    return c


def test_timeout_is_per_step_and_reported():
    fns = [functools.partial(envs.make, "testing/faulty", fault="hang", at_step=1, hang_s=30), faulty]
    with EnvPool(fns, num_workers=1, step_timeout=1.0, reset_timeout=30) as pool:
        pool.reset([0, 1])
        t0 = time.monotonic()
        out = pool.step(["a", "a"])
        elapsed = time.monotonic() - t0
    assert out[0][4]["failure_kind"] == "timeout" and "step_timeout=1.0s" in out[0][4]["failure"]
    assert out[1][0] == f"seed 1 step 1 checksum {_checksum(1, ['a'])}"
    assert 1.0 <= elapsed < 8  # its own step timeout, not the 30 s reset timeout


def test_submit_collect_overlaps_with_caller_work():
    fns = [functools.partial(envs.make, "testing/faulty")] * 4
    with EnvPool(fns, num_workers=2) as pool:
        pool.submit_reset([0, 1, 2, 3])
        with pytest.raises(RuntimeError, match="still in flight"):
            pool.submit_step(["a"] * 4)
        first = pool.collect()
        pool.submit_step(["a"] * 4)
        sum(range(10_000))  # the caller works while the envs step
        second = pool.collect()
        with pytest.raises(RuntimeError, match="without a submitted"):
            pool.collect()
    assert [f[0] for f in first] == [f"seed {i} step 0 checksum {i}" for i in range(4)]
    assert [s[0] for s in second] == [f"seed {i} step 1 checksum {_checksum(i, ['a'])}" for i in range(4)]


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="unknown env name 'nope'"):
        EnvPool(["nope"])
    with pytest.raises(TypeError, match=r"env_fns\[1\].*cannot be pickled"):
        EnvPool(["sokoban", lambda: envs.make("sokoban")], num_workers=1)
    with pytest.raises(ValueError, match="mp_context"):
        EnvPool(["sokoban"], mp_context="fork")
    with pytest.raises(ValueError, match="env_fns is empty"):
        EnvPool([])
    with EnvPool(["testing/faulty"] * 2, num_workers=1) as pool:
        with pytest.raises(ValueError, match="seeds has 1 entries; the pool has 2 slots"):
            pool.reset([1])
        with pytest.raises(TypeError, match=r"seeds\[1\] must be an int"):
            pool.reset([1, "2"])
        with pytest.raises(ValueError, match=r"actions\[0\]: slot 0 has no episode"):
            pool.step(["a", None])
    with pytest.raises(RuntimeError, match="closed"):
        pool.reset([1, 2])


def test_env_factory_that_returns_garbage_fails_its_slot():
    with EnvPool([functools.partial(int, 3), "testing/faulty"], num_workers=1) as pool:
        res = pool.reset([0, 1])
    assert res[0][1]["failure_kind"] == "raised" and "lacks" in res[0][1]["failure"]
    assert res[1][0] == "seed 1 step 0 checksum 1"


def test_close_stops_workers_and_is_idempotent():
    pool = EnvPool(["testing/faulty"] * 4, num_workers=2)
    pool.reset([0, 1, 2, 3])
    procs = [psutil.Process(pid) for pid in pool.worker_pids()]
    assert len(procs) == 2
    pool.close()
    pool.close()
    for p in procs:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def _script(body: str, context: str = "spawn") -> str:
    return textwrap.dedent(f"""
        import functools, os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        import envs
        if __name__ == "__main__":
            # A child inherits its parent's blocked and ignored signals; the pytest process
            # may carry SIGINT blocked (seen in full-suite runs: the script never received
            # it). Start as a terminal's process does: SIGINT delivered, KeyboardInterrupt.
            status = open("/proc/self/status").read() if os.path.exists("/proc/self/status") else ""
            print("inherited", *[ln for ln in status.splitlines() if ln.startswith(("SigBlk", "SigIgn"))],
                  file=sys.stderr, flush=True)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            signal.signal(signal.SIGINT, signal.default_int_handler)
            pool = envs.EnvPool(["testing/faulty"] * 4, num_workers=2, mp_context={context!r})
            pool.reset([0, 1, 2, 3])
            print("PIDS", *pool.worker_pids(), flush=True)
    """) + textwrap.indent(textwrap.dedent(body), "    ")


def _start(body, context="spawn"):
    proc = subprocess.Popen(
        [sys.executable, "-c", _script(body, context)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line + proc.stderr.read()
    return proc, [int(x) for x in line.split()[1:]]


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def test_ctrl_c_in_the_parent_leaves_no_workers():
    proc, pids = _start("""
        while True:
            pool.step(["a"] * 4) if all(pool.status(i) == "running" for i in range(4)) else pool.reset([0, 1, 2, 3])
    """)
    time.sleep(0.3)
    # A KeyboardInterrupt raised inside a finalizer (`__del__`, a weakref callback) is
    # printed as "Exception ignored" and lost, so a Ctrl-C can need a second press; press
    # again, as a user would, up to 3 times.
    err = ""
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"3 SIGINTs did not stop the parent; its stderr:\n{err}")
    assert "KeyboardInterrupt" in err
    assert _wait_gone(pids) == []


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_exit_when_the_parent_is_killed(context):
    proc, pids = _start(
        """
        time.sleep(60)
    """,
        context,
    )
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_gone(pids) == []


@pytest.mark.slow
def test_soak_random_faults_many_slots():
    """32 slots, 3 workers, a random fault in a third of them at a random step."""
    rng = random.Random(1234)
    kinds = ["crash", "segfault", "raise", "garbage", "unpicklable", "unloadable", "nan_reward", "hang"]
    specs = {}
    for i in range(32):
        if rng.random() < 0.33:
            specs[i] = dict(fault=rng.choice(kinds), at_step=rng.randint(1, 8), horizon=12)
    fns = [functools.partial(envs.make, "testing/faulty", **specs.get(i, dict(horizon=12))) for i in range(32)]
    seeds = [rng.randrange(10_000) for _ in range(32)]
    with EnvPool(fns, num_workers=3, step_timeout=1.0, reset_timeout=30) as pool:
        got = run_episodes(pool, seeds)
    ref = reference_transcripts([functools.partial(envs.make, "testing/faulty", horizon=12)] * 32, seeds)
    kind_of = {
        "crash": "crashed",
        "segfault": "crashed",
        "raise": "raised",
        "garbage": "invalid_result",
        "unpicklable": "unpicklable",
        "unloadable": "unpicklable",
        "nan_reward": "invalid_result",
        "hang": "timeout",
    }  # as EXPECTED_KIND above
    for i in range(32):
        if i in specs:
            at = specs[i]["at_step"]
            assert got[i][:at] == ref[i][:at] and len(got[i]) == at + 1, i
            # the faulty step (every fault fires before the horizon) fails with its kind
            assert got[i][at][1:] == ("", 0.0, False, True, kind_of[specs[i]["fault"]]), (i, specs[i], got[i][at])
        else:
            assert got[i] == ref[i]


def test_expert_driven_episodes_survive_a_neighbours_crash_unchanged():
    """Experts are functions of the state, so replayed episodes keep their expert moves."""

    def transcripts(fns):
        with EnvPool(fns, num_workers=1) as pool:
            trans = [[r[0]] for r in pool.reset([21, 22, 23, 24])]
            while True:
                acts = pool.expert_actions()
                if all(a is None for a in acts):
                    return trans, pool.stats["restarts"]
                for i, r in enumerate(pool.step(acts)):
                    if r is not None:
                        trans[i].append((acts[i], r[0], r[1]))

    soko = functools.partial(envs.make, "sokoban")
    crash = functools.partial(envs.make, "testing/faulty", fault="crash", at_step=4)
    clean, _ = transcripts([soko, soko, soko, faulty])
    hurt, restarts = transcripts([soko, soko, soko, crash])
    assert restarts == 1 and hurt[:3] == clean[:3]
    assert all(t[-1][2] == 1.0 for t in clean[:3])


def test_forkserver_context_runs_and_recovers():
    fns = [faulty, functools.partial(envs.make, "testing/faulty", fault="crash", at_step=1)]
    with EnvPool(fns, num_workers=1, mp_context="forkserver") as pool:
        pool.reset([1, 2])
        out = pool.step(["a", "a"])
        assert out[1][4]["failure_kind"] == "crashed"
        assert out[0][0] == f"seed 1 step 1 checksum {_checksum(1, ['a'])}"
        out = pool.step(["b", None])
        assert out[0][0] == f"seed 1 step 2 checksum {_checksum(1, ['a', 'b'])}"


def test_an_untouched_slot_whose_episode_is_lost_comes_back_failed_in_the_calls_shape():
    fns = [
        functools.partial(envs.make, "testing/faulty", fault="crash_on_reset", fault_seeds=[9]),
        functools.partial(envs.make, "testing/faulty", fault="nondeterministic"),
    ]
    with EnvPool(fns, num_workers=1) as pool:
        pool.reset([1, 2])
        pool.step(["a", "a"])
        res = pool.reset([9, None])  # slot 0 crashes the worker; slot 1 cannot be replayed
    assert res[0][1]["failure_kind"] == "crashed"
    obs, info = res[1]
    assert obs == "" and info["failure_kind"] == "replay_diverged"


@pytest.mark.parametrize("workers", [1, 2])
def test_resource_limits_end_only_the_abusive_episode(workers):
    """A memory bomb (64 GiB) under a 1 GiB address-space limit and a CPU bomb under a
    1 s CPU limit (with a wall-clock timeout far away) fail as `memory_limit` and
    `cpu_limit`; their neighbours' transcripts equal a fault-free run's; the pool goes on."""
    n = 5
    kinds = {1: dict(fault="memory_bomb", at_step=2), 3: dict(fault="cpu_bomb", at_step=1, hang_s=60)}
    fns = [functools.partial(envs.make, "testing/faulty", **kinds.get(i, {})) for i in range(n)]
    seeds = [300 + i for i in range(n)]
    t0 = time.monotonic()
    with EnvPool(fns, num_workers=workers, step_timeout=120, memory_limit_mb=1024, cpu_limit_s=1) as pool:
        got = run_episodes(pool, seeds)
        stats = dict(pool.stats)
        # the limits are re-armed in the restarted workers: a fresh episode in every slot runs
        for r in pool.reset([900 + i for i in range(n)]):
            assert r is not None and not r[1].get("failed")
    assert time.monotonic() - t0 < 60  # the CPU bomb did not run out its 60 s
    ref = reference_transcripts([faulty] * n, seeds)
    for i in range(n):
        if i in kinds:
            at = kinds[i]["at_step"]
            assert got[i][:at] == ref[i][:at]
            assert got[i][at][-1] == ("memory_limit" if i == 1 else "cpu_limit"), got[i][at]
        else:
            assert got[i] == ref[i], i
    assert stats["memory_limit"] == 1 and stats["cpu_limit"] == 1
    with pytest.raises(ValueError, match="memory_limit_mb must be a positive number"):
        EnvPool([faulty], memory_limit_mb=0)
