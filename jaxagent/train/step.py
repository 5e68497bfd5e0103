"""The jitted update: `TrainState`, the RL loss with exact micro-batch accumulation,
the optimizer, and the SFT warm-start step.

One update on a mini-batch of `B` rows (`B = M * b`, `M = num_micro_batches`)::

    logp, H   = token_logprobs(policy, tokens)             (log p(y_t | y_<t), entropy)
    L_pg      = policy_loss(logp, old_logp, A, m; mode, clips, is_weights, N, S, T')
    L_kl      = agg(kl(logp, ref_logp; kind), m_kl; mode, N_kl, S_kl, T')   if kl_coef > 0
    L_H       = agg(H, m; mode, N, S, T')                            if entropy_coef > 0
    L_policy  = L_pg + kl_coef * L_kl - entropy_coef * L_H
    L_value   = value_loss(V, V_old, R, m; value_agg_mode, clip, N, S, T')   (PPO critic)

`agg` and the losses are `jaxagent.algos` (conventions in docs/explanations/formulas.md). The
denominators `N` (valid tokens), `S` (non-empty rows) and `T'` (the Dr.GRPO length
constant, default the padded length) are those of the whole mini-batch, computed
before it is cut into micro-batches. The KL term's mask `m_kl` is `m`, or `m` times
the batch's `kl_mask` (e.g. only each episode's last turn, `LossConfig.kl_turns`),
with its own `N_kl` and `S_kl` computed the same way. Every aggregation is then a sum over rows divided
by a constant, so

    L(mini-batch) = sum_k L(micro-batch k),   grad L(mini-batch) = sum_k grad L(micro-batch k)

exactly (up to float32 summation order): gradient accumulation over the `M`
micro-batches of a `lax.scan` *is* the full mini-batch gradient, whatever the
aggregation mode and however ragged the masks.

Then, with `g` the accumulated gradient of the trainable parameters (the LoRA adapters
only when the parameters carry adapters):

    ||g|| = sqrt(sum g^2);   g <- g * min(1, c / ||g||)          (global-norm clipping, c = max_grad_norm)
    params <- AdamW(g; lr(step), b1, b2, eps, weight_decay)        (optax)

If the loss or `||g||` (policy or critic) is not finite, or the mini-batch has no
valid token at all, or (RL, without KL, entropy or critic terms) every valid token's
advantage is 0 (zero gradient: AdamW would still move the params along its momentum),
nothing is applied: params, optimizer states and `step` are
returned unchanged (bitwise) and `skipped` counts up; the metrics say `skipped = 1`
(and `num_tokens = 0` for an empty batch).

`train_step` and `sft_step` are jitted once (`config` is static, the state donated):
call them with a fixed batch shape and they never recompile. Shardings are those of
the arguments (shard the state once, e.g. FSDP over the params, and the batch over the
data axis; the step keeps the layout). Metrics come back as device scalars: the loop
dispatches step N before reading step N-1's metrics, so the device never waits on logging.

Optimizer changes that keep the state's shapes (learning rate, schedule, betas, clipping)
may differ between runs of one checkpoint; the LoRA set-up and the presence of a critic
may not (`jaxagent.train.checkpoint` checks).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxagent import algos
from jaxagent.models import (
    DecoderConfig,
    combine_lora,
    has_lora,
    lora_optimizer,
    split_lora,
    token_logprobs,
    value_forward,
)
from jaxagent.models import decoder as _decoder
from jaxagent.parallel.mesh import (
    LOGICAL_AXIS_RULES,
    activation_constraint,
    batch_sharding,
    train_state_shardings,
)
from jaxagent.parallel.distributed import place_batch, to_host

SCHEDULES = ("constant", "cosine", "linear")
TIS_LEVELS = ("token", "sequence")
#: `LossConfig.kl_turns`: the policy tokens the KL term covers.
KL_TURNS = ("all", "last")
#: leaves that weight decay applies to (matrices and embeddings; not norms or biases).
DECAYED_LEAVES = ("kernel", "embedding", "lora_a", "lora_b")


# ----------------------------------------------------------------------------- configs
def _positive(owner: str, name: str, value, *, allow_zero: bool = False, allow_none: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up, a decay schedule and global-norm clipping.

    Learning rate at update `s` (0-based count of *applied* updates), `W = warmup_steps`,
    `S = total_steps`, `r = final_lr_ratio`::

        warm(s) = min(1, (s + 1) / W)                (1 when W = 0; the first update is not wasted at lr 0)
        p(s)    = clip((s - W) / (S - W), 0, 1)
        constant: lr * warm(s)
        linear:   lr * warm(s) * (1 - (1 - r) p(s))
        cosine:   lr * warm(s) * (r + (1 - r) (1 + cos(pi p(s))) / 2)

    Weight decay (decoupled, AdamW) applies to kernels, embeddings and LoRA adapters,
    not to norm scales or biases. `max_grad_norm=None` turns clipping off.

    lr: the learning rate after the warm-up (the peak of a decaying schedule).
    warmup_steps: `W`, updates of linear warm-up (0 = none).
    schedule: "constant", "linear" or "cosine": the decay after the warm-up.
    total_steps: `S`, the update at which a linear or cosine decay ends (an int greater
      than `warmup_steps`; None only with "constant").
    final_lr_ratio: `r`, the decayed rate as a fraction of `lr`, in [0, 1].
    weight_decay: AdamW's decoupled weight decay (0 = none).
    b1, b2, eps: Adam's moment decay rates and denominator constant.
    max_grad_norm: clip the gradient to this global norm (None = no clipping).
    """

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int | None = None
    final_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        n = "OptimizerConfig"
        _positive(n, "lr", self.lr, allow_zero=True)
        _positive(n, "weight_decay", self.weight_decay, allow_zero=True)
        _positive(n, "eps", self.eps, allow_zero=True)
        _positive(n, "max_grad_norm", self.max_grad_norm, allow_none=True)
        for name in ("b1", "b2", "final_lr_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{n}.{name} must be in [0, 1], got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"{n}.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{n}.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "constant" and (
                not isinstance(self.total_steps, int) or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"{n}.total_steps must be an int > warmup_steps ({self.warmup_steps}) for the "
                f"{self.schedule!r} schedule, got {self.total_steps!r}"
            )


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the RL update minimises (see the module docstring).

    policy_loss: a name registered in `jaxagent.algos` ("ppo", "gspo", "cispo", ...).
    agg_mode, clip_low, clip_high: None = that loss's own default (PPO: token-mean,
      0.2/0.2; GSPO: seq-mean-token-mean, 3e-4/4e-4). The KL and entropy terms use the
      same aggregation mode.
    clip_c: dual-clip constant (> 1) for losses that take it (PPO); None = off.
    kl_coef, kl_kind: KL-to-reference loss term (`algos.kl` kinds: k1, abs, k2, k3 and
      their "+" straight-through forms); needs `ref_logp` in the batch when kl_coef > 0.
    kl_turns: the policy tokens the KL term covers: "all", or "last" (each episode's
      last policy turn alone, e.g. intake's assessment; the trainer builds the batch's
      `kl_mask` from the turn ids, and the step requires it).
    entropy_coef: entropy bonus (subtracted from the loss).
    tis_cap, tis_level: truncated importance-sampling weights
      `min(exp(old_logp - rollout_logp), cap)` (`algos.tis_weights`) multiplied into the
      policy loss; None = off. Needs `rollout_logp` in the batch.
    seq_len_norm: the constant T of "seq-mean-token-sum-norm" (None = padded length).
    value_clip, value_agg_mode: the critic's clipped value loss.
    temperature: the sampling temperature the log-probs are computed at.
    """

    policy_loss: str = "ppo"
    agg_mode: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    clip_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_turns: str = "all"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"
    seq_len_norm: int | None = None
    value_clip: float = 0.5
    value_agg_mode: str = "token-mean"
    temperature: float = 1.0

    def __post_init__(self):
        n = "LossConfig"
        algos.get_policy_loss(self.policy_loss)  # raises naming the known losses
        for name in ("agg_mode", "value_agg_mode"):
            v = getattr(self, name)
            if v is not None and v not in algos.AGG_MODES:
                raise ValueError(f"{n}.{name} must be one of {list(algos.AGG_MODES)}, got {v!r}")
        kind = self.kl_kind.removesuffix("+")
        if kind not in algos.KL_KINDS:
            raise ValueError(f"{n}.kl_kind must be one of {list(algos.KL_KINDS)} (optionally with '+'), "
                             f"got {self.kl_kind!r}")
        if self.kl_turns not in KL_TURNS:
            raise ValueError(f"{n}.kl_turns must be one of {list(KL_TURNS)}, got {self.kl_turns!r}")
        if self.kl_turns != "all" and not self.kl_coef:
            raise ValueError(f"{n}.kl_turns={self.kl_turns!r} places the KL loss term, which is off: "
                             f"set kl_coef > 0")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"{n}.tis_level must be one of {list(TIS_LEVELS)}, got {self.tis_level!r}")
        for name in ("clip_low", "clip_high"):
            _positive(n, name, getattr(self, name), allow_zero=True, allow_none=True)
        if self.clip_c is not None and not (isinstance(self.clip_c, (int, float)) and self.clip_c > 1):
            raise ValueError(f"{n}.clip_c must be > 1 or None, got {self.clip_c!r}")
        for name in ("kl_coef", "entropy_coef", "value_clip"):
            _positive(n, name, getattr(self, name), allow_zero=True)
        _positive(n, "tis_cap", self.tis_cap, allow_none=True)
        _positive(n, "temperature", self.temperature)
        if self.seq_len_norm is not None and (not isinstance(self.seq_len_norm, int) or self.seq_len_norm < 1):
            raise ValueError(f"{n}.seq_len_norm must be a positive int or None, got {self.seq_len_norm!r}")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about an update (hashable: a static argument of the jitted steps).

    critic_optim: the critic's optimizer (None = the same as `optim`).
    num_micro_batches: the mini-batch's rows are cut into this many equal micro-batches
      whose gradients are accumulated (memory, not maths: the result is the same).
    remat, seq_chunk, vocab_chunk: forwarded to the model (`token_logprobs`).
    compute_dtype: the forward passes run on the params cast to this dtype (None = the
      params' own): mixed precision with float32 params and "bfloat16". Gradients,
      updates and the optimizer state keep the params' dtype.
    """

    loss: LossConfig = LossConfig()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    num_micro_batches: int = 1
    remat: bool | str = False
    seq_chunk: int = 128
    vocab_chunk: int = 8192
    compute_dtype: str | None = None

    def __post_init__(self):
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"StepConfig.compute_dtype must be None, 'float32' or 'bfloat16', "
                             f"got {self.compute_dtype!r}")
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ValueError(f"StepConfig.num_micro_batches must be a positive int, got {self.num_micro_batches!r}")
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(f"StepConfig.remat must be False, True, 'full' or 'dots', got {self.remat!r}")
        for name in ("seq_chunk", "vocab_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StepConfig.{name} must be a positive int, got {v!r}")

    @property
    def critic_optimizer(self) -> OptimizerConfig:
        return self.optim if self.critic_optim is None else self.critic_optim


