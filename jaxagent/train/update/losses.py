"""The update's losses and their gradients on one (micro-)batch: the RL policy loss, the
PPO critic's value loss and the SFT cross-entropy.

On a batch with log-probs and entropy from the policy being trained::

    logp, H   = token_logprobs(policy, tokens)             (log p(y_t | y_<t), entropy)
    L_pg      = policy_loss(logp, old_logp, A, m; mode, clips, is_weights, N, S, T')
    L_kl      = agg(kl(logp, ref_logp; kind), m_kl; mode, N_kl, S_kl, T')   if kl_coef > 0
    L_H       = agg(H, m; mode, N, S, T')                            if entropy_coef > 0
    L_policy  = L_pg + kl_coef * L_kl - entropy_coef * L_H
    L_value   = value_loss(V, V_old, R, m; value_agg_mode, clip, N, S, T')   (PPO critic)
    L_sft     = -sum_t m_t log p(y_t | y_<t) / N                    (demonstrations)

`agg` and the losses are `jaxagent.algos` (conventions in docs/explanations/formulas.md). The
denominators `N` (valid tokens), `S` (non-empty rows) and `T'` (the Dr.GRPO length
constant, default the padded length) are those of the whole mini-batch
(`jaxagent.train.update.batch.Denominators`), computed before it is cut into micro-batches.
The KL term's mask `m_kl` is `m`, or `m` times the batch's `kl_mask` (e.g. only each
episode's last turn, `LossConfig.kl_turns`), with its own `N_kl` and `S_kl` computed the
same way. Every aggregation is then a sum over rows divided by a constant, so the losses
and gradients of the micro-batches add up to the mini-batch's (`jaxagent.train.update`).

Each `*_loss_and_grads` returns `(Grads, LossSums)`: the gradients of the trainable
parameters and the loss parts and statistics, grouped by how the update reports them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax
import jax.numpy as jnp

from jaxagent import algos
from jaxagent.models import DecoderConfig, token_logprobs, value_forward
from jaxagent.models import decoder as _decoder
from jaxagent.train.config.step import LossConfig, StepConfig
from jaxagent.train.update.batch import (
    Denominators,
    SFTBatch,
    UpdateBatch,
    batch_denominators,
    check_batch,
    required_fields,
)
from jaxagent.train.update.state import Grads, TrainState, split_trainable


# ----------------------------------------------------------------------------- what a loss returns
@flax.struct.dataclass
class LossSums:
    """A batch's loss parts and statistics beside its gradients, in the groups the update
    reports them by. Every entry is a sum over the batch's rows (losses already divided by
    the global denominators), so micro-batches add up.

    losses: loss terms, reported as they are (`pg_loss`, `kl_loss`, `entropy_loss`,
      `policy_loss`, `value_loss`, `sft_loss`).
    token_sums: sums over the valid tokens of per-token statistics, reported as means per
      valid token under the same name (`entropy`, the policy loss's own `clipfrac`,
      `approx_kl`, ..., `kl`, `tis_weight`, `vf_clipfrac`, `value`).
    value_stats: the critic's sums of the returns `R` and the errors `R - V` and of their
      squares (`return`, `return_sq`, `value_err`, `value_err_sq`), reported as
      `return_mean` and `explained_variance`; None without a critic.
    objective: the entry of `losses` that is minimised (static): the update's skip rule
      reads it and reports it as `loss` too.
    """

    losses: dict
    token_sums: dict
    value_stats: dict | None = None
    objective: str = flax.struct.field(pytree_node=False, default="policy_loss")

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    @property
    def loss(self) -> jax.Array:
        """The minimised loss, `losses[objective]`."""
        return self.losses[self.objective]

    def merge(self, other: LossSums) -> LossSums:
        """These sums with `other`'s added as further entries (e.g. the critic's); the
        objective stays this one's."""
        stats = other.value_stats if self.value_stats is None else {**self.value_stats, **(other.value_stats or {})}
        return self.replace(
            losses={**self.losses, **other.losses},
            token_sums={**self.token_sums, **other.token_sums},
            value_stats=stats,
        )

    def flat(self) -> dict:
        """One dict by the flat names: the losses, `loss`, and every token or value sum
        as `<name>_sum`."""
        sums = {f"{k}_sum": v for group in (self.token_sums, self.value_stats or {}) for k, v in group.items()}
        return {**self.losses, "loss": self.loss, **sums}

    def __getitem__(self, key: str) -> jax.Array:
        return self.flat()[key]


# ----------------------------------------------------------------------------- forward passes
def for_compute(params, compute_dtype: str | None):
    """`params` as the forward passes use them: cast to `compute_dtype` (None: as they are).
    Under `jax.grad` the cast passes gradients back in the params' own dtype."""
    return params if compute_dtype is None else _decoder.cast_params(params, compute_dtype)


def _model_kwargs(batch) -> dict:
    return dict(
        attention_mask_BxT=batch.attention_mask, positions_BxT=batch.positions, segment_ids_BxT=batch.segment_ids
    )


