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
    _write(out_dir, {"row_sums": par.to_host(row_sums), "total": par.to_host(total),
                     "x": par.to_host(x)})


def train(out_dir: str, num_processes: int, process_id: int) -> None:
    from jaxagent import models as M
    from jaxagent import parallel as par
    from jaxagent.train import (LossConfig, OptimizerConfig, StepConfig, UpdateBatch, init_train_state,
                                make_sharded_train_step)

    cfg = M.DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2, head_dim=8, model_type="llama")
    step_cfg = StepConfig(loss=LossConfig(entropy_coef=0.01), optim=OptimizerConfig(lr=1e-3, eps=1e-3))
    mesh = par.make_mesh(par.MeshConfig(data=2, fsdp=2, tensor=2))
    state = init_train_state(jax.random.key(0), M.init_params(jax.random.key(0), cfg, std=0.2), cfg, step_cfg)
    state = par.shard_train_state(state, mesh)
    step = make_sharded_train_step(step_cfg, state, mesh)

    rows = par.process_rows(mesh, B)
    metrics = []
    for i in range(N_STEPS):
        r = np.random.RandomState(100 + i)
        mask = (r.rand(B, T) < 0.6).astype(np.float32)
        mask[:, 0] = 0.0
        full = UpdateBatch(tokens=r.randint(0, cfg.vocab_size, (B, T)).astype(np.int32), loss_mask=mask,
                           advantages=r.randn(B, T).astype(np.float32),
                           old_logp=(-4.2 + 0.3 * r.randn(B, T)).astype(np.float32))
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
