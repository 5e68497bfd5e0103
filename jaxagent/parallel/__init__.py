"""Device meshes, the logical-axis rules, multi-host.

`mesh`: `MeshConfig(data, fsdp, tensor)` and `make_mesh`; `LOGICAL_AXIS_RULES` (the
table from the models' logical axis names to mesh axes), `logical_to_spec`,
`param_shardings`, `train_state_shardings`, `shard_train_state`, `shard_batch`,
`activation_constraint` (the decoder's activation layout on a mesh); `ROLLOUT_AXIS_RULES`,
the sampler's own rules (weights whole over data and fsdp). `rollout`: `local_mesh` (the
sampler's mesh of one process's devices), `to_local`, `relayout`. `distributed`:
`initialize`, `global_batch`, `process_rows`, `is_primary`, `barrier`, `to_host`.

This layer knows the models (their logical axis names) and nothing of training: the
sharded update is `jaxagent.train.update.make_update_step`, the memory estimate of a run
`jaxagent.train.memory`.
"""

from jaxagent.parallel.distributed import (
    barrier,
    global_batch,
    initialize,
    is_primary,
    place_batch,
    process_rows,
    shutdown,
    to_host,
)
from jaxagent.parallel.mesh import (
    BATCH_AXES,
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    ROLLOUT_AXIS_RULES,
    MeshConfig,
    activation_constraint,
    batch_sharding,
    batch_spec,
    like_params_specs,
    logical_to_spec,
    make_mesh,
    param_shardings,
    param_specs,
    shard_batch,
    shard_train_state,
    train_state_shardings,
    train_state_specs,
)
from jaxagent.parallel.rollout import local_mesh, relayout, rollout_shardings, to_local

__all__ = [
    "BATCH_AXES",
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "MeshConfig",
    "ROLLOUT_AXIS_RULES",
    "activation_constraint",
    "barrier",
    "batch_sharding",
    "batch_spec",
    "global_batch",
    "initialize",
    "is_primary",
    "like_params_specs",
    "local_mesh",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "place_batch",
    "process_rows",
    "relayout",
    "rollout_shardings",
    "shard_batch",
    "shard_train_state",
    "shutdown",
    "to_host",
    "to_local",
    "train_state_shardings",
    "train_state_specs",
]
