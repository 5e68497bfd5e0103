"""The training loop on a device mesh and across processes (`TrainerConfig.mesh`,
`distributed`, `device_memory_gb`).

A run on a data x fsdp x tensor mesh of the 8 virtual CPU devices learns what the
single-device run learns: the same per-iteration learning metrics (to float32
rounding: sharded matmuls and all-reduces sum in another order) and the same final
params. Two processes of 4 devices each, connected by `jax.distributed` over
localhost, each playing its half of the rollout batch, give the metrics of one
process with 8 devices (slow). A config that cannot fit its device fails before
anything is compiled, naming the memory components.

Run as a script, this file is one process of the multi-process run:
`python tests/test_train_sharded.py OUT_DIR NUM_PROCESSES PROCESS_ID PORT DEVICES [OVERRIDE ...]`.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
#: a multi-turn env whose reward depends on the action text (non-zero group advantages)
VARIED = ["env.name=testing/faulty", "env.kwargs={horizon: 2}", "rollout.max_context=256", "iterations=2"]
#: metrics that measure time (or are read off the clock), not learning
TIMING = ("tokens_per_s",)
#: metrics that must be equal, not just close (counts, the stream position)
EXACT = ("iteration", "step", "tasks_seen", "failed_episodes", "policy_tokens", "skipped_updates")


def _worker(out_dir: str, num_processes: int, process_id: int, port: int, devices: int, *overrides: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.trainer import Trainer

    dist = (
        []
        if num_processes == 1
        else [
            f"distributed.coordinator_address=127.0.0.1:{port}",
            f"distributed.num_processes={num_processes}",
            f"distributed.process_id={process_id}",
        ]
    )
    cfg = load_config(TrainerConfig, CONFIG, [f"run_dir={out_dir}/run", *overrides, *dist])
    Trainer(cfg, log=lambda *_: None).run()
    from jaxagent import parallel as par

    par.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:])
    sys.exit(0)


import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from multiprocess_testlib import run_process_group  # noqa: E402

from jaxagent import parallel as jax_parallel  # noqa: E402
from jaxagent.dataclass_yaml import ConfigError, load_config  # noqa: E402
from jaxagent.train import memory as train_memory  # noqa: E402
from jaxagent.train.config import TrainerConfig  # noqa: E402
from jaxagent.train.trainer import Trainer  # noqa: E402


def config(run_dir, *overrides) -> TrainerConfig:
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", *VARIED, *overrides])


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def learning(history) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k not in TIMING} for m in history]


def assert_same_learning(a: list[dict], b: list[dict], rtol=1e-4, atol=1e-5) -> None:
    a, b = learning(a), learning(b)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        for k in x:
            if k in EXACT:
                assert x[k] == y[k], (k, x[k], y[k])
            else:
                np.testing.assert_allclose(x[k], y[k], rtol=rtol, atol=atol, err_msg=k)


def need_8_devices():
    if len(jax.devices()) != 8:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")


def run(run_dir, *overrides):
    trainer = Trainer(config(run_dir, *overrides), log=lambda *_: None)
    return trainer, trainer.run()


def test_mesh_2x2x2_learns_what_one_device_learns(tmp_path):
    need_8_devices()
    one, h_one = run(tmp_path / "one")
    mesh, h_mesh = run(tmp_path / "mesh", "mesh={data: 2, fsdp: 2, tensor: 2}")
    assert one.mesh is None and dict(mesh.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # the state really is sharded (q/k/v over tensor, the embed dim over fsdp) and the
    # update ran on the mesh
    q = mesh.state.params["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.P(None, "fsdp", "tensor") and len(q.sharding.device_set) == 8
    assert_same_learning(h_one, h_mesh)
    assert read_jsonl(mesh.metrics_path) == h_mesh
    assert all(m["advantage_abs_mean"] > 0 for m in h_mesh)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(one.state.params)),
        jax.tree.leaves(jax.device_get(mesh.state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


#: `update.trim_chunks` with episodes of 1 or 2 turns, so the two micro-batches of 4 rows
#: have different lengths; a critic (GAE), so the advantages are not 0 although this env
#: pays nothing, and the critic's gradients are accumulated too
TRIM_CHUNKS = [
    "env.name=testing/uneven",
    "env.kwargs={prompt_words: 4, obs_words: 3, min_turns: 1, max_turns: 2, median_ms: 0.1}",
    "rollout.max_turns=3",
    "env.group_size=2",
    "env.tasks_per_iteration=4",
    "algo.advantage=gae",
    "update.mini_batches=1",
    "update.micro_batches=2",
    "update.trim_padding=8",
    "update.trim_chunks=true",
]


def without_explained_variance(*histories):
    """The histories without `explained_variance`, which divides by the returns'
    variance: 0 in `TRIM_CHUNKS`'s env, so the ratio is float noise."""
    return [[{k: v for k, v in m.items() if k != "explained_variance"} for m in h] for h in histories]


