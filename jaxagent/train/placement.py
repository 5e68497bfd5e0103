"""Where a run's arrays live: one object for one device, a mesh, or several processes.

`Placement(config)` decides the device mode once; the loop then asks it, without
branching on the mode itself, to:

- place the `TrainState` and the KL reference (`place_state`, `place_params`: by the
  logical-axis rules on a mesh, as they are on one device);
- build the update (`update_step(step_config, state, kind)`) and run the log-prob pass
  (`logprobs`) of the update strategy it is given (`update`, chosen once by the run's
  builder, `jaxagent.train.build.make_placement`: `jaxagent.train.update.PaddedUpdate`, whole
  padded mini-batches, `make_update_step`; or `jaxagent.train.update.trimmed.TrimmedUpdate`,
  chunks cut to their rows' length), and place mini-batches (`to_device`: rows split over
  ("data", "fsdp"));
- turn this process's rollout rows into the global batch (`global_batch`: every
  process also keeps a host copy of all rows for shaping, advantages and metrics);
- run the log-prob kernel and the value pass on the placed params (`row_logprobs`,
  `values`);
- bring replicated results to the host (`fetch`);
- give the sampler its params (`sampler_params`: the state's own on one device; on a
  mesh laid out by the sampler's own rules, `ROLLOUT_AXIS_RULES`: weights whole over
  data and fsdp, split over tensor, in one device-side reshard per update; with several
  processes on `sampler_mesh`, a mesh of this process's own devices, with no trip
  through the host: `jaxagent.parallel.rollout.to_local`).

The run's per-device memory is checked before anything is compiled by
`jaxagent.train.memory.check_memory`, from this placement's meshes and rows.

Modes: one device (an all-1 `mesh` section in one process) is a mesh of one device
(`device_mesh`, nanodo's habit): the state, the mini-batches and the update are placed
and jitted as on any mesh, and compile to the single-device programs (same values, bit
for bit); there `mesh` is None, which the sampler, the memory check and the log-prob,
entropy and value passes read as "one device" (they run the plain single-device
functions on the state's arrays). A mesh in one process samples on the mesh too
(`Sampler(mesh=...)`). With several processes each process plays its own whole groups of
the rollout batch (`rows`; `row_offset` is the global index of its first row, so its
sampling keys are those one process playing the whole batch would draw) on every one of
its devices (`sampler_mesh`: its rows split over them, the weights split over "tensor"
where the process holds the whole tensor axis, else whole); a process with one device
samples on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import parallel as par
from jaxagent.dataclass_yaml import ConfigError
from jaxagent.models import decoder
from jaxagent.parallel import MeshConfig
from jaxagent.train.config.update import check_mesh_rows
from jaxagent.train.update import PaddedUpdate
from jaxagent.train.update.batch import ModelInputs
from jaxagent.train.update.losses import critic_values, for_compute


def _policy_logprobs(
    params,
    config,
    tokens_BxT,
    attention_mask_BxT,
    segment_ids_BxT=None,
    *,
    temperature: float,
    seq_chunk: int,
    vocab_chunk: int,
    row_chunks: int = 1,
    with_entropy: bool = False,
    compute_dtype: str | None = None,
):
    from jaxagent.models import token_logprobs

    params = for_compute(params, compute_dtype)

    def one(tokens, mask, segments):
        logp, ent = token_logprobs(
            params,
            config,
            tokens,
            attention_mask_BxT=mask,
            segment_ids_BxT=segments,
            temperature=temperature,
            seq_chunk=seq_chunk,
            vocab_chunk=vocab_chunk,
        )
        return (logp, ent) if with_entropy else logp

    return _in_row_chunks(lambda xs: one(*xs), (tokens_BxT, attention_mask_BxT, segment_ids_BxT), row_chunks)


def _in_row_chunks(fn, rows, row_chunks: int):
    """`fn(rows)` for a pytree `rows` of `[B, ...]` arrays whose outputs are `[B, ...]`, in
    `row_chunks` passes one after another (`lax.map`), so that only one chunk's
    activations are live; chunk k holds rows k, k + n, k + 2n, ... (each spans every row
    shard of a mesh)."""
    if row_chunks == 1:
        return fn(rows)
    n = row_chunks
    B = jax.tree.leaves(rows)[0].shape[0]
    split = jax.tree.map(lambda x: x.reshape(B // n, n, *x.shape[1:]).swapaxes(0, 1), rows)
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, *x.shape[2:]), jax.lax.map(fn, split))


#: `log pi(tokens[t] | tokens[:t])` `[B, T]` as `train_step` computes it (same kernel;
#: `segment_ids_BxT` for packed rows, `Trajectory.segment_ids`);
#: `row_chunks` > 1 runs it on that many chunks of rows in turn (less memory, same values
#: to float32 rounding); `with_entropy` returns `(logp, entropy)`, the entropy of each
#: next-token distribution (for the episode store).
policy_logprobs = jax.jit(
    _policy_logprobs,
    static_argnames=(
        "config",
        "temperature",
        "seq_chunk",
        "vocab_chunk",
        "row_chunks",
        "with_entropy",
        "compute_dtype",
    ),
)


def _cast_critic_values(critic_params, critic_config, batch, *, compute_dtype=None, row_chunks: int = 1):
    """`critic_values` in `compute_dtype`, over `row_chunks` chunks of rows in turn (as
    `_policy_logprobs` cuts them: `logprob_rows` bounds this pass's memory too)."""
    params = for_compute(critic_params, compute_dtype)
    return _in_row_chunks(lambda b: critic_values(params, critic_config, b), batch, row_chunks)


_critic_values = jax.jit(_cast_critic_values, static_argnames=("critic_config", "compute_dtype", "row_chunks"))


@functools.cache
def _compute_cast(compute_dtype: str | None):
    """`params -> params` in `compute_dtype` (None: no cast), one object per dtype (the
    relayout's compilation cache is keyed by it)."""
    return None if compute_dtype is None else functools.partial(for_compute, compute_dtype=compute_dtype)


class Placement:
    """Device placement of one run (see the module docstring).

    Args:
      config: the `TrainerConfig` (its `mesh`, batch sizes and step config).
      model_config: the policy's `DecoderConfig` (for the log-prob pass).
      update: the update strategy (the update step, its input, the log-prob pass) the
        run's builder chose (`jaxagent.train.build.make_placement`); None = `PaddedUpdate()`.
    JAX's multi-process runtime must already be initialised (`parallel.initialize`).
    """

    def __init__(self, config, model_config, *, update=None):
        self.config = config
        self.model_config = model_config
        #: the update strategy this placement runs (`update_step`, `update_input`, `logprobs`)
        self.update = PaddedUpdate() if update is None else update
        #: the mesh the state and the update live on: always a mesh, of one device when the
        #: config asks for none (`mesh` is None then)
        self.device_mesh = _make_mesh(config)
        #: the global rows of each rollout batch this process plays (all of them alone)
        B = config.env.batch_size
        self.rows = par.process_rows(self.device_mesh, B)
        self.multi_process = jax.process_count() > 1
        #: this process writes the run's files and logs
        self.primary = par.is_primary()
        if self.multi_process:
            _check_whole_groups(config, self.rows)
        #: the sampler runs on the mesh (a mesh in one process)
        self.sampler_on_mesh = self.mesh is not None and not self.multi_process
        #: the mesh the sampler runs on: the run's mesh in one process; with several, a mesh
        #: of this process's devices (`par.local_mesh`; None when it has one); None on one device
        self.sampler_mesh = (
            self.mesh if self.sampler_on_mesh else par.local_mesh(self.device_mesh) if self.multi_process else None
        )
        self._logprobs = self._values = None
        #: passes of the log-prob pass over a batch's rows (`update.logprob_rows`)
        B, logprob_rows = config.env.batch_size, config.update.logprob_rows
        self.logprob_chunks = 1 if logprob_rows is None else B // logprob_rows
        if logprob_rows is not None and logprob_rows % self.row_shards:
            raise ValueError(
                f"update.logprob_rows ({logprob_rows}) must be divisible by mesh.data * mesh.fsdp = {self.row_shards}"
            )
        if self.mesh is not None:
            layout = par.activation_constraint(self.mesh)
            rows = jax.NamedSharding(self.mesh, par.batch_spec(2))
            sc = config.step_config

            def logprobs(params, tokens_BxT, attention_mask_BxT, segment_ids_BxT, with_entropy, row_chunks):
                with decoder.activation_constraint(layout):
                    return _policy_logprobs(
                        params,
                        model_config,
                        tokens_BxT,
                        attention_mask_BxT,
                        segment_ids_BxT,
                        temperature=sc.loss.temperature,
                        seq_chunk=sc.seq_chunk,
                        vocab_chunk=sc.vocab_chunk,
                        row_chunks=row_chunks,
                        with_entropy=with_entropy,
                        compute_dtype=sc.compute_dtype,
                    )

            def values(critic_params, batch):
                with decoder.activation_constraint(layout):
                    return _cast_critic_values(
                        critic_params,
                        model_config,
                        batch,
                        compute_dtype=sc.compute_dtype,
                        row_chunks=self.logprob_chunks,
                    )

            #: the log-prob kernel on the mesh, by `with_entropy` (`row_chunks` static)
            self._logprobs = {
                flag: jax.jit(
                    functools.partial(logprobs, with_entropy=flag),
                    static_argnames=("row_chunks",),
                    out_shardings=(rows, rows) if flag else rows,
                )
                for flag in (False, True)
            }
            self._values = jax.jit(values, out_shardings=rows)

    # ------------------------------------------------------------------ description
    @property
    def row_offset(self) -> int:
        """The global index of this process's first rollout row."""
        return int(self.rows[0])

    @property
    def mesh(self):
        """The run's mesh of several devices, None on one device: what the sampler
        (`sampler_on_mesh`), the memory check, the log-prob, entropy and value passes and
        `Trainer.mesh` read as "one device" (`device_mesh` is the mesh the state is on)."""
        return None if self.device_mesh.devices.size == 1 else self.device_mesh

    @property
    def row_shards(self) -> int:
        """How many ways a batch's rows are split (data * fsdp; 1 on one device)."""
        return self.device_mesh.shape["data"] * self.device_mesh.shape["fsdp"]

    # ------------------------------------------------------------------ params and state
    def place_state(self, state):
        """The `TrainState` laid out for the update on `device_mesh`, by the logical-axis
        rules (on one device: the same buffers)."""
        return par.shard_train_state(state, self.device_mesh)

    def place_params(self, params):
        """Params laid out like the state's (the KL reference)."""
        return _place(params, par.param_shardings(params, self.device_mesh))

    def update_step(self, step_config, state, kind: str = "rl"):
        """`step(state, batch) -> (state, metrics)` of the update strategy (`update.step`:
        `make_update_step`, or the trimmed step) on `device_mesh`, for a state placed by
        `place_state`, taking mini-batches from `update_input`; state donated."""
        return self.update.step(step_config, state, self.device_mesh, kind=kind)

    def replicated(self, x):
        """`x` (a small array: the PRNG key) replicated over `device_mesh`."""
        return jax.device_put(x, jax.NamedSharding(self.device_mesh, jax.P()))

    def check_batch_rows(self, rows: int, what: str) -> None:
        """`ConfigError` when a batch of `rows` rows cannot be split over the mesh."""
        if rows % self.row_shards:
            raise ConfigError(
                f"{what}: {rows} rows per step must be divisible by mesh.data * mesh.fsdp = {self.row_shards}"
            )

    def sampler_params(self, state, *, copy: bool = False):
        """The params the sampler runs with (module docstring), on `sampler_mesh` by the
        sampler's rules (`ROLLOUT_AXIS_RULES`), in the compute dtype. `copy`: never the
        state's own buffers (a rollout that runs while the update donates them).

        One device-side program per call: the cast and the reshard from the update's
        layout (weights split over fsdp) to the sampler's (whole over data and fsdp), so
        the decode loop never gathers a weight. With several processes that program runs
        on the run's mesh (every process calls this at the same point of the loop) and each
        process keeps its own devices' shards as arrays of `sampler_mesh`
        (`par.to_local`): nothing is gathered to the host."""
        params = state.params
        compute = self.config.model.compute_dtype
        cast = compute if compute is not None and compute != self.config.model.dtype else None
        if self.multi_process:
            return par.to_local(params, self.device_mesh, self.sampler_mesh, prepare=_compute_cast(cast))
        # one process: on one device the sampler's layout is the state's (the same buffers)
        target = par.rollout_shardings(params, self.device_mesh)
        if (
            cast is None
            and not copy
            and all(x.sharding == t for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(target), strict=True))
        ):
            return params  # the update's layout is the sampler's (no fsdp split): the state's own
        return par.relayout(params, target, _compute_cast(cast))

    @property
    def sampler_params_shared(self) -> bool:
        """Whether `sampler_params` (without a cast or `copy`) is the state's own buffers:
        on one device, or on a mesh whose fsdp axis is 1 (the sampler's layout is the
        update's), in one process. Otherwise the sampler holds a copy of its own."""
        return not self.multi_process and self.device_mesh.shape["fsdp"] == 1

    # ------------------------------------------------------------------ batches
    def to_device(self, batch):
        """A host batch holding every row, placed for the update on `device_mesh` (rows
        split over ("data", "fsdp"))."""
        return par.place_batch(batch, self.device_mesh)

    def update_input(self, batch):
        """What the update step takes for a host mini-batch holding every row (the update
        strategy's `input`: the batch placed by `to_device`, or the batch itself for a
        step that places each micro-batch it cuts)."""
        return self.update.input(self, batch)

    def host_rows(self, tree):
        """Every row of `tree` (arrays from `global_batch` or a pass's output) as host
        NumPy arrays on every process (all-gathered over processes)."""
        return par.to_host(tree)

    def gathered(self, tree):
        """A pass's output (rows split over the mesh) as one-device arrays of every row;
        on one device as it is."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda x: jnp.asarray(par.to_host(x)), tree)

    def global_batch(self, traj, per_row):
        """`(traj, per_row, placed)`: this process's rollout rows become the global batch
        `placed` (the log-prob pass's input); `traj` and `per_row` (a pytree of host
        arrays with one entry per row, e.g. the episodes' success) are returned as
        host-side copies of every process's rows."""
        if self.mesh is None:
            return traj, per_row, traj
        placed, per_row_placed = par.global_batch(
            jax.tree.map(np.asarray, (traj, per_row)), self.mesh, self.config.env.batch_size
        )
        if self.multi_process:
            traj, per_row = par.to_host((placed, per_row_placed))
            traj = jax.tree.map(jnp.asarray, traj)
        return traj, per_row, placed

    def longest_episode(self, lengths) -> int:
        """The longest of this process's episode `lengths`, and with several processes the
        longest over all of them (an all-gather), so that their batches are cut alike."""
        own = int(np.max(np.asarray(lengths))) if len(lengths) else 0
        if not self.multi_process:
            return own
        return int(np.max(par.to_host(np.asarray([own], np.int32))))  # one number from each process

    def fetch(self, tree):
        """Replicated device values (metrics) as host values on every process."""
        return jax.device_get(tree) if not self.multi_process else par.to_host(tree)

    # ------------------------------------------------------------------ passes
    def logprobs(self, params, placed, *, with_entropy: bool = False):
        """`log pi(tokens)` `[B, T]` of a batch from `global_batch`, with `params` placed
        like the state's, by the update strategy's log-prob pass (`update.logprobs`); a
        host-side (one-device) array of every row. `with_entropy`: `(logp, entropy)`."""
        return self.update.logprobs(self, params, placed, with_entropy=with_entropy)

    def row_logprobs(
        self,
        params,
        tokens_BxT,
        attention_mask_BxT,
        segment_ids_BxT=None,
        *,
        row_chunks: int = 1,
        with_entropy: bool = False,
    ):
        """The log-prob kernel (`policy_logprobs` at the step config's temperature, chunks
        and compute dtype) on rows placed by `to_device` (split over the mesh, the
        activations laid out by its rules; `segment_ids_BxT` for packed rows), in
        `row_chunks` chunks of rows in turn; its output's rows split like its input's
        (`gathered`, `host_rows` bring them back)."""
        if self.mesh is None:
            sc = self.config.step_config
            return policy_logprobs(
                params,
                self.model_config,
                tokens_BxT=tokens_BxT,
                attention_mask_BxT=attention_mask_BxT,
                segment_ids_BxT=segment_ids_BxT,
                temperature=sc.loss.temperature,
                seq_chunk=sc.seq_chunk,
                vocab_chunk=sc.vocab_chunk,
                row_chunks=row_chunks,
                with_entropy=with_entropy,
                compute_dtype=sc.compute_dtype,
            )
        return self._logprobs[with_entropy](
            params, tokens_BxT, attention_mask_BxT, segment_ids_BxT, row_chunks=row_chunks
        )

    def entropies(self, params, placed, rows, passes: int, chunk: int):
        """Token entropies `[B, T]` of `params` on `rows` (global indices) of a batch from
        `global_batch`, NaN on the other rows; None when `rows` is None (nothing to keep).
        On one device the pass covers only those rows, padded to `passes` passes of
        `chunk` rows (one shape: one compilation; `chunk` at most the log-prob pass's rows,
        so its memory is within the run's estimate). On a mesh every process runs the
        log-prob pass with entropies over the whole batch, whatever its `rows` (the pass is
        collective)."""
        if self.mesh is not None:
            return self.logprobs(params, placed, with_entropy=True)[1]
        if rows is None:
            return None
        rows = np.asarray(rows)
        take = np.concatenate([rows, np.full(passes * chunk - len(rows), rows[0])])
        segments = None if placed.segment_ids is None else placed.segment_ids[take]
        _, ent = self.row_logprobs(
            params, placed.tokens[take], placed.attention_mask[take], segments, row_chunks=passes, with_entropy=True
        )
        out = np.full(np.shape(placed.tokens), np.nan, np.float32)
        out[rows] = np.asarray(ent)[: len(rows)]
        return out

    def values(self, state, placed):
        """The critic's values `[B, T]` of a batch from `global_batch` (host-side)."""
        rows = ModelInputs(tokens=placed.tokens, attention_mask=placed.attention_mask, segment_ids=placed.segment_ids)
        if self.mesh is None:
            return _critic_values(
                state.critic_params,
                state.critic_config,
                rows,
                compute_dtype=self.config.step_config.compute_dtype,
                row_chunks=self.logprob_chunks,
            )
        return jnp.asarray(par.to_host(self._values(state.critic_params, rows)))


def _make_mesh(cfg):
    """The config's mesh; an all-1 mesh section is a mesh of the first device in one
    process, of every device with several."""
    mc = cfg.mesh
    if all(v == 1 for v in mc.shape.values()) and jax.process_count() > 1:
        mc = MeshConfig(data=-1)
    devices = None
    if -1 not in mc.shape.values() and mc.num_devices < jax.device_count() and jax.process_count() == 1:
        devices = jax.devices()[: mc.num_devices]
    try:
        mesh = par.make_mesh(mc, devices)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    try:
        check_mesh_rows(cfg.env.batch_size, cfg.update.mini_batches, mesh.shape["data"] * mesh.shape["fsdp"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return mesh


def _check_whole_groups(cfg, rows: np.ndarray) -> None:
    """Advantages need whole groups: each process must play whole groups of the batch."""
    G, B = cfg.env.group_size, cfg.env.batch_size
    whole = (
        rows.size
        and rows.size % G == 0
        and rows[0] % G == 0
        and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size))
    )
    if not whole:
        raise ConfigError(
            f"distributed: process {jax.process_index()} of {jax.process_count()} would play rows "
            f"{rows.tolist()} of the rollout batch of {B}, not whole groups of env.group_size {G}; "
            f"make env.tasks_per_iteration a multiple of the processes (rows per process "
            f"{B // jax.process_count()} must be a multiple of {G})"
        )
    if cfg.algo.dynamic_sampling:
        raise ConfigError(
            "algo.dynamic_sampling is not supported with several processes (each would "
            "choose its own groups); turn it off or run one process"
        )


def _place(tree, shardings):
    """`tree` placed by `shardings` (every process holds the same values; global arrays
    are resharded)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, s)
        h = np.asarray(x)
        return jax.make_array_from_callback(h.shape, s, lambda idx: h[idx])

    return jax.tree.map(put, tree, shardings)
