"""What an update eats: the batch pytrees (`UpdateBatch` for RL, `SFTBatch` for
demonstrations, `ModelInputs` for a forward pass alone), their trace-time checks, and
the global mini-batch denominators (`Denominators`) that make micro-batch losses add up
(`jaxagent.train.update.losses`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.train.config.step import StepConfig


@flax.struct.dataclass
class UpdateBatch:
    """One RL mini-batch, `[B, T]` arrays aligned with `tokens`.

    Position `t` of the per-token fields is about token `t` as an action: `loss_mask[t] = 1`
    when `tokens[t]` was sampled by the policy, `old_logp[t] = log pi_old(tokens[t] | tokens[:t])`
    (as `token_logprobs` returns), `advantages[t]` its advantage. Optional fields:

    attention_mask  1 on real tokens, 0 on padding (default: all real)
    positions       RoPE positions (default: from the attention mask / segments)
    segment_ids     packed rows: tokens attend within their own segment
    ref_logp        reference-policy log-probs (needed when kl_coef > 0)
    kl_mask         1 where the KL term applies, within loss_mask (None = all of it;
                    needed when kl_turns is "last": `last_turn_mask`)
    rollout_logp    the sampler's log-probs (needed for truncated IS)
    returns, old_values   critic targets and the critic's values at rollout time (PPO);
                    values follow `critic_values` (the value of the state before token t)
    """

    tokens: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    attention_mask: jax.Array | None = None
    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None
    ref_logp: jax.Array | None = None
    kl_mask: jax.Array | None = None
    rollout_logp: jax.Array | None = None
    returns: jax.Array | None = None
    old_values: jax.Array | None = None


@flax.struct.dataclass
class SFTBatch:
    """Expert demonstrations: `loss_mask[t] = 1` on the tokens the model should imitate."""

    tokens: jax.Array
    loss_mask: jax.Array
    attention_mask: jax.Array | None = None
    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None


@flax.struct.dataclass
class ModelInputs:
    """What a forward pass reads of a batch's rows (e.g. the critic's value pass,
    `jaxagent.train.update.losses.critic_values`): the tokens and their attention fields, as
    `UpdateBatch` and `SFTBatch` name them."""

    tokens: jax.Array
    attention_mask: jax.Array | None = None
    positions: jax.Array | None = None
    segment_ids: jax.Array | None = None


@flax.struct.dataclass
class Denominators:
    """Global mini-batch denominators of `algos.aggregate` (float32 scalars); the KL
    term's own `N_kl`, `S_kl` when the batch has a `kl_mask` (else None: `N`, `S`)."""

    num_tokens: jax.Array
    num_seqs: jax.Array
    seq_len: jax.Array
    kl_num_tokens: jax.Array | None = None
    kl_num_seqs: jax.Array | None = None


def batch_denominators(
    loss_mask_BxT: jax.Array, seq_len_norm: int | None = None, kl_mask_BxT: jax.Array | None = None
) -> Denominators:
    """`N = #valid tokens`, `S = #rows with a valid token`, `T' = seq_len_norm or T`; with
    `kl_mask_BxT`, the same counts of the valid tokens it covers (`N_kl`, `S_kl`)."""
    valid = loss_mask_BxT != 0
    kl = {}
    if kl_mask_BxT is not None:
        covered = valid & (kl_mask_BxT != 0)
        kl = dict(
            kl_num_tokens=jnp.sum(covered, dtype=jnp.float32),
            kl_num_seqs=jnp.sum(jnp.any(covered, axis=1), dtype=jnp.float32),
        )
    return Denominators(
        num_tokens=jnp.sum(valid, dtype=jnp.float32),
        num_seqs=jnp.sum(jnp.any(valid, axis=1), dtype=jnp.float32),
        seq_len=jnp.asarray(valid.shape[1] if seq_len_norm is None else seq_len_norm, jnp.float32),
        **kl,
    )


def last_turn_mask(turn_ids_BxT, loss_mask_BxT) -> np.ndarray:
    """1 on the policy tokens of each row's last policy turn (the largest turn id among
    its valid tokens), 0 elsewhere: `UpdateBatch.kl_mask` for `kl_turns="last"`.
    `[B, T]` float32 (NumPy)."""
    tid = np.asarray(turn_ids_BxT)
    valid = (np.asarray(loss_mask_BxT) != 0) & (tid >= 0)
    last = np.where(valid, tid, -1).max(axis=1, keepdims=True)
    return (valid & (tid == last)).astype(np.float32)


def check_batch(batch, required: tuple[str, ...], num_micro_batches: int) -> None:
    """Trace-time checks: shapes `[B, T]`, dtypes, the fields the config needs."""
    kind = type(batch).__name__
    tokens = batch.tokens
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{kind}.tokens must be an integer [B, T] array, got {tokens.dtype}{list(tokens.shape)}")
    shape = tokens.shape
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        if x is None:
            if f.name in required:
                raise ValueError(f"{kind}.{f.name} is required by this step's config but is None")
            continue
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{kind}.{f.name} must have shape {list(shape)} like tokens, got {list(x.shape)}")
        if f.name in ("tokens", "positions", "segment_ids") and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{kind}.{f.name} must be an integer array, got {x.dtype}")
    if shape[0] % num_micro_batches:
        raise ValueError(f"{kind}: batch size {shape[0]} is not divisible by num_micro_batches={num_micro_batches}")


def required_fields(config: StepConfig, has_critic: bool) -> tuple[str, ...]:
    """The optional `UpdateBatch` fields that `config` (and a critic) make necessary."""
    req = []
    if config.loss.kl_coef > 0:
        req.append("ref_logp")
        if config.loss.kl_turns != "all":
            req.append("kl_mask")
    if config.loss.tis_cap is not None:
        req.append("rollout_logp")
    if has_critic:
        req += ["returns", "old_values"]
    return tuple(req)
