"""Device meshes, the logical-axis rules, and sharded train states and batches.

A mesh has three axes::

    data    pure data parallelism: params replicated, the batch split
    fsdp    fully-sharded data parallelism: the batch split *and* params / optimizer
            state / gradients split along their "embed" dimension (ZeRO-3 style: XLA
            all-gathers a weight where it is used and reduce-scatters its gradient)
    tensor  tensor (model) parallelism: heads, MLP hidden units and the vocabulary split

Parameters carry logical axis names (`jaxagent.models.param_axes`); one table for training,
`LOGICAL_AXIS_RULES`, maps each logical name to mesh axes::

    batch    -> ("data", "fsdp")     rows of a batch
    seq      -> None                 never split
    vocab    -> "tensor"             embedding rows, lm_head columns
    embed    -> "fsdp"               the model dimension of every weight
    heads    -> "tensor"             q/k/v/o projections (k/v: the kv heads)
    kv_heads -> "tensor"             (KV cache; the decoder names its kv heads "heads")
    mlp      -> "tensor"             gate/up/down projections

How a logical tuple becomes a `PartitionSpec` (`logical_to_spec`), per dimension:
the rule's mesh axes, minus axes of size 1 and axes an earlier dimension of the same
array already uses, cut to the longest prefix whose size product divides the
dimension. A dimension that no mesh axis divides is **replicated** (not an error): a
tiny model, an odd vocabulary or 2 kv heads on `tensor=4` still run, only less split.

The sampler has rules of its own, `ROLLOUT_AXIS_RULES`: the same table with "embed"
whole. Decoding reads every weight once per token for a few rows, so an FSDP split of
the weights would all-gather each weight matrix inside the decode loop, per token
(measured on 8 CPU devices, fsdp=8: 14 weight-sized all-gathers a token); rollout weights
are instead replicated over data and fsdp (split over tensor as in training) and laid
out once per update, when the sampler gets new params (`Sampler.params`,
`jaxagent.train.placement.Placement.sampler_params`: one device-side reshard). Its rows
(batch, KV cache) are split over ("data", "fsdp") as a training batch's. See
`jaxagent.parallel.rollout` for the sampler of a multi-process run (a mesh of each
process's own devices).

Optimizer state (AdamW `mu`, `nu`) is sharded like its parameters (matched by the
parameter path at the end of each optimizer-state leaf's path, and its shape);
scalars (counts, `step`, `skipped`, the PRNG key) are replicated.

The update is `jaxagent.train.update.make_update_step`: jitted once with the state's shardings
in and out, the batch split over ("data", "fsdp"), metrics replicated, state donated.
Axis types are `Auto`: the compiler propagates shardings through the model from the
pinned inputs and outputs (what `pjit` did). Left to itself, on an fsdp axis
propagation tends to split activations along "embed" like the weights (all-to-alls,
activations not split by rows): correct, but measured on 8 CPU devices (D=256, L=4,
B=32, T=128) 6x the temporary memory and 5x the step time of the same step with the
residual stream pinned to rows over ("data", "fsdp"). So `make_update_step`
traces the step inside the decoder's layout hook with `activation_constraint`. The hook
also pins the embedding table of the token lookup to ("vocab", None): split over "fsdp"
while the looked-up rows are over ("data", "fsdp"), the lookup made XLA replicate it
whole ("involuntary full rematerialization") on a mesh with both axes. Under fsdp each
weight's gradient leaves XLA's partitioner as an all-reduce and a slice of the device's
shard, which XLA's GPU and TPU pipelines fuse into one reduce-scatter; XLA:CPU keeps the
all-reduce (`tests/test_parallel_collectives.py` checks the partitioned program).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent.models import param_axes

MESH_AXES = ("data", "fsdp", "tensor")
#: the mesh axes a batch's row dimension is split over.
BATCH_AXES = ("data", "fsdp")

#: logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("seq", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
)

#: the sampler's rules: weights replicated over data and fsdp ("embed" never split),
#: heads / kv heads / MLP / vocabulary over tensor as in training, rows over the batch axes
ROLLOUT_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("seq", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
)

Rules = Sequence[tuple[str, Any]]


# ----------------------------------------------------------------------------- the mesh
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ("data", "fsdp", "tensor") mesh axes; their product is the number
    of devices. One size may be -1: it takes whatever the others leave
    (`MeshConfig(data=-1, tensor=2)` on 8 devices is 4 x 1 x 2).

    data: data parallelism: the batch's rows are split over data x fsdp.
    fsdp: parameters, gradients and optimizer state sharded along the embedding axis
      over these devices (the batch's rows are split over them too).
    tensor: attention heads, the MLP and the vocabulary split over these devices; keep
      it within one host's fast interconnect.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (v < 1 and v != -1):
                raise ValueError(f"MeshConfig.{name} must be a positive int (or -1 = the rest), got {v!r}")
        if sum(getattr(self, n) == -1 for n in MESH_AXES) > 1:
            raise ValueError(f"MeshConfig: at most one of {list(MESH_AXES)} may be -1, got {self}")

    @property
    def shape(self) -> dict[str, int]:
        return {n: int(getattr(self, n)) for n in MESH_AXES}

    @property
    def num_devices(self) -> int:
        if -1 in self.shape.values():
            raise ValueError(f"MeshConfig: {self} has a -1 size; call resolve(num_devices) first")
        return math.prod(self.shape.values())

    def resolve(self, num_devices: int) -> MeshConfig:
        """This config with the -1 size filled in; checks the product is `num_devices`."""
        shape = self.shape
        fixed = math.prod(v for v in shape.values() if v != -1)
        if -1 in shape.values():
            free = next(n for n, v in shape.items() if v == -1)
            if num_devices % fixed:
                raise ValueError(
                    f"MeshConfig.{free} = -1: the other sizes multiply to {fixed}, which does not "
                    f"divide the {num_devices} devices available"
                )
            shape[free] = num_devices // fixed
        product = math.prod(shape.values())
        if product != num_devices:
            sizes = " * ".join(f"{n}={v}" for n, v in shape.items())
            raise ValueError(
                f"MeshConfig: {sizes} = {product} devices, but {num_devices} are available; the "
                f"product of the mesh sizes must equal the number of devices (one size may be -1)"
            )
        return MeshConfig(**shape)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all devices of all
    processes), with `Auto` axis types. `jax.make_mesh` orders the devices so that the
    inner axes (tensor, then fsdp) sit on the best-connected devices (within a host /
    ICI slice) and "data" spans hosts."""
    n = len(devices) if devices is not None else jax.device_count()
    cfg = cfg.resolve(n)
    shape = tuple(cfg.shape.values())
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


