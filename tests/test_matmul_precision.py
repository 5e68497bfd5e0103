"""Explicit matmul precision (`model.matmul_precision`): "auto" runs float32 matmuls at
"highest" on GPUs and TPUs (whose default passes compute them in TF32 or bfloat16) and
leaves the CPU's default; the precision reaches the lowered programs. An accelerator run
in float32 that the config did not ask for is warned about, and the GPU recipe sets the
accelerator defaults."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxagent import CODE_PATHS_ENV
from jaxagent import models as M
from jaxagent.dataclass_yaml import load_config
from jaxagent.train import build
from jaxagent.train.config import TrainerConfig
from jaxagent.train.placement import _policy_logprobs


@pytest.mark.parametrize(
    "setting, compute, platform, want",
    [
        ("auto", None, "gpu", "highest"),
        ("auto", None, "tpu", "highest"),
        ("auto", None, "cpu", None),
        ("auto", "bfloat16", "gpu", None),
        ("default", None, "gpu", "default"),
        ("high", None, "cpu", "high"),
    ],
)
def test_auto_is_highest_for_float32_on_accelerators(setting, compute, platform, want):
    cfg = load_config(
        TrainerConfig, None, [f"model.matmul_precision={setting}", f"model.compute_dtype={compute or 'null'}"]
    )
    assert cfg.model.resolved_matmul_precision(platform) == want


def test_a_bad_precision_is_a_config_error():
    with pytest.raises(ValueError, match="matmul_precision must be one of auto, default, high, highest"):
        load_config(TrainerConfig, None, ["model.matmul_precision=tf32"])


def _lowered_text() -> str:
    cfg = M.tiny_config()
    params = jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg))
    t = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    return (
        jax.jit(lambda p, x, m: _policy_logprobs(p, cfg, x, m, temperature=1.0, seq_chunk=16, vocab_chunk=512))
        .lower(params, t, t)
        .as_text()
    )


def test_the_precision_reaches_the_lowered_program(monkeypatch):
    """As a GPU run would set it (`JAXAGENT_CODE_PATHS=gpu`): every matmul of the
    log-prob pass is lowered at HIGHEST; on the CPU's paths nothing is set."""
    cfg = load_config(TrainerConfig, None, [])
    before = jax.config.jax_default_matmul_precision
    try:
        assert build.matmul_precision(cfg) is None
        assert "HIGHEST" not in _lowered_text()
        monkeypatch.setenv(CODE_PATHS_ENV, "gpu")
        assert build.matmul_precision(cfg) == "highest"
        text = _lowered_text()
        dots = text.count("stablehlo.dot_general")
        assert dots > 0 and text.count("precision = [HIGHEST, HIGHEST]") == dots, text.count("HIGHEST")
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.parametrize(
    "paths, overrides, fires",
    [
        ("gpu", [], True),
        ("tpu", [], True),
        ("cpu", [], False),
        ("gpu", ["model.compute_dtype=bfloat16"], False),
        ("gpu", ["model.compute_dtype=float32"], False),
        ("gpu", ["model.matmul_precision=highest"], False),
        ("tpu", ["model.matmul_precision=default"], False),
        ("gpu", ["model.dtype=bfloat16"], False),
    ],
)
def test_an_accelerator_run_in_float32_by_default_is_warned(monkeypatch, paths, overrides, fires):
    """On a GPU or TPU (`JAXAGENT_CODE_PATHS` stands in for one) the float32 defaults
    warn, naming the cost and the keys; a config that chose its dtype or precision, or
    a CPU run, does not."""
    monkeypatch.setenv(CODE_PATHS_ENV, paths)
    warning = build.precision_warning(load_config(TrainerConfig, None, overrides))
    if not fires:
        assert warning is None
        return
    assert warning.startswith(f"warning: this {paths} run computes in float32")
    for said in (
        "twice the memory",
        "KV cache",
        "model.compute_dtype: bfloat16",
        "float32 master weights",
        "model.matmul_precision",
        "configs/gpu_countdown_grpo.yaml",
    ):
        assert said in warning, said


def test_the_gpu_recipe_sets_the_accelerator_defaults(monkeypatch):
    """float32 master weights, bfloat16 compute (so the sampler's params and its KV cache
    are bfloat16: `Placement.sampler_params` casts to `compute_dtype`), an explicit
    precision; no warning on a GPU."""
    path = Path(__file__).resolve().parents[1] / "configs" / "gpu_countdown_grpo.yaml"
    cfg = load_config(TrainerConfig, path)
    assert (cfg.model.dtype, cfg.model.compute_dtype) == ("float32", "bfloat16")
    assert cfg.model.matmul_precision != "auto"
    assert cfg.step_config.compute_dtype == "bfloat16"
    monkeypatch.setenv(CODE_PATHS_ENV, "gpu")
    assert build.precision_warning(cfg) is None
