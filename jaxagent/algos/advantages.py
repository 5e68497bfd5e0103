"""Advantage estimators: token-level (GAE, REINFORCE++, ReMax), outcome-level
(GRPO, Dr.GRPO, RLOO, REINFORCE++ with baseline), step-level (GiGPO) and
turn-level credit (turn GAE, turn returns, turn-level leave-one-out).

Conventions follow ``docs/explanations/formulas.md`` (verl 0.9.1 ``core_algos``) on every
valid position. Shared deviations, all deliberate:

* outputs are float32 and exactly 0 wherever the mask is 0 (the reference leaves
  arbitrary values there);
* outcome scores sum the reward over valid positions only (the reference sums the
  whole row);
* NaN/inf at masked positions never reach an output or a gradient.

Arrays are ``[B, T]`` (rows × padded length) unless named otherwise; step-level
arrays are ``[B, S]`` (episodes × environment steps). ``mask`` may be bool or
numeric: any non-zero entry is valid.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import code_platform

from . import _checks, _native
from ._groups import GroupStats, segment_ids
from ._scan import METHODS, discounted_returns, gae_raw
from .masked import masked_whiten

GROUP_EPS = 1e-6
GIGPO_MODES = ("mean_norm", "mean_std_norm")


def _bt(name_x, x, name_m, m):
    x = _checks.floats(name_x, x, ndim=2)
    valid = _checks.mask(name_m, m, x.shape)
    return jnp.where(valid, x, 0.0), valid


def _groups(group_ids, batch):
    return _checks.ints("group_ids", group_ids, (batch,))


def _row_scores(r):
    """Per-row outcome score of already-masked rewards (``_bt`` zeroes masked
    entries), replicated: group statistics sort across rows."""
    return _checks.gathered(jnp.sum(r, axis=1))


def _broadcast_rows(a_B, valid):
    a_B = _checks.resharded_like(a_B, valid)
    return jnp.where(valid, a_B[:, None], 0.0)


GAE_METHODS = ("auto", "native") + METHODS


def gae(rewards, values, mask, gamma, lam, *, whiten: bool = True, method: str = "auto"):
    """Generalised advantage estimation with masked steps skipped.

    ::

        nextvalue = 0; lastgae = 0
        for t = T-1 .. 0:
            delta     = r[t] + γ·nextvalue - V[t]
            g         = delta + γλ·lastgae
            nextvalue = m[t] ? V[t] : nextvalue
            lastgae   = m[t] ? g    : lastgae
            A[t]      = lastgae
        returns    = A + V
        advantages = masked_whiten(A, m)     (batch-wide; skipped if whiten=False)

    Interior masked spans (observation/tool tokens of a multi-turn episode) are
    jumped over, so one token-level GAE runs across turns.

    ``method``: ``"scan"`` is a reverse ``lax.scan``; ``"associative"`` solves the
    same linear recurrences with ``lax.associative_scan`` in O(log T) depth;
    ``"native"`` is a C++ kernel called through XLA's FFI (CPU only, ``gamma`` and
    ``lam`` must be Python numbers; see ``_native.py``); ``"auto"`` (default) takes
    the native kernel where it applies (the CPU's code paths: ``jaxagent.code_platform()``)
    and the scan elsewhere. All agree to float32
    rounding and all are differentiable (the native kernel's gradient is the
    scan's).

    Returns ``(advantages, returns)``, both ``[B, T]`` float32.
    """
    _checks.choice("method", method, GAE_METHODS)
    if method in ("auto", "native"):
        g, lm = _python_float(gamma), _python_float(lam)
        usable = g is not None and lm is not None and code_platform() == "cpu"
        if usable and _native.available():
            return _gae_native(rewards, values, mask, g, lm, whiten)
        if method == "native":
            raise ValueError(
                "method='native' needs the CPU backend, Python-number gamma and lam, "
                "and a C++ compiler (see jaxagent/algos/_native.py)"
            )
        method = "scan"
    return _gae_xla(rewards, values, mask, gamma, lam, whiten, method)


def _python_float(x):
    if isinstance(x, (int, float, np.floating, np.integer)):
        return float(x)
    return None


def _gae_inputs(rewards, values, mask):
    r, valid = _bt("rewards", rewards, "mask", mask)
    v = jnp.where(valid, _checks.floats("values", values, shape=r.shape), 0.0)
    return r, v, valid


@partial(jax.jit, static_argnames=("whiten", "method"))
def _gae_xla(rewards, values, mask, gamma, lam, whiten, method):
    r, v, valid = _gae_inputs(rewards, values, mask)
    adv_raw = gae_raw(r, v, valid, gamma, lam, method)
    returns = jnp.where(valid, adv_raw + v, 0.0)
    adv = masked_whiten(adv_raw, valid) if whiten else jnp.where(valid, adv_raw, 0.0)
    return adv, returns


@partial(jax.jit, static_argnames=("gamma", "lam", "whiten"))
def _gae_native(rewards, values, mask, gamma, lam, whiten):
    # No masking pass: the kernel never reads a masked step (and writes 0 there).
    r = _checks.floats("rewards", rewards, ndim=2)
    valid = _checks.mask("mask", mask, r.shape)
    v = _checks.floats("values", values, shape=r.shape)
    return _native_core(r, v, valid, gamma, lam, whiten)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _native_core(r, v, valid, gamma, lam, whiten):
    return _native.gae(r, v, valid, gamma, lam, whiten)


def _native_core_fwd(r, v, valid, gamma, lam, whiten):
    return _native_core(r, v, valid, gamma, lam, whiten), (r, v, valid)


def _native_core_bwd(gamma, lam, whiten, res, cts):
    # The kernel computes exactly what the scan path does; differentiate that.
    r, v, valid = res
    _, pull = jax.vjp(lambda r, v: _gae_xla(r, v, valid, gamma, lam, whiten, "scan"), r, v)
    dr, dv = pull(cts)
    return dr, dv, np.zeros(valid.shape, jax.dtypes.float0)


_native_core.defvjp(_native_core_fwd, _native_core_bwd)


@partial(jax.jit, static_argnames=("norm_by_std",))
def grpo(rewards, mask, group_ids, eps=GROUP_EPS, norm_by_std: bool = True):
    """Group-relative outcome advantage (GRPO; Dr.GRPO with ``norm_by_std=False``).

    ::

        s_i = Σ_t r[i,t]·m[i,t]
        a_i = (s_i - mean_g) / (std_g + eps)      std unbiased (ddof=1)
        a_i =  s_i - mean_g                       if not norm_by_std
        a group of one has mean 0 and std 1

    broadcast over the row's valid tokens. Groups are rows with equal
    ``group_ids`` (any order, not necessarily contiguous). A group whose scores
    are all equal gets exactly 0.
    """
    r, valid = _bt("rewards", rewards, "mask", mask)
    gid = _groups(group_ids, r.shape[0])
    s = _row_scores(r)
    st = GroupStats(s, segment_ids(gid))
    single = st.count < 2
    centred = jnp.where(single, s, st.deviation)
    if norm_by_std:
        centred = centred / (jnp.where(single, 1.0, st.std) + eps)
    return _broadcast_rows(centred, valid)


def dr_grpo(rewards, mask, group_ids):
    """Dr.GRPO: GRPO without the division by the group's std."""
    return grpo(rewards, mask, group_ids, norm_by_std=False)


@jax.jit
def rloo(rewards, mask, group_ids):
    """REINFORCE leave-one-out: ``a_i = s_i - mean of the other K-1 scores``.

    Written as ``(s_i - mean_g)·K/(K-1)``. A singleton group gets 0 (the reference's
    vectorised form; its loop form keeps the raw score).
    """
    r, valid = _bt("rewards", rewards, "mask", mask)
    gid = _groups(group_ids, r.shape[0])
    st = GroupStats(_row_scores(r), segment_ids(gid))
    k = st.count
    a = jnp.where(k >= 2, st.deviation * k / jnp.maximum(k - 1.0, 1.0), 0.0)
    return _broadcast_rows(a, valid)


@partial(jax.jit, static_argnames=("method",))
def reinforce_pp(rewards, mask, gamma, *, method: str = "scan"):
    """REINFORCE++: discounted token returns, whitened over the batch.

    ::

        running = 0
        for t = T-1 .. 0:
            new = r[t] + γ·running;  returns[t] = new·m[t];  running = m[t] ? new : running
        advantages = masked_whiten(returns, m)

    Returns ``(advantages, returns)``.
    """
    _checks.choice("method", method, METHODS)
    r, valid = _bt("rewards", rewards, "mask", mask)
    ret = jnp.where(valid, discounted_returns(r, valid, gamma, method), 0.0)
    return masked_whiten(ret, valid), ret


@jax.jit
def reinforce_pp_baseline(rewards, mask, group_ids):
    """REINFORCE++ with a group-mean baseline.

    ``a_i = s_i - mean_g`` (a singleton's mean is 0), broadcast over the row, then
    whitened over all valid tokens of the batch (token-weighted).
    """
    r, valid = _bt("rewards", rewards, "mask", mask)
    gid = _groups(group_ids, r.shape[0])
    s = _row_scores(r)
    st = GroupStats(s, segment_ids(gid))
    a = jnp.where(st.count < 2, s, st.deviation)
    return masked_whiten(_broadcast_rows(a, valid), valid)


@jax.jit
def remax(rewards, mask, baselines):
    """ReMax: ``returns[t] = Σ_{t'≥t} r[t']·m[t']``, ``advantages = returns - b_i``.

    ``baselines`` is ``[B]`` (typically the greedy rollout's reward).
    Returns ``(advantages, returns)``.
    """
    r, valid = _bt("rewards", rewards, "mask", mask)
    b = _checks.floats("baselines", baselines, shape=r.shape[:1])
    ret = jnp.where(valid, jnp.flip(jnp.cumsum(jnp.flip(r, 1), axis=1), 1), 0.0)
    adv = jnp.where(valid, ret - b[:, None], 0.0)
    return adv, ret


@partial(jax.jit, static_argnames=("mode",))
def gigpo(
    step_rewards, step_mask, group_ids, anchor_ids, gamma=1.0, step_weight=1.0, mode: str = "mean_norm", eps=GROUP_EPS
):
    """GiGPO: episode-group advantage plus an anchor-state step-group advantage.

    Inputs are per environment step: ``step_rewards``, ``step_mask`` and
    ``anchor_ids`` are ``[B, S]`` (episode × step); ``group_ids`` ``[B]`` says which
    episodes share a task/seed. ``anchor_ids`` are integers naming each step's
    current state (map hashable state keys with :func:`anchor_ids_from_keys`).

    ::

        episode:  s_i = Σ_s r[i,s]·m[i,s];  A_ep = s_i - mean_g  [/ (std_g + eps)]
                  (a singleton episode group: mean 0, std 1)
        step:     R[i,s] = r[i,s] + γ·R[i,s+1] over valid steps
                  anchor group = valid steps with equal (group_id, anchor_id)
                  A_step = R - mean_a  [/ (std_a + eps)];  0 for an anchor group of one
        A = A_ep + step_weight·A_step                (0 at masked steps)

    ``mode="mean_norm"`` subtracts the mean only; ``"mean_std_norm"`` also divides
    by the unbiased std + eps. Broadcast the result to tokens with
    :func:`turns_to_tokens`.
    """
    _checks.choice("mode", mode, GIGPO_MODES)
    r, valid = _bt("step_rewards", step_rewards, "step_mask", step_mask)
    b, s = r.shape
    gid = _groups(group_ids, b)
    aid = _checks.ints("anchor_ids", anchor_ids, (b, s))
    divide = mode == "mean_std_norm"

    score = _row_scores(r)
    ep = GroupStats(score, segment_ids(gid))
    ep_single = ep.count < 2
    a_ep = jnp.where(ep_single, score, ep.deviation)
    if divide:
        a_ep = a_ep / (jnp.where(ep_single, 1.0, ep.std) + eps)

    ret = _checks.gathered(discounted_returns(r, valid, gamma)).reshape(-1)
    flat_valid = _checks.gathered(valid).reshape(-1)
    gid_flat = jnp.broadcast_to(_checks.gathered(gid)[:, None], (b, s)).reshape(-1)
    seg = segment_ids(_checks.gathered(aid).reshape(-1), gid_flat, (~flat_valid).astype(jnp.int32))
    st = GroupStats(ret, seg, flat_valid)
    a_step = jnp.where(st.count >= 2, st.deviation, 0.0)
    if divide:
        a_step = a_step / (st.std + eps)
    a_step = _checks.resharded_like(a_step.reshape(b, s), valid)
    a_ep = _checks.resharded_like(a_ep, valid)
    return jnp.where(valid, a_ep[:, None] + step_weight * a_step, 0.0)


def anchor_ids_from_keys(keys_per_episode, num_steps: int | None = None):
    """Host helper: map hashable per-step state keys to dense int32 anchor ids.

    ``keys_per_episode`` is a list (one per episode) of lists of hashable keys, one
    per step. Returns a NumPy ``[B, S]`` int32 array (padding -1), ``S`` defaulting
    to the longest episode. Equal keys get equal ids across the whole batch.
    """
    table: dict = {}
    longest = max((len(k) for k in keys_per_episode), default=0)
    s = longest if num_steps is None else num_steps
    if s < longest:
        raise ValueError(f"num_steps={num_steps} is shorter than the longest episode ({longest} steps)")
    out = np.full((len(keys_per_episode), s), -1, np.int32)
    for i, keys in enumerate(keys_per_episode):
        for j, key in enumerate(keys):
            out[i, j] = table.setdefault(key, len(table))
    return out


@jax.jit
def turn_returns(turn_rewards, turn_mask, gamma):
    """Turn-level discounted returns ``R[s] = r[s] + γ·R[s+1]`` over valid turns ``[B, S]``."""
    r, valid = _bt("turn_rewards", turn_rewards, "turn_mask", turn_mask)
    return jnp.where(valid, discounted_returns(r, valid, gamma), 0.0)


@jax.jit
def turn_loo(turn_rewards, turn_mask, group_ids, gamma=1.0):
    """Turn-level leave-one-out advantage: each turn's return-to-go minus the mean
    return-to-go of the *other* episodes of its group at the same turn index.

    Inputs are per turn: ``turn_rewards`` and ``turn_mask`` are ``[B, K]`` (episode ×
    turn), ``group_ids`` ``[B]`` says which episodes share a task. An episode is *alive*
    at turn ``t`` where ``turn_mask[i, t]``; a *member* of its group if it has at
    least one valid turn (a fully masked row, e.g. a failed episode, takes no part).

    ::

        G[i,t]   = r[i,t] + γ·G[i,t+1] over valid turns      (turn_returns)
        G0[i]    = G[i, first valid turn]                    (the episode's return)
        O[i,t]   = {j ≠ i in i's group, alive at t}
        b[i,t]   = mean_{j ∈ O[i,t]} G[j,t]                  if O[i,t] is not empty
                 = mean_{j ≠ i member of i's group} G0[j]    else (fallback)
        A[i,t]   = G[i,t] - b[i,t]        on valid turns; 0 if i's group has no other
                                           member, and 0 on masked turns

    ``b[i,t]`` is built from the other episodes only (the set ``O[i,t]``, whether the
    fallback applies, and the values averaged), so it is independent of episode i's
    own actions and ``E[∇log π(a_t|h_t)·b[i,t]] = 0``: the estimate stays an unbiased
    policy gradient for every turn even when the policy chooses how many turns to
    take. Unlike a per-turn mean/std taken over all alive episodes, episode i never
    enters its own baseline and nothing is divided by a std that contains it. The
    derivation is in ``docs/explanations/turn-baseline.md``.

    The fallback (episode i alone at turn t) compares with the others' whole-episode
    returns: with a final reward only and ``γ = 1`` it is exactly :func:`rloo`'s
    baseline. No std scaling is offered: a leave-one-out std keeps each task's
    direction but reweights tasks (see the doc).

    Written as ``(G - mean_t)·n/(n-1)`` over the ``n`` alive episodes of the turn, so
    a turn where every alive episode has the same return gets exactly 0. Broadcast
    the result to tokens with :func:`turns_to_tokens`.
    """
    r, valid = _bt("turn_rewards", turn_rewards, "turn_mask", turn_mask)
    b, k = r.shape
    gid = _groups(group_ids, b)
    # Masked turns carry the return across (as turn_returns), so column 0 holds the
    # return from the episode's first valid turn.
    ret_raw = _checks.gathered(discounted_returns(r, valid, gamma))
    valid_g = _checks.gathered(valid)
    gid_g = _checks.gathered(gid)
    ret = jnp.where(valid_g, ret_raw, 0.0)

    # Fallback: leave-one-out mean of the other members' episode returns.
    member = jnp.any(valid_g, axis=1)
    total = jnp.where(member, ret_raw[:, 0], 0.0)
    ep = GroupStats(total, segment_ids(gid_g), member)
    m = ep.count
    others_mean = total - ep.deviation * m / jnp.maximum(m - 1.0, 1.0)
    a_fallback = jnp.where((m >= 2)[:, None], ret - others_mean[:, None], 0.0)

    # Per turn: (G - mean over the n alive episodes of (group, t))·n/(n-1).
    flat_valid = valid_g.reshape(-1)
    t_flat = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None, :], (b, k)).reshape(-1)
    gid_flat = jnp.broadcast_to(gid_g[:, None], (b, k)).reshape(-1)
    seg = segment_ids(t_flat, gid_flat, (~flat_valid).astype(jnp.int32))
    st = GroupStats(ret.reshape(-1), seg, flat_valid)
    n = st.count
    a_turn = (st.deviation * n / jnp.maximum(n - 1.0, 1.0)).reshape(b, k)
    n = n.reshape(b, k)

    a = jnp.where(n >= 2, a_turn, a_fallback)
    a = _checks.resharded_like(a, valid)
    return jnp.where(valid, a, 0.0)