# ----------------------------------------------------------------------------- rules
def axis_sizes(mesh) -> dict[str, int]:
    if isinstance(mesh, MeshConfig):
        return mesh.shape
    if isinstance(mesh, jax.sharding.Mesh):
        return dict(mesh.shape)
    if isinstance(mesh, Mapping):
        return {k: int(v) for k, v in mesh.items()}
    raise TypeError(f"expected a Mesh, a MeshConfig or a mapping of axis sizes, got {type(mesh).__name__}")


def rules_dict(rules: Rules) -> dict[str, tuple[str, ...]]:
    out = {}
    for name, target in rules:
        if target is None:
            out[name] = ()
        elif isinstance(target, str):
            out[name] = (target,)
        else:
            out[name] = tuple(target)
    return out


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh, rules: Rules = LOGICAL_AXIS_RULES) -> P:
    """The `PartitionSpec` of an array of `shape` whose dimensions have logical names
    `axes`, under `rules`, on `mesh` (a Mesh, a MeshConfig or {axis: size}).

    Per dimension: the rule's mesh axes, dropping axes of size 1 and axes already used
    by an earlier dimension, then the longest prefix whose sizes multiply to a divisor
    of the dimension; nothing left = replicated on that dimension. An unknown logical
    name is an error (a typo would silently replicate a whole model)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical_to_spec: {len(axes)} axis names {tuple(axes)} for a rank-{len(shape)} shape")
    sizes = axis_sizes(mesh)
    table = rules_dict(rules)
    used: set[str] = set()
    spec: list = []
    for name, dim in zip(axes, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        for a in table[name]:
            if a not in sizes:
                raise ValueError(f"rule {name!r} -> {a!r}: the mesh has no axis {a!r} (axes {list(sizes)})")
        cand = [a for a in table[name] if sizes[a] > 1 and a not in used]
        while cand and dim % math.prod(sizes[a] for a in cand):
            cand.pop()
        used.update(cand)
        spec.append(None if not cand else cand[0] if len(cand) == 1 else tuple(cand))
    return P(*spec)


def param_specs(params, mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """`PartitionSpec` of every parameter (arrays or `ShapeDtypeStruct`s)."""
    return jax.tree.map(
        lambda x, ax: logical_to_spec(ax, x.shape, mesh, rules),
        params,
        param_axes(params),
        is_leaf=lambda t: isinstance(t, tuple),
    )


def param_shardings(params, mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """`NamedSharding` of every parameter on `mesh`."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(params, mesh, rules), is_leaf=lambda s: isinstance(s, P)
    )


def _dict_suffix(path) -> tuple:
    """The trailing run of dict keys of a tree path (a parameter's own path)."""
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(k.key)
    return tuple(reversed(keys))


