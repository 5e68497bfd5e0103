"""Fault soak: a training run of 20 iterations through `testing/chaos`, an env that
crashes, hangs, raises, returns garbage, allocates 64 GiB or burns CPU at random (a pure
function of the seed and the actions so far: `envs.testing.chaos_fault`), at least 1,000
times. The run completes; every episode that no fault hit has exactly the transcript of
a fault-free run's; every faulted episode fails with the kind of its fault, at its step,
and is counted in the iteration's `failed_<kind>` metric; nothing is left running.

The learning rate is 0, so both runs sample with the same params: a masked-out failed
episode changes an update by design, so with learning the runs would part after the
first update.

    python -m pytest -q -m slow tests/test_train_fault_soak.py      # ~ 5-10 min on 2 cores
"""

import collections
import json
import os

import psutil
import pytest

from envs.testing import CHAOS_REPORTED_AS, chaos_fault
from jaxagent.dataclass_yaml import load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_countdown_grpo.yaml")
HORIZON = 4
RATE = 0.45
#: the faults' weights: the slow ones (a hang costs the step timeout, a CPU bomb its CPU
#: limit) rarer than the others
KINDS = {"crash": 4, "raise": 4, "garbage": 3, "memory_bomb": 3, "hang": 0.5, "cpu_bomb": 1}


def config(run_dir, rate, iterations):
    return load_config(
        TrainerConfig,
        CONFIG,
        [
            f"run_dir={run_dir}",
            f"iterations={iterations}",
            "env.name=testing/chaos",
            f"env.kwargs={{fault_rate: {rate}, horizon: {HORIZON}, hang_s: 30, kinds: {KINDS}}}".replace("'", ""),
            "env.group_size=4",
            "env.tasks_per_iteration=16",
            "env.num_workers=2",
            "env.step_timeout=4.0",
            "env.worker_memory_mb=2048",
            "env.worker_cpu_s=1",
            "env.max_failed_iterations=0",
            f"rollout.max_turns={HORIZON + 1}",
            "rollout.max_tokens_per_turn=6",
            "rollout.max_context=256",
            "optim.lr=0.0",
            "update.mini_batches=1",
            "checkpoint_every=100",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )


def play(run_dir, rate, iterations):
    """(per-iteration metrics, per-iteration episodes) of a run driven iteration by iteration."""
    trainer = Trainer(config(run_dir, rate, iterations), log=lambda *_: None)
    episodes, history = [], []
    with trainer.source.open_pools(len(trainer.placement.rows)) as pools:
        pool = pools.train
        loop = trainer.episode_loop()
        for _ in range(iterations):
            history.append(trainer.iteration_step(loop, pool))
            episodes.append(trainer.last_episodes)
    return history, episodes


def transcript(ep):
    return (ep.tokens, ep.actions, ep.observations, ep.rewards, ep.done, ep.truncated)


def injected(ep):
    """(step, kind) of the first fault `chaos_fault` puts in this episode's actions, or None."""
    checksum = ep.seed
    for step, action in enumerate(ep.actions, 1):
        kind = chaos_fault(ep.seed, checksum, step, RATE, KINDS)
        if kind is not None:
            return step, kind
        for ch in action:
            checksum = (checksum * 31 + ord(ch)) % 1_000_003
    return None


def soak(tmp_path, iterations):
    """Runs the soak and the fault-free run; checks every episode; returns (faults,
    healthy episodes, failures counted by kind in the metrics, the soak's metrics)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    soak, soak_eps = play(tmp_path / "soak", RATE, iterations)
    clean, clean_eps = play(tmp_path / "clean", 0.0, iterations)
    counted, faults, healthy = collections.Counter(), 0, 0
    for i, (m, eps, ref_eps) in enumerate(zip(soak, soak_eps, clean_eps, strict=True)):
        for k in CHAOS_REPORTED_AS.values():
            counted[k] += m.get(f"failed_{k}", 0)
        assert m["failed_episodes"] == sum(m.get(f"failed_{k}", 0) for k in CHAOS_REPORTED_AS.values())
        for ep, ref in zip(eps, ref_eps, strict=True):
            assert ep.seed == ref.seed
            if not ep.failed:
                assert transcript(ep) == transcript(ref), (i, ep.seed)
                healthy += 1
                continue
            faults += 1
            # the fault free run took the same actions up to the faulted step, which failed
            # with the kind of its fault
            step, kind = injected(ref)
            assert ep.actions == ref.actions[:step], (i, ep.seed)
            # a CPU bomb on a loaded machine may reach the wall-clock timeout before its CPU limit
            want = {"cpu_limit", "timeout"} if kind == "cpu_bomb" else {CHAOS_REPORTED_AS[kind]}
            assert ep.failure_kind in want, (i, ep.seed, kind, ep.failure_kind, ep.failure)
    assert all(m["failed_episodes"] == 0 for m in clean)
    # nothing left running: the pools' workers are gone
    left = [
        p.cmdline()
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before
        and p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(p.cmdline())
    ]  # multiprocessing's own helper
    assert not left, left
    return faults, healthy, counted, soak


@pytest.mark.slow
def test_fault_soak_twenty_iterations_a_thousand_faults(tmp_path):
    faults, healthy, counted, metrics = soak(tmp_path, 20)
    print(
        json.dumps(
            {
                "iterations": len(metrics),
                "faults": faults,
                "healthy_episodes": healthy,
                "failed_by_kind": dict(counted),
                "seconds": round(sum(m["time_iteration_s"] for m in metrics), 1),
            }
        )
    )  # shown with -s
    assert len(metrics) == 20
    assert faults >= 1000 and healthy >= 50, (faults, healthy)
    assert sum(counted.values()) == faults and all(counted[k] > 0 for k in CHAOS_REPORTED_AS.values()), counted
