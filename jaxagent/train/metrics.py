"""An iteration's metrics (one JSON line of `metrics.jsonl`) and the run's log lines.

`iteration_metrics`: episode statistics of the whole batch (every process's episodes),
the mean of each update metric over the iteration's updates, the gap between the
sampler's and the trainer's log-probs, throughput and the seconds of each phase.
"""
from __future__ import annotations

import math

import numpy as np

def iteration_metrics(traj, success, step_metrics, adv, old_logp, loss_mask, times: dict, total_s: float, *,
                      iteration: int, tasks_seen: int, invalid_actions=None, noop_actions=None) -> dict:
    """The iteration's JSON-able metrics: episode statistics (of every process's
    episodes: `traj` and `success` hold the whole batch), the mean of each update
    metric over the iteration's updates, throughput and seconds per phase."""
    ret = np.asarray(traj.episode_return, np.float64)
    failed = np.asarray(traj.failed)
    ok = ~failed
    success = np.asarray(success)
    policy_tokens = int(np.asarray(traj.loss_mask).sum())
    mask = np.asarray(loss_mask) != 0
    adv_np = np.asarray(adv)
    # the sampler's log-probs against the trainer's recomputation (same policy): a
    # mismatch means the trainer does not see what the sampler saw
    logp_gap = np.abs(np.asarray(old_logp) - np.asarray(traj.rollout_logp))

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
        "rollout_logp_gap": float(logp_gap[mask].mean()) if mask.any() else 0.0,
    }
    for key in ("loss", "pg_loss", "entropy", "clipfrac", "approx_kl", "kl", "grad_norm", "lr",
                "value_loss", "explained_variance", "vf_clipfrac", "tis_weight"):
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


def eval_line(ev: dict) -> str:
    """One log line of a held-out evaluation."""
    env = "".join(f"{k} {v:.3f} | " for k, v in (ev.get("env_summary") or {}).items()
                  if isinstance(v, float) and not k.endswith("_std"))   # the env's own summary, e.g. the rubric
    return (f"success {ev['success_rate']:.3f} | return {ev['return_mean']:.3f} | turns {ev['turns_mean']:.2f} | "
            f"{env}{ev['episodes']} episodes at temperature {ev['temperature']} | {ev['seconds']:.1f}s")


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
    turns = int(np.asarray(traj.num_turns).sum())
    for key, counts in (("invalid_action_frac", invalid_actions), ("noop_action_frac", noop_actions)):
        if counts is not None:
            out[key] = float(np.asarray(counts).sum() / max(turns, 1))
    return out


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
    recent, earlier = np.mean(runs[-window:]), np.mean(runs[-2 * window:-window])
    if recent > earlier:
        return None
    return (f"warning: entropy collapse at iteration {metrics.get('iteration')}: entropy {entropy:.4f} < "
            f"{entropy_below} while training success did not rise (last {window} iterations {recent:.3f}, "
            f"the {window} before {earlier:.3f}); the policy may be repeating itself (lower the learning rate, "
            f"add loss.entropy_coef, or stop)")