def like_params_specs(tree, params, param_spec_tree):
    """Specs for a tree that holds per-parameter copies (optimizer state): a leaf whose
    path ends in a parameter's path and has that parameter's shape gets its spec;
    every other leaf (counts, scalars) is replicated."""
    by_path = {}
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(param_spec_tree, is_leaf=lambda t: isinstance(t, P)),
        strict=True,
    ):
        by_path[_dict_suffix(path)] = (tuple(x.shape), s)

    def spec(path, leaf):
        hit = by_path.get(_dict_suffix(path))
        if hit is not None and hit[0] == tuple(np.shape(leaf)):
            return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def train_state_specs(state, mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """A `TrainState`-shaped tree of `PartitionSpec`s: params and critic params by the
    rules, their optimizer states alike, `step` / `skipped` / `rng` replicated."""
    p_specs = param_specs(state.params, mesh, rules)
    out = dict(
        params=p_specs,
        opt_state=like_params_specs(state.opt_state, state.params, p_specs),
        step=P(),
        skipped=P(),
        rng=P(),
    )
    if state.critic_params is not None:
        c_specs = param_specs(state.critic_params, mesh, rules)
        out.update(
            critic_params=c_specs,
            critic_opt_state=like_params_specs(state.critic_opt_state, state.critic_params, c_specs),
        )
    return state.replace(**out)


def train_state_shardings(state, mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """`train_state_specs` as `NamedSharding`s on `mesh` (for `in/out_shardings`)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), train_state_specs(state, mesh, rules), is_leaf=lambda s: isinstance(s, P)
    )


def shard_train_state(state, mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """`state` placed on `mesh` by the rules (single process: the state is on the host
    or one device). Multi-process: every process builds the same state (same seed) and
    calls this; each keeps only its own shards (leaves that are already global arrays
    are resharded)."""
    shardings = train_state_shardings(state, mesh, rules)
    if jax.process_count() == 1:
        return jax.device_put(state, shardings)

    def place(x, s):
        x = jax.random.key_data(x) if _is_key(x) else x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard
            return jax.device_put(x, s)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    keys = jax.tree.map(_is_key, state)
    placed = jax.tree.map(place, state, shardings)
    return jax.tree.map(
        lambda k, x, orig: jax.random.wrap_key_data(x, impl=jax.random.key_impl(orig)) if k else x, keys, placed, state
    )


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def activation_constraint(mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """`constrain(x, logical_axes) -> x` pinning an activation's layout inside a jitted
    function by the same rules (`jax.lax.with_sharding_constraint`). The residual
    stream ("batch", "seq", "embed") becomes rows over ("data", "fsdp") with "embed"
    whole, because a mesh axis is used once per array: the FSDP layout. For a model
    hook (`jaxagent.models.decoder.activation_constraint`, which `make_update_step`
    sets while the step is traced)."""

    def constrain(x, logical_axes):
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, logical_to_spec(logical_axes, x.shape, mesh, rules))
        )

    return constrain


# ----------------------------------------------------------------------------- batches
def batch_spec(ndim: int = 2, rules: Rules = LOGICAL_AXIS_RULES, mesh=None, batch_size: int | None = None) -> P:
    """Rows split over the "batch" rule's mesh axes, other dimensions whole. With `mesh`
    and `batch_size`, the same divisibility fallback as `logical_to_spec`."""
    if mesh is not None and batch_size is not None:
        first = logical_to_spec(("batch",), (batch_size,), mesh, rules)[0]
    else:
        first = rules_dict(rules)["batch"]
        first = None if not first else first[0] if len(first) == 1 else first
    return P(first, *([None] * (ndim - 1)))


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> NamedSharding:
    """The sharding of every `[B, T]` field of a batch: rows over ("data", "fsdp")."""
    return NamedSharding(mesh, batch_spec(2, rules))


def shard_batch(batch, mesh: jax.sharding.Mesh, rules: Rules = LOGICAL_AXIS_RULES):
    """A host batch (one process) placed on `mesh`, rows split; `B` must be divisible
    by data * fsdp. Multi-process: `jaxagent.parallel.global_batch`."""
    _check_rows(batch, mesh, rules)
    return jax.device_put(batch, batch_sharding(mesh, rules))


def _check_rows(batch, mesh, rules) -> int:
    leaves = jax.tree.leaves(batch)
    B = int(np.shape(leaves[0])[0])
    n = math.prod(dict(mesh.shape)[a] for a in rules_dict(rules)["batch"])
    if B % n:
        raise ValueError(
            f"batch size {B} is not divisible by the {n} batch shards of the mesh "
            f"({' * '.join(f'{a}={dict(mesh.shape)[a]}' for a in rules_dict(rules)['batch'])})"
        )
    return B
