"""Value network: the decoder trunk with a scalar head (a separate PPO critic).

    V(prefix_t) = h_t . w + b,   h = forward_hidden(tokens)  (final-normed, [B, T, D])

Parameters are the policy's tree without `lm_head`, plus `value_head/kernel [D]` and
`value_head/bias []`. A tied embedding stays (it is the trunk's input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxagent.models.config import DecoderConfig
from jaxagent.models.decoder import Params, forward_hidden, init_params


def value_params_from_policy(
    key: jax.Array, policy_params: Params, config: DecoderConfig, head_std: float | None = None
) -> Params:
    """A critic initialised from a policy checkpoint: same trunk, fresh value head
    (kernel ~ N(0, head_std), default `1 / sqrt(D + 1)`; bias 0)."""
    D = config.hidden_size
    dt = policy_params["final_norm"]["scale"].dtype
    std = head_std if head_std is not None else 1.0 / (D + 1) ** 0.5
    trunk = {k: v for k, v in policy_params.items() if k != "lm_head"}
    head = {
        "kernel": (std * jax.random.normal(key, (D,), jnp.float32)).astype(dt),
        "bias": jnp.zeros((), dt),
    }
    return {**trunk, "value_head": head}


def init_value_params(key: jax.Array, config: DecoderConfig, dtype="float32", std: float = 0.02) -> Params:
    """A fresh critic (random trunk as `init_params`, fresh value head)."""
    k_trunk, k_head = jax.random.split(key)
    return value_params_from_policy(k_head, init_params(k_trunk, config, dtype, std), config)


def value_forward(params: Params, config: DecoderConfig, tokens_BxT: jax.Array, **kw) -> jax.Array:
    """Values `[B, T]` float32; keyword arguments as `forward_hidden`."""
    if "value_head" not in params:
        raise ValueError("value_forward: params have no 'value_head' (use value_params_from_policy)")
    h = forward_hidden(params, config, tokens_BxT, **kw)
    head = params["value_head"]
    v = jnp.einsum("btd,d->bt", h, head["kernel"], preferred_element_type=jnp.float32)
    return v + head["bias"].astype(jnp.float32)
