"""The training loop: rollout -> log-probs -> advantages -> updates -> metrics -> checkpoint.

One iteration of `Trainer.run` (CleanRL's shape: a host loop over small jitted kernels;
`Trainer.iteration_step` reads top to bottom, one method per phase)::

    rollout   (`_rollout_phase`) the next `tasks_per_iteration` tasks of the stream,
              `group_size` episodes each (`sources.collect.collect_batch`, by the run's
              `RolloutSource`'s loop), sampling seed drawn from `state.rng`
    logp      (`_logprob_phase`) old-policy log-probs (and reference log-probs with a KL
              reference, the critic's values for an estimator that consumes them, the
              episode store's entropies) of every token (`Placement.logprobs` / `values` /
              `entropies`)
    adv       (`_advantage_phase`) reward shaping, then the estimator `algo.advantage`,
              dispatched by the inputs it declares (`update.advantages`); failed episodes
              are masked out; the `UpdateBatch`
    update    (`_update_phase`) `update.epochs` x `update.mini_batches` updates (rows
              shuffled per epoch with a key from `state.rng`; micro-batch accumulation
              inside), all dispatched before any metric is read
    metrics   (`_metrics_phase`) one JSON line in `<run_dir>/metrics.jsonl`
              (`metrics.iteration_metrics`, the failures by kind, the source's summary)
    save      a checkpoint every `checkpoint_every` iterations and after the last

Task `k` of a run has env seed `env.seed + k`; the stream position, the state (with its
RNG) and the metrics history are in every checkpoint, so on CPU a run resumed from
iteration `n` produces the same per-iteration metrics (timings aside) as one that never
stopped. Success of an episode is `jaxagent.rollout.episode.episode_success`.

Before the first iteration of a fresh run (when configured): the SFT warm start on
expert demonstrations (`warmstart.sft_warm_start`), then a held-out evaluation
(`evaluate.evaluate`), then a checkpoint at iteration 0; after the last iteration, the
held-out evaluation again. Both go to `<run_dir>/summary.json`, and the run's last log
line is a JSON object with `success_before_rl` and `success_after_rl`.

Device modes (one device, a mesh, several processes) are `placement.Placement`'s
business; the loop does not branch on them. One-step off-policy overlap
(`overlap.off_policy`, needs `loss.tis_cap`): the rollout of iteration n+1 runs in a
background thread (`overlap.OffPolicyRollouts`) with the params before update n, while
update n runs; `old_logp` is recomputed with the params being updated, so
`min(exp(old_logp - rollout_logp), cap)` corrects the lag. Metrics add `staleness`,
`tis_weight`, `time_rollout_wait_s` and `device_idle_frac`. The rollout in flight is not
checkpointed: the first iteration after a resume samples on-policy (staleness 0). With
the overlap off (the default), resume is exact.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.rollout.trajectory import trim_padding
from jaxagent.train import build
from jaxagent.train.config import TrainerConfig
from jaxagent.train.evaluate import EvalProgress, evaluate, flat_env_summary
from jaxagent.train.metrics import eval_line, eval_metrics, iteration_line, iteration_metrics, run_warnings
from jaxagent.train.rundir import DiskFullError, Progress, RunDir, disk_full
from jaxagent.train.rundir.episodes import EpisodeStore, select_for_store
from jaxagent.train.rundir.runlog import RunLogger
from jaxagent.train.sources.collect import collect_batch
from jaxagent.train.sources.overlap import OffPolicyRollouts
from jaxagent.train.stop import Interrupted, StopRequests
from jaxagent.train.update.advantages import compute_advantages, shape_rewards
from jaxagent.train.update.batch import UpdateBatch, last_turn_mask
from jaxagent.train.warmstart import sft_warm_start

__all__ = ["EnvFailureError", "Iteration", "RunningState", "Trainer"]


class EnvFailureError(RuntimeError):
    """Every episode failed for `env.max_failed_iterations` consecutive iterations."""


def store_entropy_passes(config) -> tuple[int, int]:
    """`(passes, rows a pass)` of the episode store's entropy pass on one device: its
    `logging.episodes_per_iteration` rows, cut into passes of at most the log-prob pass's
    rows (`update.logprob_rows`, else the batch), one after another, so that it never needs more
    memory than the log-prob pass the memory check counts."""
    n = config.logging.episodes_per_iteration
    logprob_rows = config.update.logprob_rows
    per_pass = logprob_rows if logprob_rows is not None else config.env.batch_size
    chunk = max(1, min(n, per_pass))
    return -(-n // chunk), chunk


@dataclasses.dataclass
class Iteration:
    """What one iteration's phases hand each other (`Trainer.iteration_step`): the
    rollout's batch (`collected`, this process's; `traj`, `per_row` and `placed`, the
    global batch), then the passes' arrays, the advantages, and the seconds per phase."""

    collected: Any  # `sources.collect.Collected`
    staleness: int  # updates the batch's params lag behind (0: on-policy)
    traj: Any  # the global `Trajectory`
    per_row: dict[str, Any]  # success, baselines, invalid and no-op actions of every row
    placed: Any  # `traj` placed for the device passes (`Placement.global_batch`)
    loss_mask: Any  # the policy tokens of episodes that did not fail (then shaped)
    times: dict[str, float]
    old_logp: Any = None
    ref_logp: Any = None  # None: no KL reference
    entropy: Any = None  # the store's rows' token entropies (NaN elsewhere), or None
    values: Any = None  # the critic's, for an estimator that consumes them
    adv: Any = None
    shaping: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RunningState:
    """What changes while `Trainer.run` runs and is not checkpointed (the `TrainState` and
    the `Progress` are): the `RunLogger` while RL iterations run (primary process, else
    None), the last iteration's episodes (this process's, for transcripts and the failure
    report) and the iterations in a row in which every episode failed (the first failure
    of each)."""

    run_log: RunLogger | None = None
    last_episodes: list | None = None
    failed_streak: list[dict] = dataclasses.field(default_factory=list)


