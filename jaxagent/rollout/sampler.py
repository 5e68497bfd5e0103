"""A jitted KV-cache sampler: prefill / append and an on-device decode loop.

The sampler keeps one `SamplerState` per batch of rows: the decoder's compacted
`KVCache` (per-row lengths, so rows of different lengths share a batch), the
next-token logits of each row (from the last token appended to it), and one PRNG
key per row. Three jitted kernels act on it:

* `append` feeds `T` new tokens per row (a prompt on an empty cache = prefill; an
  observation on a live cache = continuation). Rows with no new tokens are left
  alone. Afterwards each fed row's next-token logits are those at its last new token.
* `decode` samples up to `max_new_tokens` tokens per row in a `lax.while_loop` that
  exits as soon as every row is done. Each sampled token is fed to the cache in the
  same iteration, so after `decode` the cache holds every token of the rows' history,
  including the last sampled one: a following `append` continues exactly there.
* `select_rows` gathers rows of a state (to shrink the batch when rows finish).

Shapes are static per call; the host side (`Sampler`) pads the new-token axis to a
power-of-two bucket, so the number of compilations is bounded by the number of
distinct (batch, bucket, sampling config) combinations. `Sampler.trace_counts`
counts how often each kernel was traced (= compiled).

The kernels are in `jaxagent.rollout.kernels`, the sampling configs and the draw in
`jaxagent.rollout.sampling`; this module is the host side (`Sampler`).

Sampling (`SamplingConfig`: temperature, top-k, top-p, min-p, in the Hugging Face order;
greedy at temperature 0) and the log-prob a sampled token is given are described in
`jaxagent.rollout.sampling`. Randomness: row `b`'s token at cache position `p` uses
`fold_in(key_b, p)`, so a row's samples depend only on its own key and history, never on
which other rows share the batch or on how the batch was re-bucketed.

Finish reasons (`FINISH_REASONS[finish_reason]`): `none` (row not decoded),
`stop_token`, `stop_sequence`, `max_new_tokens`, `cache_full` (the row's cache has
no free slot for another token: the episode cannot go on).

Sharded sampling (`Sampler(..., mesh=mesh)`, one process): "rows over data and fsdp,
heads over tensor", by the sampler's own rules (`jaxagent.parallel.ROLLOUT_AXIS_RULES`).
Params are placed by them: whole over data and fsdp (decode reads every weight each
token, so an fsdp split would all-gather the weights inside the decode loop, per token),
split over tensor as in training; they are laid out once when set (`Sampler.params`), not
per token. The KV cache by `decoder.ACTIVATION_AXES["cache_kv"]` (rows over ("data",
"fsdp"), kv heads over "tensor"); every other per-row array (logits, keys, lengths, host
inputs, outputs) has its rows over the batch axes. Params already laid out on a mesh of
several devices of this process (`jaxagent.parallel.to_local`: the sampler of one
process of a multi-process run) make the sampler sample on that mesh without `mesh=`.
Each layout goes through `logical_to_spec`, so a row count (e.g. a shrunk bucket) or a
kv-head count the mesh axes do not divide is split over the longest dividing prefix of
the axes, or replicated: it still runs, only less split. The kernels are traced under the
decoder's `activation_constraint` hook, which pins the residual stream and the cache to
those layouts. Without a mesh nothing changes (the hook is unset, so the compiled code is
the unsharded one).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxagent.models import decoder
from jaxagent.models.config import DecoderConfig
from jaxagent.parallel import mesh as pmesh
from jaxagent.parallel.rollout import params_mesh
from jaxagent.rollout.kernels import (
    FINISH_REASONS,
    Generation,
    SamplerState,
    append_kernel,
    copy_rows_kernel,
    decode_kernel,
    put_rows_kernel,
    reset_rows_kernel,
    select_rows_kernel,
    truncate_rows_kernel,
    unroll_layers_default,
)
from jaxagent.rollout.sampling import GREEDY, SamplingConfig


# ---------------------------------------------------------------- host side
def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def _sampler_mesh(params, mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """`Sampler`'s mesh: `mesh`, else the one `params` are laid out on (None = unsharded).
    A sampler's calls are its own process's alone, so a mesh that spans other processes'
    devices is refused here, before anything is placed on it."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"Sampler: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if mesh is None:  # params laid out on a mesh of this process's devices: sample there
        try:
            mesh = params_mesh(params)
        except ValueError as e:
            raise ValueError(f"Sampler: {e}") from None
    if mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        raise ValueError(
            f"Sampler: the mesh spans {len({d.process_index for d in mesh.devices.flat})} "
            "processes; a sampler runs on devices of its own process "
            "(jaxagent.parallel.local_mesh)"
        )
    return mesh


