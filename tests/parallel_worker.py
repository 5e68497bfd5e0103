"""One process of a (simulated) multi-host run, for tests/test_parallel_multihost.py.

    python tests/parallel_worker.py OUT_DIR NUM_PROCESSES PROCESS_ID PORT DEVICES_PER_PROCESS [MODE]

Every process builds the same state and the same global batches (same seeds), keeps
only the rows `process_rows` assigns to it, assembles the global batch with
`global_batch`, and runs N_STEPS sharded updates on a data=2 x fsdp=2 x tensor=2 mesh
spanning all processes. Process 0 writes `OUT_DIR/result.npz` (params, AdamW moments,
metrics); each process writes the rows it fed (`rows_<id>.npy`). With NUM_PROCESSES = 1 it is the single-process
reference on the same mesh shape.

MODE "smoke" (fast, no model): the global batch and one jitted cross-process reduction
over it; process 0 writes `result.npz` with the row sums and the total.

MODE "sampler": the rollout sampler of a multi-process run (`Placement.sampler_params`
on the tiny config's data=2 x fsdp=2 x tensor=2 mesh): each process checks that its
sampler spans all its own devices, holds the state's values, and samples what an
unsharded sampler on one device samples; also `to_local` on a mesh whose tensor axis
spans the processes (the weights then whole on every device). Each process writes
`sampler_<id>.json` with what it found.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

N_STEPS, B, T = 3, 16, 10


def main(out_dir: str, num_processes: int, process_id: int, port: int, devices: int, mode: str = "train") -> None:
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    from jaxagent import parallel as par

    multi = par.initialize(f"127.0.0.1:{port}", num_processes, process_id, timeout_s=120)
    assert multi == (num_processes > 1)
    assert jax.process_count() == num_processes and jax.device_count() == 8
    assert par.is_primary() == (process_id == 0)
    if mode == "smoke":
        smoke(out_dir, process_id)
    elif mode == "sampler":
        sampler(out_dir, process_id)
    else:
        train(out_dir, num_processes, process_id)
    par.shutdown()


def _write(out_dir: str, out: dict) -> None:
    from jaxagent import parallel as par

    par.barrier("results")
    if par.is_primary():
        tmp = os.path.join(out_dir, "result.tmp.npz")
        np.savez(tmp, **out)
        os.replace(tmp, os.path.join(out_dir, "result.npz"))
    par.barrier("written")


def smoke(out_dir: str, process_id: int) -> None:
    from jaxagent import parallel as par

    mesh = par.make_mesh(par.MeshConfig(data=2, fsdp=2, tensor=2))
    full = np.arange(B * T, dtype=np.float32).reshape(B, T)
    rows = par.process_rows(mesh, B)
    np.save(os.path.join(out_dir, f"rows_{process_id}.npy"), rows)
    x = par.global_batch({"x": full[rows]}, mesh, B)["x"]
    row_sums, total = jax.jit(lambda x: (jnp.sum(x, axis=1), jnp.sum(x)))(x)
    _write(out_dir, {"row_sums": par.to_host(row_sums), "total": par.to_host(total), "x": par.to_host(x)})


def sampler(out_dir: str, process_id: int) -> None:
    import json
    from pathlib import Path

    from jaxagent import models as M
    from jaxagent import parallel as par
    from jaxagent.dataclass_yaml import load_config
    from jaxagent.rollout import Sampler, SamplingConfig
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.placement import Placement
    from jaxagent.train.update.state import init_train_state

    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_countdown_grpo.yaml"
    cfg = load_config(TrainerConfig, config, [f"run_dir={out_dir}/run", "mesh={data: 2, fsdp: 2, tensor: 2}"])
    model_cfg = M.tiny_config(vocab_size=96)
    host = M.init_params(jax.random.key(0), model_cfg, std=0.3)
    place = Placement(cfg, model_cfg)
    state = place.place_state(init_train_state(jax.random.key(0), host, model_cfg, cfg.step_config))
    params = place.sampler_params(state)
    again = place.sampler_params(state, copy=True)  # the overlap thread's copy: fresh buffers
    local = set(jax.local_devices())
    q = params["layers"]["q_proj"]["kernel"]
    sampler = Sampler(params, model_cfg, max_len=40, window_segments=2)  # takes the params' mesh
    reference = Sampler(jax.device_put(host, jax.local_devices()[0]), model_cfg, max_len=40, window_segments=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14], [5], [6, 7], [8, 8, 8, 8]]
    same = []
    for sampling in (SamplingConfig(0.0), SamplingConfig(0.9, top_k=20)):
        (t0, l0, r0), (t1, l1, r1) = (
            Sampler.to_lists(s.generate(prompts, max_new_tokens=6, sampling=sampling, seed=3)[1])
            for s in (reference, sampler)
        )
        same.append(t0 == t1 and r0 == r1 and all(np.allclose(a, b, atol=1e-5) for a, b in zip(l0, l1, strict=True)))
    # a mesh whose tensor axis spans the processes: every local device, the weights whole
    wide = par.make_mesh(par.MeshConfig(tensor=8))
    wide_local = par.local_mesh(wide)
    on_wide = jax.tree.map(
        lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i, x=x: np.asarray(x)[i]),
        host,
        par.param_shardings(host, wide),
    )
    wide_params = par.to_local(on_wide, wide, wide_local)
    out = {
        "sampler_devices": sorted(d.id for d in sampler.mesh.devices.flat),
        "local_devices": sorted(d.id for d in local),
        "sampler_mesh": dict(sampler.mesh.shape),
        "sampler_is_placement_mesh": sampler.mesh is place.sampler_mesh,
        "q_spec": str(q.sharding.spec),
        "fully_addressable": all(x.is_fully_addressable for x in jax.tree.leaves(params)),
        "values_equal": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(params), strict=True)
        ),
        "copy_is_fresh": again["layers"]["q_proj"]["kernel"].addressable_shards[0].data.unsafe_buffer_pointer()
        != q.addressable_shards[0].data.unsafe_buffer_pointer(),
        "same_samples": same,
        "cache_spec": str(sampler.init_state(8).cache.k.sharding.spec),
        "wide_mesh": dict(wide_local.shape),
        "wide_q_spec": str(wide_params["layers"]["q_proj"]["kernel"].sharding.spec),
        "wide_values_equal": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(wide_params), strict=True)
        ),
    }
    with open(os.path.join(out_dir, f"sampler_{process_id}.json"), "w") as f:
        json.dump(out, f)
    par.barrier("sampled")


def train(out_dir: str, num_processes: int, process_id: int) -> None:
    from jaxagent import models as M
    from jaxagent import parallel as par
    from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig
    from jaxagent.train.update import make_update_step
    from jaxagent.train.update.batch import UpdateBatch
    from jaxagent.train.update.state import init_train_state

    cfg = M.DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        model_type="llama",
    )
    step_cfg = StepConfig(loss=LossConfig(entropy_coef=0.01), optim=OptimizerConfig(lr=1e-3, eps=1e-3))
    mesh = par.make_mesh(par.MeshConfig(data=2, fsdp=2, tensor=2))
    state = init_train_state(jax.random.key(0), M.init_params(jax.random.key(0), cfg, std=0.2), cfg, step_cfg)
    state = par.shard_train_state(state, mesh)
    step = make_update_step(step_cfg, state, mesh)

    rows = par.process_rows(mesh, B)
    metrics = []
    for i in range(N_STEPS):
        r = np.random.RandomState(100 + i)
        mask = (r.rand(B, T) < 0.6).astype(np.float32)
        mask[:, 0] = 0.0
        full = UpdateBatch(
            tokens=r.randint(0, cfg.vocab_size, (B, T)).astype(np.int32),
            loss_mask=mask,
            advantages=r.randn(B, T).astype(np.float32),
            old_logp=(-4.2 + 0.3 * r.randn(B, T)).astype(np.float32),
        )
        local = jax.tree.map(lambda x: x[rows], full)  # this host's share only
        state, m = step(state, par.global_batch(local, mesh, B))
        metrics.append(m)

    params = par.to_host(state.params)
    adam = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")][0]
    mu = par.to_host(adam.mu)
    out = {f"param/{jax.tree_util.keystr(p)}": np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    out.update({f"mu/{jax.tree_util.keystr(p)}": np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(mu)})
    for i, m in enumerate(metrics):
        out.update({f"metric/{i}/{k}": np.asarray(v) for k, v in par.to_host(m).items()})
    np.save(os.path.join(out_dir, f"rows_{process_id}.npy"), rows)  # each process: its own file
    out["spec/q_proj"] = np.array(str(state.params["layers"]["q_proj"]["kernel"].sharding.spec))
    _write(out_dir, out)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:7])