class Trainer:
    """Runs a `TrainerConfig` (see the module docstring).

        trainer = Trainer(load_config(TrainerConfig, "configs/tiny_countdown_grpo.yaml"))
        history = trainer.run()            # one metrics dict per iteration
        Trainer(config, resume=True).run() # continues from the latest checkpoint

    `resume=True` restores the newest readable checkpoint of `<run_dir>/checkpoints` (or
    checkpoint `step`): an error, before anything is created or written, if there is
    none; an error if its arrays do not fit the config's model (`CheckpointManager`), or
    if the config changed a `RESUME_FIXED` key. A damaged newest checkpoint is reported
    and the one before it is used (`RunDir.restore`). Without it, a run_dir that already holds
    checkpoints is an error (nothing is overwritten). `log` receives one line per
    iteration. Construction builds everything (`build.build_run`): the processes are
    connected, the demonstrations played, the tokenizer trained and the memory checked.
    """

    def __init__(self, config: TrainerConfig, *, resume: bool = False, step: int | None = None, log=print):
        if step is not None and not resume:
            raise ValueError("step= chooses the checkpoint to resume from: it needs resume=True")
        self.config = config
        self.resume = resume
        self.resume_step = step
        build.check_trackers(config)  # before anything is built: a missing package is a config error
        build.judge_reward(config)  # and so is a judge that cannot be built (a missing key variable)
        run = build.build_run(config, resume=resume, log=log)
        self.placement = run.placement
        self.primary = self.placement.primary
        self.log = log if self.primary else (lambda *_, **__: None)
        self.tokenizer, self.model_config = run.tokenizer, run.model_config
        self.state, self.ref_params = run.state, run.ref_params
        self.demonstrations, self._keys = run.demonstrations, run.keys
        self.memory_estimate = run.memory_estimate
        self.sandbox_isolation = run.sandbox_isolation
        #: where the run's episodes come from (`sources.RolloutSource`, chosen by `build`)
        self.source = run.source
        self.rundir = RunDir(config.run_dir, primary=self.primary)
        self.run_dir, self.metrics_path = self.rundir.path, self.rundir.metrics_path
        self.progress = Progress()
        self._update = self.placement.update_step(config.step_config, self.state)
        self._overlap = OffPolicyRollouts()
        #: what changes during a run and is not checkpointed (`RunningState`)
        self.running = RunningState()
        self._stops = StopRequests(log)
        lc = config.logging
        #: the episode store (`jaxagent.train.rundir.episodes`), or None when off
        self._store = (
            None
            if not lc.episodes_per_iteration
            else EpisodeStore(config.run_dir, per_iteration=lc.episodes_per_iteration, max_mb=lc.episodes_max_mb)
        )

    @property
    def mesh(self):
        """The run's device mesh (None on one device)."""
        return self.placement.mesh

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    @property
    def last_episodes(self) -> list | None:
        """The last iteration's episodes (this process's rows, `rollout.Episode`), or None."""
        return self.running.last_episodes

    @property
    def history(self) -> list[dict]:
        return self.progress.history

    @property
    def summary(self) -> dict:
        return self.progress.summary

    def episode_loop(self):
        """An `EpisodeLoop` for this run's policy, from its rollout source (`build.episode_loop`)."""
        return build.episode_loop(self.source, self.tokenizer, self.model_config, self.placement, self.state)

    def evaluate(self, loop, pool, *, run_log=None, **kwargs) -> dict:
        """The current policy on held-out seeds of `pool` (the source's held-out pool;
        `evaluate.evaluate`; keywords: episodes, first_seed, temperature, details,
        progress). Progress shows on a terminal: on the progress line of `run_log` (the
        `RunLogger` of the RL iterations running), else as a bar of its own."""
        if "progress" not in kwargs and self.primary:
            greedy = kwargs.get("temperature") == 0.0
            label = "held-out evaluation" + (", greedy" if greedy else "")
            kwargs["progress"] = (
                EvalProgress(label)
                if run_log is None
                else (lambda done, total: run_log.phase(f"{label} {done}/{total}"))
            )
        params = self.placement.sampler_params(self.state)
        return evaluate(self.config, loop, pool, params, summarize=self.source.summarizer(), **kwargs)

    # ------------------------------------------------------------------ run
    def run(self) -> list[dict]:
        """Warm start and evaluation before RL (fresh runs, when configured), then RL up to
        `config.iterations`, then the held-out evaluation after RL; returns the metrics
        history (one dict per RL iteration). `self.summary` holds the evaluations."""
        cfg = self.config
        with contextlib.ExitStack() as stack:
            ckpt = self.rundir.checkpoints(cfg.keep_checkpoints)
            stack.callback(ckpt.close)
            stack.callback(self._overlap.close)
            self._stops = stack.enter_context(StopRequests(self.log))
            if not self._start(ckpt):
                return self.history
            loop = stack.enter_context(self.episode_loop())
            pools = stack.enter_context(self.source.open_pools(len(self.placement.rows)))
            if not self.resume and (cfg.warm_start.enabled or cfg.eval.episodes):
                self._before_rl(loop, pools.held_out, ckpt)
            self._iterations(loop, pools, ckpt)
            if cfg.eval.episodes and not self._evaluated_after_rl():
                ckpt.wait_until_finished()
                self._held_out("after_rl", loop, pools.held_out)
                self.summary["iterations_at_eval"] = self.iteration
                self.rundir.write_summary(self.summary)
        self._final_line()
        return self.history

    def _start(self, ckpt) -> bool:
        """Restores the checkpoint (resume) or starts the run directory, records the
        config (and a sandbox weaker than bubblewrap); False when there is nothing to do."""
        cfg = self.config
        if self.resume:
            self._restore(ckpt)
        else:
            self.rundir.start(ckpt, cfg, self.tokenizer if cfg.model.tokenizer == "bpe" else None)
        self.rundir.write_config(cfg)
        if self.sandbox_isolation is not None:  # a weaker sandbox than bwrap is on record
            self.summary["sandbox_isolation"] = self.sandbox_isolation
            self.rundir.write_summary(self.summary)
        if self.iteration >= cfg.iterations and (self._evaluated_after_rl() or not cfg.eval.episodes):
            self.log(f"nothing to do: {self.iteration} of {cfg.iterations} iterations done")
            return False
        return True

    def _run_logger(self):
        """The `RunLogger` of the RL iterations (primary process, iterations left), or None."""
        cfg = self.config
        if not self.primary or self.iteration >= cfg.iterations:
            return None
        lc = cfg.logging
        return RunLogger(
            self.run_dir,
            total_iterations=cfg.iterations,
            tensorboard=lc.tensorboard,
            progress=lc.progress,
            transcripts_every=lc.transcripts_every,
            transcripts_per_iteration=lc.transcripts_per_iteration,
            trackers=build.trackers(cfg, self.run_dir),
        )

    def _iterations(self, loop, pools, ckpt) -> None:
        cfg = self.config
        run_log = self.running.run_log = self._run_logger()
        graceful = not self.placement.multi_process  # several processes must stop at the same iteration
        if self.iteration < cfg.iterations:  # the first line otherwise comes only after compilation
            say = run_log.message if run_log is not None else self.log
            say(
                f"iteration {self.iteration + 1}: rollout, log-probs and update compile on the first "
                "iteration of a process (later ones reuse them)"
            )
        try:
            while self.iteration < cfg.iterations:
                self._stops.graceful = graceful
                metrics = self.iteration_step(loop, pools.train)
                if cfg.eval.episodes and cfg.eval.every and self.iteration % cfg.eval.every == 0:
                    if self.iteration < cfg.iterations:
                        metrics.update(self._periodic_eval(loop, pools.held_out, run_log))
                self._record(metrics, run_log, ckpt)
        finally:  # never close the pool under a running rollout
            self._overlap.discard()
            if run_log is not None:
                error = sys.exc_info()[0]
                run_log.close(failed=error is not None and not issubclass(error, (Interrupted, KeyboardInterrupt)))
            self.running.run_log = None

    def _periodic_eval(self, loop, pool, run_log) -> dict:
        """The `eval.every` evaluation's metrics (`eval_*`, with `eval.greedy` `eval_greedy_*`)."""
        self._overlap.wait()
        out = eval_metrics("eval", self.evaluate(loop, pool, run_log=run_log))
        if self.config.eval.greedy:
            out.update(eval_metrics("eval_greedy", self.evaluate(loop, pool, run_log=run_log, temperature=0.0)))
        return out

    def _record(self, metrics: dict, run_log, ckpt) -> None:
        """An iteration's metrics into the history, `metrics.jsonl` and the run log, its
        checkpoint when due; then a requested stop, a full disk or a run of failed
        iterations ends the run (after what could be written is written)."""
        cfg = self.config
        run_warnings(self.history, metrics, cfg.logging, self.log)
        self._check_failures(metrics)
        self.history.append(metrics)
        full = self._checked(self.rundir.append_metrics, metrics, path=self.metrics_path)
        if run_log is not None:
            run_log.log_iteration(metrics, self.running.last_episodes)
            full = full or run_log.disk_full
        if run_log is None or not cfg.logging.progress:
            self.log(iteration_line(metrics))
        saved = self.iteration % cfg.checkpoint_every == 0 or self.iteration == cfg.iterations
        if full is None and (saved or self._stops.requested):
            full = self._checked(self._save, ckpt, path=ckpt.directory)
        if full is not None:  # no checkpoint of this iteration: --resume replays it exactly
            self._checked(ckpt.wait_until_finished, path=ckpt.directory)
            raise full
        self._stops.graceful = False
        signum = self._stops.signum
        if signum is not None:  # a stop was requested
            ckpt.wait_until_finished()
            raise Interrupted(signum, saved_iteration=self.iteration)
        self._stop_on_failures()

    def _check_failures(self, metrics: dict) -> None:
        """Counts the iterations in a row in which every episode failed, keeping the first
        failure of this process's episodes (its kind, message and traceback)."""
        if metrics["failed_frac"] < 1.0:
            self.running.failed_streak = []
            return
        first = next((ep for ep in self.running.last_episodes or () if ep.failed), None)
        self.running.failed_streak.append(
            {}
            if first is None
            else {
                "kind": first.failure_kind or "unknown",
                "message": first.failure,
                "traceback": first.failure_traceback,
            }
        )

    def _stop_on_failures(self) -> None:
        """`EnvFailureError` once every episode failed for `env.max_failed_iterations`
        iterations in a row (after the metrics and checkpoint of the last are written)."""
        limit = self.config.env.max_failed_iterations
        if not limit or len(self.running.failed_streak) < limit:
            return
        first = self.running.failed_streak[0]
        what = f"{first['kind']}: {first['message']}" if first else "(the failures are in another process's log)"
        tb = f"\n{first['traceback'].rstrip()}" if first.get("traceback") else ""
        raise EnvFailureError(
            f"every episode of the last {limit} iterations failed in the env "
            f"(env.max_failed_iterations={limit}); the first failure: {what}{tb}"
        )

    # ------------------------------------------------------------------ one iteration
    def iteration_step(self, loop, pool) -> dict:
        """One RL iteration (module docstring) over the training `pool`; returns its metrics."""
        t_start = time.perf_counter()
        rng, k_sample, k_shuffle = jax.random.split(self.state.rng, 3)
        self.state = self.state.replace(rng=self.placement.replicated(rng))
        it = self._rollout_phase(loop, pool, k_sample)
        self._logprob_phase(it)
        batch = self._advantage_phase(it)
        # the next iteration's rollout starts now, with the params before this update
        if self.config.overlap.off_policy and self.iteration + 1 < self.config.iterations:
            self._start_rollout(loop, pool, k_sample, staleness=1)
        step_metrics = self._update_phase(it, batch, k_shuffle)
        self.progress.iteration += 1
        return self._metrics_phase(it, step_metrics, time.perf_counter() - t_start)

    def _rollout_phase(self, loop, pool, key) -> Iteration:
        """This process's rows (played now, or by the overlap thread during the last update),
        trimmed when `update.trim_padding`, then the global batch."""
        self._phase("rollout")
        cfg, place = self.config, self.placement
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        collected, staleness = self._rollout(loop, pool, key, times)
        if cfg.update.trim_padding:  # the passes below then pay for the longest episode, not max_context
            collected.traj = trim_padding(
                collected.traj, cfg.update.trim_padding, place.longest_episode(collected.traj.lengths)
            )
        self.progress.task_position += collected.tasks_played
        self.running.last_episodes = eps = collected.episodes
        per_row = {
            "success": np.array([ep.success for ep in eps]),
            "baselines": collected.baselines,
            "invalid_actions": np.array([ep.invalid_actions for ep in eps]),
            "noop_actions": np.array([ep.noop_actions for ep in eps]),
        }
        traj, per_row, placed = place.global_batch(collected.traj, per_row)
        times.setdefault("rollout", time.perf_counter() - t0)
        loss_mask = traj.loss_mask * (~traj.failed)[:, None].astype(traj.loss_mask.dtype)
        return Iteration(collected, staleness, traj, per_row, placed, loss_mask, times)

    def _logprob_phase(self, it: Iteration) -> None:
        """The old policy's log-probs (recomputed, or the sampler's own:
        `update.old_logprobs`), the KL reference's, the critic's values and the episode
        store's token entropies (from the params the log-probs were taken with)."""
        self._phase("log-probs")
        cfg, place = self.config, self.placement
        t0 = time.perf_counter()
        recompute = cfg.update.old_logprobs != "sampler"
        it.old_logp = place.logprobs(self.state.params, it.placed) if recompute else it.traj.rollout_logp
        if self.ref_params is not None:
            it.ref_logp = place.logprobs(build.full_reference(self.ref_params, self.state.params), it.placed)
        if cfg.logging.episodes_per_iteration:  # on a mesh a collective pass: every process's config
            it.entropy = place.entropies(
                self.state.params, it.placed, self._store_rows(it.collected.episodes), *store_entropy_passes(cfg)
            )
        if cfg.algo.uses_critic:
            it.values = place.values(self.state, it.placed)
        it.times["logprobs"] = _seconds_after((it.old_logp, it.ref_logp, it.values), t0)  # every pass of the phase

    def _advantage_phase(self, it: Iteration) -> UpdateBatch:
        """Reward shaping, the estimator's advantages (and returns), and the update's batch."""
        cfg, traj = self.config, it.traj
        t0 = time.perf_counter()
        shaped, it.loss_mask, it.shaping = shape_rewards(cfg.algo, traj, it.loss_mask, it.old_logp, it.ref_logp)
        it.adv, returns = compute_advantages(cfg.algo, shaped, it.loss_mask, it.values, it.per_row["baselines"])
        # the KL term on each episode's last turn (LossConfig: kl_coef > 0)
        kl_mask = jnp.asarray(last_turn_mask(traj.turn_ids, it.loss_mask)) if cfg.loss.kl_turns == "last" else None
        batch = UpdateBatch(
            tokens=traj.tokens,
            loss_mask=it.loss_mask,
            advantages=it.adv,
            old_logp=it.old_logp,
            attention_mask=traj.attention_mask,
            segment_ids=traj.segment_ids,
            ref_logp=it.ref_logp if cfg.loss.kl_coef > 0 else None,
            kl_mask=kl_mask,
            rollout_logp=traj.rollout_logp,
            returns=returns if cfg.algo.uses_critic else None,
            old_values=it.values,
        )
        it.times["advantages"] = _seconds_after(it.adv, t0)
        return batch

    def _update_phase(self, it: Iteration, batch: UpdateBatch, key) -> list[dict]:
        """`update.epochs` passes of `update.mini_batches` updates over `batch`'s rows,
        shuffled per epoch, all dispatched before any metric is read."""
        self._phase("update")
        cfg = self.config
        t0 = time.perf_counter()
        B = cfg.env.batch_size
        mb = B // cfg.update.mini_batches
        step_metrics = []
        for k_epoch in jax.random.split(key, cfg.update.epochs):
            perm = np.asarray(jax.random.permutation(k_epoch, B))
            for m in range(cfg.update.mini_batches):
                rows = jnp.asarray(perm[m * mb : (m + 1) * mb])
                mini = jax.tree.map(lambda x, rows=rows: x[rows], batch)
                self.state, sm = self._update(self.state, self.placement.update_input(mini))
                step_metrics.append(sm)
        out = self.placement.fetch(step_metrics)
        it.times["update"] = time.perf_counter() - t0
        return out

    def _metrics_phase(self, it: Iteration, step_metrics: list[dict], total_s: float) -> dict:
        """The iteration's metrics (`metrics.iteration_metrics`, then the overlap's and
        dynamic sampling's, the shaping's, the failures by kind and the source's summary
        of the training episodes), and its episodes into the store."""
        cfg, episodes = self.config, it.collected.episodes
        out = iteration_metrics(
            it.traj,
            it.per_row["success"],
            step_metrics,
            it.adv,
            it.old_logp,
            it.loss_mask,
            it.times,
            total_s,
            iteration=self.iteration,
            tasks_seen=self.progress.task_position,
            invalid_actions=it.per_row["invalid_actions"],
            noop_actions=it.per_row["noop_actions"],
            recomputed=cfg.update.old_logprobs == "recompute",
        )
        if it.entropy is not None and self._store is not None:
            self._store_episodes(episodes, it.traj, it.adv, it.old_logp, it.entropy, it.loss_mask)
        if cfg.overlap.off_policy:  # the main thread (which drives the device) idled only while it waited
            out.update(staleness=it.staleness, device_idle_frac=it.times["rollout_wait"] / max(total_s, 1e-9))
        if cfg.algo.dynamic_sampling:
            out.update(it.collected.sampling)
        out.update(it.shaping)
        # failed episodes by the pool's failure kind (this process's episodes)
        kinds = collections.Counter(ep.failure_kind or "unknown" for ep in episodes if ep.failed)
        out.update({f"failed_{kind}": n for kind, n in sorted(kinds.items())})
        # the source's own summary of the training episodes (e.g. intake's rubric, triage
        # rates and exploit counters; this process's episodes): train_env_<key>
        summarize = self.source.summarizer()
        played = [{"info": ep.info, "done": ep.done} for ep in episodes if not ep.failed]
        if summarize is not None and played:
            out.update({f"train_{k}": v for k, v in flat_env_summary(summarize(played)).items()})
        return out

    def _phase(self, what: str) -> None:
        """Shows what the iteration is doing on the progress line (a terminal's); the first
        iteration of a process also compiles."""
        run_log = self.running.run_log
        if run_log is not None:
            first = run_log.iterations_logged == 0
            run_log.phase(f"iteration {self.iteration + 1}: {what}" + (" (compiling)" if first else ""))

    def _store_rows(self, episodes) -> list[int] | None:
        """The global rows of the episodes the store keeps this iteration (primary process,
        an iteration the store writes), else None. Their entropies come from a pass of
        their own (`Placement.entropies`): the log-prob pass the update uses stays the same
        computation with the store on or off, so a run's numbers do not depend on it."""
        if not self.primary or self._store is None or (self.iteration + 1) % self._store.stride:
            return None
        chosen = [i for i, _ in select_for_store(episodes, self.config.logging.episodes_per_iteration)]
        return [int(self.placement.rows[i]) for i in chosen] or None

    def _store_episodes(self, episodes, traj, adv, old_logp, entropy, loss_mask) -> None:
        """This iteration's sample of episodes with their per-token signals, in the
        episode store (`jaxagent.train.rundir.episodes`). The primary process writes its own
        rows (the arrays are whole host-side batches on every process, so no collective
        is needed); a write that fails switches the store off with one warning."""
        store = self._store
        if store is None or not self.primary or self.iteration % store.stride:
            return
        signals = {
            "advantage": adv,
            "logp": old_logp,
            "rollout_logp": traj.rollout_logp,
            "entropy": entropy,
            "loss_mask": loss_mask,
        }
        stride = store.stride
        try:
            store.write(self.iteration, episodes, self.tokenizer, signals, rows=self.placement.rows)
        except Exception as err:  # logging never stops training
            warnings.warn(
                f"episode store: writing iteration {self.iteration} to {store.dir} failed "
                f"({type(err).__name__}: {err}); the store is off for this run",
                RuntimeWarning,
                stacklevel=2,
            )
            self._store = None
            return
        if store.stride != stride:
            self.log(
                f"episode store: {store.dir} reached logging.episodes_max_mb="
                f"{self.config.logging.episodes_max_mb:g} MiB; it now keeps every {store.stride}th "
                "iteration (the others are deleted)"
            )

    def _rollout(self, loop, pool, key, times: dict):
        """`(collected, staleness)`: this iteration's batch, played now with the current
        params, or (off-policy) the one the overlap thread played during the last update."""
        if not self.config.overlap.off_policy:
            self.loop_params(loop)
            return self._collect(loop, pool, key), 0
        t0 = time.perf_counter()
        if not self._overlap.pending:  # the first iteration (of a run or after a resume): on-policy
            self._start_rollout(loop, pool, jax.random.fold_in(key, 1), staleness=0)
        got = self._overlap.result()
        times["rollout"], times["rollout_wait"] = got.seconds, time.perf_counter() - t0
        return got.collected, got.staleness

    def loop_params(self, loop) -> None:
        """Gives the episode loop's sampler the current policy."""
        loop.set_params(self.placement.sampler_params(self.state))

    def _collect(self, loop, pool, key, position: int | None = None):
        position = self.progress.task_position if position is None else position
        return collect_batch(self.config, loop, pool, self.placement.rows, key, position)

    def _start_rollout(self, loop, pool, key, *, staleness: int) -> None:
        """The next batch's rollout in the overlap thread, with a copy of the current
        params (the update donates the state's buffers) from the current stream position."""
        loop.set_params(self.placement.sampler_params(self.state, copy=True))
        position = self.progress.task_position
        self._overlap.start(lambda: self._collect(loop, pool, key, position), staleness=staleness)

    # ------------------------------------------------------------------ before and after RL
    def _before_rl(self, loop, pool, ckpt) -> None:
        """The warm start and the held-out evaluation before RL, then checkpoint 0 (a
        resumed run never repeats them)."""
        if self.config.warm_start.enabled:
            self._warm_start()
            self.loop_params(loop)
        if self.config.eval.episodes:
            self._held_out("before_rl", loop, pool)
        self.rundir.write_summary(self.summary)
        self._save(ckpt)

    def _warm_start(self) -> None:
        """SFT on the demonstrations, then a fresh RL state (optimizer, critic) and KL
        reference from the SFT weights."""
        cfg = self.config
        if self.demonstrations is None:
            raise RuntimeError("the warm start has no demonstrations: the run was built without them (resumed)")
        params, lines, summary = sft_warm_start(
            cfg, self.state.params, self.model_config, self.tokenizer, self.demonstrations, self.placement, self.log
        )
        self.rundir.write_warm_start(lines)
        if self.ref_params is not None:  # the KL reference is the warm-started policy
            self.ref_params = build.reference_copy(params)
            self.rundir.save_reference(self.ref_params)
            self.ref_params = self.placement.place_params(self.ref_params)
        self.state = build.rl_state(
            cfg, params, self.model_config, self.placement, critic_key=self._keys["critic"], rng_key=self._keys["rng"]
        )
        self._update = self.placement.update_step(cfg.step_config, self.state)
        self.summary["warm_start"] = summary

    def _held_out(self, when: str, loop, pool) -> None:
        """The held-out evaluation `when` ("before_rl" / "after_rl") into the summary, at
        the sampling temperature and, with `eval.greedy`, greedily."""
        ev = self.evaluate(loop, pool)
        evg = self.evaluate(loop, pool, temperature=0.0) if self.config.eval.greedy else None
        label = when.replace("_rl", " RL")
        self.summary.update({f"success_{when}": ev["success_rate"], f"eval_{when}": ev})
        self.log(f"held-out evaluation {label}: {eval_line(ev)}")
        if evg is not None:
            self.summary.update({f"success_{when}_greedy": evg["success_rate"], f"eval_{when}_greedy": evg})
            self.log(f"held-out evaluation {label}, greedy: {eval_line(evg)}")

    def _evaluated_after_rl(self) -> bool:
        """The summary's evaluation after RL is of the current policy (a run resumed with
        more iterations evaluates again)."""
        return "success_after_rl" in self.summary and self.summary.get("iterations_at_eval") == self.iteration

    def _final_line(self) -> None:
        s = self.summary
        if "success_after_rl" not in s:
            return
        line = {k: s[k] for k in ("success_before_rl", "success_after_rl") if k in s}
        if "success_before_rl" in line:
            line["lift_points"] = round(100 * (line["success_after_rl"] - line["success_before_rl"]), 2)
        line.update({k: s[k] for k in ("success_before_rl_greedy", "success_after_rl_greedy") if k in s})
        for when in ("before_rl", "after_rl", "before_rl_greedy", "after_rl_greedy"):  # e.g. intake's rubric
            if "env_summary" in s.get(f"eval_{when}", {}):
                line[f"env_{when}"] = s[f"eval_{when}"]["env_summary"]
        line.update(eval_episodes=self.config.eval.episodes, iterations=self.iteration, run_dir=str(self.run_dir))
        self.log(json.dumps(line))

    # ------------------------------------------------------------------ checkpoints
    def _save(self, ckpt) -> None:
        self.rundir.save(ckpt, self.state, self.progress, self.config)

    @staticmethod
    def _checked(write, *args, path) -> DiskFullError | None:
        """Runs `write(*args)`; a write that found no room is returned as a `DiskFullError`
        naming `path` (the run stops at the end of the iteration), any other error raises."""
        try:
            write(*args)
        except Exception as err:  # a checkpoint writer may wrap the OSError
            full = disk_full(err, path)
            if full is None:
                raise
            return full
        return None

    def _restore(self, ckpt) -> None:
        cfg = self.config
        state, self.progress, step = self.rundir.restore(ckpt, self.state, cfg, self.resume_step, log=self.log)
        self.state = self.placement.place_state(state)
        self._update = self.placement.update_step(cfg.step_config, self.state)
        if self.ref_params is not None:
            self.ref_params = self.placement.place_params(self.ref_params)
            if cfg.warm_start.enabled:
                self.ref_params = self.rundir.restore_reference(self.ref_params)
        # metrics of iterations after the checkpoint (a run killed before its next save)
        # are dropped, so the file holds exactly the iterations the resumed run builds on
        self.rundir.write_metrics(self.history)
        if self._store is not None and self.primary:  # the same for the episode store
            self._store.drop_after(self.iteration)
        self.log(f"resumed from {ckpt.directory / str(step)} at iteration {self.iteration}")


def _seconds_after(x, t0: float) -> float:
    """Seconds since `t0` once `x` is computed."""
    jax.block_until_ready(x)
    return time.perf_counter() - t0
