"""The memory estimate against what XLA compiles: the temporary bytes of the compiled
update and log-prob pass (`Compiled.memory_analysis()`, XLA's own buffer assignment), for
several shapes, micro-batches and remat; `logprob_rows` bounds the log-prob pass; on CPU
the check compares against the host's available RAM and refuses, before compiling, a
config whose log-prob pass cannot fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.dataclass_yaml import load_config
from jaxagent.train import memory
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.step import StepConfig
from jaxagent.train.placement import _policy_logprobs, policy_logprobs
from jaxagent.train.trainer import Trainer
from jaxagent.train.update import train_step
from jaxagent.train.update.batch import UpdateBatch
from jaxagent.train.update.state import init_train_state

SHAPES = [  # D, L, H, K, hd, F, V, B, T
    (128, 2, 4, 2, 32, 256, 512, 16, 512),
    (64, 4, 4, 2, 16, 256, 512, 8, 1024),
    (256, 2, 8, 4, 32, 512, 2048, 8, 256),
]


def model(D, L, H, K, hd, F, V):
    return M.DecoderConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=hd,
        model_type="qwen2",
    )


def measured(fn, *args, **static) -> int:
    return (
        jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile().memory_analysis().temp_size_in_bytes
    )


def _cases():
    """In the default run shape 0 without remat and shape 1 with it; the rest (micro-batches,
    the third shape, the other remat settings) are slow."""
    out = []
    for i, shape in enumerate(SHAPES):
        for micro, remat in ((1, False), (2, False), (1, True)):
            slow = i == 2 or micro > 1 or (i == 0) == remat  # default: shape 0 plain, shape 1 remat
            out.append(
                pytest.param(
                    shape, micro, remat, id=f"{shape}-{micro}-{remat}", marks=(pytest.mark.slow,) if slow else ()
                )
            )
    return out


@pytest.mark.parametrize("shape, micro, remat", _cases())
def test_update_activations_match_the_compiled_step(shape, micro, remat):
    *arch, B, T = shape
    cfg, sc = model(*arch), StepConfig(num_micro_batches=micro, remat=remat)
    state = init_train_state(jax.random.key(1), M.init_params(jax.random.key(0), cfg), cfg, sc)
    z = jnp.zeros((B, T), jnp.float32)
    batch = UpdateBatch(
        tokens=jnp.zeros((B, T), jnp.int32),
        loss_mask=z + 1,
        advantages=z + 1,
        old_logp=z,
        attention_mask=jnp.ones((B, T), jnp.int32),
    )
    est = memory.estimate_memory(cfg, sc, None, batch_size=B, seq_len=T)
    ratio = measured(train_step, state, batch, config=sc) / (est["activations"] + est["grads"])
    low = 0.5 if remat else 0.75  # "tens of percent either way" (the memory module's docstring)
    assert low < ratio < 1.5, ratio


@pytest.mark.parametrize(
    "shape",
    [SHAPES[0], pytest.param(SHAPES[1], marks=pytest.mark.slow), pytest.param(SHAPES[2], marks=pytest.mark.slow)],
    ids=str,
)
def test_logprob_pass_matches_the_compiled_pass_and_logprob_rows_bound_it(shape):
    *arch, B, T = shape
    cfg = model(*arch)
    params = M.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    mask = jnp.ones((B, T), jnp.int32)
    kw = dict(config=cfg, temperature=1.0, seq_chunk=128, vocab_chunk=8192)
    peaks = {}
    for chunks in (1, 4):
        peaks[chunks] = measured(
            lambda p, t, m, c=chunks: _policy_logprobs(
                p, cfg, t, m, temperature=1.0, seq_chunk=128, vocab_chunk=8192, row_chunks=c
            ),
            params,
            tokens,
            mask,
        )
        est = memory.forward_activation_bytes(cfg, StepConfig(), rows=B // chunks, seq_len=T)
        # an overestimate is safe (the check refuses too early), an underestimate is not
        assert 0.55 < peaks[chunks] / est < 1.5, (chunks, peaks[chunks] / est)
    assert peaks[4] < peaks[1] / 3
    whole = np.asarray(policy_logprobs(params, tokens_BxT=tokens, attention_mask_BxT=mask, **kw))
    parts = np.asarray(policy_logprobs(params, tokens_BxT=tokens, attention_mask_BxT=mask, row_chunks=4, **kw))
    np.testing.assert_allclose(parts, whole, atol=1e-5, rtol=1e-6)


def test_cpu_check_uses_host_ram_and_refuses_a_log_prob_pass_that_cannot_fit(tmp_path):
    host = memory.host_memory_bytes()
    if host is None:
        pytest.skip("no /proc/meminfo")
    # 64 rows of 16k tokens through 4 heads with the dense attention (the blocked one, auto's
    # choice at this length, would fit): the log-prob pass alone needs ~ 64 * 16k * 4 * 16k * 12 bytes
    cfg = load_config(
        TrainerConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "env.name=countdown",
            "env.group_size=8",
            "env.tasks_per_iteration=8",
            "rollout.max_context=16384",
            "update.mini_batches=64",
            "model.attention=dense",
        ],
    )
    lines = []
    with pytest.raises(memory.DoesNotFitError, match=r"logprob_pass [\d.]+ (GiB|TiB).*logprob_rows"):
        Trainer(cfg, log=lines.append)
    assert any("host RAM available" in x for x in lines), lines
    # with the pass cut into rows (and the update into micro-batches) the estimate shrinks by the same factor
    small = load_config(
        TrainerConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "env.name=countdown",
            "env.group_size=8",
            "env.tasks_per_iteration=8",
            "rollout.max_context=16384",
            "update.mini_batches=64",
            "update.logprob_rows=1",
        ],
    )
    dense = M.tiny_config().replace(attention="dense")  # (the blocked attention's block shrinks with rows)
    big = memory.forward_activation_bytes(dense, rows=64, seq_len=16384)
    one = memory.forward_activation_bytes(dense, rows=1, seq_len=16384)
    assert 60 < big / one <= 64
    assert small.update.logprob_rows == 1


def test_the_episode_stores_entropy_pass_stays_within_the_estimate():
    """configs/intake_grpo.yaml (8,192-token episodes, `logprob_rows: 1`) once ran out of
    memory in the episode store's entropy pass, which ran its 8 rows at once outside the
    estimate. Its passes are now of the log-prob pass's rows: compiled at the config's
    shapes (not run), the pass stays within 1.5x the estimate's `logprob_pass`, where all
    rows at once would not."""
    from pathlib import Path

    from jaxagent.train import build
    from jaxagent.train.trainer import store_entropy_passes

    config = load_config(TrainerConfig, Path(__file__).resolve().parents[1] / "configs" / "intake_grpo.yaml", [])
    passes, chunk = store_entropy_passes(config)
    assert (passes, chunk) == (config.logging.episodes_per_iteration, config.update.logprob_rows)
    cfg = build.scratch_config(config.model, range(config.model.tokenizer_vocab_size))  # len() = the vocabulary
    sc, T = config.step_config, config.rollout.max_context
    params = jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg))
    tokens = jax.ShapeDtypeStruct((passes * chunk, T), jnp.int32)

    def peak(row_chunks):
        return measured(
            lambda p, t, m: _policy_logprobs(
                p,
                cfg,
                t,
                m,
                temperature=sc.loss.temperature,
                seq_chunk=sc.seq_chunk,
                vocab_chunk=sc.vocab_chunk,
                row_chunks=row_chunks,
                with_entropy=True,
                compute_dtype=sc.compute_dtype,
            ),
            params,
            tokens,
            tokens,
        )

    rows_a_pass = config.env.batch_size // (config.env.batch_size // config.update.logprob_rows)
    est = memory.forward_activation_bytes(cfg, sc, rows=rows_a_pass, seq_len=T, param_dtype=config.model.dtype)
    assert peak(passes) < 1.5 * est, (peak(passes), est)
    assert peak(1) > 3 * est  # the old single pass (8 rows): the check above can fail


def test_the_samplers_append_is_bounded_and_within_the_estimate():
    """A prompt appended to the cache in one pass needs memory in proportion to its
    length times the cache's (`configs/intake_grpo.yaml`: 16 rows over 8,192 slots, 6 GiB
    for 1,024 tokens, outside the estimate). In `APPEND_CHUNK` pieces, compiled at the
    config's shapes, it is the same for every length, and within 1.5x the estimate's
    `prefill`."""
    from pathlib import Path

    from jaxagent.rollout.kernels import APPEND_CHUNK, append_kernel
    from jaxagent.rollout.sampler import Sampler
    from jaxagent.train import build

    config = load_config(TrainerConfig, Path(__file__).resolve().parents[1] / "configs" / "intake_grpo.yaml", [])
    cfg = build.scratch_config(config.model, range(config.model.tokenizer_vocab_size))
    B, S = config.env.batch_size, config.rollout.max_context
    params = M.init_params(jax.random.key(0), cfg)
    state = Sampler(params, cfg, max_len=S).init_state(B)

    def peak(T, chunk, cfg=cfg):
        tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
        return measured(lambda p, st, t, m: append_kernel(p, cfg, st, t, m, chunk=chunk), params, state, tokens, tokens)

    est = memory.prefill_bytes(cfg, rows=B, max_len=S, chunk=APPEND_CHUNK, param_dtype=config.model.dtype)
    bounded = [peak(T, APPEND_CHUNK) for T in (APPEND_CHUNK, 4 * APPEND_CHUNK)]
    assert bounded[1] < 1.01 * bounded[0]  # the same for 4x the tokens (to a scan's few buffers)
    assert 0.6 < bounded[1] / est < 1.5, bounded[1] / est
    # one pass with the dense scores over the cache (the blocked attention bounds even that)
    assert peak(4 * APPEND_CHUNK, 10**6, cfg.replace(attention="dense")) > 3 * est  # the check above can fail


def test_the_value_pass_runs_in_the_log_prob_pass_rows():
    """configs/sokoban_ppo.yaml (`logprob_rows: 8` of 32 rows of 3,072 tokens) compiled its
    critic's value pass over all 32 rows at once: 13.8 GiB against the 3.5 GiB of the
    log-prob pass the estimate counts (`tests/test_train_compiled.py` found it). The pass
    now runs in the same row chunks: the same values, a quarter of the memory."""
    from jaxagent.train.placement import _critic_values
    from jaxagent.train.update.batch import UpdateBatch
    from jaxagent.train.update.losses import critic_values

    cfg = model(64, 2, 4, 2, 16, 128, 256)
    from jaxagent.models.value import value_params_from_policy

    params = M.init_params(jax.random.key(0), cfg)
    state = init_train_state(
        jax.random.key(1),
        params,
        cfg,
        StepConfig(),
        critic_config=cfg,
        critic_params=value_params_from_policy(jax.random.key(2), params, cfg),
    )
    B, T = 8, 256
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)
    mask = (jnp.arange(T)[None, :] < jnp.array([T, 200, 31, 256, 5, 128, 64, 100])[:, None]).astype(jnp.int32)
    batch = UpdateBatch(tokens=tokens, loss_mask=mask, advantages=mask, old_logp=mask, attention_mask=mask)
    whole = np.asarray(critic_values(state.critic_params, state.critic_config, batch))
    parts = np.asarray(_critic_values(state.critic_params, state.critic_config, batch, row_chunks=4))
    np.testing.assert_allclose(parts, whole, atol=1e-5, rtol=1e-6)
    peak = {
        n: _critic_values.lower(state.critic_params, state.critic_config, batch, row_chunks=n)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for n in (1, 4)
    }
    assert peak[4] < peak[1] / 3, peak


class _ReportingDevice:
    """A device as a GPU or TPU backend presents it: `memory_stats()["bytes_limit"]`."""

    platform, id = "gpu", 0

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 0}


@pytest.mark.parametrize("gib, fits", [(16, True), (0.05, False)])
def test_the_check_reads_an_accelerators_memory_and_refuses_what_does_not_fit(tmp_path, monkeypatch, gib, fits):
    """The GPU and TPU branch: the device's own `bytes_limit` is the limit (not the host's
    RAM, not `device_memory_gb`), and a run over 90% of it stops before compiling."""
    real = memory.device_memory_bytes
    assert real(_ReportingDevice(123 * 2**20)) == 123 * 2**20
    with pytest.raises(ValueError, match="does not report its memory"):
        real(type("Cpu", (), {"platform": "cpu", "id": 0, "memory_stats": lambda self: None})())
    monkeypatch.setattr(memory, "device_memory_bytes", lambda *a, **k: real(_ReportingDevice(int(gib * 2**30))))
    cfg = load_config(
        TrainerConfig, None, [f"run_dir={tmp_path / 'run'}", "env.name=countdown", "device_memory_gb=1000"]
    )
    lines = []
    if fits:
        Trainer(cfg, log=lines.append)
        line = next(x for x in lines if x.startswith("memory per device"))
        assert line.endswith("of 16.00 GiB"), line  # the device's figure, nothing about the host
    else:
        with pytest.raises(memory.DoesNotFitError, match=r"this config does not fit \(one device\).*90% of 51\.2 MiB"):
            Trainer(cfg, log=lines.append)


_ALLOCATOR_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
from jaxagent import models as M
from jaxagent.train import memory
from jaxagent.train.config.step import StepConfig
from jaxagent.train.update import train_step
from jaxagent.train.update.batch import UpdateBatch
from jaxagent.train.update.state import init_train_state
D, L, H, K, hd, F, V, B, T = json.loads(sys.argv[1])
cfg = M.DecoderConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=L, num_heads=H,
                      num_kv_heads=K, head_dim=hd, model_type="qwen2")
sc = StepConfig()
dev = jax.devices()[0]
start = dev.memory_stats()
state = init_train_state(jax.random.key(1), M.init_params(jax.random.key(0), cfg), cfg, sc)
z = jnp.zeros((B, T), jnp.float32)
batch = UpdateBatch(tokens=jnp.zeros((B, T), jnp.int32), loss_mask=z + 1, advantages=z + 1, old_logp=z,
                    attention_mask=jnp.ones((B, T), jnp.int32))
compiled = train_step.lower(state, batch, config=sc).compile()
jax.block_until_ready((state, batch))
before = dev.memory_stats()
state, metrics = compiled(state, batch)
jax.block_until_ready((state, metrics))
after = dev.memory_stats()
mem = compiled.memory_analysis()
print(json.dumps({"start": start, "before": before, "after": after, "device_kind": dev.device_kind,
                  "estimate": memory.estimate_memory(cfg, sc, None, batch_size=B, seq_len=T),
                  "temp_bytes": None if mem is None else mem.temp_size_in_bytes}))
"""


def test_on_an_accelerator_the_allocators_peak_over_a_step_is_within_the_estimate():
    """The estimate against the device's real allocator (not XLA's compiled figure): in a
    fresh process (a clean `peak_bytes_in_use`, no preallocated pool), the peak over
    building the state and one update stays within 0.5x-1.5x of `estimate_memory`'s total.
    Only where the device reports its allocator's peak (GPU, TPU): the device check
    (`jaxagent bench device`) runs it there; on the CPU it is skipped."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without stats raise or return None)
        stats = None
    if not stats or "peak_bytes_in_use" not in stats:
        pytest.skip(f"{jax.devices()[0].platform}: the allocator reports no peak_bytes_in_use")
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ALLOCATOR_CHILD, json.dumps(list(SHAPES[0]))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = got["after"]["peak_bytes_in_use"] - got["start"]["bytes_in_use"]
    # the update set the process's peak (not the compilation's autotuning, nor the state's init)
    assert got["after"]["peak_bytes_in_use"] > got["before"]["peak_bytes_in_use"], got
    ratio = peak / got["estimate"]["total"]
    assert 0.5 < ratio < 1.5, (ratio, got)
