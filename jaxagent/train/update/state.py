"""The train state and its optimizer: `TrainState` (everything an update changes, one
pytree), `Grads` (the gradients of its trainable part), AdamW with the schedule of
`OptimizerConfig` (`make_optimizer`, `learning_rate_schedule`; the formula is in
`OptimizerConfig`'s docstring) and `init_train_state`.

Under LoRA only the adapters are trainable (`split_trainable`): gradients, clipping and
the optimizer state cover them alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxagent.models import DecoderConfig, combine_lora, has_lora, lora_optimizer, split_lora
from jaxagent.train.config.step import OptimizerConfig, StepConfig

#: leaves that weight decay applies to (matrices and embeddings; not norms or biases).
DECAYED_LEAVES = ("kernel", "embedding", "lora_a", "lora_b")


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

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    @property
    def has_critic(self) -> bool:
        return self.critic_params is not None


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
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in DECAYED_LEAVES, params)


def make_optimizer(config: OptimizerConfig, params) -> optax.GradientTransformation:
    """AdamW with the config's schedule. Clipping is done by the step itself (it needs
    the norm for its metrics and the finiteness check). With LoRA adapters in `params`,
    `lora_optimizer` gives the frozen leaves zero updates and no optimizer state."""
    tx = optax.adamw(
        learning_rate_schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
    )
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
        raise ValueError(
            "init_train_state: params carry LoRA adapters but model_config.lora is None "
            "(or the reverse); use jaxagent.models.add_lora"
        )
    if (critic_params is None) != (critic_config is None):
        raise ValueError("init_train_state: pass critic_params and critic_config together")
    if critic_params is not None and "value_head" not in critic_params:
        raise ValueError(
            "init_train_state: critic_params have no 'value_head' "
            "(build them with jaxagent.models.value_params_from_policy)"
        )
    critic_opt = None
    if critic_params is not None:
        critic_opt = make_optimizer(config.critic_optimizer, critic_params).init(critic_params)
    return _unaliased(
        TrainState(
            params=params,
            opt_state=make_optimizer(config.optim, params).init(params),
            step=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            rng=key,
            model_config=model_config,
            critic_params=critic_params,
            critic_opt_state=critic_opt,
            critic_config=critic_config,
        )
    )


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


def split_trainable(params):
    """`(part, rebuild)`: the differentiated part of `params` (the LoRA adapters when
    they carry some, else all of them) and `rebuild(part) -> full params`."""
    if has_lora(params):
        adapters, frozen = split_lora(params)
        return adapters, functools.partial(combine_lora, frozen=frozen)
    return params, lambda p: p


def state_shardings(state: TrainState) -> TrainState:
    """The sharding of every leaf, as a `TrainState`-shaped tree (for `in/out_shardings`)."""
    return jax.tree.map(lambda x: x.sharding, state)
