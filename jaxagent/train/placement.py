"""Where a run's arrays live: one object for one device, a mesh, or several processes.

`Placement(config)` decides the device mode once; the loop then asks it, without
branching on the mode itself, to:

- place the `TrainState` and the KL reference (`place_state`, `place_params`: by the
  logical-axis rules on a mesh, as they are on one device);
- build the update (`update_step(step_config, state, kind)`: `train_step` / `sft_step`
  on one device, `make_sharded_train_step` on a mesh) and place its mini-batches
  (`to_device`: rows split over ("data", "fsdp"));
- turn this process's rollout rows into the global batch (`global_batch`: every
  process also keeps a host copy of all rows for shaping, advantages and metrics);
- run the log-prob and value passes on the placed params (`logprobs`, `values`);
- bring replicated results to the host (`fetch`);
- give the sampler its params (`sampler_params`: the state's own on one device; on a
  mesh laid out by the sampler's own rules, `ROLLOUT_AXIS_RULES`: weights whole over
  data and fsdp, split over tensor, in one device-side reshard per update; with several
  processes on `sampler_mesh`, a mesh of this process's own devices, with no trip
  through the host: `jaxagent.parallel.rollout.to_local`);
- check the run's per-device memory before anything is compiled (`check_memory`).

Modes: no mesh (an all-1 `mesh` section in one process) is exactly the single-device
loop. A mesh in one process samples on the mesh too (`Sampler(mesh=...)`). With several
processes each process plays its own whole groups of the rollout batch (`rows`;
`row_offset` is the global index of its first row, so its sampling keys are those one
process playing the whole batch would draw) on every one of its devices
(`sampler_mesh`: its rows split over them, the weights split over "tensor" where the
process holds the whole tensor axis, else whole); a process with one device samples on it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import parallel as par
from jaxagent.config import ConfigError
from jaxagent.models import decoder
from jaxagent.parallel import MeshConfig
from jaxagent.train import memory
from jaxagent.train.step import (
    TrimmedTrainStep,
    UpdateBatch,
    _length_runs,
    critic_values,
    for_compute,
    length_groups,
    make_sharded_train_step,
    row_lengths,
    sft_step,
    train_step,
)


def _policy_logprobs(params, config, tokens_BxT, attention_mask_BxT, *, temperature: float,
                     seq_chunk: int, vocab_chunk: int, row_chunks: int = 1, with_entropy: bool = False,
                     compute_dtype: str | None = None):
    from jaxagent.models import token_logprobs

    params = for_compute(params, compute_dtype)

    def one(tokens, mask):
        logp, ent = token_logprobs(params, config, tokens, attention_mask_BxT=mask,
                                   temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
        return (logp, ent) if with_entropy else logp

    return _in_row_chunks(lambda xs: one(*xs), (tokens_BxT, attention_mask_BxT), row_chunks)


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


#: `log pi(tokens[t] | tokens[:t])` `[B, T]` as `train_step` computes it (same kernel);
#: `row_chunks` > 1 runs it on that many chunks of rows in turn (less memory, same values
#: to float32 rounding); `with_entropy` returns `(logp, entropy)`, the entropy of each
#: next-token distribution (for the episode store).
policy_logprobs = jax.jit(_policy_logprobs, static_argnames=("config", "temperature", "seq_chunk", "vocab_chunk",
                                                             "row_chunks", "with_entropy", "compute_dtype"))


def trimmed_logprobs(params, config, tokens_BxT, attention_mask_BxT, lengths, *, chunk_rows: int, multiple: int,
                     with_entropy: bool = False, logprobs=None, place=None, fetch=np.asarray, **kw):
    """`policy_logprobs` in chunks of `chunk_rows` rows grouped by length (`length_groups`:
    rows sorted by `lengths`), each chunk cut to its longest row rounded up to `multiple`;
    consecutive chunks of one length go in one call. The same values as one pass at every
    position of a row up to its length, 0 after its chunk's length (padding). A host-side
    `[B, T]` array (`(logp, entropy)` with `with_entropy`). `kw`: `policy_logprobs`'s
    `temperature`, `seq_chunk`, `vocab_chunk`, `compute_dtype`. `logprobs`: the pass to
    call as `logprobs(params, tokens, mask, row_chunks=, with_entropy=)` (default
    `policy_logprobs` with `config` and `kw`); `place`: applied to each cut `(tokens,
    mask)` before the call (e.g. rows split over a mesh); `fetch`: brings a call's output
    to the host (`jaxagent.parallel.to_host` for arrays that span processes)."""
    if logprobs is None:
        def logprobs(params, tokens, mask, **more):
            return policy_logprobs(params, config, tokens_BxT=tokens, attention_mask_BxT=mask, **kw, **more)
    tokens_BxT, attention_mask_BxT = np.asarray(tokens_BxT), np.asarray(attention_mask_BxT)
    B, T = tokens_BxT.shape
    parts = []
    for run, L in _length_runs(length_groups(lengths, B // chunk_rows, multiple, T)):
        # rows interleaved so that `row_chunks`'s chunk j (rows j, j + n, ...) is the run's group j
        idx = np.stack(run, axis=1).reshape(-1)
        cut = (tokens_BxT[idx, :L], attention_mask_BxT[idx, :L])
        out = logprobs(params, *(cut if place is None else place(cut)), row_chunks=len(run), with_entropy=with_entropy)
        parts.append((idx, L, out))
    full = [np.zeros((B, T), np.float32) for _ in range(2 if with_entropy else 1)]
    for idx, L, out in parts:
        for f, x in zip(full, out if with_entropy else (out,)):
            f[idx, :L] = fetch(x)
    full = [jnp.asarray(f) for f in full]
    return tuple(full) if with_entropy else full[0]


def _cast_critic_values(critic_params, critic_config, batch, *, compute_dtype=None, row_chunks: int = 1):
    """`critic_values` in `compute_dtype`, over `row_chunks` chunks of rows in turn (as
    `_policy_logprobs` cuts them: `logprob_rows` bounds this pass's memory too)."""
    params = for_compute(critic_params, compute_dtype)
    return _in_row_chunks(lambda b: critic_values(params, critic_config, b), batch, row_chunks)


_critic_values = jax.jit(_cast_critic_values, static_argnames=("critic_config", "compute_dtype", "row_chunks"))


#: the sampler's params in the compute dtype (jitted: a sharded state stays sharded)
_cast_for_sampler = jax.jit(for_compute, static_argnames=("compute_dtype",))


@functools.lru_cache(maxsize=None)
def _compute_cast(compute_dtype: str | None):
    """`params -> params` in `compute_dtype` (None: no cast), one object per dtype (the
    relayout's compilation cache is keyed by it)."""
    return None if compute_dtype is None else functools.partial(for_compute, compute_dtype=compute_dtype)


class Placement:
    """Device placement of one run (see the module docstring).

    Args:
      config: the `TrainerConfig` (its `mesh`, batch sizes and step config).
      model_config: the policy's `DecoderConfig` (for the log-prob pass).
    JAX's multi-process runtime must already be initialised (`parallel.initialize`).
    """

    def __init__(self, config, model_config):
        self.config = config
        self.model_config = model_config
        self.mesh = _make_mesh(config)   # None = one device
        #: the global rows of each rollout batch this process plays (all of them alone)
        B = config.env.batch_size
        self.rows = np.arange(B) if self.mesh is None else par.process_rows(self.mesh, B)
        self.multi_process = jax.process_count() > 1
        #: this process writes the run's files and logs
        self.primary = par.is_primary()
        if self.multi_process:
            _check_whole_groups(config, self.rows)
        #: the sampler runs on the mesh (a mesh in one process)
        self.sampler_on_mesh = self.mesh is not None and not self.multi_process
        #: the mesh the sampler runs on: the run's mesh in one process; with several, a mesh
        #: of this process's devices (`par.local_mesh`; None when it has one); None on one device
        self.sampler_mesh = self.mesh if self.sampler_on_mesh else \
            par.local_mesh(self.mesh) if self.multi_process else None
        self._logprobs = self._values = None
        #: `rollout.trim_chunks`: the update's micro-batches and the log-prob pass's row
        #: chunks cut to their own rows' length (every process cuts the same chunks from
        #: its host copy of the batch)
        self.trim_chunks = config.rollout.trim_chunks
        if self.trim_chunks and self.mesh is not None:
            micro = config.env.batch_size // (config.mini_batches * config.micro_batches)
            if micro % self.row_shards:
                raise ConfigError(f"rollout.trim_chunks on a mesh: each micro-batch's {micro} rows (env.group_size * "
                                  f"env.tasks_per_iteration / mini_batches / micro_batches) are split over "
                                  f"mesh.data * mesh.fsdp = {self.row_shards} and must be divisible by it")
        #: passes of the log-prob pass over a batch's rows (`logprob_rows`)
        B = config.env.batch_size
        self.logprob_chunks = 1 if config.logprob_rows is None else B // config.logprob_rows
        if self.mesh is not None and config.logprob_rows is not None and config.logprob_rows % self.row_shards:
            raise ValueError(f"logprob_rows ({config.logprob_rows}) must be divisible by mesh.data * mesh.fsdp "
                             f"= {self.row_shards}")
        if self.mesh is not None:
            layout = par.activation_constraint(self.mesh)
            rows = jax.NamedSharding(self.mesh, par.batch_spec(2))
            sc = config.step_config

            def logprobs(params, tokens_BxT, attention_mask_BxT, with_entropy, row_chunks):
                with decoder.activation_constraint(layout):
                    return _policy_logprobs(params, model_config, tokens_BxT, attention_mask_BxT,
                                            temperature=sc.loss.temperature, seq_chunk=sc.seq_chunk,
                                            vocab_chunk=sc.vocab_chunk, row_chunks=row_chunks,
                                            with_entropy=with_entropy, compute_dtype=sc.compute_dtype)

            def values(critic_params, batch):
                with decoder.activation_constraint(layout):
                    return _cast_critic_values(critic_params, model_config, batch, compute_dtype=sc.compute_dtype,
                                               row_chunks=self.logprob_chunks)

            self._logprobs = {
                flag: jax.jit(functools.partial(logprobs, with_entropy=flag, row_chunks=self.logprob_chunks),
                              out_shardings=(rows, rows) if flag else rows)
                for flag in (False, True)}
            #: the cut chunks' pass (`rollout.trim_chunks`): rows split over the mesh
            self._trimmed_logprobs_fn = jax.jit(logprobs, static_argnames=("row_chunks", "with_entropy"))
            self._values = jax.jit(values, out_shardings=rows)

    # ------------------------------------------------------------------ description
    @property
    def row_offset(self) -> int:
        """The global index of this process's first rollout row."""
        return int(self.rows[0])

    @property
    def row_shards(self) -> int:
        """How many ways a batch's rows are split (data * fsdp; 1 on one device)."""
        return 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def describe(self) -> str:
        return "one device" if self.mesh is None else " x ".join(f"{k}={v}" for k, v in self.mesh.shape.items())

    # ------------------------------------------------------------------ params and state
    def place_state(self, state):
        """The `TrainState` laid out for the update (by the logical-axis rules on a mesh)."""
        return state if self.mesh is None else par.shard_train_state(state, self.mesh)

    def place_params(self, params):
        """Params laid out like the state's (the KL reference)."""
        if self.mesh is None:
            return params
        return _place(params, par.param_shardings(params, self.mesh))

    def update_step(self, step_config, state, kind: str = "rl"):
        """`step(state, batch) -> (state, metrics)` for a state placed by `place_state`,
        taking batches placed by `to_device`; jitted once, state donated."""
        if self.mesh is None:
            if self.trim_chunks and kind == "rl":
                return TrimmedTrainStep(step_config, self.config.rollout.trim_padding)
            return functools.partial(train_step if kind == "rl" else sft_step, config=step_config)
        if self.trim_chunks and kind == "rl":
            return TrimmedTrainStep(step_config, self.config.rollout.trim_padding, mesh=self.mesh)
        return make_sharded_train_step(step_config, state, self.mesh, kind=kind)

    def replicated(self, x):
        """`x` (a small array: the PRNG key) replicated over the mesh."""
        return x if self.mesh is None else jax.device_put(x, jax.NamedSharding(self.mesh, jax.P()))

    def check_batch_rows(self, rows: int, what: str) -> None:
        """`ConfigError` when a batch of `rows` rows cannot be split over the mesh."""
        if rows % self.row_shards:
            raise ConfigError(f"{what}: {rows} rows per step must be divisible by mesh.data * mesh.fsdp = "
                              f"{self.row_shards}")

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
        if self.mesh is None:
            if cast is not None:   # a cast copy: never the state's buffers
                return _cast_for_sampler(params, cast)
            return jax.tree.map(jnp.copy, params) if copy else params
        if self.multi_process:
            return par.to_local(params, self.mesh, self.sampler_mesh, prepare=_compute_cast(cast))
        target = par.rollout_shardings(params, self.mesh)
        if cast is None and not copy and all(
                x.sharding == t for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(target))):
            return params   # the update's layout is the sampler's (no fsdp split): the state's own
        return par.relayout(params, target, _compute_cast(cast))

    @property
    def sampler_params_shared(self) -> bool:
        """Whether `sampler_params` (without a cast or `copy`) is the state's own buffers:
        on one device, or on a mesh whose fsdp axis is 1 (the sampler's layout is the
        update's), in one process. Otherwise the sampler holds a copy of its own."""
        if self.mesh is None:
            return True
        return not self.multi_process and self.mesh.shape["fsdp"] == 1

    # ------------------------------------------------------------------ batches
    def to_device(self, batch):
        """A host batch holding every row, placed for the update (rows split on a mesh)."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, batch)
        return par.place_batch(batch, self.mesh)

    def update_input(self, batch):
        """What the update step takes for a host mini-batch holding every row: the batch
        placed (`to_device`), or with `rollout.trim_chunks` the batch itself, since
        `TrimmedTrainStep` places each micro-batch it cuts from it."""
        return batch if self.trim_chunks else self.to_device(batch)

    def global_batch(self, traj, per_row):
        """`(traj, per_row, placed)`: this process's rollout rows become the global batch
        `placed` (the log-prob pass's input); `traj` and `per_row` (a pytree of host
        arrays with one entry per row, e.g. the episodes' success) are returned as
        host-side copies of every process's rows."""
        if self.mesh is None:
            return traj, per_row, traj
        placed, per_row_placed = par.global_batch(jax.tree.map(np.asarray, (traj, per_row)), self.mesh,
                                                  self.config.env.batch_size)
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
        return int(np.max(par.to_host(np.asarray([own], np.int32))))   # one number from each process

    def fetch(self, tree):
        """Replicated device values (metrics) as host values on every process."""
        return jax.device_get(tree) if not self.multi_process else par.to_host(tree)

    # ------------------------------------------------------------------ passes
    def logprobs(self, params, placed, *, with_entropy: bool = False):
        """`log pi(tokens)` `[B, T]` of a batch from `global_batch`, with `params` placed
        like the state's; a host-side (one-device) array of every row. `with_entropy`:
        `(logp, entropy)`."""
        if self.trim_chunks:
            return self._trimmed_logprobs(params, placed, with_entropy)
        if self.mesh is None:
            sc = self.config.step_config
            return policy_logprobs(params, self.model_config, tokens_BxT=placed.tokens,
                                   attention_mask_BxT=placed.attention_mask, temperature=sc.loss.temperature,
                                   seq_chunk=sc.seq_chunk, vocab_chunk=sc.vocab_chunk,
                                   row_chunks=self.logprob_chunks, with_entropy=with_entropy,
                                   compute_dtype=sc.compute_dtype)
        out = self._logprobs[with_entropy](params, placed.tokens, placed.attention_mask)
        return jax.tree.map(lambda x: jnp.asarray(par.to_host(x)), out)

    def _trimmed_logprobs(self, params, placed, with_entropy: bool):
        """`trimmed_logprobs` over a batch from `global_batch` (`rollout.trim_chunks`), in
        chunks of `logprob_rows` rows or else of the update's micro-batch rows."""
        cfg, sc = self.config, self.config.step_config
        B = placed.tokens.shape[0]
        rows = cfg.logprob_rows or max(1, B // (cfg.mini_batches * cfg.micro_batches))
        if self.mesh is not None:   # rows split over the mesh, activations laid out by its rules
            tokens, mask, loss = par.to_host((placed.tokens, placed.attention_mask, placed.loss_mask))
            probe = UpdateBatch(tokens=tokens, loss_mask=loss, advantages=loss, old_logp=loss, attention_mask=mask)
            return trimmed_logprobs(params, self.model_config, probe.tokens, probe.attention_mask, row_lengths(probe),
                                    chunk_rows=rows, multiple=cfg.rollout.trim_padding, with_entropy=with_entropy,
                                    logprobs=self._trimmed_logprobs_fn, place=lambda cut: par.place_batch(cut, self.mesh),
                                    fetch=par.to_host)
        probe = UpdateBatch(tokens=placed.tokens, loss_mask=placed.loss_mask, advantages=placed.loss_mask,
                            old_logp=placed.loss_mask, attention_mask=placed.attention_mask)
        return trimmed_logprobs(params, self.model_config, placed.tokens, placed.attention_mask, row_lengths(probe),
                                chunk_rows=rows, multiple=cfg.rollout.trim_padding, with_entropy=with_entropy,
                                temperature=sc.loss.temperature, seq_chunk=sc.seq_chunk,
                                vocab_chunk=sc.vocab_chunk, compute_dtype=sc.compute_dtype)

    def values(self, state, placed):
        """The critic's values `[B, T]` of a batch from `global_batch` (host-side)."""
        # critic_values reads the tokens and the attention fields of a batch only
        probe = UpdateBatch(tokens=placed.tokens, loss_mask=placed.loss_mask, advantages=placed.loss_mask,
                            old_logp=placed.loss_mask, attention_mask=placed.attention_mask)
        if self.mesh is None:
            return _critic_values(state.critic_params, state.critic_config, probe,
                                  compute_dtype=self.config.step_config.compute_dtype, row_chunks=self.logprob_chunks)
        return jnp.asarray(par.to_host(self._values(state.critic_params, probe)))

    # ------------------------------------------------------------------ memory
    def check_memory(self, log) -> dict:
        """Logs the per-device memory estimate and returns it; raises `DoesNotFitError`
        (naming every component) when it exceeds the device's memory (`memory_stats`,
        else `device_memory_gb`, else no check). Call before anything is compiled."""
        cfg, model_config = self.config, self.model_config
        common = dict(param_dtype=cfg.model.dtype)
        est = memory.estimate_memory(model_config, cfg.step_config, self.mesh,
                                     batch_size=cfg.env.batch_size // cfg.mini_batches,
                                     seq_len=cfg.rollout.max_context, critic=cfg.algo.uses_critic, **common)
        # the sampler on its own mesh (the run's in one process, this process's devices with
        # several), its params laid out by its own rules: whole over data and fsdp, so more
        # per device than the update's under fsdp; its rows and KV cache over the row axes
        sampler = memory.estimate_memory(model_config, cfg.step_config, self.sampler_mesh,
                                         batch_size=1, seq_len=1, sample_batch=len(self.rows),
                                         sample_len=cfg.rollout.max_context, rules=par.ROLLOUT_AXIS_RULES, **common)
        est["kv_cache"] = sampler["kv_cache"]
        compute = cfg.model.compute_dtype
        cast = compute is not None and compute != cfg.model.dtype
        ratio = np.dtype(compute).itemsize / np.dtype(cfg.model.dtype).itemsize if cast else 1.0
        sampler_params = int(ratio * sampler["params"])   # the sampler's copy, in the compute dtype
        if cast:   # the update's cast copy (in the update's layout) and the sampler's (in its own)
            policy_params = est["params"] if not cfg.algo.uses_critic else memory.estimate_memory(
                model_config, cfg.step_config, self.mesh, batch_size=1, seq_len=1, **common)["params"]
            est["compute_params"] = int(ratio * policy_params) + sampler_params
        elif not self.sampler_params_shared:   # a copy of its own (fsdp > 1, or several processes)
            est["sampler_params"] = sampler_params
        if cfg.loss.kl_coef > 0 or cfg.algo.kl_reward_coef > 0:
            if model_config.lora is not None:   # a copy of the adapters: the float32 trainable leaves
                est["reference"] = est["grads"] // (2 if cfg.micro_batches > 1 else 1)
            else:
                est["reference"] = est["params"] if not cfg.algo.uses_critic else memory.estimate_memory(
                    model_config, cfg.step_config, self.mesh, batch_size=1, seq_len=1, **common)["params"]
        # the log-prob passes (old policy, reference) run before the update, over the batch's
        # rows `logprob_rows` at a time: the run needs the larger of the two activation figures
        rows = (len(self.rows) if self.multi_process else cfg.env.batch_size) // self.logprob_chunks
        est["logprob_pass"] = memory.forward_activation_bytes(
            model_config, cfg.step_config, self.mesh, rows=rows, seq_len=cfg.rollout.max_context, **common)
        # the sampler's appends (in pieces of APPEND_CHUNK tokens) and decodes run during the
        # rollout, on one pipeline group's rows (or the continuous scheduler's slots) at a time
        from jaxagent.rollout.sampler import APPEND_CHUNK, unroll_layers_default

        sampler_mesh, sampled = self.sampler_mesh, cfg.rollout.sampler_rows(len(self.rows))
        est["prefill"] = memory.prefill_bytes(model_config, sampler_mesh, rows=sampled,
                                              max_len=cfg.rollout.max_context, chunk=APPEND_CHUNK,
                                              param_dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype,
                                              rules=par.ROLLOUT_AXIS_RULES)
        est["decode"] = memory.decode_bytes(model_config, sampler_mesh, rows=sampled, max_len=cfg.rollout.max_context,
                                            unroll_layers=unroll_layers_default(), param_bytes=sampler_params,
                                            param_dtype=cfg.model.dtype, compute_dtype=cfg.model.compute_dtype,
                                            rules=par.ROLLOUT_AXIS_RULES)
        passes = ["activations", "logprob_pass", "prefill", "decode"]   # one at a time
        if cfg.warm_start.enabled:   # the warm start's SFT steps, before RL, beside a second optimizer state
            from jaxagent.train.warmstart import sft_rows_at_most, sft_step_config

            sft = memory.estimate_memory(model_config, sft_step_config(cfg), self.mesh, batch_size=sft_rows_at_most(cfg),
                                         seq_len=cfg.rollout.max_context, **common)
            est["warm_start"] = sft["activations"] + sft["grads"] + sft["opt_state"]
            passes.append("warm_start")
        est["total"] = sum(v for k, v in est.items() if k not in ("total", *passes)) \
            + max(est[k] for k in passes)
        where = "device"
        try:
            device_bytes = memory.device_memory_bytes()
        except ValueError:
            device_bytes = None if cfg.device_memory_gb is None else int(cfg.device_memory_gb * 2**30)
            if device_bytes is None and jax.local_devices()[0].platform == "cpu":
                host = memory.host_memory_bytes()   # CPU devices share the host's RAM
                if host is not None:
                    device_bytes, where = host // jax.local_device_count(), "host RAM available"
        log(memory.format_memory(est, device_bytes) + ("" if where == "device" or device_bytes is None else
                                                         f" ({where} / {jax.local_device_count()} devices)"))
        if device_bytes is None:
            log("memory check skipped: the device does not report its memory (set device_memory_gb)")
            return est
        try:
            memory.check_fits(est, device_bytes)
        except memory.DoesNotFitError as e:
            raise memory.DoesNotFitError(f"this config does not fit ({self.describe()}): {e}") from None
        return est


def _make_mesh(cfg):
    """The config's mesh, or None for one device (an all-1 mesh, one process)."""
    mc = cfg.mesh
    if all(v == 1 for v in mc.shape.values()):
        if jax.process_count() == 1:
            return None
        mc = MeshConfig(data=-1)
    devices = None
    if -1 not in mc.shape.values() and mc.num_devices < jax.device_count() and jax.process_count() == 1:
        devices = jax.devices()[:mc.num_devices]
    try:
        mesh = par.make_mesh(mc, devices)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    if mesh.devices.size == 1:
        return None
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    mb = cfg.env.batch_size // cfg.mini_batches
    if mb % shards:
        raise ConfigError(f"mesh: the mini-batch size {mb} (env.group_size * env.tasks_per_iteration / "
                          f"mini_batches) must be divisible by mesh.data * mesh.fsdp = {shards}")
    return mesh


def _check_whole_groups(cfg, rows: np.ndarray) -> None:
    """Advantages need whole groups: each process must play whole groups of the batch."""
    G, B = cfg.env.group_size, cfg.env.batch_size
    whole = rows.size and rows.size % G == 0 and rows[0] % G == 0 and np.array_equal(
        rows, np.arange(rows[0], rows[0] + rows.size))
    if not whole:
        raise ConfigError(
            f"distributed: process {jax.process_index()} of {jax.process_count()} would play rows "
            f"{rows.tolist()} of the rollout batch of {B}, not whole groups of env.group_size {G}; "
            f"make env.tasks_per_iteration a multiple of the processes (rows per process "
            f"{B // jax.process_count()} must be a multiple of {G})")
    if cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling is not supported with several processes (each would "
                          "choose its own groups); turn it off or run one process")


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
