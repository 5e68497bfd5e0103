"""Reward shaping and advantage estimation of an iteration's batch.

`shape_rewards` applies the `algo` section's shaping to the env's per-turn rewards
(scale, clip, truncation penalty or filter, KL as a reward penalty); `compute_advantages`
then calls the estimator `algo.advantage` from the `jaxagent.algos` registry with the
inputs it declares (`jaxagent.algos.get_estimator_spec`): outcome rewards and groups
(GRPO, RLOO, ...), token rewards and the critic's values (GAE), turn rewards, anchor
states and groups (GiGPO), ... An estimator registered from outside the package is
dispatched the same way. Turn-level advantages (`[B, K]`) are spread onto each turn's
policy tokens (`algos.turns_to_tokens`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxagent import algos
from jaxagent.rollout.trajectory import rewards_at_turn_ends


def estimator_inputs(algo, traj, loss_mask_BxT, values_BxT=None, baselines_B=None) -> dict:
    """Every input the trainer provides (`config.PROVIDED_INPUTS`), by name: "values" and
    "turn_values" only with the critic's values, "baselines" only with the greedy
    episodes' returns."""
    alive = ~traj.failed
    turn_mask = traj.turn_mask & alive[:, None]
    inputs = {
        "rewards": traj.rewards,
        "mask": loss_mask_BxT,
        "group_ids": traj.group_ids,
        "turn_rewards": traj.turn_rewards,
        "turn_mask": turn_mask,
        "anchor_ids": traj.anchor_ids,
        "gamma": algo.gamma,
        "lam": algo.lam,
    }
    if values_BxT is not None:
        inputs["values"] = values_BxT
        inputs["turn_values"] = algos.turn_start_values(
            values_BxT, traj.turn_ids, loss_mask_BxT, num_turns=turn_mask.shape[1]
        )
    if baselines_B is not None:
        inputs["baselines"] = jnp.asarray(baselines_B, jnp.float32)
    return inputs


def compute_advantages(algo, traj, loss_mask_BxT, values_BxT=None, baselines_B=None):
    """`(advantages [B, T], returns [B, T] or None)` by the estimator `algo.advantage`.

    `loss_mask_BxT` is the trajectory's mask with failed episodes already removed;
    `values_BxT` the critic's values and `baselines_B` the greedy episodes' returns, when
    the estimator consumes them. A turn-level estimator's advantages (and returns) are
    spread onto every policy token of their turn.
    """
    spec = algo.estimator
    inputs = estimator_inputs(algo, traj, loss_mask_BxT, values_BxT, baselines_B)
    missing = [n for n in spec.consumes if n not in inputs]
    if missing:
        raise ValueError(
            f"advantage estimator {algo.advantage!r} needs {missing} (values: the critic's; "
            "baselines: the greedy episodes' returns)"
        )
    out = spec.fn(*[inputs[n] for n in spec.inputs], **{n: inputs[n] for n in spec.keywords}, **algo.estimator_kwargs)
    adv, returns = out if spec.returns else (out, None)
    if spec.turn_level:
        adv = algos.turns_to_tokens(adv, traj.turn_ids, loss_mask_BxT)
        returns = None if returns is None else algos.turns_to_tokens(returns, traj.turn_ids, loss_mask_BxT)
    return adv, returns


def shaped_turn_rewards(algo, traj) -> np.ndarray:
    """Each turn's env reward after `algo`'s scaling, clipping and truncation penalty, `[B, K]`
    float32 (0 on turns not played)."""
    a = algo
    r = np.asarray(traj.turn_rewards, np.float32) * np.float32(a.reward_scale)
    if a.reward_clip is not None:
        r = np.clip(r, -a.reward_clip, a.reward_clip)
    if a.truncation == "penalty":
        trunc = np.asarray(traj.truncated) & ~np.asarray(traj.failed)
        last = np.asarray(traj.num_turns) - 1
        rows = np.nonzero(trunc & (last >= 0))[0]
        r[rows, last[rows]] += np.float32(a.truncation_penalty)
    return np.where(np.asarray(traj.turn_mask), r, 0.0).astype(np.float32)


def shape_rewards(algo, traj, loss_mask, old_logp=None, ref_logp=None):
    """`(traj, loss_mask, stats)` with `algo`'s reward shaping (see `AlgoSection`): the
    trajectory's `turn_rewards` and per-token `rewards` (each turn's reward at its last
    policy token) replaced by the shaped ones, the loss mask without filtered episodes.
    `old_logp` / `ref_logp` are needed for `kl_reward_coef > 0`."""
    a = algo
    turn_r = shaped_turn_rewards(algo, traj)
    tid = np.asarray(traj.turn_ids)
    tok_r = rewards_at_turn_ends(turn_r, tid)
    stats = {}
    if a.kl_reward_coef > 0:
        if old_logp is None or ref_logp is None:
            raise ValueError("shape_rewards: kl_reward_coef > 0 needs old_logp and ref_logp")
        kl_tok = np.asarray(algos.kl(old_logp, ref_logp, a.kl_reward_kind)) * np.asarray(loss_mask)
        pen = np.float32(a.kl_reward_coef) * kl_tok.astype(np.float32)
        tok_r -= pen
        K = turn_r.shape[1]
        per_turn = np.zeros_like(turn_r)
        bb, tt = np.nonzero(tid >= 0)
        np.add.at(per_turn, (bb, np.minimum(tid[bb, tt], K - 1)), pen[bb, tt])
        turn_r = turn_r - per_turn
        m = np.asarray(loss_mask) != 0
        stats["kl_reward_penalty"] = float(pen[m].sum() / max(1, traj.batch_size))
    if a.truncation == "filter":
        keep = ~np.asarray(traj.truncated)
        loss_mask = loss_mask * jnp.asarray(keep[:, None].astype(np.float32))
        stats["truncated_filtered"] = int((~keep).sum())
    traj = traj.replace(rewards=jnp.asarray(tok_r), turn_rewards=jnp.asarray(turn_r))
    return traj, loss_mask, stats
