"""An iteration's metrics (one JSON line of `metrics.jsonl`) and the run's log lines.

`iteration_metrics`: episode statistics of the whole batch (every process's episodes),
the mean of each update metric over the iteration's updates, the gap between the
sampler's and the trainer's log-probs, throughput and the seconds of each phase.
"""

from __future__ import annotations

import math

import numpy as np


def iteration_metrics(
    traj,
    success,
    step_metrics,
    adv,
    old_logp,
    loss_mask,
    times: dict,
    total_s: float,
    *,
    iteration: int,
    tasks_seen: int,
    invalid_actions=None,
    noop_actions=None,
    recomputed: bool = True,
) -> dict:
    """The iteration's JSON-able metrics: episode statistics (of every process's
    episodes: `traj` and `success` hold the whole batch), the mean of each update
    metric over the iteration's updates, throughput and seconds per phase.
    `recomputed`: whether `old_logp` is the trainer's recomputation (else it is the
    sampler's own, and there is no `rollout_logp_gap` to report)."""
    ret = np.asarray(traj.episode_return, np.float64)
    failed = np.asarray(traj.failed)
    ok = ~failed
    success = np.asarray(success)
    policy_tokens = int(np.asarray(traj.loss_mask).sum())
    mask = np.asarray(loss_mask) != 0
    adv_np = np.asarray(adv)

    def mean_of(key):
        vals = [float(m[key]) for m in step_metrics if key in m]
        return float(np.mean(vals)) if vals else None

    out = {
        "iteration": iteration,
        "step": int(step_metrics[-1]["step"]),
        "tasks_seen": tasks_seen,
        "reward_mean": float(ret[ok].mean()) if ok.any() else 0.0,
        "reward_std": float(ret[ok].std()) if ok.any() else 0.0,
        "success_rate": float(success.mean()),
        "failed_episodes": int(failed.sum()),
        "failed_frac": float(failed.mean()),
        "truncated_frac": float(np.asarray(traj.truncated).mean()),
        "turns_mean": float(np.asarray(traj.num_turns).mean()),
        "episode_tokens_mean": float(np.asarray(traj.lengths).mean()),
        "policy_tokens": policy_tokens,
        "advantage_abs_mean": float(np.abs(adv_np[mask]).mean()) if mask.any() else 0.0,
    }
    if recomputed:  # the sampler's log-probs against the trainer's recomputation (same policy):
        # a mismatch means the trainer does not see what the sampler saw
        logp_gap = np.abs(np.asarray(old_logp) - np.asarray(traj.rollout_logp))
        out["rollout_logp_gap"] = float(logp_gap[mask].mean()) if mask.any() else 0.0
    for key in (
        "loss",
        "pg_loss",
        "entropy",
        "clipfrac",
        "approx_kl",
        "kl",
        "grad_norm",
        "lr",
        "value_loss",
        "explained_variance",
        "vf_clipfrac",
        "tis_weight",
    ):
        v = mean_of(key)
        if v is not None:
            out[key] = v
    out.update(learning_diagnostics(traj, invalid_actions, noop_actions))
    out["skipped_updates"] = int(sum(float(m["skipped"]) for m in step_metrics))
    out["tokens_per_s"] = policy_tokens / max(times["rollout"], 1e-9)
    out.update({f"time_{k}_s": v for k, v in times.items()})
    out["time_iteration_s"] = total_s
    return out


def jsonable(x):
    """`x` with everything JSON cannot hold turned into its repr."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return jsonable(x.item())
    return repr(x)


#: the numbers of an evaluation each iteration's metrics keep, by prefix (`eval_metrics`)
EVAL_METRIC_KEYS = {
    "eval": ("success_rate", "return_mean", "turns_mean", "invalid_action_frac", "noop_action_frac"),
    "eval_greedy": ("success_rate", "return_mean", "noop_action_frac"),
}


def eval_metrics(prefix: str, ev: dict) -> dict:
    """An evaluation's metrics for an iteration's line (`eval.every`): `<prefix>_<key>` of
    `EVAL_METRIC_KEYS[prefix]`, and its env summary's numbers flat (`<prefix>_env_<key>`)."""
    from jaxagent.train.evaluate import flat_env_summary

    out = {f"{prefix}_{k}": ev[k] for k in EVAL_METRIC_KEYS[prefix]}
    out.update({f"{prefix}_{k}": v for k, v in flat_env_summary(ev.get("env_summary", {})).items()})
    return out


