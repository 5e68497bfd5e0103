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

Success of an episode: the env's `info["success"]` on its last step when it reports
one, else "the env terminated it with a last reward > 0" (`warmstart.episode_success`).

Before the first iteration of a fresh run (when configured): a warm start by SFT on
expert demonstrations (`warm_start`), then a held-out evaluation (`eval`), then a
checkpoint at iteration 0; after the last iteration, the held-out evaluation again.
Both go to `<run_dir>/summary.json`, and the run's last log line is a JSON object with
`success_before_rl` and `success_after_rl`.

Meshes (`mesh: {data, fsdp, tensor}`, all 1 = one device, the loop above unchanged):
the `TrainState` (params, optimizer state, critic) is placed by
`jaxagent.parallel.shard_train_state`, every update (RL, and the warm start's SFT) is
`make_sharded_train_step`, the log-prob / reference / critic passes run on the sharded
params with the trajectory's rows split over ("data", "fsdp"), and each mini-batch is
placed the same way (its size must be divisible by `data * fsdp`). Shaping, advantages
and metrics run on a host copy of the whole batch, as on one device. In one process the
sampler runs sharded on the same mesh (`Sampler(mesh=...)`: the state's own params,
the KV cache's rows over ("data", "fsdp") and its KV heads over "tensor"). With several
processes each process samples its own rows with a whole copy of the params on its
first device (gathered after every update): a sampler sharded across hosts would need
every process to drive one loop over global arrays, which per-host env pools do not. Before anything is built, the per-device memory
estimate (`parallel.estimate_memory`: params, optimizer state, gradients, activations of
a mini-batch, the sampler's KV cache and param copy, the KL reference) is logged and
checked against the device (`memory_stats`, else `device_memory_gb`, else no check).

Multi-host (`distributed`, or the `JAX_*` environment variables): `jax.distributed` is
initialised first; each process runs its own `EnvPool` over its rows of the rollout
batch (`parallel.process_rows`: whole groups, checked), with the task seeds of those
rows and the sampling keys of their global row indices, so N processes play exactly
the batch one process would. Their trajectories become one global batch
(`parallel.global_batch`); every process gathers a host copy for shaping, advantages and
the episode statistics. Only process 0 writes metrics.jsonl, summary.json, config.yaml
and logs; all processes take part in the orbax checkpoint save / restore.

One-step off-policy overlap (`overlap.off_policy`, needs `loss.tis_cap`): the rollout of
iteration n+1 runs in a background thread, with the params before update n, while the
main thread dispatches update n; `old_logp` is still computed at update time with the
params being updated, so `min(exp(old_logp - rollout_logp), cap)` corrects the lag.
Metrics add `staleness` (0 for the first batch, then 1), `tis_weight`,
`time_rollout_wait_s` and `device_idle_frac` (the share of the iteration the main
thread waited for the rollout). Resume with the overlap on continues the task stream,
the RNG and the state exactly, but the rollout that was in flight is not saved: the
first iteration after a resume samples on-policy (staleness 0), so from there on the
metrics are those of a valid run, not bitwise those of the uninterrupted one. With the
overlap off (the default), resume stays exact.
"""
from __future__ import annotations

import concurrent.futures
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
from jaxagent import parallel as par
from jaxagent.config import ConfigError, dump_yaml, to_dict
from jaxagent.parallel import MeshConfig
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
TRUNCATION_MODES = ("keep", "filter", "penalty")
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
      `jaxagent.rollout.testing`), "bpe" (a byte-level BPE of `tokenizer_vocab_size`
      tokens trained on the env's text, `jaxagent.train.warmstart.train_bpe_tokenizer`:
      the warm-start demonstrations, or noise-free expert episodes when there is no
      warm start; saved in `<run_dir>/tokenizer/` and reloaded from there on resume),
      a path for `load_tokenizer`, or None (= "byte" from scratch, the checkpoint's own
      tokenizer with `path`).
    tokenizer_vocab_size: vocabulary of the "bpe" tokenizer (bytes + specials + merges).
    hidden_size ... model_type: the from-scratch architecture (vocab = the tokenizer's).
    init_std: std of the from-scratch initialisation.
    dtype: "float32" or "bfloat16".
    """

    path: str | None = None
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 512
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
        _check_int("tokenizer_vocab_size", self.tokenizer_vocab_size, 259)
        if self.tokenizer == "bpe" and self.path is not None:
            raise ValueError("tokenizer 'bpe' is for models trained from scratch; a checkpoint (path) brings "
                             "its own tokenizer")
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
    """Episode limits and sampling (`jaxagent.rollout.AgentLoopConfig`).

    pipeline_groups: > 1 splits each rollout into that many sub-batches so that env
      steps of one overlap the device's decoding of another (same trajectories).
    """

    max_turns: int = 2
    max_tokens_per_turn: int = 32
    max_context: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    pipeline_groups: int = 1

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "pipeline_groups"):
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

    Reward shaping, in this order, on each turn's env reward before the estimator:
    reward_scale: multiply (reward scaling).
    reward_clip: then clip to [-reward_clip, reward_clip] (None = off).
    truncation: what to do with episodes cut short (max turns, context, env step
      limit; DAPO's overlong handling made multi-turn): "keep" (as they are), "filter"
      (their tokens leave the loss; they still count in their group's statistics), or
      "penalty" (add `truncation_penalty` to their last turn's reward).
    kl_reward_coef, kl_reward_kind: KL as a reward penalty (InstructGPT / verl's
      `use_kl_in_reward`): each policy token's reward gets `- coef * kl(old, ref)`
      (`algos.kl`, kind k1 by default); turn-level estimators get each turn's sum. This is
      separate from `loss.kl_coef` (KL as a loss term); both can be on.
    dynamic_sampling: drop groups whose (shaped) returns do not vary and refill the
      batch with new tasks (DAPO), up to `max_sampling_rounds` rollouts per iteration;
      if still short, the batch is completed with groups without signal. Outcome and
      group estimators only.
    """

    advantage: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    gigpo_step_weight: float = 1.0
    gigpo_mode: str = "mean_norm"
    reward_scale: float = 1.0
    reward_clip: float | None = None
    truncation: str = "keep"
    truncation_penalty: float = -1.0
    kl_reward_coef: float = 0.0
    kl_reward_kind: str = "k1"
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3

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
        for name in ("reward_scale", "truncation_penalty", "kl_reward_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.kl_reward_coef < 0:
            raise ValueError(f"kl_reward_coef must be >= 0, got {self.kl_reward_coef!r}")
        if self.reward_clip is not None and not (isinstance(self.reward_clip, (int, float)) and self.reward_clip > 0):
            raise ValueError(f"reward_clip must be a number > 0 or null, got {self.reward_clip!r}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {list(TRUNCATION_MODES)}, got {self.truncation!r}")
        if self.kl_reward_kind.removesuffix("+") not in algos.KL_KINDS:
            raise ValueError(f"kl_reward_kind must be one of {list(algos.KL_KINDS)}, got {self.kl_reward_kind!r}")
        _check_int("max_sampling_rounds", self.max_sampling_rounds, 1)
        if self.dynamic_sampling and self.advantage not in OUTCOME_ESTIMATORS + ("gigpo",):
            raise ValueError(f"dynamic_sampling needs a group estimator ({list(OUTCOME_ESTIMATORS + ('gigpo',))}), "
                             f"got advantage {self.advantage!r}")

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
    """Supervised fine-tuning on expert demonstrations before RL (`episodes: 0` = none).

    episodes: demonstrations, one per seed `seed, seed + 1, ...` (played with the env's
      expert in this process, `jaxagent.train.warmstart.collect_demonstrations`).
    expert_noise: probability that the expert's action at a turn is replaced by a
      uniformly random one of the env's `random_actions` (a deliberately imperfect
      expert; 0 = the expert itself).
    only_successful: train only on demonstrations that succeeded (rejection sampling).
    epochs, batch_size: passes over the demonstrations and rows per `sft_step`.
    optim: the SFT optimizer (RL then starts a fresh optimizer from the SFT weights).
    """

    episodes: int = 0
    seed: int = 1_000_000
    expert_noise: float = 0.0
    only_successful: bool = False
    epochs: int = 1
    batch_size: int = 32
    optim: OptimizerConfig = OptimizerConfig(lr=1e-3)

    def __post_init__(self):
        _check_int("episodes", self.episodes, 0)
        _check_int("seed", self.seed, 0)
        _check_int("epochs", self.epochs, 1)
        _check_int("batch_size", self.batch_size, 1)
        if not (isinstance(self.expert_noise, (int, float)) and 0.0 <= self.expert_noise <= 1.0):
            raise ValueError(f"expert_noise must be in [0, 1], got {self.expert_noise!r}")

    @property
    def enabled(self) -> bool:
        return self.episodes > 0


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation (`episodes: 0` = none): seeds `seed, seed + 1, ...`, disjoint
    from the training stream and the demonstrations (checked).

    Run before RL (after any warm start) and after the last iteration; their success
    rates are `success_before_rl` / `success_after_rl` of `<run_dir>/summary.json`, and
    every `every` iterations in between (0 = never) as `eval_*` metrics.
    temperature: sampling temperature of the evaluation (None = `rollout.temperature`;
      0 = greedy).
    greedy: also evaluate with greedy decoding before and after RL
      (`success_before_rl_greedy` / `success_after_rl_greedy`): whether RL taught the
      policy something its most likely actions did not already do.
    """

    episodes: int = 0
    seed: int = 2_000_000
    temperature: float | None = None
    every: int = 0
    greedy: bool = False

    def __post_init__(self):
        _check_int("episodes", self.episodes, 0)
        _check_int("seed", self.seed, 0)
        _check_int("every", self.every, 0)
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 or null, got {self.temperature!r}")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host runs (`jaxagent.parallel.initialize`, JAX's multi-controller runtime).

    All None / False (the default) = one process, unless the environment says otherwise:
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or
    `JAXAGENT_DISTRIBUTED=auto` (fields given here take precedence).
    coordinator_address: "host:port" of process 0.
    num_processes, process_id: world size and this process's rank.
    auto: JAX's cluster detection (TPU pod slices, SLURM, Open MPI, Kubernetes).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    def __post_init__(self):
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, 1)
        if self.process_id is not None:
            _check_int("process_id", self.process_id, 0)
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(f"process_id must be < num_processes ({self.num_processes}), "
                                 f"got {self.process_id!r}")


@dataclasses.dataclass(frozen=True)
class OverlapSection:
    """One-step off-policy overlap of rollout and update.

    off_policy: while the update of iteration n runs, a background thread already
      collects the rollout of iteration n+1 with the pre-update params (so that batch is
      one update stale). The update corrects for it with truncated importance sampling,
      `min(exp(old_logp - rollout_logp), loss.tis_cap)` (required), where `old_logp` is
      recomputed with the params being updated and `rollout_logp` are the sampler's.
    max_staleness: updates a rollout may lag behind (only 1 is supported).
    """

    off_policy: bool = False
    max_staleness: int = 1

    def __post_init__(self):
        if self.max_staleness != 1:
            raise ValueError(f"max_staleness: only 1 (one-step off-policy) is supported, got {self.max_staleness!r}")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Run logging besides `metrics.jsonl` (`jaxagent.train.logging.RunLogger`).

    tensorboard: event files in `<run_dir>/tensorboard/`.
    progress: a live progress line on stderr (one plain line per iteration when stderr
      is not a terminal); off = the trainer prints a summary line per iteration.
    transcripts_every, transcripts_per_iteration: readable transcripts of that many
      episodes every N iterations in `<run_dir>/transcripts/` (0 = never).
    """

    tensorboard: bool = True
    progress: bool = True
    transcripts_every: int = 1
    transcripts_per_iteration: int = 2

    def __post_init__(self):
        _check_int("transcripts_every", self.transcripts_every, 0)
        _check_int("transcripts_per_iteration", self.transcripts_per_iteration, 0)


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
    mesh: the device mesh `{data, fsdp, tensor}` (`jaxagent.parallel.MeshConfig`; one
      size may be -1 = the rest). All 1 (the default) = one device, exactly the
      single-device loop. Otherwise the mini-batch size must be divisible by
      `data * fsdp`; a mesh smaller than the devices uses the first ones (one process).
    distributed: multi-host set-up (`DistributedSection`); with several processes and
      an all-1 mesh, the mesh is `data = -1` (pure data parallelism over every device).
    device_memory_gb: the per-device memory for the memory check before the run, when
      the device does not report it (CPU); None = skip the check there.
    overlap: one-step off-policy rollout/update overlap (`OverlapSection`; off by default).
    """

    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algo: AlgoSection = AlgoSection()
    warm_start: WarmStartSection = WarmStartSection()
    eval: EvalSection = EvalSection()
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
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedSection = DistributedSection()
    device_memory_gb: float | None = None
    overlap: OverlapSection = OverlapSection()
    logging: LoggingSection = LoggingSection()

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
        if self.device_memory_gb is not None and not (
                isinstance(self.device_memory_gb, (int, float)) and not isinstance(self.device_memory_gb, bool)
                and math.isfinite(self.device_memory_gb) and self.device_memory_gb > 0):
            raise ValueError(f"device_memory_gb must be a number > 0 or null, got {self.device_memory_gb!r}")
        if self.overlap.off_policy:
            if self.loss.tis_cap is None:
                raise ValueError("overlap.off_policy needs loss.tis_cap (e.g. 2.0): the rollouts are one update "
                                 "stale and the update corrects them by truncated importance sampling")
            if self.algo.dynamic_sampling:
                raise ValueError("overlap.off_policy and algo.dynamic_sampling cannot be combined")
        if -1 not in self.mesh.shape.values():
            shards = self.mesh.data * self.mesh.fsdp
            if (B // self.mini_batches) % shards:
                raise ValueError(f"mesh: the mini-batch size {B // self.mini_batches} (env.group_size * "
                                 f"env.tasks_per_iteration / mini_batches) must be divisible by mesh.data * "
                                 f"mesh.fsdp = {shards} (its rows are split over them)")
        ranges = {"env.seed (the training task stream)": (self.env.seed, self.iterations * self.env.tasks_per_iteration),
                  "warm_start.seed (demonstrations)": (self.warm_start.seed, self.warm_start.episodes),
                  "eval.seed (held-out evaluation)": (self.eval.seed, self.eval.episodes)}
        items = [(k, a, n) for k, (a, n) in ranges.items() if n > 0]
        for i, (k1, a1, n1) in enumerate(items):
            for k2, a2, n2 in items[i + 1:]:
                if a1 < a2 + n2 and a2 < a1 + n1:
                    raise ValueError(f"seed ranges overlap: {k1} covers [{a1}, {a1 + n1}) and {k2} covers "
                                     f"[{a2}, {a2 + n2}); held-out and demonstration seeds must not be trained on")

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


def scratch_config(section: ModelSection, tokenizer):
    """The `DecoderConfig` of a from-scratch policy (`section.path` is None)."""
    from jaxagent import models

    return models.DecoderConfig(
        vocab_size=len(tokenizer), hidden_size=section.hidden_size, intermediate_size=section.intermediate_size,
        num_layers=section.num_layers, num_heads=section.num_heads, num_kv_heads=section.num_kv_heads,
        head_dim=section.head_dim, qkv_bias=section.qkv_bias, tie_word_embeddings=section.tie_word_embeddings,
        model_type=section.model_type)


def build_policy(section: ModelSection, tokenizer, key: jax.Array):
    """`(params, model_config)`: loaded from `section.path`, else initialised from `key`."""
    from jaxagent import models

    if section.path is not None:
        model = models.load_pretrained(section.path, dtype=section.dtype)
        if model.config.vocab_size < len(tokenizer):
            raise ConfigError(f"model.tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                              f"has {model.config.vocab_size}")
        return model.params, model.config
    config = scratch_config(section, tokenizer)
    return models.init_params(key, config, dtype=section.dtype, std=section.init_std), config


def _policy_logprobs(params, config, tokens_BxT, attention_mask_BxT, *, temperature: float,
                     seq_chunk: int, vocab_chunk: int) -> jax.Array:
    from jaxagent.models import token_logprobs

    logp, _ = token_logprobs(params, config, tokens_BxT, attention_mask_BxT=attention_mask_BxT,
                             temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
    return logp


#: `log pi(tokens[t] | tokens[:t])` `[B, T]` as `train_step` computes it (same kernel).
policy_logprobs = jax.jit(_policy_logprobs, static_argnames=("config", "temperature", "seq_chunk", "vocab_chunk"))


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


def shaped_turn_rewards(algo: AlgoSection, traj) -> np.ndarray:
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

def shape_rewards(algo: AlgoSection, traj, loss_mask, old_logp=None, ref_logp=None):
    """`(traj, loss_mask, stats)` with `algo`'s reward shaping (see `AlgoSection`): the
    trajectory's `turn_rewards` and per-token `rewards` (each turn's reward at its last
    policy token) replaced by the shaped ones, the loss mask without filtered episodes.
    `old_logp` / `ref_logp` are needed for `kl_reward_coef > 0`."""
    a = algo
    from jaxagent.rollout.trajectory import rewards_at_turn_ends

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
        dist = config.distributed
        par.initialize(dist.coordinator_address, dist.num_processes, dist.process_id,
                       auto=True if dist.auto else None)
        self.primary = par.is_primary()   # the one process that writes files and logs
        self.log = log if self.primary else (lambda *_, **__: None)
        self.mesh = self._make_mesh()      # None = one device: the single-device loop as it was
        #: the global rows of each rollout batch this process plays (all of them alone)
        self.local_rows = np.arange(config.env.batch_size) if self.mesh is None else \
            par.process_rows(self.mesh, config.env.batch_size)
        self._check_local_rows()
        self._row_offset = 0
        self.run_dir = Path(config.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.demonstrations = None
        if config.warm_start.enabled and not resume:
            from jaxagent.train.warmstart import collect_demonstrations

            ws = config.warm_start
            self.demonstrations = collect_demonstrations(
                config.env.name, config.env.kwargs, range(ws.seed, ws.seed + ws.episodes),
                noise=ws.expert_noise, max_turns=config.rollout.max_turns)
        self.tokenizer = self._tokenizer()
        k_model, k_critic, k_rng = jax.random.split(jax.random.key(config.seed), 3)
        self._keys = {"critic": k_critic, "rng": k_rng}
        if config.model.path is None:  # before anything is built or compiled
            self._check_memory(scratch_config(config.model, self.tokenizer))
        params, self.model_config = build_policy(config.model, self.tokenizer, k_model)
        if config.model.path is not None:
            self._check_memory(self.model_config)
        self.ref_params = None
        if config.loss.kl_coef > 0 or config.algo.kl_reward_coef > 0:
            # a copy: the state's params are donated to train_step
            self.ref_params = jax.tree.map(jnp.copy, params)
        critic_params = critic_config = None
        if config.algo.uses_critic:
            from jaxagent.models import value_params_from_policy

            critic_params = value_params_from_policy(k_critic, params, self.model_config)
            critic_config = self.model_config
        self.state: TrainState = init_train_state(k_rng, params, self.model_config, config.step_config,
                                                  critic_params=critic_params, critic_config=critic_config)
        self._place_state()
        self.iteration = 0        # iterations completed
        self.task_position = 0    # tasks of the stream consumed
        self.history: list[dict] = []
        self.summary: dict = {}   # warm start and held-out evaluations (<run_dir>/summary.json)
        self._last_episodes = None  # the last iteration's episodes (this process's), for transcripts
        self._overlap = None      # the rollout thread (`overlap.off_policy`)
        self._pending = None      # its running rollout

    # ------------------------------------------------------------------ meshes and hosts
    def _make_mesh(self):
        """The config's mesh, or None for one device (an all-1 mesh, one process)."""
        cfg = self.config
        mc = cfg.mesh
        if all(v == 1 for v in mc.shape.values()):
            if jax.process_count() == 1:
                return None
            mc = MeshConfig(data=-1)
        devices = None
        if -1 not in mc.shape.values() and mc.num_devices < jax.device_count() and jax.process_count() == 1:
            devices = jax.devices()[:mc.num_devices]
        try:
            mesh = par.make_mesh(mc, devices)
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        if mesh.devices.size == 1:
            return None
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        mb = cfg.env.batch_size // cfg.mini_batches
        if mb % shards:
            raise ConfigError(f"mesh: the mini-batch size {mb} (env.group_size * env.tasks_per_iteration / "
                              f"mini_batches) must be divisible by mesh.data * mesh.fsdp = {shards}")
        return mesh

    def _check_local_rows(self) -> None:
        """Advantages need whole groups: each process must play whole groups of the batch."""
        cfg = self.config
        if jax.process_count() == 1:
            return
        rows, G, B = self.local_rows, cfg.env.group_size, cfg.env.batch_size
        whole = rows.size and rows.size % G == 0 and rows[0] % G == 0 and np.array_equal(
            rows, np.arange(rows[0], rows[0] + rows.size))
        if not whole:
            raise ConfigError(
                f"distributed: process {jax.process_index()} of {jax.process_count()} would play rows "
                f"{rows.tolist()} of the rollout batch of {B}, not whole groups of env.group_size {G}; "
                f"make env.tasks_per_iteration a multiple of the processes (rows per process "
                f"{B // jax.process_count()} must be a multiple of {G})")
        if cfg.algo.dynamic_sampling:
            raise ConfigError("algo.dynamic_sampling is not supported with several processes (each would "
                              "choose its own groups); turn it off or run one process")

    def _check_memory(self, model_config) -> None:
        """Logs the per-device memory estimate; raises `DoesNotFitError` (naming every
        component) before anything is compiled when it exceeds the device's memory
        (`memory_stats`, else `device_memory_gb`, else no check)."""
        cfg = self.config
        common = dict(param_dtype=cfg.model.dtype)
        est = par.estimate_memory(model_config, cfg.step_config, self.mesh, batch_size=cfg.env.batch_size //
                                  cfg.mini_batches, seq_len=cfg.rollout.max_context, critic=cfg.algo.uses_critic,
                                  **common)
        # one process: the sampler runs on the mesh with the state's params; several: on one
        # device per process with this process's rows and a param copy (see `_sampler_params`)
        sharded = self.mesh is not None and jax.process_count() == 1
        sampler = par.estimate_memory(model_config, cfg.step_config, self.mesh if sharded else None, batch_size=1,
                                      seq_len=1, sample_batch=len(self.local_rows),
                                      sample_len=cfg.rollout.max_context, **common)
        est["kv_cache"] = sampler["kv_cache"]
        if self.mesh is not None and not sharded:
            est["sampler_params"] = sampler["params"]
        if cfg.loss.kl_coef > 0 or cfg.algo.kl_reward_coef > 0:
            est["reference"] = est["params"] if not cfg.algo.uses_critic else par.estimate_memory(
                model_config, cfg.step_config, self.mesh, batch_size=1, seq_len=1, **common)["params"]
        est["total"] = sum(v for k, v in est.items() if k != "total")
        self.memory_estimate = est
        try:
            device_bytes = par.device_memory_bytes()
        except ValueError:
            device_bytes = None if cfg.device_memory_gb is None else int(cfg.device_memory_gb * 2**30)
        self.log(par.format_memory(est, device_bytes))
        if device_bytes is None:
            self.log("memory check skipped: the device does not report its memory (set device_memory_gb)")
            return
        try:
            par.check_fits(est, device_bytes)
        except par.DoesNotFitError as e:
            shape = "one device" if self.mesh is None else " x ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
            raise par.DoesNotFitError(f"this config does not fit ({shape}): {e}") from None

    def _place_state(self) -> None:
        """With a mesh: the state (and KL reference) placed by the logical-axis rules, and
        the sharded update built for it (jitted once per state layout)."""
        if self.mesh is None:
            return
        self.state = par.shard_train_state(self.state, self.mesh)
        if self.ref_params is not None:
            self.ref_params = _place(self.ref_params, par.param_shardings(self.ref_params, self.mesh))
        self._rl_step = par.make_sharded_train_step(self.config.step_config, self.state, self.mesh)
        from jaxagent.models import decoder

        layout = par.activation_constraint(self.mesh)
        rows = jax.NamedSharding(self.mesh, par.batch_spec(2))
        sc = self.config.step_config

        def logprobs(params, tokens_BxT, attention_mask_BxT):
            with decoder.activation_constraint(layout):
                return _policy_logprobs(params, self.model_config, tokens_BxT, attention_mask_BxT,
                                        temperature=sc.loss.temperature, seq_chunk=sc.seq_chunk,
                                        vocab_chunk=sc.vocab_chunk)

        def values(critic_params, batch):
            with decoder.activation_constraint(layout):
                return critic_values(critic_params, self.model_config, batch)

        self._mesh_logprobs = jax.jit(logprobs, out_shardings=rows)
        self._mesh_values = jax.jit(values, out_shardings=rows)

    @property
    def _sampler_sharded(self) -> bool:
        """The sampler runs on the mesh (one process with a mesh; module docstring)."""
        return self.mesh is not None and jax.process_count() == 1

    def _sampler_params(self):
        """The params the sampler runs with: the state's own (on one device, or sharded on
        the mesh in one process); with several processes, a whole copy on this process's
        first device (gathered from the shards)."""
        params = self.state.params
        if self.mesh is None or self._sampler_sharded:
            return params
        if jax.process_count() > 1:
            params = par.to_host(params)
        return jax.device_put(params, jax.local_devices()[0])

    def _to_mesh(self, batch):
        """A host (or one-device) batch with every process's full rows, placed on the mesh
        with its rows split over ("data", "fsdp")."""
        if jax.process_count() == 1:
            return par.shard_batch(batch, self.mesh)

        def put(x):
            h = np.asarray(x)
            return jax.make_array_from_callback(h.shape, jax.NamedSharding(self.mesh, par.batch_spec(h.ndim)),
                                                lambda idx: h[idx])

        return jax.tree.map(put, batch)

    def _fetch(self, tree):
        """Replicated device values (metrics) as host values on every process."""
        return jax.device_get(tree) if jax.process_count() == 1 else par.to_host(tree)

    # ------------------------------------------------------------------ helpers
    def _tokenizer(self):
        """`build_tokenizer`, or for "bpe" the tokenizer trained on the env's text (fresh
        run) / saved in the run directory (resume)."""
        cfg = self.config
        if cfg.model.tokenizer != "bpe":
            return build_tokenizer(cfg.model)
        from jaxagent.train import warmstart

        saved = self.run_dir / "tokenizer"
        if self.resume:
            if not saved.is_dir():
                raise FileNotFoundError(f"--resume: the run's trained tokenizer {saved} is missing")
            from jaxagent.models import load_tokenizer

            return load_tokenizer(saved)
        demos = self.demonstrations
        if demos is None:  # no warm start: noise-free expert episodes on the demonstration seeds
            ws = cfg.warm_start
            demos = warmstart.collect_demonstrations(cfg.env.name, cfg.env.kwargs, range(ws.seed, ws.seed + 256),
                                                     max_turns=cfg.rollout.max_turns)
        return warmstart.train_bpe_tokenizer(warmstart.demonstration_texts(demos), cfg.model.tokenizer_vocab_size)

    def _agent_loop(self):
        from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

        r = self.config.rollout
        pad = self.tokenizer.pad_token_id
        loop_cfg = AgentLoopConfig(
            max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn, max_context=r.max_context,
            sampling=SamplingConfig(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
            pad_id=0 if pad is None else int(pad), pipeline_groups=r.pipeline_groups)
        loop = AgentLoop(self._sampler_params(), self.model_config, self.tokenizer, loop_cfg,
                         mesh=self.mesh if self._sampler_sharded else None)
        if jax.process_count() > 1:
            # this process's rows draw the sampling keys of their global row index, so the
            # processes together sample what one process playing the whole batch would
            init_state = loop.sampler.init_state

            def offset_init_state(batch, seed=0, row_ids=None):
                row_ids = np.arange(batch) if row_ids is None else np.asarray(row_ids)
                return init_state(batch, seed, row_ids=row_ids + self._row_offset)

            loop.sampler.init_state = offset_init_state
        return loop

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
        self.state, extras = ckpt.restore(self.state)  # all processes, with the state's shardings
        self._place_state()
        self._check_resumable(extras.get("config"), ckpt.directory / str(ckpt.latest_step()))
        if self.ref_params is not None and self.config.warm_start.enabled:
            self._restore_reference()
        self.iteration = int(extras["iteration"])
        self.task_position = int(extras["task_position"])
        self.history = list(extras.get("history", []))
        self.summary = dict(extras.get("summary", {}))
        summary_file = self.run_dir / "summary.json"
        if summary_file.exists():  # the evaluation after RL is written after the last checkpoint
            on_disk = json.loads(summary_file.read_text())
            if on_disk.get("iterations_at_eval") == self.iteration and "success_after_rl" in on_disk:
                self.summary = on_disk
        # metrics of iterations after the checkpoint (a run killed before its next save)
        # are dropped, so the file holds exactly the iterations the resumed run builds on
        self._write_metrics_file()
        self.log(f"resumed from {ckpt.directory / str(ckpt.latest_step())} at iteration {self.iteration}")

    def _write_metrics_file(self) -> None:
        if not self.primary:
            return
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
        tmp.replace(self.metrics_path)

    def _save(self, ckpt: CheckpointManager) -> None:
        ckpt.save(self.iteration, self.state, extras={
            "iteration": self.iteration, "task_position": self.task_position,
            "history": self.history, "config": to_dict(self.config), "summary": self.summary})

    # ------------------------------------------------------------------ run
    def run(self) -> list[dict]:
        """Warm start and evaluation before RL (fresh runs, when configured), then RL up to
        `config.iterations`, then the held-out evaluation after RL; returns the metrics
        history (one dict per RL iteration). `self.summary` holds the evaluations."""
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
            elif self.primary:
                self.metrics_path.write_text("")
                if cfg.model.tokenizer == "bpe":
                    from jaxagent.train.warmstart import save_tokenizer

                    save_tokenizer(self.tokenizer, self.run_dir / "tokenizer")
            if self.primary:
                (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            final_eval_done = "success_after_rl" in self.summary or not cfg.eval.episodes
            if self.iteration >= cfg.iterations and final_eval_done:
                self.log(f"nothing to do: {self.iteration} of {cfg.iterations} iterations done")
                return self.history
            loop = self._agent_loop()
            factory = _env_factory(cfg.env.name, cfg.env.kwargs)
            with envs.EnvPool([factory] * len(self.local_rows), num_workers=cfg.env.num_workers,
                              step_timeout=cfg.env.step_timeout) as pool:
                if not self.resume and (cfg.warm_start.enabled or cfg.eval.episodes):
                    if cfg.warm_start.enabled:
                        self._warm_start()
                        loop.set_params(self._sampler_params())
                    if cfg.eval.episodes:
                        ev = self.evaluate(loop, pool)
                        self.summary.update(success_before_rl=ev["success_rate"], eval_before_rl=ev)
                        self.log(f"held-out evaluation before RL: {_eval_summary(ev)}")
                        if cfg.eval.greedy:
                            evg = self.evaluate(loop, pool, temperature=0.0)
                            self.summary.update(success_before_rl_greedy=evg["success_rate"],
                                                eval_before_rl_greedy=evg)
                            self.log(f"held-out evaluation before RL, greedy: {_eval_summary(evg)}")
                    self._write_summary()
                    self._save(ckpt)  # iteration 0: a resumed run never repeats the warm start
                run_log = None
                if self.primary and self.iteration < cfg.iterations:
                    from jaxagent.train.logging import RunLogger

                    lc = cfg.logging
                    run_log = RunLogger(self.run_dir, total_iterations=cfg.iterations, tensorboard=lc.tensorboard,
                                        progress=lc.progress, transcripts_every=lc.transcripts_every,
                                        transcripts_per_iteration=lc.transcripts_per_iteration)
                try:
                    while self.iteration < cfg.iterations:
                        metrics = self._iteration(loop, pool)
                        if cfg.eval.episodes and cfg.eval.every and self.iteration % cfg.eval.every == 0 \
                                and self.iteration < cfg.iterations:
                            self._finish_pending()
                            ev = self.evaluate(loop, pool)
                            metrics.update({f"eval_{k}": ev[k] for k in ("success_rate", "return_mean", "turns_mean")})
                        self.history.append(metrics)
                        if self.primary:
                            with self.metrics_path.open("a") as f:
                                f.write(json.dumps(metrics) + "\n")
                        if run_log is not None:
                            run_log.log_iteration(metrics, self._last_episodes)
                        if run_log is None or not cfg.logging.progress:
                            self.log(_summary(metrics))
                        if self.iteration % cfg.checkpoint_every == 0 or self.iteration == cfg.iterations:
                            self._save(ckpt)
                finally:  # never close the pool under a running rollout
                    self._finish_pending()
                    self._pending = None
                    if run_log is not None:
                        run_log.close()
                if cfg.eval.episodes and "success_after_rl" not in self.summary:
                    ckpt.wait_until_finished()
                    ev = self.evaluate(loop, pool)
                    if cfg.eval.greedy:
                        evg = self.evaluate(loop, pool, temperature=0.0)
                        self.summary.update(success_after_rl_greedy=evg["success_rate"], eval_after_rl_greedy=evg)
                        self.log(f"held-out evaluation after RL, greedy: {_eval_summary(evg)}")
                    self.summary.update(success_after_rl=ev["success_rate"], eval_after_rl=ev,
                                        iterations_at_eval=self.iteration)
                    self.log(f"held-out evaluation after RL: {_eval_summary(ev)}")
                    self._write_summary()
        finally:
            ckpt.close()
            if self._overlap is not None:
                self._overlap.shutdown(wait=True)
                self._overlap = None
        if "success_after_rl" in self.summary:
            line = {k: self.summary[k] for k in ("success_before_rl", "success_after_rl") if k in self.summary}
            if "success_before_rl" in line:
                line["lift_points"] = round(100 * (line["success_after_rl"] - line["success_before_rl"]), 2)
            line.update({k: self.summary[k] for k in ("success_before_rl_greedy", "success_after_rl_greedy")
                         if k in self.summary})
            line.update(eval_episodes=cfg.eval.episodes, iterations=self.iteration, run_dir=str(self.run_dir))
            self.log(json.dumps(line))
        return self.history

    # ------------------------------------------------------------------ warm start
    def _warm_start(self) -> None:
        """SFT on `self.demonstrations` (`warm_start` section), then a fresh RL state
        (optimizer, critic) from the SFT weights. Metrics go to `<run_dir>/warm_start.jsonl`."""
        from jaxagent.rollout.chat import ChatFormat
        from jaxagent.train.step import SFTBatch, sft_step
        from jaxagent.train.warmstart import demonstration_tokens, pack_rows

        cfg, ws = self.config, self.config.warm_start
        t_start = time.perf_counter()
        demos = self.demonstrations
        if ws.only_successful:
            demos = [d for d in demos if d.success]
            if not demos:
                raise RuntimeError("warm_start.only_successful: none of the demonstrations succeeded")
        chat = ChatFormat(self.tokenizer)
        rows = [demonstration_tokens(chat, d, cfg.rollout.max_context) for d in demos]
        length = -(-max(len(t) for t, _ in rows) // 16) * 16
        pad = self.tokenizer.pad_token_id
        tokens, loss_mask, attn = pack_rows(rows, length, 0 if pad is None else int(pad))
        n = len(rows)
        bs = min(ws.batch_size, n)
        per_epoch = n // bs
        total = per_epoch * ws.epochs
        sc = dataclasses.replace(self.config.step_config, loss=LossConfig(temperature=1.0), optim=ws.optim,
                                 num_micro_batches=1)
        k_sft, k_shuffle = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), 1))
        state = init_train_state(k_sft, self.state.params, self.model_config, sc)
        update = functools.partial(sft_step, config=sc)
        if self.mesh is not None:
            shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            if bs % shards:
                raise ConfigError(f"warm_start.batch_size: {bs} rows per SFT step must be divisible by "
                                  f"mesh.data * mesh.fsdp = {shards}")
            state = par.shard_train_state(state, self.mesh)
            update = par.make_sharded_train_step(sc, state, self.mesh, kind="sft")
        success = float(np.mean([d.success for d in self.demonstrations]))
        self.log(f"warm start: {n} demonstrations (expert noise {ws.expert_noise}, demonstration success "
                 f"{success:.2f}), {ws.epochs} epochs x {per_epoch} steps of {bs} rows x {length} tokens")
        path = self.run_dir / "warm_start.jsonl"
        lines, window = [], []
        every = max(1, total // 10)
        for epoch, key in enumerate(jax.random.split(k_shuffle, ws.epochs)):
            perm = np.asarray(jax.random.permutation(key, n))
            for j in range(per_epoch):
                idx = perm[j * bs:(j + 1) * bs]
                batch = SFTBatch(tokens=tokens[idx], loss_mask=loss_mask[idx], attention_mask=attn[idx])
                batch = jax.tree.map(jnp.asarray, batch) if self.mesh is None else self._to_mesh(batch)
                state, m = update(state, batch)
                window.append(m)
                step = epoch * per_epoch + j + 1
                if step % every == 0 or step == total:
                    got = self._fetch(window)
                    line = {"sft_step": step, "epoch": epoch + 1,
                            "loss": float(np.mean([g["loss"] for g in got])),
                            "entropy": float(np.mean([g["entropy"] for g in got])),
                            "skipped": int(sum(float(g["skipped"]) for g in got)),
                            "time_s": time.perf_counter() - t_start}
                    lines.append(line)
                    window = []
                    self.log(f"warm start: step {step}/{total} | loss {line['loss']:.4f} | "
                             f"entropy {line['entropy']:.4f} | {line['time_s']:.0f}s")
        if self.primary:
            path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        params = state.params
        critic_params = critic_config = None
        if cfg.algo.uses_critic:
            from jaxagent.models import value_params_from_policy

            critic_params = value_params_from_policy(self._keys["critic"], params, self.model_config)
            critic_config = self.model_config
        if self.ref_params is not None:  # the KL reference is the warm-started policy
            self.ref_params = jax.tree.map(jnp.copy, params)
            self._save_reference()
        self.state = init_train_state(self._keys["rng"], params, self.model_config, cfg.step_config,
                                      critic_params=critic_params, critic_config=critic_config)
        self._place_state()
        self.summary["warm_start"] = {"demonstrations": n, "demonstration_success": success,
                                      "steps": total, "final_loss": lines[-1]["loss"] if lines else None,
                                      "seconds": time.perf_counter() - t_start}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, loop, pool, *, episodes: int | None = None, first_seed: int | None = None,
                 temperature: float | None = None, details: bool = False) -> dict:
        """Success rate, mean return and turns of the current policy on held-out seeds
        `first_seed ...` (default: the `eval` section), played in chunks of the pool's size
        with a fixed sampling seed (so evaluations differ only by the policy). With
        `details`, `per_episode` lists each episode's seed, success, return, turns,
        end reason and the env's last info (rubric components, for `intake`)."""
        cfg = self.config
        episodes = cfg.eval.episodes if episodes is None else episodes
        first_seed = cfg.eval.seed if first_seed is None else first_seed
        if temperature is None:
            temperature = cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature
        from jaxagent.train.warmstart import episode_success

        t0 = time.perf_counter()
        saved = loop.config
        loop.set_params(self._sampler_params())
        B = len(pool)
        results = []
        try:
            for start in range(0, episodes, B):
                seeds = list(range(first_seed + start, first_seed + min(start + B, episodes)))
                k = len(seeds)
                seeds += [seeds[-1]] * (B - k)  # padding slots, dropped below
                loop.config = dataclasses.replace(
                    saved, seed=cfg.seed * 7919 + start,
                    sampling=dataclasses.replace(saved.sampling, temperature=float(temperature)))
                _, eps = loop.run(pool, seeds, list(range(B)))
                results += [(episode_success(ep.done, ep.rewards, ep.info), float(sum(ep.rewards)),
                             len(ep.rewards), ep.failed, ep) for ep in eps[:k]]
        finally:
            loop.config = saved
        ok = np.array([r[0] for r in results])
        out = {"episodes": episodes, "success_rate": float(ok.mean()),
               "return_mean": float(np.mean([r[1] for r in results])),
               "turns_mean": float(np.mean([r[2] for r in results])),
               "failed_episodes": int(sum(r[3] for r in results)),
               "temperature": float(temperature), "seconds": time.perf_counter() - t0}
        if details:
            out["per_episode"] = [
                {"seed": int(ep.seed), "success": bool(r[0]), "return": r[1], "turns": r[2], "failed": bool(r[3]),
                 "end_reason": ep.end_reason, "info": _jsonable(ep.info)} for *r, ep in results]
        return out

    @property
    def _reference_dir(self) -> Path:
        return (self.run_dir / "reference").absolute()

    def _save_reference(self) -> None:
        """The KL reference after a warm start, for resumed runs (orbax, atomic)."""
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(self._reference_dir, self.ref_params, force=True)
            ckptr.wait_until_finished()

    def _restore_reference(self) -> None:
        import orbax.checkpoint as ocp

        if not self._reference_dir.is_dir():
            raise FileNotFoundError(f"--resume: the warm-started KL reference {self._reference_dir} is missing")
        with ocp.StandardCheckpointer() as ckptr:
            self.ref_params = ckptr.restore(self._reference_dir, jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                                               self.ref_params))

    def _write_summary(self) -> None:
        if not self.primary:
            return
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n")
        tmp.replace(self.run_dir / "summary.json")

    def _rollout(self, loop, pool, k_sample, position: int) -> tuple[Any, list, dict, int]:
        """The iteration's batch of `tasks_per_iteration` groups from task `position` of
        the stream on: one rollout, or with `algo.dynamic_sampling` up to
        `max_sampling_rounds` rollouts whose groups with varying returns are kept first.
        Returns `(traj, episodes, sampling stats, tasks played)`; touches no trainer state
        but the loop (it may run in the overlap thread)."""
        cfg = self.config
        G, n_tasks = cfg.env.group_size, cfg.env.tasks_per_iteration
        rounds = cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1
        groups_signal, groups_flat = [], []   # rows of each group in the concatenated rounds
        round_trajs, all_episodes = [], []
        played = 0
        for r in range(rounds):
            sample_seed = int(jax.random.randint(jax.random.fold_in(k_sample, r), (), 0, 2**31 - 1))
            task_seeds = [cfg.env.seed + position + played * n_tasks + j for j in range(n_tasks)]
            seeds = [s for s in task_seeds for _ in range(G)]
            group_ids = [j for j in range(n_tasks) for _ in range(G)]
            loop.config = dataclasses.replace(loop.config, seed=sample_seed)
            if len(self.local_rows) == len(seeds):
                traj, episodes = loop.run(pool, seeds, group_ids)
            else:  # several processes: this one plays its own (whole) groups of the batch
                self._row_offset = int(self.local_rows[0])
                try:
                    traj, episodes = loop.run(pool, [seeds[i] for i in self.local_rows],
                                              [group_ids[i] for i in self.local_rows])
                finally:
                    self._row_offset = 0
                # anchor-state ids are per process: keep them apart (GiGPO groups them within
                # an episode group, and a group never spans processes)
                anchor = np.asarray(traj.anchor_ids)
                offset = self.local_rows[0] * cfg.rollout.max_turns
                traj = traj.replace(anchor_ids=jnp.asarray(np.where(anchor >= 0, anchor + offset, anchor)))
            played += 1
            if rounds == 1:
                return traj, episodes, {"sampling_rounds": 1}, n_tasks
            returns = shaped_turn_rewards(cfg.algo, traj).sum(axis=1)
            failed = np.asarray(traj.failed)
            base = len(all_episodes)
            round_trajs.append(traj)
            all_episodes += episodes
            for j in range(n_tasks):
                rows = list(range(j * G, (j + 1) * G))
                ok = [i for i in rows if not failed[i]]
                varies = len(ok) >= 2 and np.ptp(returns[ok]) > 0
                (groups_signal if varies else groups_flat).append([base + i for i in rows])
            if len(groups_signal) >= n_tasks:
                break
        from jaxagent.rollout.agent_loop import anchor_ids

        rows = [i for group in (groups_signal + groups_flat)[:n_tasks] for i in group]
        take = jnp.asarray(rows)
        traj = jax.tree.map(lambda *xs: jnp.concatenate(xs)[take], *round_trajs)
        episodes = [all_episodes[i] for i in rows]
        traj = traj.replace(group_ids=jnp.repeat(jnp.arange(n_tasks, dtype=jnp.int32), G),
                            anchor_ids=jnp.asarray(anchor_ids(episodes, cfg.rollout.max_turns)))
        return traj, episodes, {"sampling_rounds": played,
                                "groups_with_signal": min(len(groups_signal), n_tasks),
                                "groups_with_signal_frac": len(groups_signal) / (played * n_tasks)}, played * n_tasks

    def _start_rollout(self, loop, pool, k_sample, *, staleness: int) -> None:
        """Starts the rollout of the next batch in the overlap thread, with the current
        params (a copy: the update donates the state's buffers) from the current stream
        position. `self._pending.result()` is `(rollout, seconds, staleness)`."""
        aliased = self.mesh is None or self._sampler_sharded  # the state's own buffers
        loop.set_params(jax.tree.map(jnp.copy, self._sampler_params()) if aliased else self._sampler_params())
        position = self.task_position
        if self._overlap is None:
            self._overlap = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxagent-rollout")

        def collect():
            t0 = time.perf_counter()
            out = self._rollout(loop, pool, k_sample, position)
            return out, time.perf_counter() - t0, staleness

        self._pending = self._overlap.submit(collect)

    def _finish_pending(self) -> None:
        """Waits for a background rollout (before the loop or pool is used otherwise);
        its result stays pending for the next iteration."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def _iteration(self, loop, pool) -> dict:
        cfg = self.config
        B = cfg.env.batch_size
        times: dict[str, float] = {}
        t_start = time.perf_counter()

        rng, k_sample, k_shuffle = jax.random.split(self.state.rng, 3)
        if self.mesh is not None:
            rng = jax.device_put(rng, jax.NamedSharding(self.mesh, jax.P()))
        self.state = self.state.replace(rng=rng)

        # ---- rollout (a fresh sampling seed per round; the loop and its compiled sampler are reused)
        t0 = time.perf_counter()
        if cfg.overlap.off_policy:
            if self._pending is None:  # the first iteration (of a run or after a resume): on-policy
                self._start_rollout(loop, pool, jax.random.fold_in(k_sample, 1), staleness=0)
            (traj, episodes, sampling, played), times["rollout"], staleness = self._pending.result()
            self._pending = None
            times["rollout_wait"] = time.perf_counter() - t0
        else:
            loop.set_params(self._sampler_params())
            traj, episodes, sampling, played = self._rollout(loop, pool, k_sample, self.task_position)
            staleness = 0
        self.task_position += played
        self._last_episodes = episodes
        from jaxagent.train.warmstart import episode_success

        success = np.array([episode_success(ep.done, ep.rewards, ep.info) for ep in episodes])
        if self.mesh is not None:
            # the processes' rows become one global batch (rows over data x fsdp); every
            # process also keeps a host copy of all rows for shaping, advantages and metrics
            traj_mesh, success_mesh = par.global_batch(jax.tree.map(np.asarray, (traj, success)), self.mesh,
                                                       cfg.env.batch_size)
            if jax.process_count() > 1:
                traj, success = par.to_host((traj_mesh, success_mesh))
                traj = jax.tree.map(jnp.asarray, traj)
        if not cfg.overlap.off_policy:
            times["rollout"] = time.perf_counter() - t0

        # ---- log-probs, values
        t0 = time.perf_counter()
        alive = ~traj.failed
        loss_mask = traj.loss_mask * alive[:, None].astype(traj.loss_mask.dtype)
        sc = cfg.step_config
        ref_logp = values = None
        if self.mesh is None:
            lp = functools.partial(policy_logprobs, config=self.model_config, temperature=cfg.loss.temperature,
                                   seq_chunk=sc.seq_chunk, vocab_chunk=sc.vocab_chunk)
            old_logp = lp(self.state.params, tokens_BxT=traj.tokens, attention_mask_BxT=traj.attention_mask)
            if self.ref_params is not None:
                ref_logp = lp(self.ref_params, tokens_BxT=traj.tokens, attention_mask_BxT=traj.attention_mask)
            if cfg.algo.uses_critic:
                # critic_values reads the tokens and the attention fields of a batch only
                probe = UpdateBatch(tokens=traj.tokens, loss_mask=loss_mask, advantages=loss_mask,
                                    old_logp=old_logp, attention_mask=traj.attention_mask)
                values = _critic_values(self.state.critic_params, self.state.critic_config, probe)
        else:  # on the sharded params, the batch's rows split; host copies for what follows
            toks, attn = traj_mesh.tokens, traj_mesh.attention_mask
            got = {"old": self._mesh_logprobs(self.state.params, toks, attn)}
            if self.ref_params is not None:
                got["ref"] = self._mesh_logprobs(self.ref_params, toks, attn)
            if cfg.algo.uses_critic:
                probe = UpdateBatch(tokens=toks, loss_mask=traj_mesh.loss_mask, advantages=traj_mesh.loss_mask,
                                    old_logp=got["old"], attention_mask=attn)
                got["values"] = self._mesh_values(self.state.critic_params, probe)
            got = jax.tree.map(jnp.asarray, par.to_host(got))
            old_logp, ref_logp, values = got["old"], got.get("ref"), got.get("values")
        jax.block_until_ready(old_logp)
        times["logprobs"] = time.perf_counter() - t0

        # ---- reward shaping, advantages
        t0 = time.perf_counter()
        env_traj = traj
        traj, loss_mask, shaping = shape_rewards(cfg.algo, traj, loss_mask, old_logp, ref_logp)
        adv, returns = compute_advantages(cfg.algo, traj, loss_mask, values)
        batch = UpdateBatch(tokens=traj.tokens, loss_mask=loss_mask, advantages=adv, old_logp=old_logp,
                            attention_mask=traj.attention_mask,
                            ref_logp=ref_logp if cfg.loss.kl_coef > 0 else None,
                            rollout_logp=traj.rollout_logp,
                            returns=returns if cfg.algo.uses_critic else None,
                            old_values=values)
        jax.block_until_ready(adv)
        times["advantages"] = time.perf_counter() - t0

        # ---- the next iteration's rollout starts now, with the params before this update
        if cfg.overlap.off_policy and self.iteration + 1 < cfg.iterations:
            self._start_rollout(loop, pool, k_sample, staleness=1)

        # ---- updates (all dispatched before any metric is read)
        t0 = time.perf_counter()
        mb = B // cfg.mini_batches
        step_metrics = []
        for k_epoch in jax.random.split(k_shuffle, cfg.epochs):
            perm = np.asarray(jax.random.permutation(k_epoch, B))
            for m in range(cfg.mini_batches):
                rows = jnp.asarray(perm[m * mb:(m + 1) * mb])
                mini = jax.tree.map(lambda x: x[rows], batch)
                if self.mesh is None:
                    self.state, sm = train_step(self.state, mini, sc)
                else:
                    self.state, sm = self._rl_step(self.state, self._to_mesh(mini))
                step_metrics.append(sm)
        step_metrics = self._fetch(step_metrics)
        times["update"] = time.perf_counter() - t0

        self.iteration += 1
        total_s = time.perf_counter() - t_start
        out = self._metrics(env_traj, success, step_metrics, adv, old_logp, loss_mask, times, total_s)
        if cfg.overlap.off_policy:
            # the batch's params lag the updated ones by `staleness` updates; the main thread
            # (which drives the device) idled only while it waited for the rollout
            out["staleness"] = staleness
            out["device_idle_frac"] = times["rollout_wait"] / max(total_s, 1e-9)
        if cfg.algo.dynamic_sampling:
            out.update(sampling)
        out.update(shaping)
        return out

    def _metrics(self, traj, success, step_metrics, adv, old_logp, loss_mask, times, total_s) -> dict:
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
                    "value_loss", "explained_variance", "vf_clipfrac", "tis_weight"):
            v = mean_of(key)
            if v is not None:
                out[key] = v
        out["skipped_updates"] = int(sum(float(m["skipped"]) for m in step_metrics))
        out["tokens_per_s"] = policy_tokens / max(times["rollout"], 1e-9)
        out.update({f"time_{k}_s": v for k, v in times.items()})
        out["time_iteration_s"] = total_s
        return out


def _place(tree, shardings):
    """`tree` placed by `shardings` (every process holds the same values; global arrays
    are resharded)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, s)
        h = np.asarray(x)
        return jax.make_array_from_callback(h.shape, s, lambda idx: h[idx])

    return jax.tree.map(put, tree, shardings)


def _jsonable(x):
    """`x` with everything JSON cannot hold turned into its repr."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return _jsonable(x.item())
    return repr(x)


def _eval_summary(ev: dict) -> str:
    return (f"success {ev['success_rate']:.3f} | return {ev['return_mean']:.3f} | turns {ev['turns_mean']:.2f} | "
            f"{ev['episodes']} episodes at temperature {ev['temperature']} | {ev['seconds']:.1f}s")


def _summary(m: dict) -> str:
    parts = [f"iter {m['iteration']}", f"reward {m['reward_mean']:.3f}", f"success {m['success_rate']:.2f}"]
    for key in ("kl", "approx_kl", "entropy", "clipfrac"):
        if key in m:
            parts.append(f"{key} {m[key]:.4f}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    parts.append(f"{m['time_iteration_s']:.1f}s")
    return " | ".join(parts)