def critic_values(critic_params, critic_config: DecoderConfig, batch, *, remat: bool | str = False) -> jax.Array:
    """Values `[B, T]` aligned like the log-probs: `values[:, t] = V(tokens[:, :t])`, the
    value of the state in which token `t` is chosen (`value_forward` at `t - 1`); column
    0 is 0. Use this for `UpdateBatch.old_values` too, so the two agree."""
    v = value_forward(critic_params, critic_config, batch.tokens, remat=remat, **_model_kwargs(batch))
    return jnp.pad(v[:, :-1].astype(jnp.float32), ((0, 0), (1, 0)))


def _token_logprobs(params, model_config: DecoderConfig, batch, config: StepConfig):
    """`(logp, entropy)` `[B, T]` of the batch's tokens under `params` (the policy)."""
    return token_logprobs(
        for_compute(params, config.compute_dtype),
        model_config,
        batch.tokens,
        temperature=config.loss.temperature,
        seq_chunk=config.seq_chunk,
        vocab_chunk=config.vocab_chunk,
        remat=config.remat,
        **_model_kwargs(batch),
    )


# ----------------------------------------------------------------------------- small pieces
def _f32(x):
    return x.astype(jnp.float32)


def _agg_kwargs(denominators: Denominators) -> dict:
    """`N`, `S`, `T'` as `algos.aggregate`'s keyword arguments."""
    return dict(num_tokens=denominators.num_tokens, num_seqs=denominators.num_seqs, seq_len=denominators.seq_len)


def _token_sum(mean_metric, valid_count):
    """A masked mean over a micro-batch back to its masked sum (for global averaging)."""
    return mean_metric * (valid_count + algos.masked.MEAN_EPS)


def _loss_defaults(config: LossConfig):
    """(fn, mode, kwargs) of the registered policy loss, filling None with its defaults."""
    fn = algos.get_policy_loss(config.policy_loss)
    sig = inspect.signature(fn).parameters

    def default(name, value):
        if value is not None:
            return value
        if name not in sig or sig[name].default is inspect.Parameter.empty:
            raise ValueError(f"policy loss {config.policy_loss!r} has no default for {name!r}; set LossConfig.{name}")
        return sig[name].default

    mode = default("mode", config.agg_mode)
    kwargs = {"clip_low": default("clip_low", config.clip_low), "clip_high": default("clip_high", config.clip_high)}
    if "clip_c" in sig:
        kwargs["clip_c"] = config.clip_c
    return fn, mode, kwargs


# ----------------------------------------------------------------------------- the policy
def _tis_weights(batch: UpdateBatch, lc: LossConfig):
    """Truncated importance-sampling weights `min(exp(old_logp - rollout_logp), cap)`
    (None when `tis_cap` is off): constants of the loss."""
    if lc.tis_cap is None:
        return None
    return algos.tis_weights(
        _f32(batch.old_logp), _f32(batch.rollout_logp), batch.loss_mask, lc.tis_cap, level=lc.tis_level
    )


def _kl_term(logp, batch: UpdateBatch, lc: LossConfig, mode: str, denominators: Denominators):
    """`(L_kl, the KL's token sum)`, on `m_kl`: the loss mask, or the part of it in the
    batch's `kl_mask` with its own `N_kl`, `S_kl`."""
    mask, d = batch.loss_mask, _agg_kwargs(denominators)
    if batch.kl_mask is not None:
        mask = jnp.where((batch.loss_mask != 0) & (batch.kl_mask != 0), batch.loss_mask, 0)
        d = dict(d, num_tokens=denominators.kl_num_tokens, num_seqs=denominators.kl_num_seqs)
    kl_tok = algos.kl(logp, _f32(batch.ref_logp), lc.kl_kind, mask)
    return algos.aggregate(kl_tok, mask, mode, **d), jnp.sum(kl_tok)


def _policy_objective(
    logp, entropy, batch: UpdateBatch, lc: LossConfig, denominators: Denominators, is_weights
) -> tuple[jax.Array, LossSums]:
    """`L_policy = L_pg + kl_coef * L_kl - entropy_coef * L_H` and its parts."""
    fn, mode, clip_kwargs = _loss_defaults(lc)
    d = _agg_kwargs(denominators)
    mask = batch.loss_mask
    valid = mask != 0
    n_local = jnp.sum(valid, dtype=jnp.float32)
    pg, pg_metrics = fn(
        logp, _f32(batch.old_logp), _f32(batch.advantages), mask, mode=mode, is_weights=is_weights, **clip_kwargs, **d
    )
    total = pg
    losses = {"pg_loss": pg}
    token_sums = {"entropy": jnp.sum(jnp.where(valid, entropy, 0.0))}
    token_sums.update({k: _token_sum(v, n_local) for k, v in pg_metrics.items()})
    if lc.kl_coef > 0:
        kl_loss, token_sums["kl"] = _kl_term(logp, batch, lc, mode, denominators)
        total = total + lc.kl_coef * kl_loss
        losses["kl_loss"] = kl_loss
    if lc.entropy_coef > 0:
        entropy_loss = algos.aggregate(entropy, mask, mode, **d)
        total = total - lc.entropy_coef * entropy_loss
        losses["entropy_loss"] = entropy_loss
    if is_weights is not None:
        token_sums["tis_weight"] = jnp.sum(is_weights)
    losses["policy_loss"] = total
    return total, LossSums(losses=losses, token_sums=token_sums, objective="policy_loss")


