"""The accelerator paths lowered for GPU and TPU on a machine without either
(`jax.export` for platforms "cuda" and "tpu"): the sampler's prefill (its append) and
its decode loop on the layer scan (what an accelerator runs; the CPU unrolls the
layers), the log-prob pass, and the train step plain, with LoRA, with remat, and
trimmed (its three programs). Exporting runs each primitive's lowering rule for each
platform and refuses custom calls without a compatibility guarantee, so a program with
a CPU-only piece (an FFI kernel built for the CPU) fails here, as the native GAE kernel
does below. Shapes are Qwen2.5-0.5B's,
abstract: nothing is allocated and nothing compiled.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxagent import models as M
from jaxagent.rollout.kernels import SamplerState, append_kernel, decode_kernel
from jaxagent.rollout.sampling import SamplingConfig
from jaxagent.train.config.step import StepConfig
from jaxagent.train.placement import _policy_logprobs
from jaxagent.train.update import train_step
from jaxagent.train.update.batch import UpdateBatch
from jaxagent.train.update.state import init_train_state
from jaxagent.train.update.trimmed import _micro_add, _trimmed_finish, _trimmed_prepare

PLATFORMS = ("cuda", "tpu")
#: Qwen2.5-0.5B's layer shapes (24 layers, GQA 14 / 2 heads, a 151,936-token vocabulary)
QWEN = M.DecoderConfig(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    qkv_bias=True,
    tie_word_embeddings=True,
    model_type="qwen2",
)
B, T, S = 8, 512, 2048


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def abstract_params(cfg, dtype="bfloat16"):
    return jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg, dtype=dtype))


def exported(fn, *args, **kwargs):
    exp = export.export(jax.jit(fn), platforms=PLATFORMS)(*args, **kwargs)
    assert exp.platforms == PLATFORMS
    return exp


def sampler_state(cfg, rows, dtype=jnp.bfloat16):
    cache = jax.eval_shape(lambda: M.init_cache(cfg, rows, S, dtype))
    return SamplerState(
        cache=cache,
        next_logits_BxV=sds((rows, cfg.vocab_size), jnp.float32),
        keys_B=jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows)),
    )


def test_the_prefill_exports_for_gpu_and_tpu():
    params, state = abstract_params(QWEN), sampler_state(QWEN, B)
    exp = exported(
        lambda p, s, t, m: append_kernel(p, QWEN, s, t, m),
        params,
        state,
        sds((B, T), jnp.int32),
        sds((B, T), jnp.int32),
    )
    assert exp.out_avals[0].shape == state.cache.k.shape


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)], ids=["sampled", "greedy"]
)
def test_the_decode_loop_on_the_layer_scan_exports_for_gpu_and_tpu(sampling):
    params, state = abstract_params(QWEN), sampler_state(QWEN, B)
    matmuls = {}
    for unroll in (False, True):

        def decode(p, s, active, max_new, stop_tokens, stop_seqs, unroll=unroll):
            return decode_kernel(
                p,
                QWEN,
                s,
                active,
                max_new,
                stop_tokens,
                stop_seqs,
                sampling=sampling,
                max_new_tokens=64,
                window_segments=3,
                unroll_layers=unroll,
            )

        exp = exported(
            decode,
            params,
            state,
            sds((B,), jnp.bool_),
            sds((B,), jnp.int32),
            sds((B, 2), jnp.int32),
            sds((B, 1, 4), jnp.int32),
        )
        matmuls[unroll] = exp.mlir_module().count("dot_general")
    # the layer scan holds one layer's matmuls per window segment; the unrolled loop (the
    # CPU's) holds all 24 layers' in each
    assert matmuls[False] * 10 < matmuls[True], matmuls


def test_the_log_prob_pass_exports_for_gpu_and_tpu():
    params = abstract_params(QWEN)
    exp = exported(
        lambda p, t, m: _policy_logprobs(
            p, QWEN, t, m, temperature=1.0, seq_chunk=256, vocab_chunk=32768, row_chunks=2, compute_dtype="bfloat16"
        ),
        params,
        sds((B, T), jnp.int32),
        sds((B, T), jnp.int32),
    )
    assert exp.out_avals[0].shape == (B, T)


def _update_batch(rows, length):
    f, i = sds((rows, length), jnp.float32), sds((rows, length), jnp.int32)
    return UpdateBatch(tokens=i, loss_mask=f, advantages=f, old_logp=f, attention_mask=i)


@pytest.mark.parametrize("variant", ["plain", "lora", "remat"])
def test_the_train_step_exports_for_gpu_and_tpu(variant):
    cfg = QWEN
    params = abstract_params(cfg, "float32")
    if variant == "lora":
        lora = M.LoraConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"))
        params, cfg = (
            jax.eval_shape(lambda p: M.add_lora(jax.random.key(1), p, cfg, lora)[0], params),
            cfg.replace(lora=lora),
        )
    sc = StepConfig(num_micro_batches=2, remat=variant == "remat", compute_dtype="bfloat16")
    state = jax.eval_shape(lambda p: init_train_state(jax.random.key(2), p, cfg, sc), params)
    exp = export.export(train_step, platforms=PLATFORMS)(state, _update_batch(4, T), config=sc)
    assert exp.platforms == PLATFORMS


def test_the_trimmed_train_step_exports_for_gpu_and_tpu():
    """`TrimmedTrainStep`'s three programs: the mini-batch's denominators, a run of
    micro-batches cut to a shorter length, the optimizer step."""
    sc = StepConfig(num_micro_batches=2, compute_dtype="bfloat16")
    params = abstract_params(QWEN, "float32")
    state = jax.eval_shape(lambda p: init_train_state(jax.random.key(2), p, QWEN, sc), params)
    batch = _update_batch(4, T)
    export.export(jax.jit(lambda s, b: _trimmed_prepare(s, b, rows=2, config=sc)), platforms=PLATFORMS)(state, batch)
    denominators, has_signal, acc = jax.eval_shape(lambda s, b: _trimmed_prepare(s, b, rows=2, config=sc), state, batch)
    short = _update_batch(4, T // 4)
    export.export(jax.jit(lambda s, b, d, a: _micro_add(s, b, d, a, n=2, config=sc)), platforms=PLATFORMS)(
        state, short, denominators, acc
    )
    export.export(jax.jit(lambda s, a, d, h: _trimmed_finish(s, a, d, h, config=sc)), platforms=PLATFORMS)(
        state, acc, denominators, has_signal
    )


def test_a_cpu_only_kernel_does_not_export_for_gpu():
    """The check can fail: GAE's native kernel, an FFI call built for the CPU only, is
    refused (export takes no custom call without a compatibility guarantee), so a
    program that reached it on an accelerator path would fail above."""
    from jaxagent.algos import _native
    from jaxagent.algos.advantages import _gae_native

    if not _native.available():
        pytest.skip("the native GAE kernel is not built here (no C++ compiler)")
    x = sds((4, 16), jnp.float32)
    with pytest.raises(ValueError, match="custom call"):
        export.export(jax.jit(lambda r, v, m: _gae_native(r, v, m, 0.99, 0.95, True)), platforms=("cuda",))(x, x, x)


# ------------------------------------------------------------------ the accelerator paths on the CPU
def test_the_code_paths_override_takes_the_accelerator_branches_on_the_cpu(monkeypatch):
    """`JAXAGENT_CODE_PATHS=gpu`: the sampler decodes on the layer scan and GAE skips the
    CPU's native kernel, here on the CPU (with the same results: GAE's scan method)."""
    import numpy as np

    from jaxagent import CODE_PATHS_ENV, code_platform
    from jaxagent.algos import advantages
    from jaxagent.rollout.kernels import unroll_layers_default

    assert code_platform() == "cpu" and unroll_layers_default()
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(3, 12)).astype(np.float32), rng.normal(size=(3, 12)).astype(np.float32)
    m = (rng.random((3, 12)) < 0.8).astype(np.float32)
    if advantages._native.available():  # on the CPU's paths "auto" takes the native kernel
        calls, native = [], advantages._gae_native
        monkeypatch.setattr(advantages, "_gae_native", lambda *a, **k: calls.append(1) or native(*a, **k))
        advantages.gae(r, v, m, gamma=0.99, lam=0.95)
        assert calls
    monkeypatch.setenv(CODE_PATHS_ENV, "gpu")
    assert code_platform() == "gpu" and not unroll_layers_default()
    monkeypatch.setattr(advantages, "_gae_native", lambda *a, **k: pytest.fail("the native kernel ran"))
    got = advantages.gae(r, v, m, gamma=0.99, lam=0.95)
    want = advantages.gae(r, v, m, gamma=0.99, lam=0.95, method="scan")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setenv(CODE_PATHS_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{CODE_PATHS_ENV}='cuda': expected one of cpu, gpu, tpu"):
        code_platform()
