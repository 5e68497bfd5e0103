"""Overlap of env stepping with device decoding: the pool's non-blocking calls, the
agent loop's pipelined sub-batches (`AgentLoopConfig.pipeline_groups`) and its
continuous scheduling (`AgentLoopConfig.slots`, with the pool's `send` / `poll`).

The reference for a pipelined or continuous rollout is the same rollout with one group: every token,
action, observation, reward, end and failure must be equal (log-probs to float32
rounding, since XLA:CPU's per-row results may differ in the last bits with the batch
shape), with fault-free envs, with envs that fail in every way the pool reports, and
with episodes that end early.
"""

import dataclasses
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import envs
from envs import EnvPool
from envs.pool import PoolCall
from jaxagent import models as M
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
TOK = byte_chat_tokenizer()
CFG = tiny_config(vocab_size=len(TOK))
faulty = functools.partial(envs.make, "testing/faulty")

TRAJ_EXACT = (
    "tokens",
    "attention_mask",
    "loss_mask",
    "turn_ids",
    "rewards",
    "group_ids",
    "turn_rewards",
    "turn_mask",
    "anchor_ids",
    "episode_return",
    "lengths",
    "num_turns",
    "done",
    "truncated",
    "failed",
)
EP_EXACT = (
    "index",
    "seed",
    "group_id",
    "tokens",
    "loss_mask",
    "turn_ids",
    "segments",
    "rewards",
    "state_keys",
    "actions",
    "observations",
    "finish_reasons",
    "done",
    "truncated",
    "failed",
    "end_reason",
    "failure",
    "system_prompt",
    "state_key",
    "info",
)


@pytest.fixture(scope="module")
def loop():
    """One loop (one sampler: compilations shared); tests set `loop.config`."""
    return AgentLoop(M.init_params(jax.random.key(0), CFG, std=0.3), CFG, TOK, AgentLoopConfig(max_context=512))


def rollouts(loop, cfg, env_fns, seeds, groups, num_workers=2, **pool_kw):
    """The same rollout with each variant in `groups`, each in a fresh pool: an int is
    `pipeline_groups`, "sN" is continuous scheduling with N slots."""
    out = {}
    for g in groups:
        if isinstance(g, str):
            loop.config = dataclasses.replace(cfg, pipeline_groups=1, slots=int(g[1:]))
        else:
            loop.config = dataclasses.replace(cfg, pipeline_groups=g, slots=0)
        with EnvPool(env_fns, num_workers=num_workers, **pool_kw) as pool:
            out[g] = loop.run(pool, seeds)
    return out


