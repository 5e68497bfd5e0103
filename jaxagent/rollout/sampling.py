"""How the sampler draws a token from the logits: `SamplingConfig` and the jitted
logits processing and draw (`processed_logits`, `sample_tokens`).

Sampling (`SamplingConfig`), applied in the Hugging Face order::

    z = logits / temperature
    top-k:  keep z_i >= (k-th largest z)                          (ties kept)
    top-p:  sort p = softmax(z) descending; keep the smallest prefix whose mass
            reaches top_p (token i kept iff the mass strictly before it < top_p)
    min-p:  keep p_i >= min_p * max_j p_j
    token ~ softmax(z restricted to the kept set)

`temperature == 0` is greedy (argmax of the raw logits). The returned log-prob of a
sampled token is its log-probability under the distribution it was drawn from (the
truncated, renormalised, temperature-scaled one). Greedy decoding draws from a point
mass, whose log-prob (0) says nothing, so for greedy the raw model log-prob
`log_softmax(logits)[token]` is returned instead.

Drawing is by inverse CDF (one uniform per row and step). Randomness: row `b`'s
token at cache position `p` uses `fold_in(key_b, p)`, so a
row's samples depend only on its own key and history, never on which other rows share
the batch or on how the batch was re-bucketed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn from the logits (static: one compilation per distinct config).

    Attributes:
      temperature: 0 = greedy; otherwise logits are divided by it.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus mass (1.0 = off).
      min_p: keep tokens with p >= min_p * max p (0.0 = off).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"SamplingConfig.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p < 1.0):
            raise ValueError(f"SamplingConfig.min_p must be in [0, 1), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig(temperature=0.0)


# ---------------------------------------------------------------- logits processing
def processed_logits(logits_BxV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Temperature-scaled logits with tokens outside the top-k / top-p / min-p support at -inf.

    Not for greedy configs (temperature 0). float32 in, float32 out.
    """
    if sampling.greedy:
        raise ValueError("processed_logits: a greedy config has no sampling distribution")
    z = logits_BxV.astype(jnp.float32) / jnp.float32(sampling.temperature)
    V = z.shape[-1]
    if 0 < sampling.top_k < V:
        kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, _NEG_INF)
    if sampling.top_p < 1.0:
        z_desc = -jnp.sort(-z, axis=-1)
        p_desc = jax.nn.softmax(z_desc, axis=-1)
        mass_before = jnp.cumsum(p_desc, axis=-1) - p_desc
        keep = mass_before < jnp.float32(sampling.top_p)
        threshold = jnp.min(jnp.where(keep, z_desc, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z >= threshold, z, _NEG_INF)
    if sampling.min_p > 0.0:
        zmax = jnp.max(z, axis=-1, keepdims=True)
        z = jnp.where(z - zmax >= jnp.float32(math.log(sampling.min_p)), z, _NEG_INF)
    return z


def sample_tokens(
    logits_BxV: jax.Array, keys_B: jax.Array, positions_B: jax.Array, sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob (see the module docstring).

    Row `b` draws with `fold_in(keys_B[b], positions_B[b])`.
    """
    logits = logits_BxV.astype(jnp.float32)
    if sampling.greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
    else:
        z = processed_logits(logits, sampling)
        logp_all = jax.nn.log_softmax(z, axis=-1)
        # inverse-CDF draw: one uniform per row instead of V Gumbel variates (which cost
        # more than the model's own decode step on a CPU)
        step_keys = jax.vmap(jax.random.fold_in)(keys_B, positions_B)
        u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(step_keys)
        p = jnp.exp(logp_all)
        cdf = jnp.cumsum(p, axis=-1)
        below = jnp.sum((cdf <= (u_B * cdf[:, -1])[:, None]).astype(jnp.int32), axis=-1)
        # the first token whose cdf exceeds u has p > 0; rounding at the top end falls back
        # to the most likely token
        tok = jnp.where(below < p.shape[-1], below, jnp.argmax(p, axis=-1)).astype(jnp.int32)
    logp = jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
    return tok, logp
