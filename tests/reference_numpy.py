"""Independent float64 NumPy references for ``jaxagent.algos``.

Written straight from ``docs/explanations/formulas.md`` and the public API spec, with
explicit Python loops (over t, over rows, dicts for groups) so that they read
like the formulas and share no code with the implementation under test.  This
module must never import ``jaxagent``.

Conventions shared by every function here:
  * inputs are converted to float64 (``_f``); masks to 0/1 float64;
  * values at masked positions are never read (NaN/inf there are harmless);
  * outputs are exactly 0 where the mask is 0, as the spec requires.
"""

from __future__ import annotations

import math

import numpy as np

# --------------------------------------------------------------------------
# small utilities


def _f(x):
    """float64 copy of x (works for jax / bfloat16 arrays too)."""
    x = np.asarray(x)
    if x.dtype != np.float64:
        x = x.astype(np.float32)  # bfloat16 / ints go through float32 exactly
    return x.astype(np.float64)


def _m(mask):
    return (np.asarray(mask).astype(np.float64) != 0).astype(np.float64)


def row_scores(rewards, mask):
    """s_i = sum_t r[i,t] over valid positions only."""
    r, m = _f(rewards), _m(mask)
    B, T = r.shape
    s = np.zeros(B)
    for i in range(B):
        for t in range(T):
            if m[i, t]:
                s[i] += r[i, t]
    return s