def assert_same(a, b):
    (ta, ea), (tb, eb) = a, b
    for f in TRAJ_EXACT:
        np.testing.assert_array_equal(np.asarray(getattr(ta, f)), np.asarray(getattr(tb, f)), err_msg=f)
    np.testing.assert_allclose(np.asarray(ta.rollout_logp), np.asarray(tb.rollout_logp), rtol=1e-5, atol=1e-5)
    assert len(ea) == len(eb)
    for x, y in zip(ea, eb, strict=True):
        for f in EP_EXACT:
            assert getattr(x, f) == getattr(y, f), (x.index, f)
        np.testing.assert_allclose(x.logp, y.logp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 36 s; the continuous fault test below runs by default
def test_fault_free_and_early_ending_episodes_are_identical(loop):
    # horizons 1..8: episodes end at different turns, so sub-batches shrink and one
    # sub-batch can leave the pipeline before the other
    horizons = [1, 5, 2, 8, 3, 1, 6, 4, 2, 7]
    fns = [functools.partial(envs.make, "testing/faulty", horizon=h) for h in horizons]
    cfg = AgentLoopConfig(max_turns=6, max_tokens_per_turn=5, max_context=512, sampling=SamplingConfig(1.0), seed=3)
    out = rollouts(loop, cfg, fns, list(range(10)), (1, 2, 3, "s3", "s10"))
    assert_same(out[1], out[2])
    assert_same(out[1], out[3])
    # continuous: 3 rows for 10 episodes (each row plays several in turn), or one each
    assert_same(out[1], out["s3"])
    assert_same(out[1], out["s10"])
    traj, eps = out[2]
    assert np.asarray(traj.num_turns).tolist() == [min(h, 6) for h in horizons]
    assert {e.end_reason for e in eps} == {"terminated", "max_turns"}
    # the same rollout again (compiled, fresh pool), timed from outside: its phases
    # partition the rollout and the rollout fits in the call
    with EnvPool(fns, num_workers=2) as pool:
        t0 = time.perf_counter()
        again = loop.run(pool, list(range(10)))
        wall = time.perf_counter() - t0
    assert_same(out[3], again)
    t = dict(loop.timings)
    phases = ("dispatch_s", "decode_wait_s", "submit_s", "env_wait_s", "append_s")
    assert set(t) == {*phases, "host_s", "rollout_s"}
    # every phase ran, and no phase was counted inside another (host_s, the rest, > 0)
    assert all(t[k] > 0 for k in phases) and t["host_s"] > 0, t
    assert sum(t[k] for k in (*phases, "host_s")) == pytest.approx(t["rollout_s"], rel=1e-9, abs=1e-12)
    assert t["rollout_s"] <= wall, (t, wall)


# ~20 s on idle cores (suite budget; test_continuous_episode_lost_while_waiting_for_its_decode stays): `make test-slow`
@pytest.mark.slow
def test_frozenlake_greedy_and_context_limit_are_identical(loop):
    # a short context: some episodes end by "context_full" (actions cut, never sent)
    cfg = AgentLoopConfig(max_turns=4, max_tokens_per_turn=8, max_context=330, sampling=SamplingConfig(0.0))
    out = rollouts(loop, cfg, ["frozenlake"] * 5, [3, 4, 3, 5, 6], (1, 2, "s2"), num_workers=1)
    assert_same(out[1], out[2])
    assert_same(out[1], out["s2"])
    cfg = dataclasses.replace(cfg, sampling=SamplingConfig(0.7), seed=9, max_context=512)
    out = rollouts(loop, cfg, ["frozenlake"] * 5, [3, 4, 3, 5, 6], (1, 2, "s4"))
    assert_same(out[1], out[2])
    assert_same(out[1], out["s4"])


# ~33 s on idle cores (suite budget; test_continuous_episode_lost_while_waiting_for_its_decode stays): `make test-slow`
@pytest.mark.slow
def test_faulty_envs_are_identical(loop):
    """Crash, segfault, raise (worker restarted: the other episodes of that worker are
    replayed), invalid results, an unpicklable result and a hang past the step timeout,
    spread over both sub-batches and both workers."""
    fns = [
        functools.partial(faulty, fault="crash", at_step=2, horizon=5),
        functools.partial(faulty, horizon=5),
        functools.partial(faulty, fault="raise", at_step=3, horizon=5),
        functools.partial(faulty, fault="garbage", at_step=1, horizon=5),
        functools.partial(faulty, fault="hang", at_step=2, hang_s=30, horizon=5),
        functools.partial(faulty, fault="segfault", at_step=4, horizon=5),
        functools.partial(faulty, fault="unpicklable", at_step=2, horizon=5),
        functools.partial(faulty, fault="raise_on_reset", horizon=5),
        functools.partial(faulty, horizon=2),
        functools.partial(faulty, fault="nan_reward", at_step=1, horizon=5),
    ]
    cfg = AgentLoopConfig(max_turns=5, max_tokens_per_turn=4, max_context=512, sampling=SamplingConfig(1.0), seed=7)
    out = rollouts(loop, cfg, fns, list(range(10)), (1, 2, "s4"), step_timeout=1.5)
    assert_same(out[1], out[2])
    assert_same(out[1], out["s4"])
    _, eps = out["s4"]
    kinds = [e.info.get("failure_kind") for e in eps]
    assert kinds == [
        "crashed",
        None,
        "raised",
        "invalid_result",
        "timeout",
        "crashed",
        "unpicklable",
        None,
        None,
        "invalid_result",
    ]
    assert eps[7].end_reason == "env_failed" and eps[7].tokens == []  # failed at reset
    assert [eps[i].end_reason for i in (1, 8)] == ["terminated"] * 2


@pytest.mark.slow  # ~38 s on idle cores (suite budget; the continuous variant below stays): `make test-slow`
def test_episode_lost_while_another_sub_batch_steps(loop):
    """Slot 0 (sub-batch A) crashes its worker; slot 2 (sub-batch B, same worker) is not
    deterministic, so its replay into the new worker diverges while A steps: the pool
    reports it in A's call and the loop ends B's episode at its own next step, as the
    one-group rollout does."""
    fns = [
        functools.partial(faulty, fault="crash", at_step=2, horizon=4),
        faulty,
        functools.partial(faulty, fault="nondeterministic", horizon=4),
        faulty,
    ]
    cfg = AgentLoopConfig(max_turns=4, max_tokens_per_turn=4, max_context=512, sampling=SamplingConfig(1.0))
    out = rollouts(loop, cfg, fns, [0, 1, 2, 3], (1, 2, "s4", "s3"))
    for g in (1, 2, "s4", "s3"):
        traj, eps = out[g]
        assert [e.info.get("failure_kind") for e in eps] == ["crashed", None, "replay_diverged", None], g
        assert np.asarray(traj.num_turns).tolist() == [2, 4, 2, 4], g
    # the noise makes slot 2's text differ between runs; the other episodes are identical
    for g in (2, "s4", "s3"):
        for i in (0, 1, 3):
            a, b = out[1][1][i], out[g][1][i]
            assert (a.tokens, a.rewards, a.end_reason, a.failure) == (b.tokens, b.rewards, b.end_reason, b.failure)


def test_continuous_episode_lost_while_waiting_for_its_decode(loop):
    """Continuous scheduling: slot 2's step is not in flight when slot 0 crashes their
    worker (slot 2's env answered first and it waits for a decode), so the pool reports
    its replay failure unasked; the loop keeps it and makes it that episode's next step
    result, as the turn-synchronous loop does."""
    fns = [
        functools.partial(faulty, fault="crash", at_step=2, horizon=4),
        faulty,
        functools.partial(faulty, fault="nondeterministic", horizon=4),
        faulty,
    ]
    with EnvPool(fns, num_workers=2) as pool:
        pool.send({i: ("reset", i) for i in range(4)})
        while pool.in_flight():
            pool.poll()
        pool.send({0: ("step", "a")})
        assert pool.poll()[0][4]["state_key"] == ("faulty", 0, 1, 97)
        pool.send({0: ("step", "a")})  # crashes worker 0; slot 2 (same worker) is lost
        got = pool.poll()
        assert got[0][4]["failure_kind"] == "crashed" and pool.in_flight() == []
        got.update(pool.poll())  # the restarted worker's replay, still running, reports slot 2
        assert pool.poll() == {}
        assert got[0][4]["failure_kind"] == "crashed"
        assert got[2][4]["failure_kind"] == "replay_diverged"  # reported though nothing was sent
    out = rollouts(
        loop,
        AgentLoopConfig(max_turns=4, max_tokens_per_turn=4, max_context=512, sampling=SamplingConfig(1.0)),
        fns,
        [0, 1, 2, 3],
        ("s4",),
    )
    traj, eps = out["s4"]
    assert [e.info.get("failure_kind") for e in eps] == ["crashed", None, "replay_diverged", None]


def test_send_and_poll_let_a_slow_step_hold_only_its_worker():
    fns = [functools.partial(faulty, fault="hang", at_step=1, hang_s=1.5), faulty, faulty, faulty]
    for workers in (2, 0):
        if workers == 0:
            fns[0] = faulty  # in-process: nothing runs concurrently, so no hang here
        with EnvPool(fns, num_workers=workers, step_timeout=10) as pool:
            assert pool.poll() == {} and pool.in_flight() == []
            pool.send({0: ("reset", 0), 1: ("reset", 1)})
            with pytest.raises(RuntimeError, match="outstanding"):
                pool.submit_step([None] * 4)
            with pytest.raises(RuntimeError, match="poll"):
                pool.collect()
            with pytest.raises(ValueError, match="slot 1 already has a (reset|result not polled) in flight"):
                pool.send({1: ("reset", 1)})
            with pytest.raises(ValueError, match="slot 2 has no episode in progress"):
                pool.send({2: ("step", "a")})
            with pytest.raises(ValueError, match="an op is"):
                pool.send({2: ("expert", None)})
            with pytest.raises(TypeError, match="seed must be an int"):
                pool.send({2: ("reset", "x")})
            got = {}
            while pool.in_flight():
                got.update(pool.poll())
            assert sorted(got) == [0, 1] and got[1][0] == "seed 1 step 0 checksum 1"
            t0 = time.monotonic()
            pool.send({0: ("step", "a"), 1: ("step", "a")})
            pool.send({3: ("reset", 3)})  # while the others step
            got = {}
            while len(got) < 2:
                got.update(pool.poll(timeout=5))
            if workers:  # slot 0 sleeps 1.5 s in worker 0; slots 1 and 3 (worker 1) go on
                assert sorted(got) == [1, 3] and time.monotonic() - t0 < 1.2, (sorted(got), time.monotonic() - t0)
                assert pool.in_flight() == [0]
            got.update(pool.poll())
            assert sorted(got) == [0, 1, 3] and pool.in_flight() == []
            assert (got[0][0], got[1][0]) == ("seed 0 step 1 checksum 97", "seed 1 step 1 checksum 128")
            assert pool.poll(0) == {}
            # the blocking calls work again once nothing is outstanding
            assert pool.step(["b", None, None, None])[0][0].startswith("seed 0 step 2")


def test_pool_handles_and_ready():
    fns = [functools.partial(envs.make, "testing/busy", work=20000)] * 2 + [
        functools.partial(faulty, fault="hang", at_step=1, hang_s=30)
    ]
    with EnvPool(fns, num_workers=2, step_timeout=1.0) as pool:
        h = pool.submit_reset([0, 1, 2])
        assert isinstance(h, PoolCall) and h.kind == "reset"
        pool.collect(h)
        h = pool.submit_step(["a", "b", "c"])
        t0 = time.monotonic()
        assert not pool.ready(h)  # the hang is still running: never blocks
        assert time.monotonic() - t0 < 0.5
        while not pool.ready(h):  # ready() applies the timeout too
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        out = pool.collect(h)
        assert out[2][4]["failure_kind"] == "timeout" and out[0][0].startswith("digest ")
        with pytest.raises(RuntimeError, match="without a submitted"):
            pool.collect(h)
        h2 = pool.submit_step(["a", "b", None])
        with pytest.raises(RuntimeError, match="not the one in flight"):
            pool.collect(h)
        assert pool.collect(h2)[2] is None


def test_bad_pipeline_groups_and_slots():
    with pytest.raises(ValueError, match="pipeline_groups"):
        AgentLoopConfig(pipeline_groups=0)
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        AgentLoopConfig(slots=-1)
    with pytest.raises(ValueError, match="choose one"):
        AgentLoopConfig(slots=4, pipeline_groups=2)


@pytest.mark.slow  # a benchmark's smoke run, as the other benchmarks' are
def test_w7_benchmark_quick(tmp_path):
    out = tmp_path / "w7.jsonl"
    sys.path.insert(0, str(ROOT / "benchmarks"))  # also for the workers, which import its env
    try:
        import w7_overlap

        w7_overlap.main(["--quick", "--out", str(out)])
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["env"], r["pipeline_groups"]) for r in rows] == [
        ("testing/busy", 1),
        ("testing/busy", 2),
        ("latency", 1),
        ("latency", 2),
    ]
    for r in rows:
        assert r["same_trajectories"] and r["max_logp_diff"] < 1e-4
        assert r["all_rollout_s"] == [r["rollout_s"]]  # --quick: one timed repeat
        # the phases partition the rollout, busy + idle device time is the rollout (each
        # figure is rounded to 4 decimals), and the fractions are those of the seconds
        phases = [r[k] for k in ("decode_wait_s", "env_wait_s", "append_s", "dispatch_s", "submit_s", "host_s")]
        assert abs(sum(phases) - r["rollout_s"]) <= 7 * 5e-5 + 1e-9, r
        assert r["host_s"] > 0 and r["env_wait_s"] > 0 and r["decode_wait_s"] > 0, r
        assert abs(r["device_busy_s"] + r["device_idle_s"] - r["rollout_s"]) <= 3 * 5e-5 + 1e-9, r
        assert abs(r["device_idle_frac"] - r["device_idle_s"] / r["rollout_s"]) <= 5e-4 + 1e-9, r
        assert abs(r["device_idle_env_wait_frac"] - r["device_idle_env_wait_s"] / r["rollout_s"]) <= 5e-4 + 1e-9, r
        # the device idles during env waits only for part of them
        assert -1e-4 <= r["device_idle_env_wait_s"] <= r["env_wait_s"] + 1e-4, r
        if r["env"] == "latency":
            # 4 episodes x 2 steps of >= 1 ms sleep on 2 single-threaded workers: >= 4 ms
            # of every rollout, and with one group the loop waits for each step whole
            assert r["rollout_s"] >= 0.004, r
            if r["pipeline_groups"] == 1:
                assert r["env_wait_s"] >= 0.003, r
    # the speedup is of the unrounded one-group time: within 5e-5 / rollout_s, then rounded
    base = {r["env"]: r["rollout_s"] for r in rows if r["pipeline_groups"] == 1}
    for r in rows:
        assert r["speedup_vs_groups_1"] == pytest.approx(
            base[r["env"]] / r["rollout_s"], abs=5e-5 / r["rollout_s"] + 5e-4 + 1e-9
        ), r


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_w9_benchmark_quick_through_the_cli(tmp_path):
    out = tmp_path / "w9.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxagent", "bench", "rollout", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["sync", "groups=2", "slots=4"]
    assert [(r["slots"], r["pipeline_groups"]) for r in rows] == [(0, 1), (0, 2), (4, 1)]
    for r in rows:
        assert r["workload"] == "W9" and r["episodes"] == 8 and r["same_trajectories"], r
        # the workload's shapes, as measured: a 64-token prompt, 16-token observations
        assert (r["prompt_tokens"], r["obs_tokens"]) == (64, 16)
        assert r["episodes_per_s"] == pytest.approx(8 / r["rollout_s"], rel=1e-2)
        assert 0 <= r["device_idle_frac"] <= 1 and r["max_logp_diff"] < 1e-4
    assert rows[0]["speedup_vs_sync"] == 1.0
    assert "decode_rows" in rows[2]["compilations"] and "decode_rows" not in rows[0]["compilations"]