def turn_gae(turn_rewards, turn_values, turn_mask, gamma, lam, *, whiten: bool = True):
    """Turn-level GAE: the :func:`gae` recurrence with one value and one reward per
    turn (``[B, S]``); whitening uses all valid turns of the batch.

    Take the values with :func:`turn_start_values` (the critic's value at each
    turn's first policy token) and spread the result with :func:`turns_to_tokens`.
    """
    return gae(turn_rewards, turn_values, turn_mask, gamma, lam, whiten=whiten)


@jax.jit
def turns_to_tokens(x, turn_ids, mask):
    """Spread per-turn values ``x [B, S]`` onto tokens: ``out[b,t] = x[b, turn_ids[b,t]]``
    on valid tokens with ``turn_ids ≥ 0``, else 0."""
    x = _checks.floats("x", x, ndim=2)
    if jnp.ndim(turn_ids) != 2 or jnp.shape(turn_ids)[0] != x.shape[0]:
        raise ValueError(
            f"turn_ids must be [B, T] with B = {x.shape[0]} (rows of x), got shape {tuple(jnp.shape(turn_ids))}"
        )
    tid = _checks.ints("turn_ids", turn_ids, jnp.shape(turn_ids))
    valid = _checks.mask("mask", mask, tid.shape) & (tid >= 0) & (tid < x.shape[1])
    picked = jnp.take_along_axis(x, jnp.clip(tid, 0, x.shape[1] - 1), axis=1)
    return jnp.where(valid, picked, 0.0)


@partial(jax.jit, static_argnames=("num_turns",))
def turn_start_values(values, turn_ids, mask, num_turns: int):
    """The value at each turn's first valid policy token, ``[B, num_turns]`` (0 if the
    turn has none)."""
    v = _checks.floats("values", values, ndim=2)
    b, t = v.shape
    tid = _checks.ints("turn_ids", turn_ids, (b, t))
    valid = _checks.mask("mask", mask, (b, t)) & (tid >= 0) & (tid < num_turns)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    seg = jnp.arange(b, dtype=jnp.int32)[:, None] * num_turns + jnp.clip(tid, 0, num_turns - 1)
    first = jax.ops.segment_min(
        jnp.where(valid, pos, t).reshape(-1), seg.reshape(-1), num_segments=b * num_turns
    ).reshape(b, num_turns)
    picked = jnp.take_along_axis(v, jnp.clip(first, 0, t - 1), axis=1)
    return jnp.where(first < t, picked, 0.0)
