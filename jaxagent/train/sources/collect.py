"""Batch collection: the task stream, the rollout, and the dynamic-sampling refill.

Task `k` of a run (counting from 0 over the whole run) has env seed `env.seed + k`; an
iteration's batch is `tasks_per_iteration` groups of `group_size` episodes, one group
per task, from the stream position on. With several processes each plays its own rows
(`Placement.rows`, whole groups) and samples with their global row indices, so together
they play exactly the batch one process would.

With `algo.dynamic_sampling` (DAPO), up to `max_sampling_rounds` rollouts of fresh
tasks are played; groups whose shaped returns vary are kept first, and a batch still
short is completed with groups without signal.

For an estimator that consumes "baselines" (ReMax), each rollout is followed by a greedy
one of the same tasks (temperature 0; the G slots of a group play the same greedy
episode): a row's baseline is the shaped return of its task's greedy episode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.rollout.episode import anchor_ids
from jaxagent.train.update.advantages import shaped_turn_rewards


@dataclasses.dataclass
class Collected:
    """One iteration's rollout batch."""

    traj: Any  # the `Trajectory` of this process's rows
    episodes: list  # their `Episode` records
    sampling: dict  # dynamic-sampling statistics (`sampling_rounds`, ...)
    tasks_played: int  # tasks of the stream consumed
    baselines: np.ndarray | None = None  # [rows] the greedy episode's shaped return, for "baselines"


def sampling_seed(key: jax.Array, round_index: int) -> int:
    """The sampler's seed of rollout round `round_index` of an iteration."""
    return int(jax.random.randint(jax.random.fold_in(key, round_index), (), 0, 2**31 - 1))


def collect_batch(config, loop, pool, rows: np.ndarray, key: jax.Array, position: int) -> Collected:
    """The iteration's batch from task `position` of the stream on (module docstring),
    played by this process's global batch `rows` (contiguous, whole groups). Touches
    nothing but `loop` and `pool`, so it may run in the overlap thread."""
    G, n_tasks = config.env.group_size, config.env.tasks_per_iteration
    K = config.rollout.max_turns
    rounds = config.algo.max_sampling_rounds if config.algo.dynamic_sampling else 1
    row_offset = int(rows[0])
    # rows of each group in the concatenated rounds
    groups_signal: list[list[int]] = []
    groups_flat: list[list[int]] = []
    round_trajs: list[Any] = []
    round_baselines: list[np.ndarray | None] = []
    all_episodes: list = []
    played = 0
    for r in range(rounds):
        task_seeds = [config.env.seed + position + played * n_tasks + j for j in range(n_tasks)]
        seeds = [s for s in task_seeds for _ in range(G)]
        group_ids = [j for j in range(n_tasks) for _ in range(G)]
        my_seeds, my_groups = [seeds[i] for i in rows], [group_ids[i] for i in rows]
        traj, episodes = loop.run(pool, my_seeds, my_groups, seed=sampling_seed(key, r), row_offset=row_offset)
        baselines = None
        if config.algo.uses_greedy_baseline:
            greedy, _ = loop.run(
                pool,
                my_seeds,
                my_groups,
                seed=sampling_seed(key, r),
                row_offset=row_offset,
                sampling=dataclasses.replace(loop.config.sampling, temperature=0.0),
            )
            baselines = shaped_turn_rewards(config.algo, greedy).sum(axis=1)
        if row_offset:
            # anchor-state ids are per process: keep them apart (GiGPO groups them within
            # an episode group, and a group never spans processes)
            anchor = np.asarray(traj.anchor_ids)
            traj = traj.replace(anchor_ids=jnp.asarray(np.where(anchor >= 0, anchor + row_offset * K, anchor)))
        played += 1
        if rounds == 1:
            return Collected(traj, episodes, {"sampling_rounds": 1}, n_tasks, baselines)
        returns = shaped_turn_rewards(config.algo, traj).sum(axis=1)
        failed = np.asarray(traj.failed)
        base = len(all_episodes)
        round_trajs.append(traj)
        round_baselines.append(baselines)
        all_episodes += episodes
        for j in range(n_tasks):
            group = list(range(j * G, (j + 1) * G))
            ok = [i for i in group if not failed[i]]
            varies = len(ok) >= 2 and np.ptp(returns[ok]) > 0
            (groups_signal if varies else groups_flat).append([base + i for i in group])
        if len(groups_signal) >= n_tasks:
            break
    keep = [i for group in (groups_signal + groups_flat)[:n_tasks] for i in group]
    take = jnp.asarray(keep)
    traj = jax.tree.map(lambda *xs: jnp.concatenate(xs)[take], *round_trajs)
    episodes = [all_episodes[i] for i in keep]
    traj = traj.replace(
        group_ids=jnp.repeat(jnp.arange(n_tasks, dtype=jnp.int32), G), anchor_ids=jnp.asarray(anchor_ids(episodes, K))
    )
    stats = {
        "sampling_rounds": played,
        "groups_with_signal": min(len(groups_signal), n_tasks),
        "groups_with_signal_frac": len(groups_signal) / (played * n_tasks),
    }
    # every round has its baselines or none has (`algo.uses_greedy_baseline`)
    baselines = (
        None if round_baselines[0] is None else np.concatenate([b for b in round_baselines if b is not None])[keep]
    )
    return Collected(traj, episodes, stats, played * n_tasks, baselines)
