"""The ragged update: `TrimmedTrainStep` computes `train_step`'s update with each
micro-batch cut to its own rows' length, from the rows' lengths (`row_lengths`), their
grouping into equal micro-batches by length (`length_groups`) and the runs of groups of
one length that go in one call (`length_runs`). The trimmed log-prob pass
(`trimmed_logprobs`) cuts its chunks of rows the same way. `TrimmedUpdate` is the update
strategy (`update.trim_chunks`) made of the two, beside `jaxagent.train.update.PaddedUpdate`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.parallel.distributed import place_batch, to_host
from jaxagent.parallel.mesh import MeshConfig, make_mesh, shard_train_state
from jaxagent.train.config.step import StepConfig
from jaxagent.train.update import (
    accumulate,
    apply_gradients,
    has_signal,
    make_update_step,
    on_mesh,
    zero_accumulator,
)
from jaxagent.train.update.batch import UpdateBatch, batch_denominators, check_batch, required_fields
from jaxagent.train.update.losses import policy_loss_and_grads
from jaxagent.train.update.state import Grads, TrainState, split_trainable, state_shardings


def row_lengths(loss_mask_BxT, attention_mask_BxT=None) -> np.ndarray:
    """`[B]` int: 1 + the last position of each row that is a real token or a loss token
    (`attention_mask_BxT` or `loss_mask_BxT` non-zero; `T` for every row without an
    attention mask), 0 for an empty row. Under a causal model nothing after it changes
    the loss."""
    loss = np.asarray(loss_mask_BxT) != 0
    B, T = loss.shape
    if attention_mask_BxT is None:
        return np.full(B, T, np.int64)
    real = loss | (np.asarray(attention_mask_BxT) != 0)
    last = np.where(real.any(axis=1), T - np.argmax(real[:, ::-1], axis=1), 0)
    return last.astype(np.int64)


def length_groups(lengths, num_groups: int, multiple: int, max_len: int) -> list[tuple[np.ndarray, int]]:
    """`(rows, L)` for each of `num_groups` equal groups of rows: the rows sorted by length
    (stable: ties keep their order), cut in turn, `L` the group's longest row rounded up
    to a multiple of `multiple`, at most `max_len` (and at least `multiple`)."""
    lengths = np.asarray(lengths)
    B = len(lengths)
    if not isinstance(num_groups, int) or num_groups < 1 or B % num_groups:
        raise ValueError(f"length_groups: {B} rows do not split into {num_groups!r} equal groups")
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"length_groups: multiple must be an int >= 1, got {multiple!r}")
    order = np.argsort(lengths, kind="stable")
    b = B // num_groups
    out = []
    for k in range(num_groups):
        rows = order[k * b : (k + 1) * b]
        longest = int(lengths[rows].max()) if b else 0
        out.append((rows, min(max_len, max(multiple, -(-longest // multiple) * multiple))))
    return out


def length_runs(groups: list[tuple[np.ndarray, int]]) -> list[tuple[list[np.ndarray], int]]:
    """`length_groups`'s groups as runs of consecutive groups of one length: `(rows of
    each group, L)`, so that a run can go in one call."""
    runs: list[tuple[list[np.ndarray], int]] = []
    for rows, L in groups:
        if runs and runs[-1][1] == L:
            runs[-1][0].append(rows)
        else:
            runs.append(([rows], L))
    return runs


def _micro_add(state, micro, denominators, acc, *, config, n):
    """`acc` plus the gradients and sums of `micro`'s rows, as `n` micro-batches of one
    length (a `lax.scan`, like `train_step`'s, when `n > 1`)."""
    out = accumulate(
        policy_loss_and_grads, state, micro, dataclasses.replace(config, num_micro_batches=n), denominators
    )
    return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out)


def _trimmed_prepare(state, batch, *, config, rows):
    """The mini-batch's denominators, its `has_signal` and a zero accumulator."""
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    first = jax.tree.map(lambda x: x[:rows], batch)
    zeros = zero_accumulator(policy_loss_and_grads, state, first, config, denominators)
    return denominators, has_signal(state, batch, config), zeros


def _trimmed_finish(state, acc, denominators, signal, *, config):
    """The optimizer step on the accumulated gradients (`apply_gradients`)."""
    grads, sums = acc
    return apply_gradients(state, grads, sums, config, denominators, signal)


def _whole_on_host(tree):
    """Every row of a batch as NumPy arrays: arrays spread over several processes are
    all-gathered, the rest (host arrays, a process's own device arrays) copied."""
    return jax.tree.map(
        lambda x: to_host(x) if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x), tree
    )


class TrimmedTrainStep:
    """`step(state, batch) -> (state, metrics)`: `train_step`'s update with each
    micro-batch cut to its own rows' length. The mini-batch's rows are sorted by length
    (`row_lengths`) and cut into `num_micro_batches` equal groups (`length_groups`), each
    group computed at its longest row rounded up to a multiple of `multiple`, not at the
    mini-batch's `T`. The denominators (`N`, `S`, `T'`: Dr.GRPO's default `T'` is the
    mini-batch's `T`) are the mini-batch's, so the accumulated loss and gradient are
    `train_step`'s, up to float32 summation order; less padding is computed (under
    attention's `T^2`, much less when episode lengths vary). The calls are host-driven:
    one per run of micro-batches of one length (a `lax.scan` over the run, as
    `train_step`'s), compiled once per length and run length, then the optimizer step
    (state donated).

    `mesh`: `make_update_step`'s mesh, in one process or several (default: a mesh of
    one device, `jax.devices()[0]`): each cut micro-batch's rows are split over ("data",
    "fsdp") (the micro-batch's rows must divide by data * fsdp), the activations are
    laid out by the same rules, and the state keeps its layout: `shard_train_state`'s (a
    state not on `mesh` is placed there first; on one device, in the same buffers). The
    batch holds every row: host arrays (each process passing the same ones) or global
    arrays on the mesh (all-gathered to every host), so every process cuts the same
    micro-batches.
    `last_lengths`: the micro-batch lengths of the last call.
    """

    def __init__(self, config: StepConfig, multiple: int, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"TrimmedTrainStep: multiple must be an int >= 1, got {multiple!r}")
        if mesh is None:
            mesh = make_mesh(MeshConfig(), jax.devices()[:1])
        self.config, self.multiple, self.mesh = config, multiple, mesh
        self.last_lengths: list[int] = []
        self.lengths_seen: set[int] = set()
        #: the jitted parts, built on the first call (they pin the state's layout then)
        self._add: Any = None
        self._prepare: Any = None
        self._finish: Any = None

    def _build(self, state: TrainState):
        config, mesh = self.config, self.mesh
        add = functools.partial(on_mesh(_micro_add, mesh), config=config)
        prepare = functools.partial(on_mesh(_trimmed_prepare, mesh), config=config)
        finish = functools.partial(_trimmed_finish, config=config)
        replicated = jax.NamedSharding(mesh, jax.P())
        trainable, _ = split_trainable(state.params)
        grads = Grads(
            policy=jax.tree.map(lambda x: x.sharding, trainable),
            critic=jax.tree.map(lambda x: x.sharding, state.critic_params) if state.has_critic else None,
        )
        acc = (grads, replicated)  # the accumulated gradients laid out as their params; the sums replicated
        return (
            jax.jit(add, static_argnames=("n",), donate_argnums=(3,), out_shardings=acc),
            jax.jit(prepare, static_argnames=("rows",), out_shardings=(replicated, replicated, acc)),
            jax.jit(finish, donate_argnums=(0,), out_shardings=(state_shardings(state), replicated)),
        )

    def placed(self, state: TrainState) -> TrainState:
        """`state` on the step's mesh: as it is when every leaf is there, else laid out by
        the rules (`shard_train_state`)."""
        on = all(
            isinstance(s := getattr(x, "sharding", None), jax.NamedSharding) and s.mesh == self.mesh
            for x in jax.tree.leaves(state)
        )
        return state if on else shard_train_state(state, self.mesh)

    def accumulate(self, state: TrainState, batch: UpdateBatch):
        """`((grads, sums), denominators, has_signal)`: the accumulated mini-batch gradient
        (before clipping) and loss parts the step applies (`accumulated_grads`'s, trimmed)."""
        config, M = self.config, self.config.num_micro_batches
        state = self.placed(state)
        check_batch(batch, required_fields(config, state.has_critic), M)
        if self._add is None:
            self._add, self._prepare, self._finish = self._build(state)
        batch = _whole_on_host(batch)  # each micro-batch is cut on the host, then placed
        B, T = batch.tokens.shape
        groups = length_groups(row_lengths(batch.loss_mask, batch.attention_mask), M, self.multiple, T)
        denominators, signal, acc = self._prepare(state, place_batch(batch, self.mesh), rows=B // M)
        for run, L in length_runs(groups):  # micro-batches of one length: one call, a scan over them
            rows = np.concatenate(run)
            micro = place_batch(jax.tree.map(lambda x, rows=rows, L=L: x[rows, :L], batch), self.mesh)
            acc = self._add(state, micro, denominators, acc, n=len(run))
        self.last_lengths = [L for _, L in groups]
        self.lengths_seen.update(self.last_lengths)
        return acc, denominators, signal

    def __call__(self, state: TrainState, batch: UpdateBatch) -> tuple[TrainState, dict]:
        state = self.placed(state)
        acc, denominators, signal = self.accumulate(state, batch)
        return self._finish(state, acc, denominators, signal)


# ----------------------------------------------------------------------------- the trimmed log-prob pass
def trimmed_logprobs(
    params,
    config,
    tokens_BxT,
    attention_mask_BxT,
    lengths,
    *,
    segment_ids_BxT=None,
    chunk_rows: int,
    multiple: int,
    with_entropy: bool = False,
    logprobs=None,
    place=None,
    fetch=np.asarray,
    **kw,
):
    """`policy_logprobs` in chunks of `chunk_rows` rows grouped by length (`length_groups`:
    rows sorted by `lengths`), each chunk cut to its longest row rounded up to `multiple`;
    consecutive chunks of one length go in one call. The same values as one pass at every
    position of a row up to its length, 0 after its chunk's length (padding). A host-side
    `[B, T]` array (`(logp, entropy)` with `with_entropy`). `kw`: `policy_logprobs`'s
    `temperature`, `seq_chunk`, `vocab_chunk`, `compute_dtype`. `segment_ids_BxT`: packed
    rows' sequences (cut with the rows). `logprobs`: the pass to call as
    `logprobs(params, tokens, mask, segments, row_chunks=, with_entropy=)` (default
    `jaxagent.train.placement.policy_logprobs` with `config` and `kw`); `place`: applied
    to each cut `(tokens, mask, segments)` before the call (e.g. rows split over a mesh); `fetch`:
    brings a call's output to the host (`jaxagent.parallel.to_host` for arrays that span
    processes)."""
    if logprobs is None:
        from jaxagent.train.placement import policy_logprobs

        def logprobs(params, tokens, mask, segments, **more):
            return policy_logprobs(
                params, config, tokens_BxT=tokens, attention_mask_BxT=mask, segment_ids_BxT=segments, **kw, **more
            )

    tokens_BxT, attention_mask_BxT = np.asarray(tokens_BxT), np.asarray(attention_mask_BxT)
    segments = None if segment_ids_BxT is None else np.asarray(segment_ids_BxT)
    B, T = tokens_BxT.shape
    parts = []
    for run, L in length_runs(length_groups(lengths, B // chunk_rows, multiple, T)):
        # rows interleaved so that `row_chunks`'s chunk j (rows j, j + n, ...) is the run's group j
        idx = np.stack(run, axis=1).reshape(-1)
        cut = (tokens_BxT[idx, :L], attention_mask_BxT[idx, :L], None if segments is None else segments[idx, :L])
        out = logprobs(params, *(cut if place is None else place(cut)), row_chunks=len(run), with_entropy=with_entropy)
        parts.append((idx, L, out))
    full = [np.zeros((B, T), np.float32) for _ in range(2 if with_entropy else 1)]
    for idx, L, out in parts:
        for f, x in zip(full, out if with_entropy else (out,), strict=True):
            f[idx, :L] = fetch(x)
    full = [jnp.asarray(f) for f in full]
    return tuple(full) if with_entropy else full[0]


# ----------------------------------------------------------------------------- the trimmed strategy
class TrimmedUpdate:
    """The update strategy of `update.trim_chunks` (`jaxagent.train.update.PaddedUpdate`
    lists the parts): the RL update a `TrimmedTrainStep` (each micro-batch cut to its rows'
    length, rounded up to `multiple`), which takes the host mini-batch and places each
    micro-batch it cuts; the SFT update the padded one; the log-prob pass `trimmed_logprobs`
    in chunks of `logprob_rows` rows, else of the update's micro-batch rows (the batch's
    rows / `micro_batches`, the micro-batches of all its mini-batches). On a mesh every
    process cuts the same chunks from its host copy of the batch."""

    def __init__(self, multiple: int, *, logprob_rows: int | None = None, micro_batches: int = 1):
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"TrimmedUpdate: multiple must be an int >= 1, got {multiple!r}")
        self.multiple, self.logprob_rows, self.micro_batches = multiple, logprob_rows, micro_batches

    def step(self, config: StepConfig, state: TrainState, mesh: jax.sharding.Mesh, *, kind: str = "rl"):
        """A `TrimmedTrainStep` on `mesh` (kind "rl"); the SFT step is the padded one,
        `make_update_step`."""
        if kind != "rl":
            return make_update_step(config, state, mesh, kind=kind)
        return TrimmedTrainStep(config, self.multiple, mesh=mesh)

    def input(self, place, batch):
        """The host mini-batch itself: `TrimmedTrainStep` places each micro-batch it cuts."""
        return batch

    def logprobs(self, place, params, placed, *, with_entropy: bool = False):
        """`trimmed_logprobs` of a batch from `Placement.global_batch` (all its rows on the
        host), each cut chunk placed by `place.to_device` and run by `place.row_logprobs`."""
        tokens, mask, loss, segments = place.host_rows(
            (placed.tokens, placed.attention_mask, placed.loss_mask, placed.segment_ids)
        )
        B = tokens.shape[0]
        rows = self.logprob_rows or max(1, B // self.micro_batches)
        return trimmed_logprobs(
            params,
            None,
            tokens,
            mask,
            row_lengths(loss, mask),
            segment_ids_BxT=segments,
            chunk_rows=rows,
            multiple=self.multiple,
            with_entropy=with_entropy,
            logprobs=place.row_logprobs,
            place=place.to_device,
            fetch=place.host_rows,
        )