def policy_loss_and_grads(
    state: TrainState, batch: UpdateBatch, config: StepConfig, denominators: Denominators | None = None
) -> tuple[Grads, LossSums]:
    """Gradients of `L_policy` (and of `L_value` with a critic: `value_loss_and_grads`) on
    one (micro-)batch.

    `denominators`: the global mini-batch ones (default: this batch's own). Returns
    `(grads, sums)`: `sums` holds the loss parts (already normalised by the global
    denominators, so they add up over micro-batches) and token sums of the per-token
    metrics (`LossSums`; `train_step` divides those by `num_tokens`).
    """
    check_batch(batch, required_fields(config, state.has_critic), 1)
    if denominators is None:
        denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    is_weights = _tis_weights(batch, config.loss)

    def loss(trainable, rebuild):
        logp, entropy = _token_logprobs(rebuild(trainable), state.model_config, batch, config)
        return _policy_objective(logp, entropy, batch, config.loss, denominators, is_weights)

    trainable, rebuild = split_trainable(state.params)
    (_, sums), g_policy = jax.value_and_grad(loss, has_aux=True)(trainable, rebuild)
    if not state.has_critic:
        return Grads(policy=g_policy), sums
    g_critic, value_sums = value_loss_and_grads(state, batch, config, denominators)
    return Grads(policy=g_policy, critic=g_critic), sums.merge(value_sums)


# ----------------------------------------------------------------------------- the critic
def value_loss_and_grads(
    state: TrainState, batch: UpdateBatch, config: StepConfig, denominators: Denominators | None = None
) -> tuple[object, LossSums]:
    """The gradient of `L_value` with respect to the critic's trainable parameters, and
    `LossSums` with `value_loss`, the token sums `vf_clipfrac` and `value`, and the
    return and error sums (`value_stats`). `denominators` as `policy_loss_and_grads`."""
    if not state.has_critic:
        raise ValueError("value_loss_and_grads: the state has no critic")
    lc = config.loss
    check_batch(batch, ("returns", "old_values"), 1)
    if denominators is None:
        denominators = batch_denominators(batch.loss_mask, lc.seq_len_norm, batch.kl_mask)
    mask = batch.loss_mask
    valid = mask != 0
    n_local = jnp.sum(valid, dtype=jnp.float32)

    def loss(trainable, rebuild):
        values = critic_values(
            for_compute(rebuild(trainable), config.compute_dtype), state.critic_config, batch, remat=config.remat
        )
        vl, vm = algos.value_loss(
            values,
            _f32(batch.old_values),
            _f32(batch.returns),
            mask,
            mode=lc.value_agg_mode,
            clip=lc.value_clip,
            **_agg_kwargs(denominators),
        )
        ret = jnp.where(valid, _f32(batch.returns), 0.0)
        err = jnp.where(valid, ret - values, 0.0)
        return vl, LossSums(
            losses={"value_loss": vl},
            token_sums={
                "vf_clipfrac": _token_sum(vm["vf_clipfrac"], n_local),
                "value": jnp.sum(jnp.where(valid, values, 0.0)),
            },
            value_stats={
                "return": jnp.sum(ret),
                "return_sq": jnp.sum(ret * ret),
                "value_err": jnp.sum(err),
                "value_err_sq": jnp.sum(err * err),
            },
            objective="value_loss",
        )

    trainable, rebuild = split_trainable(state.critic_params)
    (_, sums), grads = jax.value_and_grad(loss, has_aux=True)(trainable, rebuild)
    return grads, sums


# ----------------------------------------------------------------------------- demonstrations
def sft_loss_and_grads(
    state: TrainState, batch: SFTBatch, config: StepConfig, denominators: Denominators | None = None
) -> tuple[Grads, LossSums]:
    """Masked token cross-entropy `L = -sum_t m_t log p(y_t | y_<t) / N` (token-mean over
    the global mini-batch's `N` demonstration tokens), and its gradient."""
    check_batch(batch, (), 1)
    if denominators is None:
        denominators = batch_denominators(batch.loss_mask)
    valid = batch.loss_mask != 0

    def loss(trainable, rebuild):
        logp, entropy = _token_logprobs(rebuild(trainable), state.model_config, batch, config)
        nll = algos.aggregate(-logp, valid, "token-mean", num_tokens=denominators.num_tokens)
        return nll, LossSums(
            losses={"sft_loss": nll},
            token_sums={"entropy": jnp.sum(jnp.where(valid, entropy, 0.0))},
            objective="sft_loss",
        )

    trainable, rebuild = split_trainable(state.params)
    (_, sums), g = jax.value_and_grad(loss, has_aux=True)(trainable, rebuild)
    return Grads(policy=g), sums
