"""Mixed precision (`model.compute_dtype: bfloat16` on float32 params): the passes run in
bfloat16 on a cast copy, the master weights and AdamW state stay float32, and updates
too small for a bfloat16 weight are kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.update import train_step
from jaxagent.train.update.batch import UpdateBatch
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
B, T = 4, 10


def bf16_exact_params():
    """float32 params whose values are bfloat16 numbers (so a cast loses nothing)."""
    p = M.init_params(jax.random.key(0), CFG, std=0.2)
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), p)


def batch():
    r = np.random.RandomState(0)
    mask = (r.rand(B, T) < 0.7).astype(np.float32)
    mask[:, 0] = 0
    return UpdateBatch(
        tokens=jnp.asarray(r.randint(0, 64, (B, T)), jnp.int32),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(r.randn(B, T), jnp.float32),
        old_logp=jnp.full((B, T), -4.1, jnp.float32),
        attention_mask=jnp.ones((B, T), jnp.int32),
    )


def step(compute_dtype, lr=1e-3, *, bf16_weights=False):
    """(params before, state after, metrics) of one update from `bf16_exact_params` (the
    step donates its input state, so the params before are a host copy)."""
    params = bf16_exact_params()
    if bf16_weights:
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    sc = StepConfig(
        loss=LossConfig(policy_loss="ppo"),
        optim=OptimizerConfig(lr=lr, max_grad_norm=None),
        compute_dtype=compute_dtype,
    )
    state = init_train_state(jax.random.key(1), params, CFG, sc)
    before = jax.tree.map(np.asarray, state.params)
    new, metrics = train_step(state, batch(), sc)
    return before, new, metrics


def leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_the_passes_run_in_bfloat16_and_the_masters_and_optimizer_state_stay_float32():
    _, mixed, m_mixed = step("bfloat16")
    _, _, m_bf16 = step(None, bf16_weights=True)
    _, _, m_f32 = step(None)
    # the forward pass is the bfloat16 model's: the same loss as bfloat16 weights, bit for bit
    assert float(m_mixed["loss"]) == float(m_bf16["loss"])
    assert float(m_mixed["loss"]) != float(m_f32["loss"])  # so not silently float32
    assert float(m_mixed["loss"]) == pytest.approx(float(m_f32["loss"]), rel=2e-2, abs=2e-3)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(mixed.params))
    assert all(
        x.dtype == jnp.float32 for x in jax.tree.leaves(mixed.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)
    )


def test_the_gradient_is_the_float32_one_up_to_bfloat16_rounding():
    s_mixed, mixed, _ = step("bfloat16")
    s_f32, full, _ = step(None)
    # with AdamW's first step the update is about -lr * sign(g): compare the moved directions
    d_mixed = np.concatenate([(a - b).ravel() for a, b in zip(leaves(mixed.params), leaves(s_mixed), strict=True)])
    d_f32 = np.concatenate([(a - b).ravel() for a, b in zip(leaves(full.params), leaves(s_f32), strict=True)])
    moved = np.abs(d_f32) > 1e-6
    assert np.mean(np.sign(d_mixed[moved]) == np.sign(d_f32[moved])) > 0.9
    mu_mixed = np.concatenate([x.ravel() for x in leaves(mixed.opt_state[0].mu)])
    mu_f32 = np.concatenate([x.ravel() for x in leaves(full.opt_state[0].mu)])  # (1 - b1) * g
    cos = mu_mixed @ mu_f32 / (np.linalg.norm(mu_mixed) * np.linalg.norm(mu_f32))
    assert cos > 0.99


def test_float32_masters_keep_updates_that_bfloat16_weights_round_away():
    lr = 1e-5  # far below a bfloat16 weight's spacing (2^-8 relative): 0.2 * 2^-8 ~ 8e-4
    s_mixed, mixed, _ = step("bfloat16", lr=lr)
    s_bf16, bf16, _ = step(None, lr=lr, bf16_weights=True)

    def changed(new, old):
        return np.mean([np.mean(a != b) for a, b in zip(leaves(new.params), leaves(old), strict=True)])

    assert changed(mixed, s_mixed) > 0.5  # the float32 masters moved
    assert changed(bf16, s_bf16) < 0.1  # the bfloat16 weights mostly did not


def test_compute_dtype_is_checked():
    from jaxagent.dataclass_yaml import ConfigError, load_config
    from jaxagent.train.config import TrainerConfig

    with pytest.raises(ValueError, match="compute_dtype must be None, 'float32' or 'bfloat16'"):
        StepConfig(compute_dtype="float16")
    with pytest.raises(ConfigError, match="compute_dtype must be null, 'float32' or 'bfloat16'"):
        load_config(TrainerConfig, None, ["model.compute_dtype=fp8"])
    cfg = load_config(TrainerConfig, None, ["model.compute_dtype=bfloat16"])
    assert cfg.step_config.compute_dtype == "bfloat16"


@pytest.mark.slow  # a whole run, ~15 s on 2 idle cores (the suite's 15-minute budget)
def test_a_mixed_precision_run_samples_and_trains_in_bfloat16_and_saves_float32(tmp_path):
    from pathlib import Path

    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    lines = []
    cfg = load_config(
        TrainerConfig,
        root / "configs" / "tiny_frozenlake_gigpo.yaml",
        [f"run_dir={tmp_path / 'run'}", "iterations=1", "eval.episodes=0", "model.compute_dtype=bfloat16"],
    )
    trainer = Trainer(cfg, log=lines.append)
    trainer.run()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.state.params))
    sampler = trainer.placement.sampler_params(trainer.state)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(sampler) if jnp.issubdtype(x.dtype, jnp.floating))
    m = trainer.history[-1]
    # the trainer's bfloat16 log-probs against the bfloat16 sampler's: the same policy
    assert m["rollout_logp_gap"] < 0.05
    memory_line = next(x for x in lines if x.startswith("memory per device"))
    assert "compute_params" in memory_line
