"""`Model`: parameters + static config in one pytree, callable like a function."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import flax.struct
import jax

from jaxagent.models import decoder
from jaxagent.models.config import DecoderConfig


@flax.struct.dataclass
class Model:
    """A decoder with its parameters. A pytree (the config is static), so a `Model` can
    be passed through `jax.jit` / `jax.grad` directly.

    `model(tokens_BxT, attention_mask_BxT=..., ...)` -> logits `[B, T, V]` float32.
    The pure functions in `jaxagent.models.decoder` take `(model.params, model.config)`.
    """

    params: Any
    config: DecoderConfig = flax.struct.field(pytree_node=False)

    if TYPE_CHECKING:  # added by `flax.struct.dataclass` at runtime (`dataclasses.replace`)

        def replace(self, **updates: Any) -> Self: ...

    def __call__(self, tokens_BxT: jax.Array, **kw) -> jax.Array:
        return decoder.forward(self.params, self.config, tokens_BxT, **kw)

    def hidden(self, tokens_BxT: jax.Array, **kw) -> jax.Array:
        return decoder.forward_hidden(self.params, self.config, tokens_BxT, **kw)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> decoder.KVCache:
        if dtype is None:
            dtype = self.params["final_norm"]["scale"].dtype
        return decoder.init_cache(self.config, batch, max_len, dtype)

    def extend(self, tokens_BxT: jax.Array, cache: decoder.KVCache, **kw):
        """KV-cache step (prefill / decode / append): `(logits [B, T, V], cache)`."""
        h, cache = decoder.forward_cached(self.params, self.config, tokens_BxT, cache, **kw)
        return decoder.logits_from_hidden(self.params, self.config, h), cache

    def param_axes(self):
        return decoder.param_axes(self.params)

    def astype(self, dtype) -> Model:
        return self.replace(params=decoder.cast_params(self.params, dtype))