# ----------------------------------------------------------------------------- pytrees
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
class Denominators:
    """Global mini-batch denominators of `algos.aggregate` (float32 scalars); the KL
    term's own `N_kl`, `S_kl` when the batch has a `kl_mask` (else None: `N`, `S`)."""

    num_tokens: jax.Array
    num_seqs: jax.Array
    seq_len: jax.Array
    kl_num_tokens: jax.Array | None = None
    kl_num_seqs: jax.Array | None = None


@flax.struct.dataclass
class Grads:
    """Gradients of the trainable parameters (adapters only under LoRA; `None` holes
    where a leaf is frozen, as `split_lora`)."""

    policy: Any
    critic: Any = None


@flax.struct.dataclass
class TrainState:
    """Everything an update changes, as one pytree (donated to the jitted steps).

    params / opt_state: policy parameters and their optimizer state.
    step: int32, number of updates applied (drives the learning-rate schedule).
    skipped: int32, number of updates skipped (non-finite loss/gradient, no valid token,
      or no learning signal).
    rng: a typed PRNG key for the training loop; the steps never consume it.
    critic_params / critic_opt_state: the PPO critic (None without one).
    model_config / critic_config: static (part of the tree structure, not leaves).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    rng: jax.Array
    model_config: DecoderConfig = flax.struct.field(pytree_node=False)
    critic_params: Any = None
    critic_opt_state: Any = None
    critic_config: DecoderConfig | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def has_critic(self) -> bool:
        return self.critic_params is not None


# ----------------------------------------------------------------------------- optimizer
def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The schedule of `OptimizerConfig` as a pure function of the update count."""
    lr, w, r = float(config.lr), int(config.warmup_steps), float(config.final_lr_ratio)
    total = config.total_steps

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (s + 1.0) / w) if w > 0 else jnp.ones_like(s)
        if config.schedule == "constant":
            return lr * warm
        p = jnp.clip((s - w) / float(total - w), 0.0, 1.0)
        if config.schedule == "linear":
            return lr * warm * (1.0 - (1.0 - r) * p)
        return lr * warm * (r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(jnp.pi * p)))

    return schedule


