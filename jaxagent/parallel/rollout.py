"""Where the sampler runs: its own layout of the weights, and with several processes a
mesh of each process's own devices.

The sampler decodes a few tokens per row per step, so it reads every weight once per
token. Under the training rules (`LOGICAL_AXIS_RULES`: "embed" over fsdp) XLA would
all-gather each weight matrix inside the decode loop, every token. The rollout rules
(`jaxagent.parallel.ROLLOUT_AXIS_RULES`) keep the weights whole over "data" and "fsdp"
and split over "tensor" (heads, kv heads, MLP, vocabulary) as in training; the rows of a
sampling batch and of its KV cache are split over ("data", "fsdp"). The params are laid
out so once per update (`rollout_shardings`, `relayout`: one device-side reshard), and
the decode loop then moves only activation-sized data: the new K/V rows of the cache
write, the all-done flag, and under tensor parallelism an all-reduce of the rows'
hidden states per layer and the logits' gather over the vocabulary.

With several processes each process samples its own rows (whole groups of the rollout
batch) on a mesh of **its own devices** (`local_mesh`), not on one device: the
("data", "fsdp", "tensor") block of the training mesh that the process owns, when that
block holds the whole "tensor" axis (weights split over it as in training, rows over its
data x fsdp devices); otherwise every local device on the row axes with the weights
whole. `to_local` turns the state's params (global arrays spanning the processes) into
arrays on that mesh without a trip through the host: one jitted reshard on the global
mesh to the rollout layout (the only cross-process traffic: each process's devices
receive the weights they do not hold, device to device), after which each process's
shards *are* its local arrays (`jax.make_array_from_single_device_arrays`, no copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent.parallel.mesh import MESH_AXES, ROLLOUT_AXIS_RULES, Rules, param_specs

__all__ = ["local_mesh", "params_mesh", "relayout", "rollout_shardings", "to_local"]


def rollout_shardings(params, mesh: Mesh, rules: Rules = ROLLOUT_AXIS_RULES):
    """`NamedSharding` of every parameter for sampling on `mesh` (the rollout rules)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(params, mesh, rules), is_leaf=lambda s: isinstance(s, P)
    )


