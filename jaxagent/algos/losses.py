"""Loss aggregation, clipped policy objectives, value loss, KL, entropy and
truncated importance-sampling weights.

Conventions follow ``docs/explanations/formulas.md`` (verl 0.9.1) on valid positions. Every
loss returns ``(loss, metrics)``; the loss is a float32 scalar and the metrics a
dict of float32 scalars (masked means over the given mini-batch).

Exact gradient accumulation: pass the *global* mini-batch denominators
(``num_tokens``, ``num_seqs``, ``seq_len``; see :func:`aggregate`) when computing a
micro-batch's loss, and the sum of the micro-batch losses and gradients equals
the full mini-batch loss and gradient. An all-masked batch gives loss 0 and
gradient 0 (the reference gives NaN). Masked inputs are selected away before any
arithmetic, so NaN/inf there reaches neither loss nor gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from . import _checks
from .masked import masked_mean, safe_div

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def _clamp(x, lo, hi):
    """``clip(x, lo, hi)`` with gradient 1 on the closed interval ``[lo, hi]`` and 0
    outside, as ``torch.clamp`` has (``jnp.clip`` gives 0.5 exactly on a bound), so
    gradients match the PyTorch trainers even at exact ties."""
    return jnp.where(x < lo, lo, jnp.where(x > hi, hi, x))


def _count(valid, axis=None):
    return jnp.sum(valid, axis=axis, dtype=jnp.float32)


def _global_denominators(valid, num_tokens, num_seqs, seq_len):
    """The local denominators, overridden by the caller's global ones."""
    n_tok = _count(valid) if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
    n_seq = _count(_count(valid, 1) > 0) if num_seqs is None else jnp.asarray(num_seqs, jnp.float32)
    t = valid.shape[1] if seq_len is None else seq_len
    return n_tok, n_seq, jnp.asarray(t, jnp.float32)


def _aggregate(loss, valid, mode, num_tokens, num_seqs, seq_len):
    _checks.choice("mode", mode, AGG_MODES)
    loss = jnp.where(valid, loss, 0.0)
    n_tok, n_seq, t = _global_denominators(valid, num_tokens, num_seqs, seq_len)
    if mode == "token-mean":
        return safe_div(jnp.sum(loss), n_tok)
    if mode == "token-sum":
        return jnp.sum(loss)
    row_sum = jnp.sum(loss, axis=1)
    if mode == "seq-mean-token-sum":
        return safe_div(jnp.sum(row_sum), n_seq)
    if mode == "seq-mean-token-mean":
        return safe_div(jnp.sum(safe_div(row_sum, _count(valid, 1))), n_seq)
    return safe_div(jnp.sum(row_sum), n_seq * t)  # seq-mean-token-sum-norm


