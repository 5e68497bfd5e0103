"""Multi-host runs: JAX's multi-controller runtime, one Python process per host.

Every process runs the same program. `initialize` connects the processes (before any
other JAX call); afterwards `jax.devices()` lists the devices of all hosts, a mesh
spans them, and every jitted step is one SPMD program across the hosts. Each process
produces only its share of a batch (its own EnvPool and rollouts) and `global_batch`
assembles the global array without moving data between hosts. Metrics come back
replicated (every process can read them); only `is_primary()` writes logs and
checkpoint metadata.

Set-up, by precedence: explicit arguments, then the environment variables
``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID`` (and optionally ``JAX_LOCAL_DEVICE_IDS``), then, with
``auto=True`` or ``JAXAGENT_DISTRIBUTED=auto``, JAX's own cluster detection (Cloud TPU
pod slices, SLURM, Open MPI, Kubernetes: ``jax.distributed.initialize()`` with no
arguments). None of these, or one process: a no-op.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxagent.parallel.mesh import LOGICAL_AXIS_RULES, Rules, batch_spec, shard_batch

ENV_ADDRESS, ENV_NUM, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
ENV_AUTO = "JAXAGENT_DISTRIBUTED"


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {v!r}") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool | None = None,
    local_device_ids: list[int] | None = None,
    timeout_s: int = 300,
) -> bool:
    """Connects this process to the others (`jax.distributed.initialize`); call it
    first, before anything touches a device. Returns True when a multi-process runtime
    is up (now or already), False for a single process (nothing done).

    coordinator_address: "host:port" of process 0 (reachable from every host).
    num_processes, process_id: the world size and this process's rank (0-based).
    auto: use JAX's cluster detection (TPU pod slices, SLURM, ...) when nothing is given;
      default: `JAXAGENT_DISTRIBUTED=auto` in the environment.
    """
    if jax.distributed.is_initialized():
        return True
    addr = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    n = num_processes if num_processes is not None else _env_int(ENV_NUM)
    pid = process_id if process_id is not None else _env_int(ENV_ID)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"initialize: num_processes ({ENV_NUM}) must be a positive int, got {n!r}")
    if n == 1:
        return False
    if addr is None and n is None and pid is None:
        if auto is None:
            auto = os.environ.get(ENV_AUTO, "").lower() == "auto"
        if not auto:
            return False
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return True
    missing = [
        f"{arg} ({env})"
        for arg, env, v in (
            ("coordinator_address", ENV_ADDRESS, addr),
            ("num_processes", ENV_NUM, n),
            ("process_id", ENV_ID, pid),
        )
        if v is None
    ]
    if missing:
        raise ValueError(
            f"initialize: a multi-process run needs all three of coordinator_address, "
            f"num_processes and process_id; missing {', '.join(missing)}"
        )
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < n:
        raise ValueError(f"initialize: process_id ({ENV_ID}) must be an int in [0, {n}), got {pid!r}")
    jax.distributed.initialize(addr, n, pid, local_device_ids=local_device_ids, initialization_timeout=timeout_s)
    return True


def shutdown() -> None:
    """Disconnects from the other processes (at the end of a run; safe to call always)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def is_primary() -> bool:
    """True on process 0: the one process that writes metrics, logs and checkpoint metadata."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier of this `name` (no-op alone)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def process_rows(mesh: jax.sharding.Mesh, global_batch_size: int, rules: Rules = LOGICAL_AXIS_RULES) -> np.ndarray:
    """The global row indices this process must provide, in the order `global_batch`
    expects its local rows (ascending). Every process gets `B / process_count` rows when
    the batch axes span the processes evenly; processes that hold replicas of the same
    rows (a mesh axis other than the batch axes spanning hosts) get the same rows."""
    sharding = NamedSharding(mesh, batch_spec(1, rules))
    rows: set[int] = set()
    for device, index in sharding.devices_indices_map((global_batch_size,)).items():
        if device.process_index == jax.process_index():
            rows.update(range(global_batch_size)[index[0]])
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(
    local_batch, mesh: jax.sharding.Mesh, global_batch_size: int | None = None, rules: Rules = LOGICAL_AXIS_RULES
):
    """Global arrays (rows split over ("data", "fsdp")) from every process's local rows
    (`jax.make_array_from_process_local_data`; no data crosses hosts). `local_batch` is a
    pytree of host arrays (e.g. an `UpdateBatch` of NumPy arrays; None fields stay None)
    holding the rows `process_rows(mesh, B)` names, in that order. `global_batch_size`
    is checked when given. With one process this is `shard_batch`."""
    leaves = jax.tree.leaves(local_batch)
    if not leaves:
        raise ValueError("global_batch: the local batch has no arrays")
    local_rows = int(np.shape(leaves[0])[0])
    if global_batch_size is not None:
        want = len(process_rows(mesh, global_batch_size, rules))
        if want != local_rows:
            raise ValueError(
                f"global_batch: process {jax.process_index()} must provide {want} rows of the "
                f"global batch of {global_batch_size}, got {local_rows}"
            )

    def make(x):
        x = np.asarray(x)
        if x.shape[0] != local_rows:
            raise ValueError(f"global_batch: every field needs {local_rows} local rows, got shape {x.shape}")
        sharding = NamedSharding(mesh, batch_spec(x.ndim, rules))
        shape = None if global_batch_size is None else (global_batch_size, *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(make, local_batch)


def place_batch(batch, mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """A host batch that every process holds whole (the same rows on each) placed on
    `mesh` as global arrays, rows split over ("data", "fsdp"): each process keeps the
    shards of its own devices. With one process this is `shard_batch`."""
    if jax.process_count() == 1:
        return shard_batch(batch, mesh, rules)

    def put(x):
        h = np.asarray(x)
        return jax.make_array_from_callback(h.shape, NamedSharding(mesh, batch_spec(h.ndim, rules)), lambda idx: h[idx])

    return jax.tree.map(put, batch)


def to_host(tree):
    """NumPy copies of (possibly cross-host sharded) arrays, identical on every process
    (an all-gather over the processes; for checkpoints, evaluation and tests)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return multihost_utils.process_allgather(tree, tiled=True)