class Sampler:
    """Host front-end: pads inputs to buckets and calls the jitted kernels.

    Args:
      params, config: the decoder (`jaxagent.models`).
      max_len: cache slots per row (prompt + everything appended and generated).
      cache_dtype: dtype of the KV cache (default: the params' dtype).
      min_bucket: smallest padded length of an `append` (new-token axis).
      pad_id: token id written in unused output slots.
      window_segments: decode attends over growing windows of the cache in this many
        segments (`decode_kernel`); 1 = the whole cache at every step.
      unroll_layers: decode with the layers unrolled on per-layer cache buffers
        (`decode_kernel`; the same results bit for bit, faster on a CPU, slower to compile).
        None = on for the CPU backend (`unroll_layers_default`).
      mesh: a ("data", "fsdp", "tensor") `jax.sharding.Mesh` (`jaxagent.parallel.make_mesh`)
        to sample sharded on, of this process's devices. None = the mesh `params` are
        laid out on when that is a `NamedSharding` over several devices of this process
        (`jaxagent.parallel.to_local`'s output), else unsharded, exactly as without it.
        Params are placed with `param_shardings(params, mesh, rules)` (here and by the
        `params` setter); states, inputs and outputs have their rows over the batch
        axes and the cache's kv heads over "tensor" (see the module docstring). A row
        count the batch axes do not divide (a small `select_rows` bucket) falls back to
        the longest dividing prefix of the batch axes, or to replicated rows.
      rules: the logical-axis rules (default `jaxagent.parallel.ROLLOUT_AXIS_RULES`: weights
        whole over data and fsdp; the training rules would all-gather them every token).

    `trace_counts` counts traces of each kernel (`append`, `decode`, `select`); each
    trace is one XLA compilation.
    """

    def __init__(
        self,
        params,
        config: DecoderConfig,
        *,
        max_len: int,
        cache_dtype=None,
        min_bucket: int = 16,
        pad_id: int = 0,
        window_segments: int = 3,
        mesh: jax.sharding.Mesh | None = None,
        rules: pmesh.Rules = pmesh.ROLLOUT_AXIS_RULES,
        unroll_layers: bool | None = None,
    ):
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"Sampler: max_len must be a positive int, got {max_len!r}")
        self.mesh, self.rules = _sampler_mesh(params, mesh), tuple(rules)
        self.config, self.max_len = config, max_len
        self.params = params
        self.cache_dtype = cache_dtype or params["final_norm"]["scale"].dtype
        self.min_bucket, self.pad_id = int(min_bucket), int(pad_id)
        self.window_segments = int(window_segments)
        self.unroll_layers = unroll_layers_default() if unroll_layers is None else bool(unroll_layers)
        self.trace_counts: collections.Counter = collections.Counter()
        self._build_kernels()

    def _jit(self, name: str, kernel: Callable, **jit_kw: Any) -> Callable:
        """`jax.jit` of `kernel`, counted in `trace_counts[name]`, traced under the mesh's
        layout hook and with its output (a state, or a state and a `Generation`) pinned to
        the mesh layout: every kernel needs all three, so they are done in one place."""

        @functools.wraps(kernel)  # its signature: `static_argnames` / `donate_argnames` go by it
        def traced(*args, **kwargs):
            self.trace_counts[name] += 1
            with self._layout():
                out = kernel(*args, **kwargs)
                if isinstance(out, SamplerState):
                    return self._pin_state(out)
                state, gen = out
                return self._pin_state(state), self._pin_rows(gen)

        traced.__name__ = name  # the compiled module's name (`jit_decode`), as in profiles
        return jax.jit(traced, **jit_kw)

    def _build_kernels(self) -> None:
        """The jitted kernels the host methods call (`_jit`). The decode settings are read
        from the sampler when a kernel is traced; `config` is the one it was built with."""
        config, donate, static = self.config, ("state",), ("sampling", "max_new_tokens")

        def append(params, state, tokens, mask):
            return append_kernel(params, config, state, tokens, mask)

        def decode(params, state, active, max_new, stop_tokens, stop_seqs, sampling, max_new_tokens):
            return decode_kernel(
                params,
                config,
                state,
                active,
                max_new,
                stop_tokens,
                stop_seqs,
                sampling=sampling,
                max_new_tokens=max_new_tokens,
                pad_id=self.pad_id,
                window_segments=self.window_segments,
                unroll_layers=self.unroll_layers,
            )

        def decode_rows(
            params, state, rows, tokens, mask, active, max_new, stop_tokens, stop_seqs, sampling, max_new_tokens
        ):
            sub = select_rows_kernel(state, rows)
            if tokens is not None:
                sub = append(params, sub, tokens, mask)
            sub, gen = decode(params, sub, active, max_new, stop_tokens, stop_seqs, sampling, max_new_tokens)
            return put_rows_kernel(state, rows, sub), gen

        def append_rows(params, state, rows, tokens, mask):
            return put_rows_kernel(state, rows, append(params, select_rows_kernel(state, rows), tokens, mask))

        self._append = self._jit("append", append, donate_argnames=donate)
        self._decode = self._jit("decode", decode, static_argnames=static, donate_argnames=donate)
        self._decode_rows = self._jit("decode_rows", decode_rows, static_argnames=static, donate_argnames=donate)
        self._select = self._jit("select", select_rows_kernel)
        self._reset = self._jit("reset", reset_rows_kernel, donate_argnames=donate)
        self._truncate = self._jit("truncate", truncate_rows_kernel, donate_argnames=donate)
        self._copy = self._jit("copy", copy_rows_kernel, donate_argnames=donate)
        self._append_rows = self._jit("append_rows", append_rows, donate_argnames=donate)

    # -------------------------------------------------------------- sharding
    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        """New params (with a mesh: placed by `param_shardings` under the sampler's rules,
        one reshard per call; a no-op if already so)."""
        if self.mesh is not None:
            params = jax.device_put(params, pmesh.param_shardings(params, self.mesh, self.rules))
        self._params = params

    def _sharding(self, axes: Sequence[str | None], shape: Sequence[int]) -> jax.sharding.NamedSharding:
        assert self.mesh is not None  # mesh samplers only
        return jax.sharding.NamedSharding(self.mesh, pmesh.logical_to_spec(axes, shape, self.mesh, self.rules))

    def _row_sharding(self, shape: Sequence[int]) -> jax.sharding.NamedSharding:
        """Rows (axis 0) over the batch axes (divisibility fallback), the rest whole."""
        return self._sharding(("batch",) + (None,) * (len(shape) - 1), shape)

    def state_shardings(self, state: SamplerState) -> SamplerState:
        """The `NamedSharding`s a state of this shape has on the mesh (mesh samplers only)."""
        cache = state.cache
        # a state-shaped pytree of shardings (the fields hold arrays in a state, shardings here)
        return SamplerState(
            cache=decoder.KVCache(
                k=self._sharding(decoder.ACTIVATION_AXES["cache_kv"], cache.k.shape),
                v=self._sharding(decoder.ACTIVATION_AXES["cache_kv"], cache.v.shape),
                lengths=self._sharding(decoder.ACTIVATION_AXES["cache_lengths"], cache.lengths.shape),
            ),
            next_logits_BxV=self._row_sharding(state.next_logits_BxV.shape),
            keys_B=self._row_sharding(state.keys_B.shape),
        )

    def _layout(self):
        """The decoder's activation layout hook while a kernel is traced (mesh only)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return decoder.activation_constraint(pmesh.activation_constraint(self.mesh, self.rules))

    def _pin_state(self, state: SamplerState) -> SamplerState:
        if self.mesh is None:
            return state
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    def _pin_rows(self, tree):
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._row_sharding(x.shape)), tree)

    def _put_rows(self, x: np.ndarray) -> jax.Array:
        """A host per-row array on the device(s): rows over the batch axes with a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, self._row_sharding(x.shape))

    # -------------------------------------------------------------- state
    def init_state(self, batch: int, seed: int = 0, row_ids: Sequence[int] | np.ndarray | None = None) -> SamplerState:
        """An empty state for `batch` rows; row `b`'s key is `fold_in(key(seed), row_ids[b])`.

        With a mesh the state is created sharded (`state_shardings`)."""
        keys = self.row_keys(batch, seed, row_ids, "init_state")
        if self.mesh is None:
            cache = decoder.init_cache(self.config, batch, self.max_len, self.cache_dtype)
            logits = jnp.zeros((batch, self.config.vocab_size), jnp.float32)
            return SamplerState(cache=cache, next_logits_BxV=logits, keys_B=keys)
        # a state-shaped pytree of shapes (the fields hold arrays in a state, shapes here)
        shapes = SamplerState(
            cache=jax.eval_shape(lambda: decoder.init_cache(self.config, batch, self.max_len, self.cache_dtype)),
            next_logits_BxV=jax.ShapeDtypeStruct((batch, self.config.vocab_size), jnp.float32),
            keys_B=keys,
        )
        shard = self.state_shardings(shapes)
        cache = decoder.KVCache(
            k=jnp.zeros(shapes.cache.k.shape, shapes.cache.k.dtype, device=shard.cache.k),
            v=jnp.zeros(shapes.cache.v.shape, shapes.cache.v.dtype, device=shard.cache.v),
            lengths=jnp.zeros((batch,), jnp.int32, device=shard.cache.lengths),
        )
        logits = jnp.zeros((batch, self.config.vocab_size), jnp.float32, device=shard.next_logits_BxV)
        return SamplerState(cache=cache, next_logits_BxV=logits, keys_B=jax.device_put(keys, shard.keys_B))

    @staticmethod
    def row_keys(
        batch: int, seed: int, row_ids: Sequence[int] | np.ndarray | None = None, what: str = "row_keys"
    ) -> jax.Array:
        """Row `b`'s sampling key, `fold_in(key(seed), row_ids[b])` (`row_ids` default:
        `0 .. batch - 1`): what it samples depends on its id, not on the row it is in."""
        row_ids = np.arange(batch) if row_ids is None else np.asarray(row_ids)
        if row_ids.shape != (batch,):
            raise ValueError(f"{what}: row_ids must have length {batch}, got shape {row_ids.shape}")
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.asarray(row_ids, jnp.uint32))

    def prefill(
        self, prompts: Sequence[Sequence[int]], seed: int = 0, row_ids: Sequence[int] | np.ndarray | None = None
    ) -> SamplerState:
        """A new state holding `prompts`, row `b`'s key from `row_ids[b]` (`init_state`):
        `append(init_state(len(prompts), seed, row_ids), prompts)`, except that equal
        prompts (a group's episodes of one task) are prefilled once and their cache rows
        copied, so the prefill's work is that of the distinct prompts. The distinct
        prompts are padded to a power of two rows (with repeats), so the prefill compiles
        for few shapes. The rows are `append`'s up to float32 rounding (fewer rows in the
        prefill's matmuls); the tokens sampled from them are the same
        (`tests/test_rollout_sampler.py`)."""
        B = len(prompts)
        keys = self.row_keys(B, seed, row_ids, "prefill")
        distinct: dict[tuple, int] = {}
        source = [
            distinct.setdefault(tuple(int(t) for t in (p if p is not None else ())), len(distinct)) for p in prompts
        ]
        U = min(bucket(len(distinct), 1), B)
        if U >= B:  # nothing to share
            return self.append(self.init_state(B, seed, row_ids), prompts)
        unique = [list(p) for p in distinct]
        unique += [unique[0]] * (U - len(unique))
        state = self.select_rows(self.append(self.init_state(U, seed), unique), source)
        if self.mesh is not None:
            keys = jax.device_put(keys, self.state_shardings(state).keys_B)
        return state.replace(keys_B=keys)

    def free_slots(self, state: SamplerState) -> np.ndarray:
        """Free cache slots per row (host copy; waits for the state)."""
        return self.max_len - np.asarray(jax.device_get(state.cache.lengths))

    def select_rows(self, state: SamplerState, rows: Sequence[int] | np.ndarray) -> SamplerState:
        """A new state holding rows `rows` of `state` (in that order; repeats allowed)."""
        rows = np.asarray(rows, np.int32)
        if self.mesh is not None:  # the index is replicated; the result's rows are laid out by `_pin_state`
            return self._select(state, jax.device_put(rows, jax.sharding.NamedSharding(self.mesh, P())))
        return self._select(state, jnp.asarray(rows))

    def reset_rows(
        self, state: SamplerState, rows: Sequence[int] | np.ndarray, seed: int, row_ids: Sequence[int] | np.ndarray
    ) -> SamplerState:
        """`state` with rows `rows` emptied for new sequences: row `rows[j]` gets the key
        `fold_in(key(seed), row_ids[j])`, as `init_state` gives it, so what it samples
        does not depend on the row it is in. `state` is donated."""
        rows = np.asarray(rows, np.int32)
        row_ids = np.asarray(row_ids)
        if rows.ndim != 1 or rows.shape != row_ids.shape:
            raise ValueError(
                f"reset_rows: rows and row_ids must be equal-length lists, got shapes {rows.shape} and {row_ids.shape}"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= state.batch_size):
            raise ValueError(f"reset_rows: rows must be in [0, {state.batch_size}), got {rows.tolist()}")
        if not rows.size:
            return state
        # padded to the batch by repeating the first entry (the same write again), so
        # one compilation serves any number of rows
        pad = state.batch_size - rows.size
        rows = np.concatenate([rows, np.full(pad, rows[0], np.int32)])
        row_ids = np.concatenate([row_ids, np.full(pad, row_ids[0], row_ids.dtype)])
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.asarray(row_ids, jnp.uint32))
        if self.mesh is not None:
            rep = jax.sharding.NamedSharding(self.mesh, P())
            return self._reset(state, jax.device_put(rows, rep), jax.device_put(keys, rep))
        return self._reset(state, jnp.asarray(rows), keys)

    def truncate_rows(
        self, state: SamplerState, rows: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray
    ) -> SamplerState:
        """`state` with row `rows[j]` cut back to its first `lengths[j]` cached tokens (a row
        holding fewer keeps what it holds), its key kept: the next tokens appended go at
        position `lengths[j]`. Append at least one token to a cut row before decoding it
        (its next-token logits are those of its old last token). `state` is donated."""
        rows = np.asarray(rows, np.int32)
        lengths = np.asarray(lengths, np.int32)
        if rows.ndim != 1 or rows.shape != lengths.shape:
            raise ValueError(
                "truncate_rows: rows and lengths must be equal-length lists, "
                f"got shapes {rows.shape} and {lengths.shape}"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= state.batch_size):
            raise ValueError(f"truncate_rows: rows must be in [0, {state.batch_size}), got {rows.tolist()}")
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"truncate_rows: lengths must be >= 0, got {lengths.tolist()}")
        if not rows.size:
            return state
        pad = state.batch_size - rows.size  # one compilation for any number of rows
        rows = np.concatenate([rows, np.full(pad, rows[0], np.int32)])
        lengths = np.concatenate([lengths, np.full(pad, lengths[0], np.int32)])
        if self.mesh is not None:
            rep = jax.sharding.NamedSharding(self.mesh, P())
            return self._truncate(state, jax.device_put(rows, rep), jax.device_put(lengths, rep))
        return self._truncate(state, jnp.asarray(rows), jnp.asarray(lengths))

    def copy_rows(
        self, state: SamplerState, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray
    ) -> SamplerState:
        """`state` with row `dst[j]` holding row `src[j]`'s cache and next-token logits (its own
        key kept): a prefix prefilled once serves others. `dst` distinct, none a `src`; donated."""
        src, dst, B = np.asarray(src, np.int32), np.asarray(dst, np.int32), state.batch_size
        if src.ndim != 1 or src.shape != dst.shape:
            raise ValueError(f"copy_rows: src and dst must be equal-length lists, got {src.shape} and {dst.shape}")
        if len(set(dst.tolist())) != dst.size or set(dst.tolist()) & set(src.tolist()):
            raise ValueError(f"copy_rows: dst rows must be distinct and not sources, got src {src} dst {dst}")
        if dst.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= B):
            raise ValueError(f"copy_rows: rows must be in [0, {B})")
        if not dst.size:
            return state
        n = 1 << (dst.size - 1).bit_length()  # padded with the first copy again: few compilations
        src = np.concatenate([src, np.full(n - src.size, src[0], np.int32)])
        dst = np.concatenate([dst, np.full(n - dst.size, dst[0], np.int32)])
        if self.mesh is not None:
            rep = jax.sharding.NamedSharding(self.mesh, P())
            return self._copy(state, jax.device_put(src, rep), jax.device_put(dst, rep))
        return self._copy(state, jnp.asarray(src), jnp.asarray(dst))

    def append_rows(self, state: SamplerState, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> SamplerState:
        """`append` of `tokens[j]` to row `rows[j]` (distinct rows), in a call whose work is
        that of those rows (padded to a power of two with untouched rows), not of the whole
        state. Raises ValueError when tokens do not fit. `state` is donated."""
        rows = [int(r) for r in rows]
        B = state.batch_size
        if not rows or len(set(rows)) != len(rows) or min(rows) < 0 or max(rows) >= B:
            raise ValueError(f"append_rows: rows must be distinct rows of the state (0..{B - 1}), got {rows}")
        if len(tokens) != len(rows):
            raise ValueError(f"append_rows: got token lists for {len(tokens)} rows, expected {len(rows)}")
        R = min(bucket(len(rows), 1), B)
        others = [r for r in range(B) if r not in set(rows)]
        idx = np.asarray(rows + others[: R - len(rows)], np.int32)
        arr, mask = self._token_arrays(
            list(tokens) + [None] * (R - len(rows)), self.free_slots(state)[idx], "append_rows"
        )
        if self.mesh is not None:
            idx_d = jax.device_put(idx, jax.sharding.NamedSharding(self.mesh, P()))
        else:
            idx_d = jnp.asarray(idx)
        return self._append_rows(self.params, state, idx_d, self._put_rows(arr), self._put_rows(mask))

    # -------------------------------------------------------------- kernels
    def append(self, state: SamplerState, tokens: Sequence[Sequence[int] | None]) -> SamplerState:
        """Feed each row its new tokens (`None` or `[]` = nothing for that row).

        Raises ValueError when a row's tokens do not fit in its cache (see
        `free_slots`): tokens are never silently dropped. `state` is donated.
        """
        B = state.batch_size
        if len(tokens) != B:
            raise ValueError(f"append: got token lists for {len(tokens)} rows, the state has {B}")
        arr, mask = self._token_arrays(tokens, self.free_slots(state), "append")
        return self._append(self.params, state, self._put_rows(arr), self._put_rows(mask))

    def _token_arrays(self, tokens, free, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Padded `[B, T]` token ids and mask of per-row token lists, checked against the
        vocabulary and each row's free cache slots `free`."""
        B = len(tokens)
        lens = [0 if t is None else len(t) for t in tokens]
        T = bucket(max(lens), self.min_bucket)
        arr = np.zeros((B, T), np.int32)
        mask = np.zeros((B, T), np.int32)
        for b, t in enumerate(tokens):
            if t is not None and len(t):
                arr[b, : len(t)] = np.asarray(t, np.int32)
                mask[b, : len(t)] = 1
        if arr.min(initial=0) < 0 or arr.max(initial=0) >= self.config.vocab_size:
            raise ValueError(
                f"{what}: token ids must be in [0, {self.config.vocab_size}), got range [{arr.min()}, {arr.max()}]"
            )
        over = [b for b in range(B) if lens[b] > free[b]]
        if over:
            b = over[0]
            raise ValueError(
                f"{what}: row {b} gets {lens[b]} tokens but its cache has {free[b]} free slots "
                f"(max_len {self.max_len}); {len(over)} row(s) overflow"
            )
        return arr, mask

    def decode(
        self,
        state: SamplerState,
        *,
        max_new_tokens: int,
        sampling: SamplingConfig = GREEDY,
        active: Sequence[bool] | None = None,
        max_new: Sequence[int] | None = None,
        stop_tokens: Sequence[Sequence[int]] | Sequence[int] | None = None,
        stop_sequences: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> tuple[SamplerState, Generation]:
        """Sample from every active row until it stops; `state` is donated.

        max_new_tokens: static cap (the output width N); `max_new` lowers it per row.
        stop_tokens: one list for all rows, or one list per row.
        stop_sequences: per row, a list of token sequences (matched on generated tokens).
        """
        B = state.batch_size
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"decode: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        act = np.ones((B,), bool) if active is None else np.asarray(active, bool)
        mx = (
            np.full((B,), max_new_tokens, np.int32)
            if max_new is None
            else np.minimum(np.asarray(max_new, np.int32), max_new_tokens)
        )
        if act.shape != (B,) or mx.shape != (B,):
            raise ValueError(f"decode: active / max_new must have one entry per row ({B})")
        st = _stop_token_array(stop_tokens, B)
        sq = _stop_seq_array(stop_sequences, B)
        return self._decode(
            self.params,
            state,
            self._put_rows(act),
            self._put_rows(mx),
            self._put_rows(st),
            self._put_rows(sq),
            sampling,
            max_new_tokens,
        )

    def decode_rows(
        self,
        state: SamplerState,
        rows: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig = GREEDY,
        max_new: Sequence[int] | None = None,
        stop_tokens: Sequence[int] | None = None,
        stop_sequences: Sequence[Sequence[int]] | None = None,
        tokens: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[SamplerState, Generation]:
        """`decode` of rows `rows` of `state` only (distinct; the others are left as they
        are), in one call that gathers them, appends `tokens[j]` to row `rows[j]` (as
        `append` would; None = nothing), decodes and puts them back: the work is that of
        a batch of `len(rows)` rows (padded to a power of two, and to at least an eighth
        of the state, with other rows that are not touched), not of the whole state. Row `j` of the `Generation` is row
        `rows[j]`. `max_new` is per entry of `rows`; `stop_tokens` / `stop_sequences` are
        for every row. Raises ValueError when appended tokens do not fit in a row's
        cache. `state` is donated."""
        rows = [int(r) for r in rows]
        B = state.batch_size
        if not rows or len(set(rows)) != len(rows) or min(rows) < 0 or max(rows) >= B:
            raise ValueError(f"decode_rows: rows must be distinct rows of the state (0..{B - 1}), got {rows}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"decode_rows: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        n = len(rows)
        R = min(max(bucket(n, 1), bucket(B // 8, 1)), B)  # at most 4 batch shapes: 4 compilations
        others = [r for r in range(B) if r not in set(rows)]
        idx = np.asarray(rows + others[: R - n], np.int32)
        act = np.arange(R) < n
        mx = np.zeros((R,), np.int32)
        mx[:n] = max_new_tokens if max_new is None else np.minimum(np.asarray(max_new, np.int32), max_new_tokens)
        st = _stop_token_array(stop_tokens, R)
        sq = _stop_seq_array(None if stop_sequences is None else [stop_sequences] * R, R)
        arr: np.ndarray | None = None
        mask: np.ndarray | None = None
        if tokens is not None and any(t is not None and len(t) for t in tokens):
            if len(tokens) != n:
                raise ValueError(f"decode_rows: got token lists for {len(tokens)} rows, expected {n}")
            arr, mask = self._token_arrays(list(tokens) + [None] * (R - n), self.free_slots(state)[idx], "decode_rows")
        if R == B:  # every row is in the batch: no gather and scatter, the rows in state order
            inv = np.argsort(idx)
            if arr is not None:
                assert mask is not None  # set with `arr`
                state = self._append(self.params, state, self._put_rows(arr[inv]), self._put_rows(mask[inv]))
            state, gen = self._decode(
                self.params,
                state,
                self._put_rows(act[inv]),
                self._put_rows(mx[inv]),
                self._put_rows(st[inv]),
                self._put_rows(sq[inv]),
                sampling,
                max_new_tokens,
            )
            if np.array_equal(idx, np.arange(B)):
                return state, gen
            return state, jax.tree.map(lambda x: x[jnp.asarray(idx)], gen)
        arr_d = mask_d = None
        if arr is not None:
            assert mask is not None  # set with `arr`
            arr_d, mask_d = self._put_rows(arr), self._put_rows(mask)
        if self.mesh is not None:
            idx_d = jax.device_put(idx, jax.sharding.NamedSharding(self.mesh, P()))
        else:
            idx_d = jnp.asarray(idx)
        return self._decode_rows(
            self.params,
            state,
            idx_d,
            arr_d,
            mask_d,
            self._put_rows(act),
            self._put_rows(mx),
            self._put_rows(st),
            self._put_rows(sq),
            sampling,
            max_new_tokens,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig = GREEDY,
        seed: int = 0,
        **decode_kw,
    ) -> tuple[SamplerState, Generation]:
        """Prefill `prompts` (token lists of any lengths) on a fresh state and decode."""
        state = self.append(self.init_state(len(prompts), seed), prompts)
        return self.decode(state, max_new_tokens=max_new_tokens, sampling=sampling, **decode_kw)

    @staticmethod
    def to_lists(gen: Generation) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Host lists: per-row tokens, log-probs and finish-reason names."""
        toks, logps, num, reason = jax.device_get(
            (gen.tokens_BxN, gen.logprobs_BxN, gen.num_tokens_B, gen.finish_reason_B)
        )
        return (
            [toks[b, : num[b]].tolist() for b in range(len(num))],
            [logps[b, : num[b]].tolist() for b in range(len(num))],
            [FINISH_REASONS[int(r)] for r in reason],
        )


def _stop_token_array(stop_tokens, B: int) -> np.ndarray:
    if stop_tokens is None or len(stop_tokens) == 0:
        return np.full((B, 1), -1, np.int32)
    if all(isinstance(t, (int, np.integer)) for t in stop_tokens):
        return np.broadcast_to(np.asarray(stop_tokens, np.int32)[None, :], (B, len(stop_tokens))).copy()
    if len(stop_tokens) != B:
        raise ValueError(f"decode: stop_tokens must be one list of ids or one list per row ({B})")
    width = bucket(max((len(t) for t in stop_tokens), default=1), 1)
    out = np.full((B, width), -1, np.int32)
    for b, t in enumerate(stop_tokens):
        out[b, : len(t)] = t
    return out


def _stop_seq_array(stop_sequences, B: int) -> np.ndarray:
    if stop_sequences is None:
        return np.full((B, 1, 1), -1, np.int32)
    if len(stop_sequences) != B:
        raise ValueError(f"decode: stop_sequences must have one list of sequences per row ({B})")
    q = bucket(max((len(s) for s in stop_sequences), default=1), 1)
    lens = [len(seq) for s in stop_sequences for seq in s]
    if any(n == 0 for n in lens):
        raise ValueError("decode: a stop sequence is empty")
    width = bucket(max(lens, default=1), 1)
    out = np.full((B, q, width), -1, np.int32)
    for b, seqs in enumerate(stop_sequences):
        for i, seq in enumerate(seqs):
            out[b, i, width - len(seq) :] = seq
    return out