@partial(jax.jit, static_argnames=("mode",))
def aggregate(loss, mask, mode: str = "token-mean", num_tokens=None, num_seqs=None, seq_len=None):
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    ============================  =======================================
    ``token-mean``                ``Σ(L·m) / N``, N valid tokens
    ``token-sum``                 ``Σ(L·m)``
    ``seq-mean-token-sum``        mean over non-empty rows of ``Σ_t L·m``
    ``seq-mean-token-mean``       mean over non-empty rows of ``Σ_t L·m / n_i``
    ``seq-mean-token-sum-norm``   ``seq-mean-token-sum / T`` (Dr.GRPO)
    ============================  =======================================

    ``num_tokens`` (N), ``num_seqs`` (non-empty rows) and ``seq_len`` (T) default to
    this batch's own; pass the global mini-batch values when this is a micro-batch.
    A zero denominator gives 0.
    """
    loss = _checks.floats("loss", loss, ndim=2)
    valid = _checks.mask("mask", mask, loss.shape)
    return _aggregate(loss, valid, mode, num_tokens, num_seqs, seq_len)


def _policy_inputs(logp, old_logp, advantages, mask, is_weights):
    logp = _checks.floats("logp", logp, ndim=2)
    valid = _checks.mask("mask", mask, logp.shape)
    old = _checks.floats("old_logp", old_logp, shape=logp.shape)
    adv = _checks.floats("advantages", advantages, shape=logp.shape)
    clean = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    w = None
    if is_weights is not None:
        w = lax.stop_gradient(clean(_checks.floats("is_weights", is_weights, shape=logp.shape)))
    return clean(logp), clean(old), clean(adv), valid, w


def _check_clip(clip_low, clip_high):
    for name, v in (("clip_low", clip_low), ("clip_high", clip_high)):
        if isinstance(v, (int, float)) and v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")


@partial(jax.jit, static_argnames=("mode", "clip_c"))
def ppo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    mode: str = "token-mean",
    clip_low=0.2,
    clip_high=0.2,
    clip_c: float | None = 3.0,
    is_weights=None,
    *,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    """Clipped PPO surrogate with asymmetric (clip-higher) and dual clipping.

    ::

        d = clip(logp - old_logp, -20, 20);  ratio = exp(d)
        l1 = -A·ratio;  l2 = -A·clip(ratio, 1 - clip_low, 1 + clip_high)
        c1 = max(l1, l2)
        L  = where(A < 0, min(-A·clip_c, c1), c1)     (dual clip, clip_c > 1)
        L *= is_weights                                (optional, constant)
        loss = aggregate(L, m, mode)

    ``clip_c=None`` turns the dual clip off. ``max``/``min`` split the gradient at
    ties, as the reference does. Metrics: ``clipfrac`` (share of tokens where the
    clipped term is larger), ``clipfrac_lower`` (dual clip active), ``approx_kl``
    (``masked_mean(-d)``).
    """
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c must be > 1 (or None to disable dual clip), got {clip_c}")
    _check_clip(clip_low, clip_high)
    logp, old, adv, valid, w = _policy_inputs(logp, old_logp, advantages, mask, is_weights)
    d = _clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(d)
    l1 = -adv * ratio
    l2 = -adv * _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    c1 = jnp.maximum(l1, l2)
    per_token = c1
    lower = jnp.zeros_like(valid)
    if clip_c is not None:
        per_token = jnp.where(adv < 0, jnp.minimum(-adv * clip_c, c1), c1)
        lower = (c1 > -adv * clip_c) & (adv < 0)
    if w is not None:
        per_token = per_token * w
    loss = _aggregate(per_token, valid, mode, num_tokens, num_seqs, seq_len)
    metrics = {
        "clipfrac": masked_mean(l2 > l1, valid),
        "clipfrac_lower": masked_mean(lower, valid),
        "approx_kl": masked_mean(-d, valid),
    }
    return loss, metrics


@partial(jax.jit, static_argnames=("mode",))
def gspo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    mode: str = "seq-mean-token-mean",
    clip_low=3e-4,
    clip_high=4e-4,
    is_weights=None,
    *,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    """GSPO: PPO clipping on the sequence-level (length-normalised) ratio.

    ::

        d = logp - old_logp                                 (no ±20 clamp)
        d_seq_i = Σ_t d·m / max(n_i, 1)
        log s = logp - sg(logp) + sg(d_seq_i);  log s = min(log s, 10)
        L = max(-A·s, -A·clip(s, 1 - clip_low, 1 + clip_high))

    The value of ``s`` is the row's geometric-mean ratio; its gradient is the
    token's own ``∂logp``. Default clip range 3e-4 / 4e-4 is the GSPO paper's
    (Zheng et al., 2025).
    """
    _check_clip(clip_low, clip_high)
    logp, old, adv, valid, w = _policy_inputs(logp, old_logp, advantages, mask, is_weights)
    d = logp - old
    d_seq = safe_div(jnp.sum(d, axis=1), _count(valid, 1))
    log_s = logp - lax.stop_gradient(logp) + lax.stop_gradient(d_seq)[:, None]
    s = jnp.exp(jnp.minimum(log_s, GSPO_LOG_RATIO_MAX))
    l1 = -adv * s
    l2 = -adv * _clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(l1, l2)
    if w is not None:
        per_token = per_token * w
    loss = _aggregate(per_token, valid, mode, num_tokens, num_seqs, seq_len)
    return loss, {"clipfrac": masked_mean(l2 > l1, valid), "approx_kl": masked_mean(-d, valid)}


@partial(jax.jit, static_argnames=("mode",))
def cispo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    mode: str = "token-mean",
    clip_low=0.2,
    clip_high=0.2,
    is_weights=None,
    *,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient IS ratio.

    ::

        cr = sg(clip(exp(clip(logp - old_logp, ±20)), 1 - clip_low, 1 + clip_high))
        L  = -cr·A·logp

    Every token keeps a gradient (the ratio is clipped, not the objective).
    """
    _check_clip(clip_low, clip_high)
    logp, old, adv, valid, w = _policy_inputs(logp, old_logp, advantages, mask, is_weights)
    d = _clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(d)
    clipped = _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -lax.stop_gradient(clipped) * adv * logp
    if w is not None:
        per_token = per_token * w
    loss = _aggregate(per_token, valid, mode, num_tokens, num_seqs, seq_len)
    return loss, {"clipfrac": masked_mean(clipped != ratio, valid), "approx_kl": masked_mean(-d, valid)}