def _groups(group_ids):
    groups = {}
    for i, g in enumerate(np.asarray(group_ids).tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def _broadcast_rows(a, mask):
    m = _m(mask)
    B, T = m.shape
    out = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if m[i, t]:
                out[i, t] = a[i]
    return out


# --------------------------------------------------------------------------
# helpers


def masked_mean(x, mask):
    x, m = _f(x), _m(mask)
    total, n = 0.0, 0.0
    for v, w in zip(x.ravel(), m.ravel(), strict=True):
        if w:
            total += v
            n += 1.0
    return total / (n + 1e-8)


def masked_var(x, mask):
    """Unbiased; n <= 1 gives 0 (the spec's documented deviation)."""
    x, m = _f(x), _m(mask)
    n = m.sum()
    if n <= 1:
        return 0.0
    mu = masked_mean(x, m)
    acc = 0.0
    for v, w in zip(x.ravel(), m.ravel(), strict=True):
        if w:
            acc += (v - mu) ** 2
    return acc / (n + 1e-8) * n / (n - 1)


def masked_whiten(x, mask):
    x, m = _f(x), _m(mask)
    mu = masked_mean(x, m)
    inv = 1.0 / math.sqrt(masked_var(x, m) + 1e-8)
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        if m[idx]:
            out[idx] = (x[idx] - mu) * inv
    return out


# --------------------------------------------------------------------------
# advantage estimators


def gae_raw(rewards, values, mask, gamma, lam):
    r, v, m = _f(rewards), _f(values), _m(mask)
    B, T = r.shape
    A = np.zeros((B, T))
    for i in range(B):
        nextvalue, lastgae = 0.0, 0.0
        for t in range(T - 1, -1, -1):
            if m[i, t]:
                delta = r[i, t] + gamma * nextvalue - v[i, t]
                g = delta + gamma * lam * lastgae
                nextvalue, lastgae = v[i, t], g
                A[i, t] = lastgae
            # masked: accumulator and bootstrap jump over t; output is 0 there
    return A


def gae(rewards, values, mask, gamma, lam, whiten=True):
    m = _m(mask)
    A = gae_raw(rewards, values, mask, gamma, lam)
    v = _f(values)
    returns = np.where(m > 0, A + np.where(m > 0, v, 0.0), 0.0)
    adv = masked_whiten(A, m) if whiten else A
    return adv, returns


def _group_mean_std(s, groups):
    """{gid: (mean, std_unbiased)} with the singleton rule mean 0, std 1."""
    stats = {}
    for g, rows in groups.items():
        if len(rows) == 1:
            stats[g] = (0.0, 1.0)
        else:
            vals = [s[i] for i in rows]
            mu = sum(vals) / len(vals)
            var = sum((x - mu) ** 2 for x in vals) / (len(vals) - 1)
            stats[g] = (mu, math.sqrt(var))
    return stats


def grpo(rewards, mask, group_ids, eps=1e-6, norm_by_std=True):
    s = row_scores(rewards, mask)
    stats = _group_mean_std(s, _groups(group_ids))
    a = np.zeros(len(s))
    for i, g in enumerate(np.asarray(group_ids).tolist()):
        mu, sd = stats[g]
        a[i] = (s[i] - mu) / (sd + eps) if norm_by_std else s[i] - mu
    return _broadcast_rows(a, mask)


def rloo(rewards, mask, group_ids):
    s = row_scores(rewards, mask)
    a = np.zeros(len(s))
    for rows in _groups(group_ids).values():
        K = len(rows)
        if K == 1:
            continue  # singleton: 0 (documented choice)
        for i in rows:
            others = [s[j] for j in rows if j != i]
            a[i] = s[i] - sum(others) / (K - 1)
    return _broadcast_rows(a, mask)


def reinforce_pp(rewards, mask, gamma):
    r, m = _f(rewards), _m(mask)
    B, T = r.shape
    returns = np.zeros((B, T))
    for i in range(B):
        running = 0.0
        for t in range(T - 1, -1, -1):
            if m[i, t]:
                running = r[i, t] + gamma * running
                returns[i, t] = running
    return masked_whiten(returns, m), returns


def reinforce_pp_baseline(rewards, mask, group_ids):
    s = row_scores(rewards, mask)
    groups = _groups(group_ids)
    a = np.zeros(len(s))
    for rows in groups.values():
        mu = 0.0 if len(rows) == 1 else sum(s[i] for i in rows) / len(rows)
        for i in rows:
            a[i] = s[i] - mu
    return masked_whiten(_broadcast_rows(a, mask), mask)


def remax(rewards, mask, baselines):
    r, m, b = _f(rewards), _m(mask), _f(baselines)
    B, T = r.shape
    returns = np.zeros((B, T))
    adv = np.zeros((B, T))
    for i in range(B):
        acc = 0.0
        for t in range(T - 1, -1, -1):
            if m[i, t]:
                acc += r[i, t]
                returns[i, t] = acc
                adv[i, t] = acc - b[i]
    return adv, returns


def turn_returns(turn_rewards, turn_mask, gamma):
    r, m = _f(turn_rewards), _m(turn_mask)
    B, S = r.shape
    R = np.zeros((B, S))
    for i in range(B):
        running = 0.0
        for s in range(S - 1, -1, -1):
            if m[i, s]:
                running = r[i, s] + gamma * running
                R[i, s] = running
    return R


def turn_gae(turn_rewards, turn_values, turn_mask, gamma, lam, whiten=True):
    return gae(turn_rewards, turn_values, turn_mask, gamma, lam, whiten=whiten)


def gigpo(step_rewards, step_mask, group_ids, anchor_ids, gamma=1.0, step_weight=1.0, mode="mean_norm", eps=1e-6):
    r, m = _f(step_rewards), _m(step_mask)
    B, S = r.shape
    gids = np.asarray(group_ids).tolist()
    anchors = np.asarray(anchor_ids).tolist()
    # episode level
    s = row_scores(r, m)
    stats = _group_mean_std(s, _groups(gids))
    a_ep = np.zeros(B)
    for i in range(B):
        mu, sd = stats[gids[i]]
        a_ep[i] = s[i] - mu if mode == "mean_norm" else (s[i] - mu) / (sd + eps)
    # step level
    R = turn_returns(r, m, gamma)
    anchor_groups = {}
    for i in range(B):
        for k in range(S):
            if m[i, k]:
                anchor_groups.setdefault((gids[i], anchors[i][k]), []).append((i, k))
    a_step = np.zeros((B, S))
    for members in anchor_groups.values():
        if len(members) == 1:
            continue
        vals = [R[i, k] for i, k in members]
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((x - mu) ** 2 for x in vals) / (len(vals) - 1))
        for i, k in members:
            a_step[i, k] = R[i, k] - mu if mode == "mean_norm" else (R[i, k] - mu) / (sd + eps)
    out = np.zeros((B, S))
    for i in range(B):
        for k in range(S):
            if m[i, k]:
                out[i, k] = a_ep[i] + step_weight * a_step[i, k]
    return out