def local_mesh(mesh: Mesh, process_index: int | None = None, *, process_of=None) -> Mesh | None:
    """The sampler's mesh in process `process_index` (default: this one) of a run on
    `mesh`: a ("data", "fsdp", "tensor") mesh of that process's devices, or None when it
    has one device only (the sampler then runs unsharded on it).

    The block of `mesh` the process owns, with the same axis sizes where it holds the
    whole "tensor" axis (the weights are then split over "tensor" exactly as on `mesh`,
    and the reshard in `to_local` moves nothing over "tensor"); otherwise (the process's
    devices are not a block of `mesh`, or "tensor" spans processes) all its devices on
    "data" in the order of `mesh`, weights whole.

    process_of: `device -> process index` (default `device.process_index`; tests use it to
      lay one process's devices out as several processes would be)."""
    pid = jax.process_index() if process_index is None else int(process_index)
    process_of = process_of or (lambda d: d.process_index)
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"local_mesh: expected a mesh with axes {MESH_AXES}, got {tuple(mesh.axis_names)}")
    devices = mesh.devices
    mine = np.vectorize(lambda d: process_of(d) == pid, otypes=[bool])(devices)
    if not mine.any():
        raise ValueError(f"local_mesh: process {pid} has no device in the mesh")
    if mine.sum() == 1:
        return None
    coords = np.argwhere(mine)
    lo, hi = coords.min(axis=0), coords.max(axis=0) + 1
    block = devices[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if block.size == mine.sum() and block.shape[2] == devices.shape[2]:
        return Mesh(block, MESH_AXES, axis_types=axis_types)
    flat = devices[mine].reshape(-1, 1, 1)
    return Mesh(flat, MESH_AXES, axis_types=axis_types)


def _layouts(x, local: NamedSharding | None, mesh: Mesh) -> tuple[NamedSharding, NamedSharding | None]:
    """`(on the global mesh, on the local mesh)` for one leaf: the local mesh's spec on
    both where the global one puts on this process's devices exactly the shards the local
    one wants (the local mesh is a block of `mesh` holding the whole "tensor" axis), else
    replicated on both."""
    if local is None:
        return NamedSharding(mesh, P()), None
    target = NamedSharding(mesh, local.spec)
    want = local.devices_indices_map(x.shape)
    have = target.devices_indices_map(x.shape)
    if all(have[d] == idx for d, idx in want.items()):
        return target, local
    return NamedSharding(mesh, P()), NamedSharding(local.mesh, P())


def to_local(params, mesh: Mesh, local: Mesh | None, rules: Rules = ROLLOUT_AXIS_RULES, *, prepare=None):
    """`params` (global arrays laid out on the multi-process `mesh`) as arrays of this
    process alone: on `local` (`local_mesh(mesh)`) by `rules`, or on this process's one
    device when `local` is None. Every process must call it (it runs one jitted program
    on `mesh`); the host sees none of the weights.

    prepare: a function applied to the params inside that program (e.g. the cast to the
      compute dtype); its outputs must have the params' shapes.

    The result never shares buffers with `params` (the update may donate them)."""
    if local is not None and set(local.devices.flat) - set(jax.local_devices()):
        raise ValueError("to_local: the local mesh holds devices of other processes")
    shapes = jax.eval_shape(prepare, params) if prepare is not None else params
    leaves, treedef = jax.tree.flatten(shapes)
    local_sh = [None] * len(leaves) if local is None else treedef.flatten_up_to(rollout_shardings(shapes, local, rules))
    pairs = [_layouts(x, s, mesh) for x, s in zip(leaves, local_sh, strict=True)]
    resharded = relayout(params, treedef.unflatten([g for g, _ in pairs]), prepare)
    return treedef.unflatten(
        [_assemble(x, lay) for x, (_, lay) in zip(treedef.flatten_up_to(resharded), pairs, strict=True)]
    )


def relayout(params, shardings, prepare=None):
    """`prepare(params)` (default: the params) laid out by `shardings` (a tree of
    `NamedSharding`s like the params) in one jitted program, in **fresh buffers** (never
    the inputs', which an update may donate). The sampler's params are made so once per
    update; the program is compiled once per layout."""
    leaves, treedef = jax.tree.flatten(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    key = (prepare, treedef, tuple(leaves))
    fn = _RELAYOUT.get(key)
    if fn is None:

        def body(params):
            out = params if prepare is None else prepare(params)
            return jax.tree.map(jnp.copy, out)  # a copy: the output is never forwarded from the input

        fn = _RELAYOUT[key] = jax.jit(body, out_shardings=shardings)
    return fn(params)


_RELAYOUT: dict = {}


def _assemble(x: jax.Array, local: NamedSharding | None) -> jax.Array:
    """This process's shards of the global array `x` as one array on `local` (or on the
    process's one device)."""
    if local is None:
        return x.addressable_shards[0].data
    index = local.devices_indices_map(x.shape)
    shards = [s for s in x.addressable_shards if s.device in index]
    for s in shards:
        if s.index != index[s.device]:
            raise AssertionError(
                f"to_local: device {s.device} holds {s.index} of a global {x.shape} array, but "
                f"the local layout {local.spec} wants {index[s.device]} there"
            )
    return jax.make_array_from_single_device_arrays(x.shape, local, [s.data for s in shards])


def params_mesh(params) -> Mesh | None:
    """The mesh that `params` are laid out on, when every leaf is a `NamedSharding` array
    of one ("data", "fsdp", "tensor") mesh of several devices; else None. Raises for
    params that span processes (the sampler runs within one process: `to_local`)."""
    leaves = jax.tree.leaves(params)
    meshes = {getattr(getattr(x, "sharding", None), "mesh", None) for x in leaves}
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    if not isinstance(mesh, Mesh) or mesh.devices.size < 2 or tuple(mesh.axis_names) != MESH_AXES:
        return None
    if any(not x.is_fully_addressable for x in leaves):
        raise ValueError(
            f"the sampler's params span {len({d.process_index for d in mesh.devices.flat})} "
            "processes; a sampler runs within one process: give it this process's copy "
            "(jaxagent.parallel.rollout.to_local, or Placement.sampler_params)"
        )
    return mesh
