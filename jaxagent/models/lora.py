"""LoRA: low-rank adapters on the decoder's projections.

A target projection `y = x W` becomes `y = x W + (alpha / r) (x A) B` with
`A [in, r]` ~ N(0, 1/in) and `B [r, out] = 0` (so a fresh adapter leaves the model
unchanged). The adapters live next to the frozen kernel in the same parameter dict
(`layers/<proj>/lora_a`, `layers/<proj>/lora_b`, stacked over layers), and the
`DecoderConfig.lora` field carries rank, alpha and targets, so the ordinary forward
functions apply them.

Training only the adapters: `lora_optimizer(tx, params)` wraps an optax transform
with `optax.multi_transform`, labelling adapter leaves "lora" and everything else
"frozen" (`optax.set_to_zero`, no state), so the optimizer state holds moments for the
adapters only. `merge_lora` folds `W + (alpha / r) A B` back into the kernel for export.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxagent.models.config import DecoderConfig, LoraConfig
from jaxagent.models.decoder import Params

_LORA_LEAVES = ("lora_a", "lora_b")


def add_lora(
    key: jax.Array, params: Params, config: DecoderConfig, lora: LoraConfig, adapter_dtype=None
) -> tuple[Params, DecoderConfig]:
    """Returns `(params with fresh adapters, config with config.lora = lora)`.

    adapter_dtype: dtype of A and B (default: the kernel's; e.g. float32 adapters on a
    bfloat16 base keep the trainable weights in full precision).
    """
    if config.lora is not None or has_lora(params):
        raise ValueError("params already carry LoRA adapters; merge_lora first")
    layers = dict(params["layers"])
    keys = jax.random.split(key, len(lora.targets))
    for k, name in zip(keys, lora.targets, strict=True):
        kernel = layers[name]["kernel"]  # [L, in, out]
        L, d_in, d_out = kernel.shape
        dt = kernel.dtype if adapter_dtype is None else jnp.dtype(adapter_dtype)
        a = jax.random.normal(k, (L, d_in, lora.rank), jnp.float32) / jnp.sqrt(float(d_in))
        layers[name] = {
            **layers[name],
            "lora_a": a.astype(dt),
            "lora_b": jnp.zeros((L, lora.rank, d_out), dt),
        }
    return {**params, "layers": layers}, config.replace(lora=lora)


def has_lora(params: Params) -> bool:
    return any(_is_lora_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _is_lora_path(path) -> bool:
    return getattr(path[-1], "key", None) in _LORA_LEAVES


def trainable_labels(params: Params):
    """Pytree of "lora" (adapter leaves) / "frozen" (everything else)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: "lora" if _is_lora_path(p) else "frozen", params)


def trainable_mask(params: Params):
    """Pytree of bools, True on adapter leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, _: _is_lora_path(p), params)


def lora_optimizer(tx: optax.GradientTransformation, params: Params) -> optax.GradientTransformation:
    """`tx` on the adapters, zero updates (and no optimizer state) on everything else."""
    if not has_lora(params):
        raise ValueError("lora_optimizer: params carry no LoRA adapters (call add_lora first)")
    return optax.multi_transform({"lora": tx, "frozen": optax.set_to_zero()}, trainable_labels(params))


def split_lora(params: Params) -> tuple[Params, Params]:
    """`(adapters, frozen)`: two pytrees of the same structure, `None` where the other
    one holds the leaf, so gradients can be taken w.r.t. the adapters alone:
    `jax.grad(lambda a: loss(combine_lora(a, frozen)))(adapters)`."""
    mask = trainable_mask(params)
    adapters = jax.tree.map(lambda m, x: x if m else None, mask, params)
    frozen = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return adapters, frozen


def combine_lora(adapters: Params, frozen: Params) -> Params:
    """Inverse of `split_lora`."""
    return jax.tree.map(lambda a, f: f if a is None else a, adapters, frozen, is_leaf=lambda x: x is None)


def merge_lora(params: Params, config: DecoderConfig) -> tuple[Params, DecoderConfig]:
    """`kernel + (alpha / r) A B` for every adapted projection; adapters removed.

    The product is taken in float32 and cast back to the kernel dtype."""
    if config.lora is None:
        if has_lora(params):
            raise ValueError("params carry LoRA adapters but config.lora is None")
        return params, config
    scale = config.lora.scale
    layers = {}
    for name, p in params["layers"].items():
        if "lora_a" in p:
            delta = jnp.einsum("lir,lro->lio", p["lora_a"].astype(jnp.float32), p["lora_b"].astype(jnp.float32))
            p = {k: v for k, v in p.items() if k not in _LORA_LEAVES}
            p["kernel"] = (p["kernel"].astype(jnp.float32) + scale * delta).astype(p["kernel"].dtype)
        layers[name] = p
    return {**params, "layers": layers}, config.replace(lora=None)