def _decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in DECAYED_LEAVES, params)


def make_optimizer(config: OptimizerConfig, params) -> optax.GradientTransformation:
    """AdamW with the config's schedule. Clipping is done by the step itself (it needs
    the norm for its metrics and the finiteness check). With LoRA adapters in `params`,
    `lora_optimizer` gives the frozen leaves zero updates and no optimizer state."""
    tx = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                     weight_decay=config.weight_decay, mask=_decay_mask)
    return lora_optimizer(tx, params) if has_lora(params) else tx


def init_train_state(
    key: jax.Array,
    params,
    model_config: DecoderConfig,
    config: StepConfig,
    *,
    critic_params=None,
    critic_config: DecoderConfig | None = None,
) -> TrainState:
    """A fresh `TrainState` (step 0). `key` becomes `state.rng` (an int seed is accepted)."""
    if isinstance(key, int):
        key = jax.random.key(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise TypeError("init_train_state: key must be a typed PRNG key (jax.random.key) or an int seed")
    if has_lora(params) != (model_config.lora is not None):
        raise ValueError("init_train_state: params carry LoRA adapters but model_config.lora is None "
                         "(or the reverse); use jaxagent.models.add_lora")
    if (critic_params is None) != (critic_config is None):
        raise ValueError("init_train_state: pass critic_params and critic_config together")
    if critic_params is not None and "value_head" not in critic_params:
        raise ValueError("init_train_state: critic_params have no 'value_head' "
                         "(build them with jaxagent.models.value_params_from_policy)")
    critic_opt = None
    if critic_params is not None:
        critic_opt = make_optimizer(config.critic_optimizer, critic_params).init(critic_params)
    return _unaliased(TrainState(
        params=params,
        opt_state=make_optimizer(config.optim, params).init(params),
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        rng=key,
        model_config=model_config,
        critic_params=critic_params,
        critic_opt_state=critic_opt,
        critic_config=critic_config,
    ))


def _unaliased(state: TrainState) -> TrainState:
    """Copies of leaves that appear twice (a critic built by `value_params_from_policy`
    shares the policy's trunk arrays): a donated state must not hold one buffer twice."""
    seen: set[int] = set()

    def fresh(x):
        if not isinstance(x, jax.Array):
            return x
        if id(x) in seen:
            return jnp.array(x, copy=True)
        seen.add(id(x))
        return x

    return jax.tree.map(fresh, state)


# ----------------------------------------------------------------------------- checks
def _check_batch(batch, required: tuple[str, ...], num_micro_batches: int) -> None:
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


def _required_fields(config: StepConfig, has_critic: bool) -> tuple[str, ...]:
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


# ----------------------------------------------------------------------------- pure pieces
def batch_denominators(loss_mask_BxT: jax.Array, seq_len_norm: int | None = None,
                       kl_mask_BxT: jax.Array | None = None) -> Denominators:
    """`N = #valid tokens`, `S = #rows with a valid token`, `T' = seq_len_norm or T`; with
    `kl_mask_BxT`, the same counts of the valid tokens it covers (`N_kl`, `S_kl`)."""
    valid = loss_mask_BxT != 0
    kl = {}
    if kl_mask_BxT is not None:
        covered = valid & (kl_mask_BxT != 0)
        kl = dict(kl_num_tokens=jnp.sum(covered, dtype=jnp.float32),
                  kl_num_seqs=jnp.sum(jnp.any(covered, axis=1), dtype=jnp.float32))
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


def _model_kwargs(batch) -> dict:
    return dict(attention_mask_BxT=batch.attention_mask, positions_BxT=batch.positions,
                segment_ids_BxT=batch.segment_ids)


def critic_values(critic_params, critic_config: DecoderConfig, batch, *, remat: bool | str = False) -> jax.Array:
    """Values `[B, T]` aligned like the log-probs: `values[:, t] = V(tokens[:, :t])`, the
    value of the state in which token `t` is chosen (`value_forward` at `t - 1`); column
    0 is 0. Use this for `UpdateBatch.old_values` too, so the two agree."""
    v = value_forward(critic_params, critic_config, batch.tokens, remat=remat, **_model_kwargs(batch))
    return jnp.pad(v[:, :-1].astype(jnp.float32), ((0, 0), (1, 0)))


def for_compute(params, compute_dtype: str | None):
    """`params` as the forward passes use them: cast to `compute_dtype` (None: as they are).
    Under `jax.grad` the cast passes gradients back in the params' own dtype."""
    return params if compute_dtype is None else _decoder.cast_params(params, compute_dtype)


def _trainable(params):
    """(differentiated part, rebuild(part) -> full params)."""
    if has_lora(params):
        adapters, frozen = split_lora(params)
        return adapters, functools.partial(combine_lora, frozen=frozen)
    return params, lambda p: p


def _token_sum(mean_metric, valid_count):
    """A masked mean over a micro-batch back to its masked sum (for global averaging)."""
    return mean_metric * (valid_count + algos.masked.MEAN_EPS)


def policy_loss_and_grads(state: TrainState, batch: UpdateBatch, config: StepConfig,
                          denominators: Denominators | None = None) -> tuple[Grads, dict]:
    """Gradients of `L_policy` (and of `L_value` with a critic) on one (micro-)batch.

    `denominators`: the global mini-batch ones (default: this batch's own). Returns
    `(grads, sums)`: `sums` holds the loss parts (already normalised by the global
    denominators, so they add up over micro-batches) and token sums of the per-token
    metrics (`*_sum` keys; divide by `num_tokens` for means; `train_step` does).
    """
    lc = config.loss
    _check_batch(batch, _required_fields(config, state.has_critic), 1)
    if denominators is None:
        denominators = batch_denominators(batch.loss_mask, lc.seq_len_norm, batch.kl_mask)
    fn, mode, clip_kwargs = _loss_defaults(lc)
    d = dict(num_tokens=denominators.num_tokens, num_seqs=denominators.num_seqs, seq_len=denominators.seq_len)
    mask = batch.loss_mask
    valid = mask != 0
    n_local = jnp.sum(valid, dtype=jnp.float32)
    f32 = lambda x: x.astype(jnp.float32)

    is_w = None
    if lc.tis_cap is not None:
        is_w = algos.tis_weights(f32(batch.old_logp), f32(batch.rollout_logp), mask, lc.tis_cap, level=lc.tis_level)

    def policy_loss(trainable, rebuild):
        logp, ent = token_logprobs(for_compute(rebuild(trainable), config.compute_dtype), state.model_config,
                                   batch.tokens, temperature=lc.temperature, seq_chunk=config.seq_chunk,
                                   vocab_chunk=config.vocab_chunk, remat=config.remat, **_model_kwargs(batch))
        pg, pg_metrics = fn(logp, f32(batch.old_logp), f32(batch.advantages), mask, mode=mode,
                            is_weights=is_w, **clip_kwargs, **d)
        total = pg
        aux = {"pg_loss": pg, "entropy_sum": jnp.sum(jnp.where(valid, ent, 0.0))}
        for k, v in pg_metrics.items():
            aux[f"{k}_sum"] = _token_sum(v, n_local)
        if lc.kl_coef > 0:
            kl_m, kl_d = mask, d
            if batch.kl_mask is not None:
                kl_m = jnp.where(valid & (batch.kl_mask != 0), mask, 0)
                kl_d = dict(d, num_tokens=denominators.kl_num_tokens, num_seqs=denominators.kl_num_seqs)
            kl_tok = algos.kl(logp, f32(batch.ref_logp), lc.kl_kind, kl_m)
            kl_loss = algos.aggregate(kl_tok, kl_m, mode, **kl_d)
            total = total + lc.kl_coef * kl_loss
            aux["kl_loss"] = kl_loss
            aux["kl_sum"] = jnp.sum(kl_tok)
        if lc.entropy_coef > 0:
            ent_loss = algos.aggregate(ent, mask, mode, **d)
            total = total - lc.entropy_coef * ent_loss
            aux["entropy_loss"] = ent_loss
        if is_w is not None:
            aux["tis_weight_sum"] = jnp.sum(is_w)
        aux["policy_loss"] = total
        return total, aux

    trainable, rebuild = _trainable(state.params)
    (_, sums), g_policy = jax.value_and_grad(policy_loss, has_aux=True)(trainable, rebuild)

    g_critic = None
    if state.has_critic:
        def critic_loss(trainable, rebuild):
            values = critic_values(for_compute(rebuild(trainable), config.compute_dtype), state.critic_config,
                                   batch, remat=config.remat)
            vl, vm = algos.value_loss(values, f32(batch.old_values), f32(batch.returns), mask,
                                      mode=lc.value_agg_mode, clip=lc.value_clip, **d)
            ret = jnp.where(valid, f32(batch.returns), 0.0)
            err = jnp.where(valid, ret - values, 0.0)
            aux = {
                "value_loss": vl,
                "vf_clipfrac_sum": _token_sum(vm["vf_clipfrac"], n_local),
                "value_sum": jnp.sum(jnp.where(valid, values, 0.0)),
                "return_sum": jnp.sum(ret), "return_sq_sum": jnp.sum(ret * ret),
                "value_err_sum": jnp.sum(err), "value_err_sq_sum": jnp.sum(err * err),
            }
            return vl, aux

        c_trainable, c_rebuild = _trainable(state.critic_params)
        (_, c_sums), g_critic = jax.value_and_grad(critic_loss, has_aux=True)(c_trainable, c_rebuild)
        sums = {**sums, **c_sums}
    return Grads(policy=g_policy, critic=g_critic), sums


def sft_loss_and_grads(state: TrainState, batch: SFTBatch, config: StepConfig,
                       denominators: Denominators | None = None) -> tuple[Grads, dict]:
    """Masked token cross-entropy `L = -sum_t m_t log p(y_t | y_<t) / N` (token-mean over
    the global mini-batch's `N` demonstration tokens), and its gradient."""
    _check_batch(batch, (), 1)
    if denominators is None:
        denominators = batch_denominators(batch.loss_mask)
    valid = batch.loss_mask != 0

    def loss(trainable, rebuild):
        logp, ent = token_logprobs(for_compute(rebuild(trainable), config.compute_dtype), state.model_config,
                                   batch.tokens, temperature=config.loss.temperature, seq_chunk=config.seq_chunk,
                                   vocab_chunk=config.vocab_chunk, remat=config.remat, **_model_kwargs(batch))
        nll = algos.aggregate(-logp, valid, "token-mean", num_tokens=denominators.num_tokens)
        return nll, {"sft_loss": nll, "loss": nll, "entropy_sum": jnp.sum(jnp.where(valid, ent, 0.0))}

    trainable, rebuild = _trainable(state.params)
    (_, sums), g = jax.value_and_grad(loss, has_aux=True)(trainable, rebuild)
    return Grads(policy=g), sums


def _accumulate(loss_and_grads, state, batch, config: StepConfig, denominators: Denominators):
    """Sum of the micro-batch gradients and sums (a `lax.scan` over micro-batches)."""
    M = config.num_micro_batches
    micro = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda b: loss_and_grads(state, b, config, denominators), first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def body(acc, mb):
        out = loss_and_grads(state, mb, config, denominators)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out), None

    (grads, sums), _ = jax.lax.scan(body, zeros, micro)
    return grads, sums


