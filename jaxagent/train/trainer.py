"""The training loop: rollout -> log-probs -> advantages -> updates -> metrics -> checkpoint.

One iteration of `Trainer.run` (CleanRL's shape: host loop, small jitted kernels)::

    seeds     the next `tasks_per_iteration` task seeds of the run's stream, each
              repeated `group_size` times (one group of G episodes per task)
    rollout   `AgentLoop.run` against an `envs.EnvPool` with the current policy,
              sampling seed drawn from `state.rng`
    logp      old-policy log-probs (and reference log-probs when `loss.kl_coef > 0`,
              and the critic's values for PPO) of every trajectory token
    adv       the advantage estimator named by `algo.advantage` (`jaxagent.algos`
              registry); GiGPO on per-turn rewards with the anchor-state ids, spread
              onto tokens with `algos.turns_to_tokens`; failed episodes are masked out
    update    `epochs` x `mini_batches` calls of `train_step` (rows shuffled per
              epoch with a key from `state.rng`; micro-batch accumulation inside)
    log       one JSON line in `<run_dir>/metrics.jsonl`
    save      a checkpoint every `checkpoint_every` iterations (and after the last):
              the `TrainState` plus the stream position and the metrics history

Task stream: task `k` of a run (counting from 0 over the whole run) has env seed
`env.seed + k`; the position `k` is in every checkpoint, so a resumed run plays the
same tasks an uninterrupted one would. All randomness comes from `state.rng` (split
once per iteration) and the env seeds, and both are checkpointed, so on CPU a run
resumed from iteration `n` produces the same per-iteration metrics (timings aside)
as one that never stopped.

Success of an episode: the env terminated it and its last turn's reward is > 0 (the
built-in envs give a positive reward exactly on success when they terminate).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent import algos
from jaxagent.config import ConfigError, dump_yaml, to_dict
from jaxagent.train.checkpoint import CheckpointManager, IncompatibleCheckpointError
from jaxagent.train.step import (
    LossConfig,
    OptimizerConfig,
    StepConfig,
    TrainState,
    UpdateBatch,
    critic_values,
    init_train_state,
    train_step,
)

#: outcome estimators: `fn(rewards_BxT, mask_BxT, group_ids_B) -> adv_BxT`.
OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
#: every estimator the loop can drive (`gae` needs the critic, which it then builds).
SUPPORTED_ESTIMATORS = OUTCOME_ESTIMATORS + ("reinforce_pp", "gigpo", "gae")
MODEL_TYPES = ("qwen2", "llama", "qwen3")
#: config keys a resumed run may not change: they define the policy, the task stream
#: and whether there is a critic (everything else, e.g. `iterations` or `optim.lr`, may change)
RESUME_FIXED = ("model", "env.name", "env.kwargs", "env.group_size", "env.tasks_per_iteration", "env.seed",
                "algo.advantage")


# ----------------------------------------------------------------------------- configs
def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy: a checkpoint (`path`) or a small decoder trained from scratch.

    path: a Hugging Face directory, a `.gguf` file or a packaged model name
      (`jaxagent.models.load_pretrained`); None = from scratch with the fields below.
    tokenizer: "byte" (the in-memory byte-level ChatML tokenizer of
      `jaxagent.rollout.testing`), a path for `load_tokenizer`, or None (= "byte" from
      scratch, the checkpoint's own tokenizer with `path`).
    hidden_size ... model_type: the from-scratch architecture (vocab = the tokenizer's).
    init_std: std of the from-scratch initialisation.
    dtype: "float32" or "bfloat16".
    """

    path: str | None = None
    tokenizer: str | None = None
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    qkv_bias: bool = True
    tie_word_embeddings: bool = False
    model_type: str = "qwen2"
    init_std: float = 0.02
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {list(MODEL_TYPES)}, got {self.model_type!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise ValueError(f"init_std must be a float > 0, got {self.init_std!r}")


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Which env, how many episodes per iteration, and the task seed stream.

    name, kwargs: `envs.make(name, **kwargs)`.
    group_size: episodes per task (G; the group of the outcome estimators).
    tasks_per_iteration: tasks per iteration; the rollout batch is their product.
    seed: task `k` of the run has env seed `seed + k`.
    num_workers: `EnvPool` worker processes (0 = in this process).
    step_timeout: seconds one env step may take before its episode fails.
    """

    name: str = "countdown"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    group_size: int = 4
    tasks_per_iteration: int = 2
    seed: int = 0
    num_workers: int = 1
    step_timeout: float = 30.0

    def __post_init__(self):
        import envs

        if not envs.is_known(self.name):
            raise ValueError(f"name: unknown env {self.name!r}; known: {', '.join(envs.known_envs())}")
        _check_int("group_size", self.group_size, 1)
        _check_int("tasks_per_iteration", self.tasks_per_iteration, 1)
        _check_int("seed", self.seed, 0)
        _check_int("num_workers", self.num_workers, 0)
        if not self.step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {self.step_timeout!r}")

    @property
    def batch_size(self) -> int:
        return self.group_size * self.tasks_per_iteration


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Episode limits and sampling (`jaxagent.rollout.AgentLoopConfig`)."""

    max_turns: int = 2
    max_tokens_per_turn: int = 32
    max_context: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context"):
            _check_int(name, getattr(self, name), 1)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """The advantage estimator (a `jaxagent.algos` registry name) and its constants.

    advantage: one of `SUPPORTED_ESTIMATORS`. "gae" is PPO: it trains a critic
      (initialised from the policy's trunk with a fresh value head) and uses its
      returns as the value targets.
    gamma, lam: discount and GAE lambda (`gae`, `reinforce_pp`, `gigpo` uses gamma).
    gigpo_step_weight, gigpo_mode: GiGPO's step-group weight and normalisation.
    """

    advantage: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    gigpo_step_weight: float = 1.0
    gigpo_mode: str = "mean_norm"

    def __post_init__(self):
        if self.advantage not in SUPPORTED_ESTIMATORS:
            registered = algos.list_advantage_estimators()
            raise ValueError(f"advantage must be one of {list(SUPPORTED_ESTIMATORS)} (registered in "
                             f"jaxagent.algos: {registered}), got {self.advantage!r}")
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.gigpo_mode not in algos.advantages.GIGPO_MODES:
            raise ValueError(f"gigpo_mode must be one of {list(algos.advantages.GIGPO_MODES)}, "
                             f"got {self.gigpo_mode!r}")

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Everything a training run needs; load with `jaxagent.config.load_config`.

    loss, optim, critic_optim: `jaxagent.train.LossConfig` / `OptimizerConfig` (the
      critic's defaults to `optim`). `loss.temperature` must equal a non-zero
      `rollout.temperature` (the log-probs are those of the sampling distribution).
    epochs, mini_batches, micro_batches: each iteration's batch of
      `env.group_size * env.tasks_per_iteration` episodes is shuffled and cut into
      `mini_batches` updates, `epochs` times; each mini-batch is accumulated over
      `micro_batches` micro-batches.
    iterations: the run's length (a resumed run continues up to it).
    seed: model initialisation and `state.rng`.
    run_dir: metrics.jsonl, config.yaml and checkpoints/ go here.
    checkpoint_every, keep_checkpoints: save every N iterations (and after the last);
      keep the newest `keep_checkpoints`.
    """

    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algo: AlgoSection = AlgoSection()
    loss: LossConfig = LossConfig()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    iterations: int = 2
    seed: int = 0
    run_dir: str = "runs/default"
    checkpoint_every: int = 1
    keep_checkpoints: int = 3

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "micro_batches", "iterations", "checkpoint_every",
                     "keep_checkpoints"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seed", self.seed, 0)
        B = self.env.batch_size
        if B % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the rollout batch "
                             f"env.group_size * env.tasks_per_iteration = {B}")
        if (B // self.mini_batches) % self.micro_batches:
            raise ValueError(f"micro_batches ({self.micro_batches}) must divide the mini-batch size "
                             f"{B // self.mini_batches}")
        if self.rollout.temperature > 0 and self.loss.temperature != self.rollout.temperature:
            raise ValueError(f"loss.temperature ({self.loss.temperature}) must equal rollout.temperature "
                             f"({self.rollout.temperature}): the update's log-probs are the sampler's")
        if self.algo.advantage in OUTCOME_ESTIMATORS + ("gigpo",) and self.env.group_size < 2:
            raise ValueError(f"env.group_size must be >= 2 for the group estimator {self.algo.advantage!r}")
        if not self.run_dir:
            raise ValueError("run_dir must be a non-empty path")

    @property
    def step_config(self) -> StepConfig:
        return StepConfig(loss=self.loss, optim=self.optim, critic_optim=self.critic_optim,
                          num_micro_batches=self.micro_batches)


# ----------------------------------------------------------------------------- building
def build_tokenizer(section: ModelSection):
    """The tokenizer the model section names (see `ModelSection.tokenizer`)."""
    name = section.tokenizer
    if name is None:
        name = "byte" if section.path is None else section.path
    if name == "byte":
        from jaxagent.rollout.testing import byte_chat_tokenizer

        return byte_chat_tokenizer()
    from jaxagent.models import load_tokenizer

    return load_tokenizer(name)


def build_policy(section: ModelSection, tokenizer, key: jax.Array):
    """`(params, model_config)`: loaded from `section.path`, else initialised from `key`."""
    from jaxagent import models

    if section.path is not None:
        model = models.load_pretrained(section.path, dtype=section.dtype)
        if model.config.vocab_size < len(tokenizer):
            raise ConfigError(f"model.tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                              f"has {model.config.vocab_size}")
        return model.params, model.config
    config = models.DecoderConfig(
        vocab_size=len(tokenizer), hidden_size=section.hidden_size, intermediate_size=section.intermediate_size,
        num_layers=section.num_layers, num_heads=section.num_heads, num_kv_heads=section.num_kv_heads,
        head_dim=section.head_dim, qkv_bias=section.qkv_bias, tie_word_embeddings=section.tie_word_embeddings,
        model_type=section.model_type)
    return models.init_params(key, config, dtype=section.dtype, std=section.init_std), config


@functools.partial(jax.jit, static_argnames=("config", "temperature", "seq_chunk", "vocab_chunk"))
def policy_logprobs(params, config, tokens_BxT, attention_mask_BxT, *, temperature: float,
                    seq_chunk: int, vocab_chunk: int) -> jax.Array:
    """`log pi(tokens[t] | tokens[:t])` `[B, T]` as `train_step` computes it (same kernel)."""
    from jaxagent.models import token_logprobs

    logp, _ = token_logprobs(params, config, tokens_BxT, attention_mask_BxT=attention_mask_BxT,
                             temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
    return logp


_critic_values = jax.jit(critic_values, static_argnames=("critic_config", "remat"))


def compute_advantages(algo: AlgoSection, traj, loss_mask_BxT, values_BxT=None):
    """`(advantages [B, T], returns [B, T] or None)` by the estimator `algo.advantage`.

    `loss_mask_BxT` is the trajectory's mask with failed episodes already removed.
    """
    name = algo.advantage
    fn = algos.get_advantage_estimator(name)
    if name in OUTCOME_ESTIMATORS:
        return fn(traj.rewards, loss_mask_BxT, traj.group_ids), None
    if name == "reinforce_pp":
        return fn(traj.rewards, loss_mask_BxT, algo.gamma)
    if name == "gae":
        if values_BxT is None:
            raise ValueError("gae needs the critic's values")
        return fn(traj.rewards, values_BxT, loss_mask_BxT, algo.gamma, algo.lam)
    if name == "gigpo":
        alive = ~traj.failed
        turn_mask = traj.turn_mask & alive[:, None]
        adv_BxK = fn(traj.turn_rewards, turn_mask, traj.group_ids, traj.anchor_ids, gamma=algo.gamma,
                     step_weight=algo.gigpo_step_weight, mode=algo.gigpo_mode)
        return algos.turns_to_tokens(adv_BxK, traj.turn_ids, loss_mask_BxT), None
    raise ValueError(f"unsupported advantage estimator {name!r}")  # pragma: no cover - config checks


def _env_factory(name: str, kwargs: dict):
    import envs

    return functools.partial(envs.make, name, **kwargs)


# ----------------------------------------------------------------------------- the loop
class Trainer:
    """Runs `TrainerConfig` (see the module docstring).

        trainer = Trainer(load_config(TrainerConfig, "configs/tiny_countdown_grpo.yaml"))
        history = trainer.run()            # one metrics dict per iteration
        Trainer(config, resume=True).run() # continues from the latest checkpoint

    `resume=True` restores the latest checkpoint of `<run_dir>/checkpoints`: an error if
    there is none, if its arrays do not fit the config's model (`CheckpointManager`), or
    if the config changed a `RESUME_FIXED` key. Without it, a run_dir that already holds
    checkpoints is an error (nothing is overwritten). `log` receives one line per
    iteration.
    """

    def __init__(self, config: TrainerConfig, *, resume: bool = False, log=print):
        self.config = config
        self.resume = resume
        self.log = log
        self.run_dir = Path(config.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.tokenizer = build_tokenizer(config.model)
        k_model, k_critic, k_rng = jax.random.split(jax.random.key(config.seed), 3)
        params, self.model_config = build_policy(config.model, self.tokenizer, k_model)
        self.ref_params = None
        if config.loss.kl_coef > 0:  # a copy: the state's params are donated to train_step
            self.ref_params = jax.tree.map(jnp.copy, params)
        critic_params = critic_config = None
        if config.algo.uses_critic:
            from jaxagent.models import value_params_from_policy

            critic_params = value_params_from_policy(k_critic, params, self.model_config)
            critic_config = self.model_config
        self.state: TrainState = init_train_state(k_rng, params, self.model_config, config.step_config,
                                                  critic_params=critic_params, critic_config=critic_config)
        self.iteration = 0        # iterations completed
        self.task_position = 0    # tasks of the stream consumed
        self.history: list[dict] = []

    # ------------------------------------------------------------------ helpers
    def _agent_loop(self):
        from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

        r = self.config.rollout
        pad = self.tokenizer.pad_token_id
        loop_cfg = AgentLoopConfig(
            max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn, max_context=r.max_context,
            sampling=SamplingConfig(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
            pad_id=0 if pad is None else int(pad))
        return AgentLoop(self.state.params, self.model_config, self.tokenizer, loop_cfg)

    def _check_resumable(self, saved: dict | None, where) -> None:
        """`IncompatibleCheckpointError` naming every `RESUME_FIXED` key that differs."""
        if saved is None:
            return
        current = to_dict(self.config)
        diffs = []
        for key in RESUME_FIXED:
            a, b = saved, current
            for part in key.split("."):
                a, b = (a or {}).get(part), (b or {}).get(part)
            if isinstance(a, dict) and isinstance(b, dict):
                diffs += [f"{key}.{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r}"
                          for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            elif a != b:
                diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
        if diffs:
            raise IncompatibleCheckpointError(
                f"cannot resume from {where}: the config changed keys a run must keep:\n  " + "\n  ".join(diffs))

    def _restore(self, ckpt: CheckpointManager) -> None:
        self.state, extras = ckpt.restore(self.state)
        self._check_resumable(extras.get("config"), ckpt.directory / str(ckpt.latest_step()))
        self.iteration = int(extras["iteration"])
        self.task_position = int(extras["task_position"])
        self.history = list(extras.get("history", []))
        # metrics of iterations after the checkpoint (a run killed before its next save)
        # are dropped, so the file holds exactly the iterations the resumed run builds on
        self._write_metrics_file()
        self.log(f"resumed from {ckpt.directory / str(ckpt.latest_step())} at iteration {self.iteration}")

    def _write_metrics_file(self) -> None:
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
        tmp.replace(self.metrics_path)

    def _save(self, ckpt: CheckpointManager) -> None:
        ckpt.save(self.iteration, self.state, extras={
            "iteration": self.iteration, "task_position": self.task_position,
            "history": self.history, "config": to_dict(self.config)})

    # ------------------------------------------------------------------ run
    def run(self) -> list[dict]:
        """Trains up to `config.iterations`; returns the metrics history (one dict each)."""
        import envs

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = CheckpointManager(self.run_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        try:
            if self.resume:
                if ckpt.latest_step() is None:
                    raise FileNotFoundError(f"--resume: no checkpoint in {ckpt.directory}")
                self._restore(ckpt)
            elif ckpt.latest_step() is not None:
                raise FileExistsError(f"{ckpt.directory} already holds checkpoints (latest "
                                      f"{ckpt.latest_step()}); resume, or choose another run_dir")
            else:
                self.metrics_path.write_text("")
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            if self.iteration >= cfg.iterations:
                self.log(f"nothing to do: {self.iteration} of {cfg.iterations} iterations done")
                return self.history
            loop = self._agent_loop()
            factory = _env_factory(cfg.env.name, cfg.env.kwargs)
            with envs.EnvPool([factory] * cfg.env.batch_size, num_workers=cfg.env.num_workers,
                              step_timeout=cfg.env.step_timeout) as pool:
                while self.iteration < cfg.iterations:
                    metrics = self._iteration(loop, pool)
                    self.history.append(metrics)
                    with self.metrics_path.open("a") as f:
                        f.write(json.dumps(metrics) + "\n")
                    self.log(_summary(metrics))
                    if self.iteration % cfg.checkpoint_every == 0 or self.iteration == cfg.iterations:
                        self._save(ckpt)
        finally:
            ckpt.close()
        return self.history

    def _iteration(self, loop, pool) -> dict:
        cfg = self.config
        G, n_tasks = cfg.env.group_size, cfg.env.tasks_per_iteration
        B = G * n_tasks
        times: dict[str, float] = {}
        t_start = time.perf_counter()

        rng, k_sample, k_shuffle = jax.random.split(self.state.rng, 3)
        self.state = self.state.replace(rng=rng)
        sample_seed = int(jax.random.randint(k_sample, (), 0, 2**31 - 1))
        task_seeds = [cfg.env.seed + self.task_position + j for j in range(n_tasks)]
        seeds = [s for s in task_seeds for _ in range(G)]
        group_ids = [j for j in range(n_tasks) for _ in range(G)]

        # ---- rollout
        t0 = time.perf_counter()
        loop.set_params(self.state.params)
        # a fresh sampling seed per iteration; the loop (and its compiled sampler) is reused
        loop.config = dataclasses.replace(loop.config, seed=sample_seed)
        traj, episodes = loop.run(pool, seeds, group_ids)
        times["rollout"] = time.perf_counter() - t0

        # ---- log-probs, values
        t0 = time.perf_counter()
        alive = ~traj.failed
        loss_mask = traj.loss_mask * alive[:, None].astype(traj.loss_mask.dtype)
        sc = cfg.step_config
        lp = functools.partial(policy_logprobs, config=self.model_config, temperature=cfg.loss.temperature,
                               seq_chunk=sc.seq_chunk, vocab_chunk=sc.vocab_chunk)
        old_logp = lp(self.state.params, tokens_BxT=traj.tokens, attention_mask_BxT=traj.attention_mask)
        ref_logp = None
        if self.ref_params is not None:
            ref_logp = lp(self.ref_params, tokens_BxT=traj.tokens, attention_mask_BxT=traj.attention_mask)
        values = None
        if cfg.algo.uses_critic:
            # critic_values reads the tokens and the attention fields of a batch only
            probe = UpdateBatch(tokens=traj.tokens, loss_mask=loss_mask, advantages=loss_mask, old_logp=old_logp,
                                attention_mask=traj.attention_mask)
            values = _critic_values(self.state.critic_params, self.state.critic_config, probe)
        jax.block_until_ready(old_logp)
        times["logprobs"] = time.perf_counter() - t0

        # ---- advantages
        t0 = time.perf_counter()
        adv, returns = compute_advantages(cfg.algo, traj, loss_mask, values)
        batch = UpdateBatch(tokens=traj.tokens, loss_mask=loss_mask, advantages=adv, old_logp=old_logp,
                            attention_mask=traj.attention_mask, ref_logp=ref_logp,
                            rollout_logp=traj.rollout_logp,
                            returns=returns if cfg.algo.uses_critic else None,
                            old_values=values)
        jax.block_until_ready(adv)
        times["advantages"] = time.perf_counter() - t0

        # ---- updates (all dispatched before any metric is read)
        t0 = time.perf_counter()
        mb = B // cfg.mini_batches
        step_metrics = []
        for k_epoch in jax.random.split(k_shuffle, cfg.epochs):
            perm = np.asarray(jax.random.permutation(k_epoch, B))
            for m in range(cfg.mini_batches):
                rows = jnp.asarray(perm[m * mb:(m + 1) * mb])
                mini = jax.tree.map(lambda x: x[rows], batch)
                self.state, sm = train_step(self.state, mini, sc)
                step_metrics.append(sm)
        step_metrics = jax.device_get(step_metrics)
        times["update"] = time.perf_counter() - t0

        self.iteration += 1
        self.task_position += n_tasks
        return self._metrics(traj, episodes, step_metrics, adv, old_logp, loss_mask, times,
                             time.perf_counter() - t_start)

    def _metrics(self, traj, episodes, step_metrics, adv, old_logp, loss_mask, times, total_s) -> dict:
        """The iteration's JSON-able metrics: episode statistics, the mean of each update
        metric over the iteration's updates, throughput and seconds per phase."""
        ret = np.asarray(traj.episode_return, np.float64)
        failed = np.asarray(traj.failed)
        ok = ~failed
        success = np.array([ep.done and bool(ep.rewards) and ep.rewards[-1] > 0 for ep in episodes])
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
            "iteration": self.iteration,
            "step": int(step_metrics[-1]["step"]),
            "tasks_seen": self.task_position,
            "reward_mean": float(ret[ok].mean()) if ok.any() else 0.0,
            "reward_std": float(ret[ok].std()) if ok.any() else 0.0,
            "success_rate": float(success.mean()),
            "failed_episodes": int(failed.sum()),
            "truncated_frac": float(np.asarray(traj.truncated).mean()),
            "turns_mean": float(np.asarray(traj.num_turns).mean()),
            "episode_tokens_mean": float(np.asarray(traj.lengths).mean()),
            "policy_tokens": policy_tokens,
            "advantage_abs_mean": float(np.abs(adv_np[mask]).mean()) if mask.any() else 0.0,
            "rollout_logp_gap": float(logp_gap[mask].mean()) if mask.any() else 0.0,
        }
        for key in ("loss", "pg_loss", "entropy", "clipfrac", "approx_kl", "kl", "grad_norm", "lr",
                    "value_loss", "explained_variance", "vf_clipfrac"):
            v = mean_of(key)
            if v is not None:
                out[key] = v
        out["skipped_updates"] = int(sum(float(m["skipped"]) for m in step_metrics))
        out["tokens_per_s"] = policy_tokens / max(times["rollout"], 1e-9)
        out.update({f"time_{k}_s": v for k, v in times.items()})
        out["time_iteration_s"] = total_s
        return out


def _summary(m: dict) -> str:
    parts = [f"iter {m['iteration']}", f"reward {m['reward_mean']:.3f}", f"success {m['success_rate']:.2f}"]
    for key in ("kl", "approx_kl", "entropy", "clipfrac"):
        if key in m:
            parts.append(f"{key} {m[key]:.4f}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    parts.append(f"{m['time_iteration_s']:.1f}s")
    return " | ".join(parts)
