"""Orbax checkpoints of the TrainState: exact round trip, keep-N, atomic under SIGKILL,
incompatible restores, Hugging Face export."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_testlib import host

from jaxagent import models as M
from jaxagent.train.config.step import OptimizerConfig, StepConfig
from jaxagent.train.rundir.checkpoint import CheckpointManager, IncompatibleCheckpointError, export_policy
from jaxagent.train.update.state import init_train_state

CFG = M.DecoderConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    model_type="llama",
)
STEP_CFG = StepConfig(optim=OptimizerConfig(lr=1e-3, weight_decay=0.01))
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def make_state(k: int = 0, cfg=CFG, critic=True, lora=None):
    """A deterministic state that differs in every leaf for every k (no compilation)."""
    params = M.init_params(jax.random.key(0), cfg, std=0.1)
    critic_params = M.value_params_from_policy(jax.random.key(1), params, cfg) if critic else None
    if lora is not None:
        params, cfg = M.add_lora(jax.random.key(2), params, cfg, lora)
    state = init_train_state(
        jax.random.key(100 + k),
        params,
        cfg,
        STEP_CFG,
        critic_params=critic_params,
        critic_config=cfg if critic else None,
    )

    def bump(x):
        return x + jnp.asarray(0.001 * (k + 1), x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x + k

    return state.replace(
        params=jax.tree.map(bump, state.params),
        opt_state=jax.tree.map(bump, state.opt_state),
        critic_params=jax.tree.map(bump, state.critic_params),
        critic_opt_state=jax.tree.map(bump, state.critic_opt_state),
        step=jnp.asarray(k, jnp.int32),
        skipped=jnp.asarray(k % 3, jnp.int32),
    )


def assert_bitwise_equal(a, b):
    ha, hb = host(a), host(b)
    assert jax.tree.structure(ha) == jax.tree.structure(hb)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ha), jax.tree.leaves(hb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8), err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("lora", [None, M.LoraConfig(rank=2, targets=("q_proj", "up_proj"))], ids=["full", "lora"])
def test_round_trip_is_bitwise_and_keeps_extras(tmp_path, lora):
    state = make_state(3, lora=lora, critic=lora is None)
    extras = {
        "task_position": 17,
        "seed_stream": [1, 2, 3],
        "history": [{"reward": 0.5, "kl": 1e-3}],
        "config": {"algo": "ppo", "lr": 1e-3},
    }
    with CheckpointManager(tmp_path / "ckpt") as ck:
        ck.save(3, state, extras)
    with CheckpointManager(tmp_path / "ckpt") as ck:  # a fresh process would do this
        assert ck.all_steps() == [3]
        restored, got = ck.restore(make_state(0, lora=lora, critic=lora is None))
    assert got == extras
    assert_bitwise_equal(restored, state)
    assert jnp.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    assert restored.model_config == state.model_config
    # the restored key draws the same numbers
    np.testing.assert_array_equal(jax.random.uniform(restored.rng, (4,)), jax.random.uniform(state.rng, (4,)))


def test_keep_n_and_step_selection(tmp_path):
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1 if x.dtype != jnp.int32 else x, s), donate_argnums=0)
    with CheckpointManager(tmp_path, max_to_keep=2) as ck:
        for k in range(4):
            state = make_state(k)
            ck.save(10 * k, state, {"k": k})
            bump(state.params)  # donated at once, as the training loop does: the async save is unaffected
        ck.wait_until_finished()
        # the 2 newest, and step 0 (the warm-started policy), which keep-N never deletes
        assert ck.all_steps() == [0, 20, 30] and ck.latest_step() == 30
        restored, extras = ck.restore(make_state(0), step=20)
        assert extras == {"k": 2}
        assert_bitwise_equal(restored, make_state(2))
        restored, extras = ck.restore(make_state(1), step=0)
        assert extras == {"k": 0}
        assert_bitwise_equal(restored, make_state(0))
        with pytest.raises(FileNotFoundError, match="committed steps"):
            ck.restore(make_state(0), step=10)
        with pytest.raises(FileExistsError, match="30"):
            ck.save(30, make_state(0))
        with pytest.raises(TypeError, match="JSON"):
            ck.save(40, make_state(0), {"bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["0", "20", "30"]


def test_restore_with_incompatible_config_names_the_fields(tmp_path):
    with CheckpointManager(tmp_path) as ck:
        ck.save(1, make_state(1))
        ck.wait_until_finished()
        wider = CFG.replace(hidden_size=48, intermediate_size=96)
        with pytest.raises(IncompatibleCheckpointError) as e:
            ck.restore(make_state(0, cfg=wider))
        msg = str(e.value)
        assert "model_config.hidden_size: checkpoint 32, this run 48" in msg
        assert "model_config.intermediate_size" in msg and "['embed']['embedding']" in msg
        with pytest.raises(IncompatibleCheckpointError, match=r"critic_config: checkpoint has one"):
            ck.restore(make_state(0, critic=False))
        with pytest.raises(IncompatibleCheckpointError, match=r"model_config.lora[\s\S]*opt_state"):
            ck.restore(make_state(0, lora=M.LoraConfig(rank=2)))
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        CheckpointManager(tmp_path / "empty").restore(make_state(0))


_CHILD = r"""
import os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {tests!r})
import test_train_checkpoint as t
from jaxagent.train.rundir.checkpoint import CheckpointManager
from orbax.checkpoint._src.path import async_path

