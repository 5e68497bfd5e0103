"""The ragged update: `TrimmedTrainStep` computes `train_step`'s update with each
micro-batch cut to its own rows' length, from the rows' lengths (`row_lengths`), their
grouping into equal micro-batches by length (`length_groups`) and the runs of groups of
one length that go in one call (`length_runs`). The trimmed log-prob pass
(`jaxagent.train.placement.trimmed_logprobs`) cuts its chunks of rows the same way.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models import decoder as _decoder
from jaxagent.parallel.distributed import place_batch, to_host
from jaxagent.parallel.mesh import activation_constraint
from jaxagent.train.batch import UpdateBatch, batch_denominators, check_batch, required_fields
from jaxagent.train.losses import policy_loss_and_grads
from jaxagent.train.state import Grads, TrainState, split_trainable, state_shardings
from jaxagent.train.step_config import StepConfig
from jaxagent.train.update import accumulate, apply_gradients, has_signal, within, zero_accumulator


def row_lengths(batch) -> np.ndarray:
    """`[B]` int: 1 + the last position of each row that is a real token or a loss token
    (`attention_mask` or `loss_mask` non-zero; `T` for every row without an attention
    mask), 0 for an empty row. Under a causal model nothing after it changes the loss."""
    loss = np.asarray(batch.loss_mask) != 0
    B, T = loss.shape
    if batch.attention_mask is None:
        return np.full(B, T, np.int64)
    real = loss | (np.asarray(batch.attention_mask) != 0)
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
        rows = order[k * b:(k + 1) * b]
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
    out = accumulate(policy_loss_and_grads, state, micro, dataclasses.replace(config, num_micro_batches=n),
                     denominators)
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
    return jax.tree.map(lambda x: to_host(x) if isinstance(x, jax.Array) and not x.is_fully_addressable
                        else np.asarray(x), tree)


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

    `mesh`: `make_sharded_train_step`'s mesh, in one process or several: the state is
    placed by `shard_train_state`, each cut micro-batch's rows are split over ("data",
    "fsdp") (the micro-batch's rows must divide by data * fsdp), the activations are
    laid out by the same rules, and the state keeps its layout. The batch holds every
    row: host arrays (each process passing the same ones) or global arrays on the mesh
    (all-gathered to every host), so every process cuts the same micro-batches.
    `last_lengths`: the micro-batch lengths of the last call.
    """

    def __init__(self, config: StepConfig, multiple: int, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"TrimmedTrainStep: multiple must be an int >= 1, got {multiple!r}")
        self.config, self.multiple, self.mesh = config, multiple, mesh
        self.last_lengths: list[int] = []
        self.lengths_seen: set[int] = set()
        #: the jitted parts, built on the first call (on a mesh they pin the state's layout)
        self._add = self._prepare = self._finish = None

    def _build(self, state: TrainState):
        config, mesh = self.config, self.mesh
        add = functools.partial(_micro_add, config=config)
        prepare = functools.partial(_trimmed_prepare, config=config)
        finish = functools.partial(_trimmed_finish, config=config)
        if mesh is None:
            return (jax.jit(add, static_argnames=("n",), donate_argnums=(3,)),
                    jax.jit(prepare, static_argnames=("rows",)), jax.jit(finish, donate_argnums=(0,)))
        layout = activation_constraint(mesh)
        traced = functools.partial(within, lambda: _decoder.activation_constraint(layout))

        replicated = jax.NamedSharding(mesh, jax.P())
        trainable, _ = split_trainable(state.params)
        grads = Grads(policy=jax.tree.map(lambda x: x.sharding, trainable),
                      critic=jax.tree.map(lambda x: x.sharding, state.critic_params) if state.has_critic else None)
        acc = (grads, replicated)   # the accumulated gradients laid out as their params; the sums replicated
        return (jax.jit(traced(add), static_argnames=("n",), donate_argnums=(3,), out_shardings=acc),
                jax.jit(traced(prepare), static_argnames=("rows",), out_shardings=(replicated, replicated, acc)),
                jax.jit(finish, donate_argnums=(0,), out_shardings=(state_shardings(state), replicated)))

    def _place(self, micro):
        return micro if self.mesh is None else place_batch(micro, self.mesh)

    def accumulate(self, state: TrainState, batch: UpdateBatch):
        """`((grads, sums), denominators, has_signal)`: the accumulated mini-batch gradient
        (before clipping) and loss parts the step applies (`accumulated_grads`'s, trimmed)."""
        config, M = self.config, self.config.num_micro_batches
        check_batch(batch, required_fields(config, state.has_critic), M)
        if self._add is None:
            self._add, self._prepare, self._finish = self._build(state)
        if self.mesh is not None:
            batch = _whole_on_host(batch)   # each micro-batch is cut on the host, then placed
        B, T = batch.tokens.shape
        groups = length_groups(row_lengths(batch), M, self.multiple, T)
        denominators, signal, acc = self._prepare(state, self._place(batch), rows=B // M)
        for run, L in length_runs(groups):   # micro-batches of one length: one call, a scan over them
            rows = np.concatenate(run)
            micro = self._place(jax.tree.map(lambda x: x[rows, :L], batch))
            acc = self._add(state, micro, denominators, acc, n=len(run))
        self.last_lengths = [L for _, L in groups]
        self.lengths_seen.update(self.last_lengths)
        return acc, denominators, signal

    def __call__(self, state: TrainState, batch: UpdateBatch) -> tuple[TrainState, dict]:
        acc, denominators, signal = self.accumulate(state, batch)
        return self._finish(state, acc, denominators, signal)