def turns_to_tokens(x, turn_ids, mask):
    x, m = _f(x), _m(mask)
    tid = np.asarray(turn_ids)
    B, T = m.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if m[b, t] and tid[b, t] >= 0:
                out[b, t] = x[b, tid[b, t]]
    return out


def turn_start_values(values, turn_ids, mask, num_turns):
    v, m = _f(values), _m(mask)
    tid = np.asarray(turn_ids)
    B, T = m.shape
    out = np.zeros((B, num_turns))
    for b in range(B):
        seen = set()
        for t in range(T):
            k = int(tid[b, t])
            if m[b, t] and 0 <= k < num_turns and k not in seen:
                seen.add(k)
                out[b, k] = v[b, t]
    return out


# --------------------------------------------------------------------------
# aggregation


AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def local_counts(mask):
    m = _m(mask)
    return m.sum(), float((m.sum(axis=-1) > 0).sum()), m.shape[-1]


def aggregate(L, mask, mode, num_tokens=None, num_seqs=None, seq_len=None):
    L, m = _f(L), _m(mask)
    B, T = m.shape
    n_tok, n_seq, t_len = local_counts(m)
    num_tokens = n_tok if num_tokens is None else num_tokens
    num_seqs = n_seq if num_seqs is None else num_seqs
    seq_len = t_len if seq_len is None else seq_len
    row_sum = np.zeros(B)
    row_n = np.zeros(B)
    for i in range(B):
        for t in range(T):
            if m[i, t]:
                row_sum[i] += L[i, t]
                row_n[i] += 1
    if mode == "token-sum":
        return float(row_sum.sum())
    if mode == "token-mean":
        return float(row_sum.sum() / num_tokens) if num_tokens > 0 else 0.0
    if num_seqs == 0:
        return 0.0
    if mode == "seq-mean-token-sum":
        return float(row_sum.sum() / num_seqs)
    if mode == "seq-mean-token-mean":
        tot = 0.0
        for i in range(B):
            if row_n[i] > 0:
                tot += row_sum[i] / row_n[i]
        return tot / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return float(row_sum.sum() / num_seqs / seq_len)
    raise ValueError(mode)


def aggregate_weights(mask, mode, num_tokens=None, num_seqs=None, seq_len=None):
    """d agg(L) / d L[i,t]: the (constant) weight of each token in the aggregate."""
    m = _m(mask)
    B, T = m.shape
    W = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if m[i, t]:
                E = np.zeros((B, T))
                E[i, t] = 1.0
                W[i, t] = aggregate(E, m, mode, num_tokens, num_seqs, seq_len)
    return W


# --------------------------------------------------------------------------
# policy losses


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def ppo_per_token(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0, is_weights=None):
    """Returns (L, dL/dlogp, metrics-ingredients) per token, float64."""
    lp, olp, A, m = _f(logp), _f(old_logp), _f(adv), _m(mask)
    w = np.ones_like(lp) if is_weights is None else _f(is_weights)
    B, T = m.shape
    L = np.zeros((B, T))
    G = np.zeros((B, T))
    clipped = np.zeros((B, T))
    clipped_lower = np.zeros((B, T))
    negkl = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if not m[i, t]:
                continue
            d_raw = lp[i, t] - olp[i, t]
            d = _clip(d_raw, -20.0, 20.0)
            dd = 1.0 if -20.0 < d_raw < 20.0 else 0.0  # d d / d logp
            a = A[i, t]
            ratio = math.exp(d)
            l1 = -a * ratio
            cr = _clip(ratio, 1 - clip_low, 1 + clip_high)
            l2 = -a * cr
            # gradient of l1 wrt logp: -a*ratio*dd; of l2: 0 where clipped
            g1 = -a * ratio * dd
            g2 = g1 if (1 - clip_low) < ratio < (1 + clip_high) else 0.0
            c1 = max(l1, l2)
            gc1 = g1 if l1 > l2 else (g2 if l2 > l1 else 0.5 * (g1 + g2))
            clipped[i, t] = float(l2 > l1)
            if clip_c is not None and a < 0:
                l3 = -a * clip_c
                c2 = min(l3, c1)
                gc2 = gc1 if c1 < l3 else (0.0 if l3 < c1 else 0.5 * gc1)
                L[i, t], G[i, t] = c2, gc2
                clipped_lower[i, t] = float(c1 > l3)
            else:  # A >= 0, or no dual clip: clipfrac_lower stays 0
                L[i, t], G[i, t] = c1, gc1
            L[i, t] *= w[i, t]
            G[i, t] *= w[i, t]
            negkl[i, t] = d
    metrics = {
        "clipfrac": masked_mean(clipped, m),
        "clipfrac_lower": masked_mean(clipped_lower, m),
        "approx_kl": masked_mean(-negkl, m),
    }
    return L, G, metrics