directory, marker, mode = sys.argv[1], sys.argv[2], sys.argv[3]
ck = CheckpointManager(directory, max_to_keep=10)
ck.save(1, t.make_state(1), {{"k": 1}})
ck.wait_until_finished()
if mode == "at_commit":
    async def stuck(src, dst):  # everything written, the commit rename not yet done
        open(marker, "w").write(str(src))
        time.sleep(600)
    async_path.rename = stuck
    ck.save(2, t.make_state(2), {{"k": 2}})
    time.sleep(600)
else:  # keep saving until killed at an arbitrary moment
    open(marker, "w").write("go")
    k = 2
    while True:
        ck.save(k, t.make_state(k), {{"k": k}})
        k += 1
"""


def _run_and_kill(tmp_path, mode, delay=0.0):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(TESTS)))
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt), str(marker), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 120
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"child exited early:\n{proc.stdout.read().decode()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError("child never reached the save")
            time.sleep(0.05)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return ckpt


def test_sigkill_mid_save_leaves_the_previous_checkpoint_restorable(tmp_path):
    ckpt = _run_and_kill(tmp_path, "at_commit")
    leftovers = [p.name for p in ckpt.iterdir() if p.name != "1"]
    assert any("tmp" in name for name in leftovers), leftovers  # the half-finished step 2
    with CheckpointManager(ckpt) as ck:
        assert ck.all_steps() == [1]
        restored, extras = ck.restore(make_state(0))
        assert extras == {"k": 1}
        assert_bitwise_equal(restored, make_state(1))
        assert not any("tmp" in p.name for p in ckpt.iterdir())  # cleaned up on open
        ck.save(2, make_state(2), {"k": 2})  # and the run goes on
    with CheckpointManager(ckpt) as ck:
        assert ck.all_steps() == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.5])
def test_sigkill_at_an_arbitrary_moment_of_repeated_saves(tmp_path, delay):
    ckpt = _run_and_kill(tmp_path, "loop", delay)
    with CheckpointManager(ckpt) as ck:
        latest = ck.latest_step()
        restored, extras = ck.restore(make_state(0))
    assert extras == {"k": latest}
    assert_bitwise_equal(restored, make_state(latest))


def test_export_policy_merges_lora_into_a_hugging_face_directory(tmp_path):
    lora = M.LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    state = make_state(1, lora=lora, critic=False)
    out = export_policy(state, tmp_path / "hf")
    assert (out / "config.json").exists()
    loaded = M.load_pretrained(out)
    merged, merged_cfg = M.merge_lora(state.params, state.model_config)
    assert loaded.config.lora is None and loaded.config.hidden_size == merged_cfg.hidden_size
    for a, b in zip(jax.tree.leaves(host(loaded.params)), jax.tree.leaves(host(merged)), strict=True):
        np.testing.assert_array_equal(a, b)