def eval_line(ev: dict) -> str:
    """One log line of a held-out evaluation."""
    env = "".join(
        f"{k} {v:.3f} | "
        for k, v in (ev.get("env_summary") or {}).items()
        if isinstance(v, float) and not k.endswith("_std")
    )  # the env's own summary, e.g. the rubric
    return (
        f"success {ev['success_rate']:.3f} | return {ev['return_mean']:.3f} | turns {ev['turns_mean']:.2f} | "
        f"{env}{ev['episodes']} episodes at temperature {ev['temperature']} | {ev['seconds']:.1f}s"
    )


def iteration_line(m: dict) -> str:
    """One log line of an iteration's metrics."""
    parts = [f"iter {m['iteration']}", f"reward {m['reward_mean']:.3f}", f"success {m['success_rate']:.2f}"]
    for key in ("kl", "approx_kl", "entropy", "clipfrac"):
        if key in m:
            parts.append(f"{key} {m[key]:.4f}")
    if m.get("failed_frac"):
        parts.append(f"failed {m['failed_frac']:.0%}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    parts.append(f"{m['time_iteration_s']:.1f}s")
    return " | ".join(parts)


def learning_diagnostics(traj, invalid_actions=None, noop_actions=None) -> dict:
    """Whether the batch can teach anything:

    flat_groups_frac    groups whose non-failed episodes' returns do not vary (fewer than
                        two of them count as flat): no group-relative signal
    anchor_repeat_frac  played turns whose anchor state (same group, same `anchor_ids`)
                        occurs more than once: the share of turns GiGPO's step groups
                        can compare
    invalid_action_frac actions the env answered with `info["invalid_action"]`, over
                        the turns played (`invalid_actions`: per row, when given)
    noop_action_frac    valid actions that changed nothing (`info["noop"]`, e.g. a move
                        into a wall), over the turns played (`noop_actions`: per row)
    """
    ret = np.asarray(traj.episode_return, np.float64)
    ok = ~np.asarray(traj.failed)
    gid = np.asarray(traj.group_ids)
    groups = np.unique(gid)
    flat = 0
    for g in groups:
        r = ret[(gid == g) & ok]
        flat += r.size < 2 or np.ptp(r) == 0
    played = np.asarray(traj.turn_mask) & ok[:, None]
    anchor = np.asarray(traj.anchor_ids)
    keys = np.stack([np.broadcast_to(gid[:, None], anchor.shape), anchor], -1)[played & (anchor >= 0)]
    repeat = 0.0
    if len(keys):
        _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
        repeat = float((counts[inverse.reshape(-1)] > 1).sum() / max(int(played.sum()), 1))
    out = {"flat_groups_frac": float(flat / max(len(groups), 1)), "anchor_repeat_frac": repeat}
    out.update(input_dependence(traj.tokens, traj.loss_mask, gid, ok))
    turns = int(np.asarray(traj.num_turns).sum())
    for key, counts in (("invalid_action_frac", invalid_actions), ("noop_action_frac", noop_actions)):
        if counts is not None:
            out[key] = float(np.asarray(counts).sum() / max(turns, 1))
    return out


def _policy_similarity(tokens, loss_mask, rows) -> np.ndarray:
    """Cosine similarity (rows x rows) of the rows' bags of policy tokens and policy-token
    bigrams (consecutive policy tokens of a row)."""
    from scipy import sparse  # type: ignore[import-untyped]  # no stubs installed (scipy-stubs is not a dependency)

    tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
    width = int(tokens.max()) + 1 if tokens.size else 1
    row_parts: list[np.ndarray] = []
    feat_parts: list[np.ndarray] = []
    for r, i in enumerate(rows):
        toks = tokens[i][loss_mask[i] != 0].astype(np.int64)
        f = np.concatenate([toks, (toks[:-1] + 1) * width + toks[1:]])
        row_parts.append(np.full(f.size, r))
        feat_parts.append(f)
    row_of, feat = np.concatenate(row_parts), np.concatenate(feat_parts)
    cols, col = np.unique(feat, return_inverse=True)
    x = sparse.csr_matrix((np.ones(feat.size), (row_of, col.reshape(-1))), shape=(len(rows), max(cols.size, 1)))
    gram = np.asarray((x @ x.T).todense(), np.float64)
    norm = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    norm = np.where(norm > 0, norm, 1.0)
    return gram / norm[:, None] / norm[None, :]


def input_dependence(tokens, loss_mask, group_ids, ok) -> dict:
    """Whether the policy's responses depend on their input, across the batch's tasks
    (a group is one task): the template-collapse signal. RAGEN-2 (Wang et al., 2026,
    arXiv 2604.06268) shows that a policy can keep its token entropy and still answer
    every input with the same template; entropy (diversity within an input) cannot see
    it, cross-input distinguishability can. This is a retrieval proxy for the latter:

    input_retrieval_acc    each non-failed episode's policy tokens (a bag of tokens and
                           bigrams, cosine similarity) are matched against every group:
                           its mean similarity to m of the group's episodes (itself left
                           out; m = the smallest group's size - 1, so that no group's
                           mean is noisier than another's); the share whose own group
                           is strictly the most similar (a tie counts as a miss)
    input_dependence       that accuracy above chance, `(acc - 1/T) / (1 - 1/T)` for T
                           groups: about 0 when responses carry nothing of the input
                           (template collapse), 1 when every response names its task
    within_input_similarity, cross_input_similarity: mean cosine similarity of two
                           episodes of one group, and of two episodes of different groups

    Groups with fewer than two non-failed episodes take no part (nothing to match
    against); an empty dict when fewer than two groups are left."""
    gid = np.asarray(group_ids)
    ok = np.asarray(ok, bool)
    groups = [g for g in np.unique(gid[ok]) if int(((gid == g) & ok).sum()) >= 2]
    if len(groups) < 2:
        return {}
    rows = np.flatnonzero(ok & np.isin(gid, groups))
    sim = _policy_similarity(tokens, loss_mask, rows)
    g = gid[rows]
    # every group's score is the mean similarity to the same number m of its episodes
    # (the first m, the episode itself left out): with unequal counts the smaller
    # group's mean would vary more and win more often by chance
    first = {k: np.flatnonzero(g == k) for k in groups}
    m = min(len(v) for v in first.values()) - 1
    score = np.empty((len(rows), len(groups)))
    for j, k in enumerate(groups):
        members = first[k][: m + 1]
        score[:, j] = sim[:, members[:m]].mean(1)  # the rows of other groups
        for r in first[k]:  # its own rows: itself left out
            score[r, j] = sim[r, members[members != r][:m]].mean()
    own = np.array([groups.index(k) for k in g])
    own_score = score[np.arange(len(rows)), own]
    score[np.arange(len(rows)), own] = -np.inf
    acc = float((own_score > score.max(1)).mean())
    chance = 1.0 / len(groups)
    same = (g[:, None] == g[None, :]) & ~np.eye(len(rows), dtype=bool)
    diff = g[:, None] != g[None, :]
    return {
        "input_retrieval_acc": acc,
        "input_dependence": float((acc - chance) / (1.0 - chance)),
        "within_input_similarity": float(sim[same].mean()),
        "cross_input_similarity": float(sim[diff].mean()),
    }


def template_collapse_warning(history: list[dict], metrics: dict, *, below: float, window: int) -> str | None:
    """A warning when `input_dependence` (`input_dependence`) has been below `below` for
    the last `window` iterations (this one included) while the entropy has not collapsed
    (the entropy warning covers that case): responses that look diverse but no longer
    depend on the input (RAGEN-2's template collapse). None otherwise."""
    runs = [m.get("input_dependence") for m in history[-(window - 1) :]] if window > 1 else []
    runs = runs + [metrics.get("input_dependence")]
    values = [v for v in runs if v is not None]
    if len(runs) < window or len(values) < len(runs) or max(values) >= below:
        return None
    return (
        f"warning: template collapse at iteration {metrics.get('iteration')}: input_dependence "
        f"{metrics['input_dependence']:.3f} < {below} for {window} iterations (entropy "
        f"{metrics.get('entropy', float('nan')):.3f}): the responses hardly depend on the task any more; "
        "read the transcripts (and consider algo.dynamic_sampling, which keeps only groups with signal)"
    )


def hacking_warning(history: list[dict], metrics: dict, *, heldout: str, window: int) -> str | None:
    """A warning when the training reward rises while a held-out scorer falls: the mean
    `reward_mean` of the last `window` iterations (this one included) is above that of
    the `window` before, and the mean of `heldout` (a metric of the same iterations,
    e.g. intake's `train_env_heldout_rubric_mean`) is below it: the policy may be
    learning the training reward's blind spots. None otherwise, or while fewer than
    `2 * window` iterations have both."""
    rows = [m for m in history + [metrics] if heldout in m and "reward_mean" in m]
    if len(rows) < 2 * window or heldout not in metrics:
        return None
    rec, ear = rows[-window:], rows[-2 * window : -window]
    r1, r0 = (float(np.mean([m["reward_mean"] for m in part])) for part in (rec, ear))
    h1, h0 = (float(np.mean([m[heldout] for m in part])) for part in (rec, ear))
    if not (r1 > r0 and h1 < h0):
        return None
    return (
        f"warning: reward hacking? at iteration {metrics.get('iteration')}: the training reward rose "
        f"({r0:.3f} -> {r1:.3f} over the last {window} iterations against the {window} before) while the "
        f"held-out scorer {heldout} fell ({h0:.4f} -> {h1:.4f}); read the transcripts"
    )


def collapse_warning(history: list[dict], metrics: dict, *, entropy_below: float, window: int) -> str | None:
    """A warning when the policy's entropy has collapsed (`entropy < entropy_below`) while
    its training success has not risen: the mean success of the last `window` iterations
    (this one included) is not above that of the `window` before (RAGEN's "echo trap":
    a policy repeating itself without getting better). None otherwise, or while there are
    fewer than `2 * window` iterations."""
    entropy = metrics.get("entropy")
    runs = [m.get("success_rate", 0.0) for m in history] + [metrics.get("success_rate", 0.0)]
    if entropy is None or entropy >= entropy_below or len(runs) < 2 * window:
        return None
    recent, earlier = np.mean(runs[-window:]), np.mean(runs[-2 * window : -window])
    if recent > earlier:
        return None
    return (
        f"warning: entropy collapse at iteration {metrics.get('iteration')}: entropy {entropy:.4f} < "
        f"{entropy_below} while training success did not rise (last {window} iterations {recent:.3f}, "
        f"the {window} before {earlier:.3f}); the policy may be repeating itself (lower the learning rate, "
        f"add loss.entropy_coef, or stop)"
    )


def run_warnings(history: list[dict], metrics: dict, lc, log) -> None:
    """Logs the entropy-collapse, template-collapse and reward-hacking warnings of an
    iteration's `metrics` (`collapse_warning`, `template_collapse_warning`,
    `hacking_warning`, turned on by the `logging` section `lc`) and counts each over the
    whole run in `metrics` (`collapse_warnings`, `template_collapse_warnings`,
    `hacking_warnings`); `history` holds the earlier iterations' metrics."""
    if (
        lc.heldout_metric is not None
        and lc.heldout_metric not in metrics
        and not history
        and metrics.get("failed_frac", 0.0) < 1.0
    ):  # a name no iteration can have
        known = sorted(k for k in metrics if isinstance(metrics[k], (int, float)) and not k.startswith("time_"))
        raise ValueError(
            f"logging.heldout_metric: the iterations have no metric {lc.heldout_metric!r} "
            f"(they have: {', '.join(known)})"
        )
    checks = (
        (
            "collapse_warnings",
            lc.collapse_entropy > 0,
            lambda: collapse_warning(history, metrics, entropy_below=lc.collapse_entropy, window=lc.collapse_window),
        ),
        (
            "template_collapse_warnings",
            lc.template_collapse_below > 0,
            lambda: template_collapse_warning(
                history, metrics, below=lc.template_collapse_below, window=lc.collapse_window
            ),
        ),
        (
            "hacking_warnings",
            lc.heldout_metric is not None,
            lambda: hacking_warning(history, metrics, heldout=lc.heldout_metric, window=lc.collapse_window),
        ),
    )
    for name, on, check in checks:
        count = history[-1].get(name, 0) if history else 0
        warning = check() if on else None
        if warning is not None:
            log(warning)
            count += 1
        metrics[name] = count