def ppo_loss(
    logp,
    old_logp,
    adv,
    mask,
    mode="token-mean",
    clip_low=0.2,
    clip_high=0.2,
    clip_c=3.0,
    is_weights=None,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    L, G, metrics = ppo_per_token(logp, old_logp, adv, mask, clip_low, clip_high, clip_c, is_weights)
    W = aggregate_weights(mask, mode, num_tokens, num_seqs, seq_len)
    return aggregate(L, mask, mode, num_tokens, num_seqs, seq_len), G * W, metrics


def gspo_per_token(logp, old_logp, adv, mask, clip_low=3e-4, clip_high=4e-4, is_weights=None):
    """(L, dL/dlogp) per token.

    log s[i,t] = logp[i,t] - sg(logp[i,t]) + sg(d_seq_i): its value is d_seq_i
    and its derivative is 1 wrt logp[i,t] only (0 once capped at 10), so
    d L[i,t] / d logp[i,t] = -A*s on the unclipped branch, 0 on the clipped one.
    """
    lp, olp, A, m = _f(logp), _f(old_logp), _f(adv), _m(mask)
    w = np.ones_like(lp) if is_weights is None else _f(is_weights)
    B, T = m.shape
    L = np.zeros((B, T))
    G = np.zeros((B, T))
    for i in range(B):
        n = 0
        tot = 0.0
        for t in range(T):
            if m[i, t]:
                tot += lp[i, t] - olp[i, t]
                n += 1
        d_seq = tot / max(n, 1)
        s = math.exp(min(d_seq, 10.0))
        ds = s if d_seq < 10.0 else 0.0  # d s / d logp[i,t]
        inside = (1 - clip_low) < s < (1 + clip_high)
        for t in range(T):
            if m[i, t]:
                a = A[i, t]
                l1 = -a * s
                l2 = -a * _clip(s, 1 - clip_low, 1 + clip_high)
                g1 = -a * ds
                g2 = g1 if inside else 0.0
                L[i, t] = max(l1, l2) * w[i, t]
                g = g1 if l1 > l2 else (g2 if l2 > l1 else 0.5 * (g1 + g2))
                G[i, t] = g * w[i, t]
    return L, G


def gspo_loss(
    logp,
    old_logp,
    adv,
    mask,
    mode="seq-mean-token-mean",
    clip_low=3e-4,
    clip_high=4e-4,
    is_weights=None,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    L, G = gspo_per_token(logp, old_logp, adv, mask, clip_low, clip_high, is_weights)
    W = aggregate_weights(mask, mode, num_tokens, num_seqs, seq_len)
    return aggregate(L, mask, mode, num_tokens, num_seqs, seq_len), G * W


def cispo_per_token(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2, is_weights=None):
    """(L, dL/dlogp) per token."""
    lp, olp, A, m = _f(logp), _f(old_logp), _f(adv), _m(mask)
    w = np.ones_like(lp) if is_weights is None else _f(is_weights)
    B, T = m.shape
    L = np.zeros((B, T))
    G = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if m[i, t]:
                d = _clip(lp[i, t] - olp[i, t], -20.0, 20.0)
                cr = _clip(math.exp(d), 1 - clip_low, 1 + clip_high)
                L[i, t] = -cr * A[i, t] * lp[i, t] * w[i, t]
                G[i, t] = -cr * A[i, t] * w[i, t]
    return L, G


def cispo_loss(
    logp,
    old_logp,
    adv,
    mask,
    mode="token-mean",
    clip_low=0.2,
    clip_high=0.2,
    is_weights=None,
    num_tokens=None,
    num_seqs=None,
    seq_len=None,
):
    L, G = cispo_per_token(logp, old_logp, adv, mask, clip_low, clip_high, is_weights)
    W = aggregate_weights(mask, mode, num_tokens, num_seqs, seq_len)
    return aggregate(L, mask, mode, num_tokens, num_seqs, seq_len), G * W


def value_loss(
    values, old_values, returns, mask, mode="token-mean", clip=0.5, num_tokens=None, num_seqs=None, seq_len=None
):
    """(loss, dloss/dvalues, vf_clipfrac)."""
    v, vo, ret, m = _f(values), _f(old_values), _f(returns), _m(mask)
    B, T = m.shape
    L = np.zeros((B, T))
    G = np.zeros((B, T))
    clipped = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if not m[i, t]:
                continue
            vc = _clip(v[i, t], vo[i, t] - clip, vo[i, t] + clip)
            inside = (vo[i, t] - clip) < v[i, t] < (vo[i, t] + clip)
            l1 = (v[i, t] - ret[i, t]) ** 2
            l2 = (vc - ret[i, t]) ** 2
            g1 = 2 * (v[i, t] - ret[i, t])
            g2 = 2 * (vc - ret[i, t]) if inside else 0.0
            L[i, t] = max(l1, l2)
            G[i, t] = g1 if l1 > l2 else (g2 if l2 > l1 else 0.5 * (g1 + g2))
            clipped[i, t] = float(l2 > l1)
    W = aggregate_weights(m, mode, num_tokens, num_seqs, seq_len)
    loss = 0.5 * aggregate(L, m, mode, num_tokens, num_seqs, seq_len)
    return loss, 0.5 * G * W, masked_mean(clipped, m)


# --------------------------------------------------------------------------
# KL, entropy, truncated IS

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl(logp, ref_logp, kind="k3"):
    """(value, d value / d logp) elementwise, float64."""
    lp, rp = _f(logp), _f(ref_logp)
    plus = kind.endswith("+")
    base = kind[:-1] if plus else kind
    base = KL_ALIASES.get(base, base)
    val = np.zeros_like(lp)
    grad = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = lp[idx] - rp[idx]
        if base == "k1":
            v, g = d, 1.0
        elif base == "abs":
            v, g = abs(d), float(np.sign(d))
        elif base == "k2":
            v, g = 0.5 * d * d, d
        elif base == "k3":
            k_raw = -d
            k = _clip(k_raw, -20.0, 20.0)
            inner = math.exp(k) - k - 1.0
            v = _clip(inner, -10.0, 10.0)
            inside = (-20.0 < k_raw < 20.0) and (-10.0 < inner < 10.0)
            g = (1.0 - math.exp(k)) if inside else 0.0
        else:
            raise ValueError(kind)
        val[idx] = v
        grad[idx] = d if plus else g
    return val, grad


def entropy(logits):
    z = _f(logits)
    out = np.zeros(z.shape[:-1])
    for idx in np.ndindex(z.shape[:-1]):
        row = z[idx]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(v - mx) for v in row))
        probs = [math.exp(v - lse) for v in row]
        out[idx] = lse - sum(p * v for p, v in zip(probs, row, strict=True))
    return out