@partial(jax.jit, static_argnames=("mode",))
def value_loss(
    values,
    old_values,
    returns,
    mask,
    mode: str = "token-mean",
    clip=0.5,
    *,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    """Clipped value loss::

        vclip = clip(V, V_old - c, V_old + c)
        L = max((V - R)², (vclip - R)²);   loss = 0.5·aggregate(L, m, mode)

    Metric ``vf_clipfrac``: share of tokens where the clipped error is larger.
    """
    v = _checks.floats("values", values, ndim=2)
    valid = _checks.mask("mask", mask, v.shape)
    clean = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    v = clean(v)
    v_old = clean(_checks.floats("old_values", old_values, shape=v.shape))
    ret = clean(_checks.floats("returns", returns, shape=v.shape))
    v_clip = _clamp(v, v_old - clip, v_old + clip)
    l1 = jnp.square(v - ret)
    l2 = jnp.square(v_clip - ret)
    loss = 0.5 * _aggregate(jnp.maximum(l1, l2), valid, mode, num_tokens, num_seqs, seq_len)
    return loss, {"vf_clipfrac": masked_mean(l2 > l1, valid)}


KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _kl_value(d, kind):
    if kind == "k1":
        return d
    if kind == "abs":
        return d * jnp.sign(d)  # gradient sign(d): 0 at d = 0 (jnp.abs gives 1 there)
    if kind == "k2":
        return 0.5 * jnp.square(d)
    k = _clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # k3
    return _clamp(jnp.exp(k) - k - 1.0, -10.0, 10.0)


@partial(jax.jit, static_argnames=("kind",))
def kl(logp, ref_logp, kind: str = "k3", mask=None):
    """Per-token KL estimate between the policy and a reference, ``d = logp - ref``.

    ======  ==========================================  ==================
    k1/kl   ``d``                                       grad 1
    abs     ``|d|``                                     grad sign(d)
    k2/mse  ``½d²``                                     grad d
    k3      ``k = clip(-d, ±20)``; ``clip(eᵏ - k - 1, ±10)``  (low-variance, Schulman)
    ======  ==========================================  ==================

    ``<kind>+`` has the value of ``<kind>`` and the gradient of k2 (``d``): the
    straight-through form ``b - sg(b) + sg(f)`` with ``b = ½d²``.
    With ``mask``, masked positions are 0 (and never produce NaN gradients).
    """
    straight = kind.endswith("+")
    base = kind[:-1] if straight else kind
    _checks.choice("kind", base, KL_KINDS)
    base = _KL_ALIASES.get(base, base)
    logp = _checks.floats("logp", logp)
    ref = _checks.floats("ref_logp", ref_logp, shape=logp.shape)
    valid = None
    if mask is not None:
        valid = _checks.mask("mask", mask, logp.shape)
        logp, ref = jnp.where(valid, logp, 0.0), jnp.where(valid, ref, 0.0)
    d = logp - ref
    out = _kl_value(d, base)
    if straight:
        b = 0.5 * jnp.square(d)
        out = b - lax.stop_gradient(b) + lax.stop_gradient(out)
    return out if valid is None else jnp.where(valid, out, 0.0)


@partial(jax.jit, static_argnames=("chunk_size",))
def entropy(logits, chunk_size: int | None = None):
    """Per-position entropy of ``softmax(logits)`` over the last axis, float32.

    ``H = logsumexp(z) - Σ_v softmax(z)_v·z_v``, computed on logits shifted by
    their maximum (``H = log Σ e^{z'} - Σ p·z'`` with ``z' = z - max z``) so large
    logits do not cancel. With ``chunk_size`` the vocabulary is streamed in chunks
    with a running max (online log-sum-exp), so no float32 copy of the whole
    ``[..., V]`` tensor is made. Entries at -inf contribute nothing.
    """
    z = jnp.asarray(logits)
    if not jnp.issubdtype(z.dtype, jnp.floating):
        raise TypeError(f"logits must be a floating-point array, got dtype {z.dtype}")
    if z.ndim < 1 or z.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) axis, got {z.shape}")
    vocab = z.shape[-1]
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    if chunk_size is None or chunk_size >= vocab:
        m, s, t = _entropy_terms(z.astype(jnp.float32), None)
        return jnp.log(s) - t / s

    n_chunks = -(-vocab // chunk_size)
    lead = z.shape[:-1]

    def body(c, carry):
        m, s, t = carry
        start = jnp.minimum(c * chunk_size, vocab - chunk_size)  # the last chunk overlaps
        zc = lax.dynamic_slice_in_dim(z, start, chunk_size, axis=-1).astype(jnp.float32)
        fresh = (start + jnp.arange(chunk_size)) >= c * chunk_size
        mc, sc, tc = _entropy_terms(zc, fresh)
        m_new = jnp.maximum(m, mc)
        s_old, t_old = _rebase(m, s, t, m_new)
        s_chunk, t_chunk = _rebase(mc, sc, tc, m_new)
        s_new, t_new = s_old + s_chunk, t_old + t_chunk
        return m_new, s_new, t_new

    init = (jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.float32))
    _, s, t = lax.fori_loop(0, n_chunks, body, init)
    return jnp.log(s) - t / s


