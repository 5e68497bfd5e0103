"""Overlap of env stepping with device decoding: the pool's non-blocking calls and the
agent loop's pipelined sub-batches (`AgentLoopConfig.pipeline_groups`).

The reference for a pipelined rollout is the same rollout with one group: every token,
action, observation, reward, end and failure must be equal (log-probs to float32
rounding, since XLA:CPU's per-row results may differ in the last bits with the batch
shape), with fault-free envs, with envs that fail in every way the pool reports, and
with episodes that end early.
"""
import dataclasses
import functools
import json
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
from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig
from jaxagent.models import tiny_config
from jaxagent.rollout.byte_tokenizer import byte_chat_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK = byte_chat_tokenizer()
CFG = tiny_config(vocab_size=len(TOK))
faulty = functools.partial(envs.make, "testing/faulty")

TRAJ_EXACT = ("tokens", "attention_mask", "loss_mask", "turn_ids", "rewards", "group_ids", "turn_rewards",
              "turn_mask", "anchor_ids", "episode_return", "lengths", "num_turns", "done", "truncated", "failed")
EP_EXACT = ("index", "seed", "group_id", "tokens", "loss_mask", "turn_ids", "segments", "rewards", "state_keys",
            "actions", "observations", "finish_reasons", "done", "truncated", "failed", "end_reason", "failure",
            "system_prompt", "state_key", "info")


@pytest.fixture(scope="module")
def loop():
    """One loop (one sampler: compilations shared); tests set `loop.config`."""
    return AgentLoop(M.init_params(jax.random.key(0), CFG, std=0.3), CFG, TOK,
                     AgentLoopConfig(max_context=512))


def rollouts(loop, cfg, env_fns, seeds, groups, num_workers=2, **pool_kw):
    """The same rollout with each `pipeline_groups` in `groups`, each in a fresh pool."""
    out = {}
    for g in groups:
        loop.config = dataclasses.replace(cfg, pipeline_groups=g)
        with EnvPool(env_fns, num_workers=num_workers, **pool_kw) as pool:
            out[g] = loop.run(pool, seeds)
    return out


def assert_same(a, b):
    (ta, ea), (tb, eb) = a, b
    for f in TRAJ_EXACT:
        np.testing.assert_array_equal(np.asarray(getattr(ta, f)), np.asarray(getattr(tb, f)), err_msg=f)
    np.testing.assert_allclose(np.asarray(ta.rollout_logp), np.asarray(tb.rollout_logp), rtol=1e-5, atol=1e-5)
    assert len(ea) == len(eb)
    for x, y in zip(ea, eb):
        for f in EP_EXACT:
            assert getattr(x, f) == getattr(y, f), (x.index, f)
        np.testing.assert_allclose(x.logp, y.logp, rtol=1e-5, atol=1e-5)


def test_fault_free_and_early_ending_episodes_are_identical(loop):
    # horizons 1..8: episodes end at different turns, so sub-batches shrink and one
    # sub-batch can leave the pipeline before the other
    horizons = [1, 5, 2, 8, 3, 1, 6, 4, 2, 7]
    fns = [functools.partial(envs.make, "testing/faulty", horizon=h) for h in horizons]
    cfg = AgentLoopConfig(max_turns=6, max_tokens_per_turn=5, max_context=512, sampling=SamplingConfig(1.0), seed=3)
    out = rollouts(loop, cfg, fns, list(range(10)), (1, 2, 3))
    assert_same(out[1], out[2])
    assert_same(out[1], out[3])
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


def test_frozenlake_greedy_and_context_limit_are_identical(loop):
    # a short context: some episodes end by "context_full" (actions cut, never sent)
    cfg = AgentLoopConfig(max_turns=4, max_tokens_per_turn=8, max_context=330, sampling=SamplingConfig(0.0))
    out = rollouts(loop, cfg, ["frozenlake"] * 5, [3, 4, 3, 5, 6], (1, 2), num_workers=1)
    assert_same(out[1], out[2])
    cfg = dataclasses.replace(cfg, sampling=SamplingConfig(0.7), seed=9, max_context=512)
    out = rollouts(loop, cfg, ["frozenlake"] * 5, [3, 4, 3, 5, 6], (1, 2))
    assert_same(out[1], out[2])


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
    out = rollouts(loop, cfg, fns, list(range(10)), (1, 2), step_timeout=1.5)
    assert_same(out[1], out[2])
    _, eps = out[2]
    kinds = [e.info.get("failure_kind") for e in eps]
    assert kinds == ["crash", None, "exception", "invalid_result", "timeout", "crash", "unpicklable", None,
                     None, "invalid_result"]
    assert eps[7].end_reason == "env_failed" and eps[7].tokens == []  # failed at reset
    assert [eps[i].end_reason for i in (1, 8)] == ["terminated"] * 2


def test_episode_lost_while_another_sub_batch_steps(loop):
    """Slot 0 (sub-batch A) crashes its worker; slot 2 (sub-batch B, same worker) is not
    deterministic, so its replay into the new worker diverges while A steps: the pool
    reports it in A's call and the loop ends B's episode at its own next step, as the
    one-group rollout does."""
    fns = [functools.partial(faulty, fault="crash", at_step=2, horizon=4), faulty,
           functools.partial(faulty, fault="nondeterministic", horizon=4), faulty]
    cfg = AgentLoopConfig(max_turns=4, max_tokens_per_turn=4, max_context=512, sampling=SamplingConfig(1.0))
    out = rollouts(loop, cfg, fns, [0, 1, 2, 3], (1, 2))
    for g in (1, 2):
        traj, eps = out[g]
        assert [e.info.get("failure_kind") for e in eps] == ["crash", None, "replay_diverged", None]
        assert np.asarray(traj.num_turns).tolist() == [2, 4, 2, 4]
    # the noise makes slot 2's text differ between runs; the other episodes are identical
    for i in (0, 1, 3):
        a, b = out[1][1][i], out[2][1][i]
        assert (a.tokens, a.rewards, a.end_reason, a.failure) == (b.tokens, b.rewards, b.end_reason, b.failure)


def test_pool_handles_and_ready():
    fns = [functools.partial(envs.make, "testing/busy", work=20000)] * 2 + [
        functools.partial(faulty, fault="hang", at_step=1, hang_s=30)]
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


def test_bad_pipeline_groups():
    with pytest.raises(ValueError, match="pipeline_groups"):
        AgentLoopConfig(pipeline_groups=0)


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
        ("testing/busy", 1), ("testing/busy", 2), ("latency", 1), ("latency", 2)]
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
        assert r["speedup_vs_groups_1"] == pytest.approx(base[r["env"]] / r["rollout_s"],
                                                         abs=5e-5 / r["rollout_s"] + 5e-4 + 1e-9), r