def _clip(grads, norm, max_norm):
    """optax.clip_by_global_norm's rule: scale by `max_norm / norm` when `norm > max_norm`."""
    if max_norm is None:
        return grads
    scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.where(norm > 0, norm, 1.0))
    return jax.tree.map(lambda g: g * scale, grads)


def _update(params, opt_state, grads, optim: OptimizerConfig):
    """One clipped AdamW update of the trainable leaves; frozen leaves are passed through."""
    norm = optax.tree.norm(grads)
    grads = _clip(grads, norm, optim.max_grad_norm)
    trainable, rebuild = _trainable(params)
    if has_lora(params):  # lora_optimizer wants full-structure gradients (zeros on frozen leaves)
        full = combine_lora(grads, jax.tree.map(jnp.zeros_like, split_lora(params)[1]))
    else:
        full = grads
    full = jax.tree.map(lambda g, p: g.astype(p.dtype), full, params)
    updates, new_opt = make_optimizer(optim, params).update(full, opt_state, params)
    upd_trainable, _ = _trainable(updates)
    new_params = rebuild(optax.apply_updates(trainable, upd_trainable))
    return new_params, new_opt, norm


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _apply(state: TrainState, grads: Grads, sums: dict, config: StepConfig, denominators: Denominators,
           has_signal=True):
    """Optimizer updates, the non-finite skip and the metrics."""
    # an empty mini-batch (no policy token), or one whose only loss term is the policy
    # gradient and whose advantages are all 0, has nothing to learn from: AdamW would
    # still move the params by momentum and weight decay, so it is skipped as well
    ok = jnp.isfinite(sums["loss"]) & (denominators.num_tokens > 0) & has_signal
    new_params, new_opt, g_norm = _update(state.params, state.opt_state, grads.policy, config.optim)
    ok &= jnp.isfinite(g_norm)
    metrics = {"grad_norm": g_norm}
    new_cp, new_copt = state.critic_params, state.critic_opt_state
    if grads.critic is not None:
        new_cp, new_copt, c_norm = _update(state.critic_params, state.critic_opt_state, grads.critic,
                                           config.critic_optimizer)
        ok &= jnp.isfinite(c_norm) & jnp.isfinite(sums["value_loss"])
        metrics["critic_grad_norm"] = c_norm
        metrics["critic_lr"] = learning_rate_schedule(config.critic_optimizer)(state.step)
    new_state = state.replace(
        params=_select(ok, new_params, state.params),
        opt_state=_select(ok, new_opt, state.opt_state),
        critic_params=_select(ok, new_cp, state.critic_params),
        critic_opt_state=_select(ok, new_copt, state.critic_opt_state),
        step=jnp.where(ok, state.step + 1, state.step),
        skipped=jnp.where(ok, state.skipped, state.skipped + 1),
    )
    n = denominators.num_tokens
    per_token = lambda s: algos.masked.safe_div(s, n)
    for k, v in sums.items():
        if k.endswith("_sum") and k not in ("return_sum", "return_sq_sum", "value_err_sum", "value_err_sq_sum"):
            metrics[k[: -len("_sum")]] = per_token(v)
        elif not k.endswith("_sum"):
            metrics[k] = v
    if "value_err_sum" in sums:
        # explained variance 1 - Var(R - V) / Var(R) over the valid tokens (biased variances)
        var_ret = per_token(sums["return_sq_sum"]) - jnp.square(per_token(sums["return_sum"]))
        var_err = per_token(sums["value_err_sq_sum"]) - jnp.square(per_token(sums["value_err_sum"]))
        metrics["explained_variance"] = 1.0 - algos.masked.safe_div(var_err, var_ret)
        metrics["return_mean"] = per_token(sums["return_sum"])
    metrics.update(
        lr=learning_rate_schedule(config.optim)(state.step),
        num_tokens=n,
        skipped=jnp.where(ok, 0.0, 1.0),
        step=new_state.step,
    )
    return new_state, {k: jnp.asarray(v, jnp.float32) if k != "step" else v for k, v in metrics.items()}