# 55-85 s; the default suite is at its 15-minute limit (trimming: test_train_options.py on one device;
# a mesh: test_mesh_2x2x2_learns_what_one_device_learns)
@pytest.mark.slow
def test_trim_chunks_on_a_mesh_learns_what_one_device_learns(tmp_path):
    """`update.trim_chunks` on a 2x2x2 mesh: each micro-batch cut to its rows' length and
    its rows split over data * fsdp, the state kept in its layout; the same learning
    metrics and params, the critic's too, as the trimmed run on one device."""
    from jaxagent.train.update.trimmed import TrimmedTrainStep

    need_8_devices()
    one, h_one = run(tmp_path / "one", *TRIM_CHUNKS)
    mesh, h_mesh = run(tmp_path / "mesh", *TRIM_CHUNKS, "mesh={data: 2, fsdp: 2, tensor: 2}")
    assert isinstance(mesh._update, TrimmedTrainStep) and mesh._update.mesh is mesh.mesh
    assert one._update.lengths_seen == mesh._update.lengths_seen and len(mesh._update.lengths_seen) > 1
    q = mesh.state.params["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.P(None, "fsdp", "tensor") and len(q.sharding.device_set) == 8
    assert_same_learning(*without_explained_variance(h_one, h_mesh))
    assert all(m["advantage_abs_mean"] > 0 for m in h_mesh) and mesh.state.has_critic
    for a, b in zip(
        jax.tree.leaves(jax.device_get((one.state.params, one.state.critic_params))),
        jax.tree.leaves(jax.device_get((mesh.state.params, mesh.state.critic_params))),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)  # sharded sums in another order, through Adam


@pytest.mark.slow  # ~15-25 s; the one-device mixed-precision run is in the default suite
def test_mixed_precision_on_a_mesh_keeps_sharded_float32_masters(tmp_path):
    """`model.compute_dtype=bfloat16` on the 2 x 2 x 2 mesh: the float32 state stays
    sharded, the sampler and the log-prob passes run in bfloat16 and agree."""
    need_8_devices()
    import jax.numpy as jnp

    mesh, h = run(
        tmp_path / "mixed", "mesh={data: 2, fsdp: 2, tensor: 2}", "model.compute_dtype=bfloat16", "iterations=1"
    )
    q = mesh.state.params["layers"]["q_proj"]["kernel"]
    assert q.dtype == jnp.float32 and q.sharding.spec == jax.P(None, "fsdp", "tensor")
    sampler = mesh.placement.sampler_params(mesh.state)
    assert sampler["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert h[-1]["rollout_logp_gap"] < 0.05 and np.isfinite(h[-1]["loss"])


@pytest.mark.slow
def test_mesh_8x1x1_and_a_resume_on_another_mesh(tmp_path):
    """Pure data parallelism over 8 devices (mini-batch of 8 rows); then a run
    checkpointed on one mesh resumes on another (orbax restores into the new layout)."""
    need_8_devices()
    _, h_one = run(tmp_path / "one", "update.mini_batches=1")
    _, h_dp = run(tmp_path / "dp", "update.mini_batches=1", "mesh={data: -1}")
    assert_same_learning(h_one, h_dp)
    run(tmp_path / "moved", "update.mini_batches=1", "iterations=1", "mesh={fsdp: 4, tensor: 2}")
    resumed = Trainer(
        config(tmp_path / "moved", "update.mini_batches=1", "mesh={data: 8}"), resume=True, log=lambda *_: None
    )
    assert_same_learning(h_one, resumed.run())


def test_mesh_errors_name_the_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"mesh: the mini-batch size 4 .* mesh.data \* mesh.fsdp = 8"):
        config(tmp_path / "r", "mesh={data: 8}")  # 8 rows / 2 mini-batches = 4 rows
    with pytest.raises(ConfigError, match="device_memory_gb"):
        config(tmp_path / "r", "device_memory_gb=-1")
    need_8_devices()
    with pytest.raises(ConfigError, match=r"mesh: MeshConfig.data = -1: the other sizes multiply to 3"):
        Trainer(config(tmp_path / "r", "mesh={data: -1, tensor: 3}"), log=lambda *_: None)


def test_a_config_that_cannot_fit_fails_before_compiling(tmp_path):
    lines = []
    with pytest.raises(train_memory.DoesNotFitError) as err:
        Trainer(config(tmp_path / "run", "device_memory_gb=1.0e-4"), log=lines.append)
    msg = str(err.value)
    assert "this config does not fit (one device)" in msg
    for name in ("params", "opt_state", "grads", "activations", "kv_cache"):
        assert name in msg, name
    assert lines and lines[0].startswith("memory per device: params") and "of 104.9 KiB" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started
    # the same config fits a sensible device, and the estimate is logged before the run
    lines = []
    trainer = Trainer(config(tmp_path / "run", "device_memory_gb=16", "mesh={fsdp: 2, tensor: 2}"), log=lines.append)
    # in one process the sampler runs on the mesh with a copy of its own, laid out by its
    # rules: whole over fsdp (more per device than the update's shard), counted
    est = trainer.memory_estimate
    assert lines[0].startswith("memory per device:") and "sampler_params" in lines[0]
    rollout = train_memory.estimate_memory(
        trainer.model_config, mesh=trainer.mesh, batch_size=1, seq_len=1, rules=jax_parallel.ROLLOUT_AXIS_RULES
    )
    assert est["sampler_params"] == rollout["params"] > est["params"]
    assert est["total"] < 16 * 2**30


# ----------------------------------------------------------------------------- processes
def _launch(out: Path, num_processes: int, devices: int, *overrides: str, timeout_s: float = 900) -> list[dict]:
    run_process_group(
        __file__, num_processes, lambda pid, port: (out, num_processes, pid, port, devices, *overrides), out, timeout_s
    )
    return read_jsonl(out / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_two_processes_learn_what_one_process_learns(tmp_path):
    """2 processes x 4 CPU devices (gloo), each with its own env pool playing one of the
    two groups, against 1 process x 8 devices; both on a 2 x 2 x 2 mesh."""
    overrides = [*VARIED, "mesh={data: 2, fsdp: 2, tensor: 2}"]
    multi = _launch(tmp_path / "multi", 2, 4, *overrides)
    single = _launch(tmp_path / "single", 1, 8, *overrides)
    assert [m["iteration"] for m in multi] == [1, 2]
    assert_same_learning(single, multi)
    # process 0 alone wrote the files; both wrote the checkpoints (orbax multi-host save)
    assert (tmp_path / "multi" / "run" / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_trim_chunks_in_two_processes_learns_what_one_process_learns(tmp_path):
    """`update.trim_chunks` with 2 processes x 4 CPU devices: every process cuts the same
    micro-batches from its copy of the batch and places its shards; the metrics of one
    process with 8 devices, both on a 2 x 2 x 2 mesh."""
    overrides = [*VARIED, *TRIM_CHUNKS, "mesh={data: 2, fsdp: 2, tensor: 2}"]
    multi = _launch(tmp_path / "multi", 2, 4, *overrides)
    single = _launch(tmp_path / "single", 1, 8, *overrides)
    assert [m["iteration"] for m in multi] == [1, 2] and all(m["advantage_abs_mean"] > 0 for m in multi)
    assert_same_learning(*without_explained_variance(single, multi))


@pytest.mark.slow
def test_warm_start_on_a_mesh_learns_what_one_device_learns(tmp_path):
    """The SFT warm start runs through the sharded SFT step; its losses, the held-out
    evaluations and the RL metrics after it match the single-device run."""
    need_8_devices()
    warm = [
        "model.tokenizer=bpe",
        "model.tokenizer_vocab_size=400",
        "env.name=frozenlake",
        "env.kwargs={size: 3, hole_prob: 0.2}",
        "rollout.max_turns=4",
        "rollout.max_tokens_per_turn=4",
        "rollout.max_context=384",
        "warm_start.episodes=16",
        "warm_start.epochs=2",
        "warm_start.batch_size=8",
        "warm_start.optim.lr=0.005",
        "eval.episodes=8",
        "iterations=1",
        "update.mini_batches=1",
        "loss.kl_coef=0.01",
    ]

    def go(name, *more):
        cfg = load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path / name}", *warm, *more])
        trainer = Trainer(cfg, log=lambda *_: None)
        return trainer, trainer.run()

    one, h_one = go("one")
    mesh, h_mesh = go("mesh", "mesh={data: 2, fsdp: 2, tensor: 2}")
    sft_one, sft_mesh = (read_jsonl(t.run_dir / "warm_start.jsonl") for t in (one, mesh))
    # 16 demonstrations in rows of 8: 2 SFT steps per epoch x 2 epochs, each logged (< 10 steps)
    assert [(x["sft_step"], x["epoch"]) for x in sft_one] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert [(x["sft_step"], x["epoch"]) for x in sft_mesh] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    for a, b in zip(sft_one, sft_mesh, strict=True):
        np.testing.assert_allclose([a["loss"], a["entropy"]], [b["loss"], b["entropy"]], rtol=1e-4)
    for key in ("success_before_rl", "success_after_rl"):
        assert one.summary[key] == mesh.summary[key]
    assert_same_learning(h_one, h_mesh)
    assert mesh.ref_params["layers"]["q_proj"]["kernel"].sharding.spec == jax.P(None, "fsdp", "tensor")