def _rebase(m, s, t, m_new):
    """Move partial sums taken relative to ``m`` onto the maximum ``m_new``: with
    ``u = z - m``, ``e^{z-m'}(z-m') = e^{m-m'}·e^{u}·(u + m - m')``. Empty sums stay 0."""
    ok = s > 0
    delta = jnp.where(ok, m - m_new, 0.0)
    scale = jnp.exp(delta)
    return jnp.where(ok, s * scale, 0.0), jnp.where(ok, scale * (t + delta * s), 0.0)


def _entropy_terms(z, keep):
    """``(m, s, t)`` with ``m = max z``, ``s = Σ e^{z-m}``, ``t = Σ e^{z-m}(z-m)`` over
    the last axis (entries where ``keep`` is False, or at -inf, are left out)."""
    if keep is not None:
        z = jnp.where(keep, z, -jnp.inf)
    m = jnp.max(z, axis=-1)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    u = z - shift[..., None]
    e = jnp.exp(u)
    live = e > 0
    return m, jnp.sum(e, axis=-1), jnp.sum(jnp.where(live, e * jnp.where(live, u, 0.0), 0.0), axis=-1)


TIS_LEVELS = ("token", "sequence")


@partial(jax.jit, static_argnames=("level",))
def tis_weights(old_logp, rollout_logp, mask, cap=2.0, level: str = "token"):
    """Truncated importance-sampling weights for the rollout/trainer mismatch.

    token:    ``w = min(exp(old_logp - rollout_logp), cap)``
    sequence: ``w_i = min(exp(masked_mean_t(old_logp - rollout_logp)), cap)``, per row

    Constant (stop-gradient), 0 at masked positions. Multiply into the per-token
    loss via the losses' ``is_weights`` argument.
    """
    _checks.choice("level", level, TIS_LEVELS)
    old = _checks.floats("old_logp", old_logp, ndim=2)
    valid = _checks.mask("mask", mask, old.shape)
    roll = _checks.floats("rollout_logp", rollout_logp, shape=old.shape)
    log_ratio = jnp.where(valid, old, 0.0) - jnp.where(valid, roll, 0.0)
    if level == "sequence":
        row = safe_div(jnp.sum(log_ratio, axis=1), _count(valid, 1))
        log_ratio = jnp.broadcast_to(row[:, None], old.shape)
    cap = jnp.asarray(cap, jnp.float32)
    w = jnp.exp(jnp.minimum(log_ratio, jnp.log(cap)))
    return lax.stop_gradient(jnp.where(valid, w, 0.0))