# ----------------------------------------------------------------------------- jitted steps
def _train_step(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[TrainState, dict]:
    _check_batch(batch, _required_fields(config, state.has_critic), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    grads, sums = _accumulate(policy_loss_and_grads, state, batch, config, denominators)
    sums = {**sums, "loss": sums["policy_loss"]}
    has_signal = True
    if config.loss.kl_coef == 0 and config.loss.entropy_coef == 0 and not state.has_critic:
        has_signal = jnp.any((batch.advantages != 0) & (batch.loss_mask != 0))
    return _apply(state, grads, sums, config, denominators, has_signal)


def _sft_step(state: TrainState, batch: SFTBatch, config: StepConfig) -> tuple[TrainState, dict]:
    _check_batch(batch, (), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask)
    grads, sums = _accumulate(sft_loss_and_grads, state, batch, config, denominators)
    return _apply(state, grads, sums, config, denominators)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def train_step(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[TrainState, dict]:
    """One RL update on a mini-batch: micro-batch gradient accumulation, clipping, AdamW
    (policy, and critic when the state has one), non-finite skip.

    Returns `(new_state, metrics)`; metrics are float32 scalars: `loss` (policy), `pg_loss`,
    `kl_loss`, `entropy_loss` (when on), token means `entropy`, `clipfrac`,
    `clipfrac_lower`, `approx_kl`, `kl`, `tis_weight`; `grad_norm` (before clipping), `lr`,
    `num_tokens`, `skipped`, `step` (int32, after the update); with a critic `value_loss`,
    `vf_clipfrac`, `value`, `return_mean`, `explained_variance`, `critic_grad_norm`,
    `critic_lr`. `state` is donated: do not use it after the call.

    Output shardings are the compiler's choice; for a sharded state use
    `make_train_step`, which pins them to the input layout.
    """
    return _train_step(state, batch, config)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def sft_step(state: TrainState, batch: SFTBatch, config: StepConfig) -> tuple[TrainState, dict]:
    """One supervised update (masked token cross-entropy on demonstrations) with the same
    accumulation, clipping, optimizer and skip rule as `train_step`. The critic, if any,
    is left untouched. Metrics: `loss` = `sft_loss`, `entropy`, `grad_norm`, `lr`,
    `num_tokens`, `skipped`, `step`."""
    return _sft_step(state, batch, config)


def state_shardings(state: TrainState) -> TrainState:
    """The sharding of every leaf, as a `TrainState`-shaped tree (for `in/out_shardings`)."""
    return jax.tree.map(lambda x: x.sharding, state)


def _within(context, fn):
    """`fn` run inside `context()` (a context-manager factory) while it is traced; the
    same signature (for `jax.jit`'s argument names)."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)
    return inner


def make_train_step(config: StepConfig, state: TrainState, batch_sharding=None, *, kind: str = "rl",
                    trace_context=None):
    """`step(state, batch) -> (state, metrics)` jitted once with explicit shardings
    (nanodo's shape): the state in and out with the layout `state` has now (so a sharded
    state keeps its layout and the step never recompiles), the batch with
    `batch_sharding` (a sharding or a tree of them; None = as given), metrics
    replicated. `kind`: "rl" (`train_step`) or "sft" (`sft_step`). State donated.
    `trace_context`: a zero-argument context-manager factory entered while the step is
    traced (e.g. the decoder's activation-layout hook for a mesh).
    """
    fns = {"rl": _train_step, "sft": _sft_step}
    if kind not in fns:
        raise ValueError(f"make_train_step: kind must be 'rl' or 'sft', got {kind!r}")
    shardings = state_shardings(state)
    device_sets = {frozenset(d.id for d in sh.device_set) for sh in jax.tree.leaves(shardings)}
    if len(device_sets) > 1:
        raise ValueError(
            "make_train_step: the state's leaves live on different device sets "
            f"({sorted(len(d) for d in device_sets)} devices); place the whole state on the mesh "
            "(step, skipped, rng and optimizer counters replicated)")
    first = jax.tree.leaves(shardings)[0]
    mesh = getattr(first, "mesh", None)
    replicated = jax.NamedSharding(mesh, jax.P()) if mesh is not None else first
    fn = functools.partial(fns[kind], config=config)
    if trace_context is not None:
        fn = _within(trace_context, fn)
        fn.__name__ = fn.__qualname__ = fns[kind].__name__  # compilation logs name the step
    return jax.jit(fn, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                   donate_argnames=("state",))


def make_sharded_train_step(config: StepConfig, state: TrainState, mesh: jax.sharding.Mesh, *, kind: str = "rl",
                            rules=None):
    """`step(state, batch) -> (state, metrics)`: `make_train_step` with
    the state's shardings from the rules (in and out, donated), the batch's rows split
    over ("data", "fsdp") and metrics replicated; jitted once, so a fixed batch shape
    never recompiles. `state` must already be placed by `shard_train_state(state, mesh,
    rules)` (checked: a leaf laid out otherwise is named). `kind`: "rl" (`UpdateBatch`,
    with a critic when the state has one) or "sft" (`SFTBatch`)."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    want = train_state_shardings(state, mesh, rules)
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(want)):
        have = getattr(x, "sharding", None)
        if not (isinstance(have, jax.NamedSharding) and have.mesh == mesh and have.spec == s.spec):
            raise ValueError(
                f"make_sharded_train_step: state leaf {jax.tree_util.keystr(path)} is laid out as {have}, "
                f"not {s.spec} on this mesh; place the state with shard_train_state(state, mesh) first")
    layout = activation_constraint(mesh, rules)
    return make_train_step(config, state, batch_sharding(mesh, rules), kind=kind,
                           trace_context=lambda: _decoder.activation_constraint(layout))


# ----------------------------------------------------------------------------- trimmed micro-batches
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


def _length_runs(groups: list[tuple[np.ndarray, int]]) -> list[tuple[list[np.ndarray], int]]:
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
    out = _accumulate(policy_loss_and_grads, state, micro, dataclasses.replace(config, num_micro_batches=n),
                      denominators)
    return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out)


def _trimmed_prepare(state, batch, *, config, rows):
    """The mini-batch's denominators, its `has_signal` and a zero accumulator."""
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    first = jax.tree.map(lambda x: x[:rows], batch)
    shapes = jax.eval_shape(lambda b: policy_loss_and_grads(state, b, config, denominators), first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
    has_signal = jnp.asarray(True)
    if config.loss.kl_coef == 0 and config.loss.entropy_coef == 0 and not state.has_critic:
        has_signal = jnp.any((batch.advantages != 0) & (batch.loss_mask != 0))
    return denominators, has_signal, zeros


def _trimmed_finish(state, acc, denominators, has_signal, *, config):
    grads, sums = acc
    return _apply(state, grads, {**sums, "loss": sums["policy_loss"]}, config, denominators, has_signal)


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
        traced = functools.partial(_within, lambda: _decoder.activation_constraint(layout))

        replicated = jax.NamedSharding(mesh, jax.P())
        trainable, _ = _trainable(state.params)
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
        _check_batch(batch, _required_fields(config, state.has_critic), M)
        if self._add is None:
            self._add, self._prepare, self._finish = self._build(state)
        if self.mesh is not None:
            batch = _whole_on_host(batch)   # each micro-batch is cut on the host, then placed
        B, T = batch.tokens.shape
        groups = length_groups(row_lengths(batch), M, self.multiple, T)
        denominators, has_signal, acc = self._prepare(state, self._place(batch), rows=B // M)
        for run, L in _length_runs(groups):   # micro-batches of one length: one call, a scan over them
            rows = np.concatenate(run)
            micro = self._place(jax.tree.map(lambda x: x[rows, :L], batch))
            acc = self._add(state, micro, denominators, acc, n=len(run))
        self.last_lengths = [L for _, L in groups]
        self.lengths_seen.update(self.last_lengths)
        return acc, denominators, has_signal

    def __call__(self, state: TrainState, batch: UpdateBatch) -> tuple[TrainState, dict]:
        acc, denominators, has_signal = self.accumulate(state, batch)
        return self._finish(state, acc, denominators, has_signal)


def accumulated_grads(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[Grads, dict]:
    """The accumulated mini-batch gradients `train_step` applies (before clipping), and
    the summed loss parts: for tests and diagnostics (not jitted; wrap it if needed)."""
    _check_batch(batch, _required_fields(config, state.has_critic), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    return _accumulate(policy_loss_and_grads, state, batch, config, denominators)