def entropy_grad(logits):
    """dH/dz_j = -p_j (z_j - sum_v p_v z_v)  (derived by hand)."""
    z = _f(logits)
    out = np.zeros(z.shape)
    for idx in np.ndindex(z.shape[:-1]):
        row = z[idx]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(v - mx) for v in row))
        probs = [math.exp(v - lse) for v in row]
        ez = sum(p * v for p, v in zip(probs, row, strict=True))
        for j, (p, v) in enumerate(zip(probs, row, strict=True)):
            out[idx + (j,)] = -p * (v - ez)
    return out


def tis_weights(old_logp, rollout_logp, mask, cap=2.0, level="token"):
    o, r, m = _f(old_logp), _f(rollout_logp), _m(mask)
    B, T = m.shape
    W = np.zeros((B, T))
    for i in range(B):
        if level == "token":
            for t in range(T):
                if m[i, t]:
                    W[i, t] = min(math.exp(o[i, t] - r[i, t]), cap)
        elif level == "sequence":
            tot, n = 0.0, 0.0
            for t in range(T):
                if m[i, t]:
                    tot += o[i, t] - r[i, t]
                    n += 1
            w = min(math.exp(tot / (n + 1e-8)), cap)
            for t in range(T):
                if m[i, t]:
                    W[i, t] = w
        else:
            raise ValueError(level)
    return W
