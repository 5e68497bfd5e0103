"""The training run's config: `TrainerConfig` and its sections, validated on construction.

Load with `jaxagent.config.load_config(TrainerConfig, path, overrides)`; every key is
listed by `jaxagent config` (the keys, their defaults and these docstrings). Sections
that configure a component embed that component's own config where there is one
(`loss`, `optim`: `jaxagent.train.step_config`; `mesh`: `jaxagent.parallel.MeshConfig`) and
build it where the trainer's keys are fewer (`RolloutSection.loop_config()` is the
`jaxagent.rollout.AgentLoopConfig`).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any

from jaxagent import algos
from jaxagent.models import LoraConfig
from jaxagent.parallel import MeshConfig
from jaxagent.train.step_config import LossConfig, OptimizerConfig, StepConfig

#: the estimator inputs (`jaxagent.algos.ESTIMATOR_INPUTS`) the trainer provides: "values"
#: and "turn_values" (the critic's value at each token / at each turn's first policy
#: token) make it build and train a critic; "baselines" makes it play one greedy episode
#: per task (ReMax: the greedy episode's shaped return is its group's baseline).
PROVIDED_INPUTS = ("rewards", "mask", "group_ids", "values", "turn_rewards", "turn_mask", "anchor_ids",
                   "turn_values", "baselines", "gamma", "lam")
#: inputs that come from the critic (consuming one makes the trainer train a critic)
CRITIC_INPUTS = ("values", "turn_values")
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
      `jaxagent.rollout.byte_tokenizer`), "bpe" (a byte-level BPE of `tokenizer_vocab_size`
      tokens trained on the env's text, `jaxagent.train.warmstart.train_bpe_tokenizer`:
      the warm-start demonstrations, or noise-free expert episodes when there is no
      warm start; saved in `<run_dir>/tokenizer/` and reloaded from there on resume),
      a path for `load_tokenizer`, or None (= "byte" from scratch, the checkpoint's own
      tokenizer with `path`).
    tokenizer_vocab_size: vocabulary of the "bpe" tokenizer (bytes + specials + merges).
    tokenizer_pieces: what the "bpe" tokenizer's merges may not cross: "words" (a space
      or line break), "lines" (a line break only: a sentence the env's text repeats,
      such as a scripted question, can become one token) or "phrases" ("words", plus each
      line the text repeats at least 8 times as one token: questions and fixed lines are
      one token, varying text stays in words that recur). With "lines" and "phrases" the
      system prompt counts once per demonstration, so a fixed prompt becomes few tokens.
    hidden_size ... model_type: the from-scratch architecture (vocab = the tokenizer's).
    init_std: std of the from-scratch initialisation.
    dtype: "float32" or "bfloat16": the parameters' storage, so the dtype of the
      optimizer state and of the updates.
    compute_dtype: the dtype the forward passes run in (the update's, the log-prob
      passes', the critic's and the sampler's): null = `dtype`. `dtype: float32` with
      `compute_dtype: bfloat16` is mixed precision: float32 master weights and AdamW state,
      every pass in bfloat16 on a cast copy (gradients reach the float32 masters through
      the cast; log-probs, losses and the softmax stay float32), so small updates are
      not rounded away as they are with bfloat16 weights.
    remat: recompute activations in the backward pass instead of keeping them: False,
      True / "full" (keep each layer's input only), "dots" (keep the matmul outputs).
      Less memory for the update (see the memory estimate), the same gradients.
    lora: low-rank adapters `{rank, alpha, targets}` (`jaxagent.models.LoraConfig`) on the
      policy; only they are trained (optimizer state for the adapters only), and the KL
      reference shares the frozen base weights with the policy (a copy of the adapters
      alone). None = train every weight.
    matmul_precision: the precision of float32 matmuls (`jax_default_matmul_precision`):
      "auto" = "highest" where the run computes in float32 on a GPU or TPU (whose default
      passes run float32 matmuls in TF32 or bfloat16, so results would drift from the
      CPU's without a word) and JAX's default elsewhere; "default", "high" or "highest"
      choose it. bfloat16 compute (`compute_dtype`) is unaffected.
    attention: the attention implementation of training, the log-prob passes and the
      sampler's prefill (`jaxagent.models.attention`): "auto" (cuDNN's fused attention on
      a GPU in bfloat16, else the dense scores while one layer's take at most 256 MiB and
      the blocked, flash-style version beyond), "dense", "blocked" or "cudnn".
    """

    path: str | None = None
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 512
    tokenizer_pieces: str = "words"
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
    compute_dtype: str | None = None
    remat: bool | str = False
    lora: LoraConfig | None = None
    matmul_precision: str = "auto"
    attention: str = "auto"

    def __post_init__(self):
        from jaxagent.models.attention import IMPLEMENTATIONS

        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}, got {self.attention!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(f"remat must be false, true, 'full' or 'dots', got {self.remat!r}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        _check_int("tokenizer_vocab_size", self.tokenizer_vocab_size, 259)
        if self.tokenizer_pieces not in ("words", "lines", "phrases"):
            raise ValueError(f"tokenizer_pieces must be 'words', 'lines' or 'phrases', got {self.tokenizer_pieces!r}")
        if self.tokenizer == "bpe" and self.path is not None:
            raise ValueError("tokenizer 'bpe' is for models trained from scratch; a checkpoint (path) brings "
                             "its own tokenizer")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {list(MODEL_TYPES)}, got {self.model_type!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be null, 'float32' or 'bfloat16', got {self.compute_dtype!r}")
        if not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise ValueError(f"init_std must be a float > 0, got {self.init_std!r}")


    def resolved_matmul_precision(self, platform: str) -> str | None:
        """The matmul precision a run sets on `platform` ("cpu", "gpu", "tpu"; None: JAX's
        default, left as it is): `matmul_precision` resolved (its docstring)."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        float32 = (self.compute_dtype or self.dtype) == "float32"
        return "highest" if float32 and platform != "cpu" else None


#: `ModelSection.matmul_precision`'s values
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Which env, how many episodes per iteration, and the task seed stream.

    name, kwargs: `envs.make(name, **kwargs)`.
    group_size: episodes per task (G; the group of the outcome estimators).
    tasks_per_iteration: tasks per iteration; the rollout batch is their product.
    seed: task `k` of the run has env seed `seed + k`.
    num_workers: `EnvPool` worker processes (0 = in this process).
    step_timeout: seconds one env step may take before its episode fails.
    imports: Python modules imported (in this process and in every env worker) before the
      env is made, so that envs they register (`envs.register`) work from a config.
    max_failed_iterations: stop the run (with the first failure's kind and traceback) after
      this many consecutive iterations in which every episode failed (0 = never stop).
    worker_memory_mb, worker_cpu_s: each env worker's address-space limit and the CPU
      seconds one env call may use (`EnvPool`'s `memory_limit_mb` / `cpu_limit_s`; null =
      none). Past them the episode fails as `memory_limit` / `cpu_limit`, the run goes on.
    """

    name: str = "countdown"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    group_size: int = 4
    tasks_per_iteration: int = 2
    seed: int = 0
    num_workers: int = 1
    step_timeout: float = 30.0
    imports: tuple[str, ...] = ()
    max_failed_iterations: int = 2
    worker_memory_mb: float | None = 16384
    worker_cpu_s: float | None = 300

    def __post_init__(self):
        import envs

        import_env_modules(self.imports)
        _check_int("max_failed_iterations", self.max_failed_iterations, 0)
        for name in ("worker_memory_mb", "worker_cpu_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a number > 0 or null (no limit), got {v!r}")
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


def import_env_modules(modules) -> None:
    """Imports `env.imports` (`envs.import_modules`); an error names the module."""
    import envs

    envs.import_modules(modules)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Episode limits and sampling (`loop_config()` is the `jaxagent.rollout.AgentLoopConfig`).

    max_turns: policy turns per episode at most.
    max_tokens_per_turn: tokens the policy may generate in one turn.
    max_context: tokens per episode (prompt, turns and observations) at most.
    temperature, top_k, top_p: sampling (temperature 0 = greedy; top_k 0 = off).
    pipeline_groups: > 1 splits each rollout into that many sub-batches so that env
      steps of one overlap the device's decoding of another (same trajectories).
    slots: 0 = turn-synchronous (or `pipeline_groups`); S > 0 = continuous scheduling
      with S sampler rows: every episode moves on as soon as its own env step is back,
      and a finished episode's row takes the next episode (same trajectories).
    trim_padding: 0 = the log-prob pass and the update see every row padded to
      `max_context` (they compile once); N > 0 = each iteration's batch is cut to its
      longest episode rounded up to a multiple of N (`jaxagent.rollout.trim_padding`):
      the same losses, computed without the trailing padding, at the cost of one compile
      per distinct length. Worth it when episodes are much shorter than `max_context`.
      With several processes the batches are cut to the longest episode of all of them.
    trim_chunks: with `trim_padding` N > 0, also cut each micro-batch of the update and
      each row chunk of the log-prob pass to its own longest episode (rounded up to a
      multiple of N), the rows grouped by length (`jaxagent.train.trimmed.TrimmedTrainStep`):
      the same losses (the denominators are the mini-batch's), without the padding of
      rows shorter than the batch's longest. Worth it when episode lengths vary; each
      distinct chunk length compiles once. The log-prob pass runs in chunks of
      `logprob_rows` rows, or of the update's micro-batch rows when that is unset. On a
      mesh (one process or several) data * fsdp must divide a micro-batch's rows: each
      cut micro-batch's rows are split over them, and every process cuts the same
      micro-batches from its copy of the batch.
    """

    max_turns: int = 2
    max_tokens_per_turn: int = 32
    max_context: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    pipeline_groups: int = 1
    slots: int = 0
    trim_padding: int = 0
    trim_chunks: bool = False

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "pipeline_groups"):
            _check_int(name, getattr(self, name), 1)
        _check_int("slots", self.slots, 0)
        _check_int("rollout.trim_padding", self.trim_padding, 0)
        if not isinstance(self.trim_chunks, bool):
            raise ValueError(f"rollout.trim_chunks must be true or false, got {self.trim_chunks!r}")
        if self.trim_chunks and not self.trim_padding:
            raise ValueError("rollout.trim_chunks needs rollout.trim_padding > 0 (the multiple its chunk lengths "
                             "are rounded up to), got rollout.trim_padding=0")
        if self.slots and self.pipeline_groups > 1:
            raise ValueError(f"rollout.slots={self.slots} (continuous scheduling) and rollout.pipeline_groups="
                             f"{self.pipeline_groups} are two ways of overlapping env steps; set one")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def sampling(self):
        """The `jaxagent.rollout.SamplingConfig` of these keys."""
        from jaxagent.rollout import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def sampler_rows(self, batch: int) -> int:
        """Rows of the largest sampler state a rollout of `batch` rows decodes at once: a
        pipeline group's (`pipeline_groups`), or the continuous scheduler's `slots`."""
        return min(self.slots, batch) if self.slots else -(-batch // min(self.pipeline_groups, batch))

    def loop_config(self, pad_id: int):
        """The `jaxagent.rollout.AgentLoopConfig` of these keys (trajectories padded with `pad_id`)."""
        from jaxagent.rollout import AgentLoopConfig

        return AgentLoopConfig(max_turns=self.max_turns, max_tokens_per_turn=self.max_tokens_per_turn,
                               max_context=self.max_context, sampling=self.sampling, pad_id=pad_id,
                               pipeline_groups=self.pipeline_groups, slots=self.slots)


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """The advantage estimator (a `jaxagent.algos` registry name) and its constants.

    advantage: a registered estimator (`jaxagent.algos.list_advantage_estimators()`,
      including ones registered by your code) whose declared inputs the trainer
      provides (`PROVIDED_INPUTS`; `jaxagent.algos.get_estimator_spec`). One that
      consumes "values" or "turn_values" (e.g. "gae" = PPO, "turn_gae") makes the
      trainer train a critic (initialised from the policy's trunk with a fresh value
      head) and use the estimator's returns as the value targets (turn-level returns on
      every token of their turn); one that consumes "baselines" ("remax") makes it play
      one greedy episode per task as the baseline.
    gamma, lam: discount and GAE lambda, for estimators that consume them.
    gigpo_step_weight, gigpo_mode: GiGPO's step-group weight and normalisation (its
      `step_weight` and `mode` keyword arguments).
    advantage_kwargs: further keyword arguments of the estimator function (checked
      against its signature).

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
    truncation_penalty: the reward added to a truncated episode's last turn with
      `truncation: penalty`.
    dynamic_sampling: drop groups whose (shaped) returns do not vary and refill the
      batch with new tasks (DAPO), up to `max_sampling_rounds` rollouts per iteration;
      if still short, the batch is completed with groups without signal. Outcome and
      group estimators only.
    max_sampling_rounds: with `dynamic_sampling`, the most rollouts an iteration makes
      to fill its batch with groups whose returns vary.
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
    advantage_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3

    def __post_init__(self):
        spec = self.estimator  # an unknown name lists the registered ones
        if spec.inputs is None:
            raise ValueError(f"advantage: estimator {self.advantage!r} was registered without declaring its inputs; "
                             f"register it with inputs=(...) from {list(algos.ESTIMATOR_INPUTS)}")
        missing = [n for n in spec.consumes if n not in PROVIDED_INPUTS]
        if missing:
            raise ValueError(f"advantage: estimator {self.advantage!r} consumes {missing}, which the trainer does "
                             f"not provide (it provides {list(PROVIDED_INPUTS)})")
        params = inspect.signature(spec.fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k in self.estimator_kwargs:
            if k in spec.consumes or (not takes_any and k not in params):
                raise ValueError(f"advantage_kwargs: {k!r} is not a keyword argument of estimator "
                                 f"{self.advantage!r} that the trainer leaves free (its parameters: {list(params)})")
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
        if self.dynamic_sampling and not self.uses_groups:
            raise ValueError(f"dynamic_sampling needs a group estimator (one that consumes group_ids), "
                             f"got advantage {self.advantage!r}")

    @property
    def estimator(self) -> algos.EstimatorSpec:
        """The registered estimator `advantage` and what it consumes."""
        return algos.get_estimator_spec(self.advantage)

    @property
    def uses_critic(self) -> bool:
        """The estimator consumes the critic's values (the trainer then trains one)."""
        return any(n in CRITIC_INPUTS for n in self.estimator.consumes)

    @property
    def uses_greedy_baseline(self) -> bool:
        """The estimator consumes a greedy episode's return per task ("baselines")."""
        return "baselines" in self.estimator.consumes

    @property
    def uses_groups(self) -> bool:
        """The estimator compares the episodes of a group (needs `group_size >= 2`)."""
        return "group_ids" in self.estimator.consumes

    @property
    def estimator_kwargs(self) -> dict[str, Any]:
        """The estimator's extra keyword arguments: `advantage_kwargs`, and for GiGPO its
        `gigpo_*` keys."""
        extra = {"step_weight": self.gigpo_step_weight, "mode": self.gigpo_mode} if self.advantage == "gigpo" else {}
        return {**extra, **self.advantage_kwargs}


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """Where an episode's reward comes from: the env (its own reward, e.g. intake's
    rubric; `judge: null`) or also a judge (`jaxagent.rewards.judge.make_judge`).

    judge: None, or a judge spec: `{type: openai, base_url, model, api_key_env, prompt,
      timeout_s, retries, max_concurrency, ...}` (an OpenAI-compatible endpoint; the key
      is read from the environment variable `api_key_env` names, never from the config)
      or `{type: callable, fn: "module:function"}` (`fn(item) -> score`), or `{type: local,
      model, max_tokens, batch_size, ...}` (`jaxagent.rewards.LocalJudge`: a local model,
      e.g. a packaged SmolLM2 GGUF, run in process by this package's sampler).
    mode: "replace" (the judge's score is the episode's final reward) or "add" (the env's
      final reward plus `weight` times the score).
    weight: the judge score's weight with `mode: add`.
    on_failure: what a failed judge call (timeout, HTTP error, unreadable reply) does to
      its episode: "drop" (the episode fails, with the judge's failure kind, and is left
      out of the loss) or "env" (it keeps the env's reward). Never the run.
    Held-out evaluations score with the env's own reward: the judge is a training signal.
    """

    judge: dict[str, Any] | None = None
    mode: str = "replace"
    weight: float = 1.0
    on_failure: str = "drop"

    def __post_init__(self):
        if self.judge is not None and not isinstance(self.judge, dict):
            raise ValueError(f"judge must be a mapping (a judge spec) or null, got {self.judge!r}")
        if self.mode not in ("replace", "add"):
            raise ValueError(f"mode must be 'replace' or 'add', got {self.mode!r}")
        if self.on_failure not in ("drop", "env"):
            raise ValueError(f"on_failure must be 'drop' or 'env', got {self.on_failure!r}")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number, got {self.weight!r}")
        if self.mode == "replace" and self.weight != 1.0:
            raise ValueError(f"weight ({self.weight}) applies to mode 'add' only; 'replace' uses the score as is")


#: With `warm_start.conclusions_balance`, the most seeds drawn, as a multiple of
#: `warm_start.conclusions` (the seed range checked against the others is that long).
CONCLUSION_BALANCE_DRAWS = 16


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
    """Supervised fine-tuning on expert demonstrations before RL (`episodes: 0` = none).

    episodes: demonstrations, one per seed `seed, seed + 1, ...` (played with the env's
      expert in this process, `jaxagent.train.warmstart.collect_demonstrations`).
    seed: the first demonstration's env seed.
    expert: keyword arguments of the env's `expert_action` (e.g. intake's weak
      clinician); an option the expert does not take is an error.
    expert_noise: probability that the expert's action at a turn is replaced by a
      uniformly random one of the env's `random_actions` (a deliberately imperfect
      expert; 0 = the expert itself).
    only_successful: train only on demonstrations that succeeded (rejection sampling).
    epochs, batch_size: passes over the demonstrations and rows per `sft_step`.
    length_buckets: batch demonstrations of similar length together and pad each batch
      only to its longest row (rounded up to 64 tokens) instead of every batch to the
      longest demonstration: the same rows in every epoch, fewer padded tokens to compute
      (the loss is a token mean, so padding never changed it; the batches' make-up does).
      Where a demonstration's length goes with what it does (intake: short interviews
      conclude early) each batch teaches one behaviour and SFT fits worse (docs/results/intake.md), so it
      is off by default.
    optim: the SFT optimizer (RL then starts a fresh optimizer from the SFT weights).
    conclusions_seed, conclusions_expert: the first seed and the expert options
      (None = `expert`) of the conclusion demonstrations below.
    conclusions: conclusion demonstrations besides `episodes` (0 = none): one episode per
      seed `conclusions_seed, conclusions_seed + 1, ...` played with `conclusions_expert`
      (None = `expert`), of which SFT trains only the final action (intake: the
      assessment). They teach how to conclude from whatever an episode elicited, on
      episodes the policy is not taught to play: intake's recipe uses them so that a warm
      start that interviews like the weak clinician still reads a longer interview's
      answers (docs/results/intake.md). `only_successful` does not filter them; one whose final action
      is past `rollout.max_context` is dropped (counted in the log and the summary).
    conclusions_skip_tokens: the final action's first tokens that a conclusion
      demonstration does not teach (its end-of-turn token is always taught). They are
      where the policy decides to conclude (intake: `<assessment>` is one token), and a
      conclusion demonstration's episode stops wherever its demonstrator chose: taught,
      they would pull the policy toward concluding at those points (docs/results/intake.md).
    conclusions_balance: a regular expression with one group (e.g. intake's
      `'Triage: (\\w+)'`), or null: the conclusion demonstrations are balanced over the
      values the group takes in their final actions. The classes are those of the first
      `conclusions` seeds; seeds are then drawn on, in order, until every class has
      `conclusions // classes` demonstrations (at most `CONCLUSION_BALANCE_DRAWS` x
      `conclusions` seeds, else an error naming the short class); a final action the
      expression does not match is left out. Where a conclusion is rarely the answer
      (intake: 8% emergent) the warm start otherwise never learns to give it, and RL
      cannot learn an answer the policy never samples (docs/results/intake.md).
    """

    episodes: int = 0
    seed: int = 1_000_000
    expert_noise: float = 0.0
    expert: dict[str, Any] = dataclasses.field(default_factory=dict)
    only_successful: bool = False
    epochs: int = 1
    batch_size: int = 32
    length_buckets: bool = False
    optim: OptimizerConfig = OptimizerConfig(lr=1e-3)
    conclusions: int = 0
    conclusions_seed: int = 1_100_000
    conclusions_expert: dict[str, Any] | None = None
    conclusions_skip_tokens: int = 1
    conclusions_balance: str | None = None

    def __post_init__(self):
        _check_int("episodes", self.episodes, 0)
        if self.conclusions_balance is not None:
            if not isinstance(self.conclusions_balance, str):
                raise ValueError(f"conclusions_balance must be a regular expression with one group (or null), got "
                                 f"{self.conclusions_balance!r}")
            try:
                groups = re.compile(self.conclusions_balance).groups
            except re.error as e:
                raise ValueError(f"conclusions_balance {self.conclusions_balance!r} is not a regular expression: "
                                 f"{e}") from None
            if groups != 1:
                raise ValueError(f"conclusions_balance {self.conclusions_balance!r} must have exactly one group "
                                 f"(the class), it has {groups}")
            if not self.conclusions:
                raise ValueError("conclusions_balance needs conclusions > 0 (it balances the conclusion "
                                 "demonstrations)")
        _check_int("conclusions", self.conclusions, 0)
        _check_int("conclusions_seed", self.conclusions_seed, 0)
        _check_int("conclusions_skip_tokens", self.conclusions_skip_tokens, 0)
        if self.conclusions_expert is not None and not isinstance(self.conclusions_expert, dict):
            raise ValueError(f"conclusions_expert must be a mapping of expert_action keyword arguments (or null "
                             f"for `expert`), got {self.conclusions_expert!r}")
        _check_int("seed", self.seed, 0)
        _check_int("epochs", self.epochs, 1)
        _check_int("batch_size", self.batch_size, 1)
        if not (isinstance(self.expert_noise, (int, float)) and 0.0 <= self.expert_noise <= 1.0):
            raise ValueError(f"expert_noise must be in [0, 1], got {self.expert_noise!r}")
        if not isinstance(self.length_buckets, bool):
            raise ValueError(f"length_buckets must be true or false, got {self.length_buckets!r}")
        if not isinstance(self.expert, dict):
            raise ValueError(f"expert must be a mapping of expert_action keyword arguments, got {self.expert!r}")

    @property
    def enabled(self) -> bool:
        return self.episodes > 0 or self.conclusions > 0


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation (`episodes: 0` = none): seeds `seed, seed + 1, ...`, disjoint
    from the training stream and the demonstrations (checked).

    Run before RL (after any warm start) and after the last iteration; their success
    rates are `success_before_rl` / `success_after_rl` of `<run_dir>/summary.json`, and
    every `every` iterations in between (0 = never) as `eval_*` metrics.

    episodes: held-out episodes per evaluation (0 = no evaluation).
    seed: the first held-out env seed; episode i plays seed `seed + i`.
    every: also evaluate every this many iterations (0 = only before and after RL).
    temperature: sampling temperature of the evaluation (None = `rollout.temperature`;
      0 = greedy).
    greedy: also evaluate with greedy decoding before and after RL (and every `every`
      iterations, as `eval_greedy_*` metrics)
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
    collapse_entropy, collapse_window: print a warning (counted in `collapse_warnings`)
      when the token entropy is below `collapse_entropy` while training success over the
      last `collapse_window` iterations is not above the window before (0 = off).
    template_collapse_below: print a warning (counted in `template_collapse_warnings`)
      when the batch's `input_dependence` (`jaxagent.train.metrics.input_dependence`:
      whether an episode's responses tell which task it played) has stayed below this
      for `collapse_window` iterations: RAGEN-2's template collapse (0 = off).
    heldout_metric: a metric of every iteration that scores the training episodes with
      a scorer the policy is not trained on (e.g. intake's
      `train_env_heldout_rubric_mean`); a warning (counted in `hacking_warnings`) is
      printed when the training reward rose over the last `collapse_window` iterations
      against the window before while this fell (null = off; a name the iterations do
      not have is an error at the run's first iteration, listing the ones they have; an
      iteration without it, e.g. one whose episodes all failed, is skipped).
    episodes_per_iteration, episodes_max_mb: the episode store (`jaxagent.train.episodes`):
      that many episodes of each iteration, with tokens, texts, rewards and per-token
      signals, in `<run_dir>/episodes/` (0 = off), at most `episodes_max_mb` MiB a run
      (past it, evenly spaced iterations are kept: every 2nd, then every 4th, ...).
    trackers: experiment trackers besides TensorBoard that get every scalar
      (`jaxagent.train.trackers`): `wandb` and/or `mlflow` (their extras must be installed).
    wandb_project, wandb_mode: the W&B project, and `offline` (files in
      `<run_dir>/wandb/`, `wandb sync` uploads them) or `online`.
    mlflow_tracking_uri, mlflow_experiment: where MLflow records the run (null: the file
      store `<run_dir>/mlruns`) and under which experiment.
    """

    tensorboard: bool = True
    progress: bool = True
    transcripts_every: int = 1
    transcripts_per_iteration: int = 2
    collapse_entropy: float = 0.05
    collapse_window: int = 3
    template_collapse_below: float = 0.0
    heldout_metric: str | None = None
    episodes_per_iteration: int = 8
    episodes_max_mb: float = 64.0
    trackers: tuple[str, ...] = ()
    wandb_project: str = "jaxagent"
    wandb_mode: str = "offline"
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "jaxagent"

    def __post_init__(self):
        from jaxagent.train.trackers import KNOWN

        object.__setattr__(self, "trackers", tuple(self.trackers))
        for name in self.trackers:
            if name not in KNOWN or name == "tensorboard":
                raise ValueError(f"trackers: unknown tracker {name!r} (known: wandb, mlflow; TensorBoard is "
                                 "logging.tensorboard)")
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers: {list(self.trackers)} names a tracker twice")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"wandb_mode must be 'offline' or 'online', got {self.wandb_mode!r}")
        _check_int("episodes_per_iteration", self.episodes_per_iteration, 0)
        if not (isinstance(self.episodes_max_mb, (int, float)) and not isinstance(self.episodes_max_mb, bool)
                and math.isfinite(self.episodes_max_mb) and self.episodes_max_mb > 0):
            raise ValueError(f"episodes_max_mb must be a number > 0, got {self.episodes_max_mb!r}")
        _check_int("transcripts_every", self.transcripts_every, 0)
        _check_int("transcripts_per_iteration", self.transcripts_per_iteration, 0)
        _check_int("collapse_window", self.collapse_window, 1)
        if not (isinstance(self.collapse_entropy, (int, float)) and not isinstance(self.collapse_entropy, bool)
                and math.isfinite(self.collapse_entropy) and self.collapse_entropy >= 0):
            raise ValueError(f"collapse_entropy must be a number >= 0, got {self.collapse_entropy!r}")
        if not (isinstance(self.template_collapse_below, (int, float))
                and not isinstance(self.template_collapse_below, bool)
                and 0 <= self.template_collapse_below <= 1):
            raise ValueError(f"template_collapse_below must be a number in [0, 1], got "
                             f"{self.template_collapse_below!r}")
        if self.heldout_metric is not None and not (isinstance(self.heldout_metric, str) and self.heldout_metric):
            raise ValueError(f"heldout_metric must be a metric name or null, got {self.heldout_metric!r}")


OLD_LOGPROBS = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Everything a training run needs; load with `jaxagent.config.load_config`.

    critic_optim: the critic's optimizer (`OptimizerConfig`), for estimators that train
      one (e.g. "gae", "turn_gae"); None = the same settings as `optim`.
    loss, optim, critic_optim: `jaxagent.train.LossConfig` / `OptimizerConfig` (the
      critic's defaults to `optim`). `loss.temperature` must equal a non-zero
      `rollout.temperature` (the log-probs are those of the sampling distribution).
    epochs, mini_batches, micro_batches: each iteration's batch of
      `env.group_size * env.tasks_per_iteration` episodes is shuffled and cut into
      `mini_batches` updates, `epochs` times; each mini-batch is accumulated over
      `micro_batches` micro-batches.
    logprob_rows: rows per pass of the log-prob computations over an iteration's batch
      (old policy, KL reference); None = the whole batch in one pass. The passes run in
      turn, so their memory is that of `logprob_rows` rows: set it (a divisor of the batch,
      e.g. the update's micro-batch rows) when the memory check says the log-prob pass
      does not fit. Values agree with one pass to float32 rounding.
    old_logprobs: where the update's old-policy log-probs come from. "recompute" (the
      default): a forward pass of the trainer over the batch before the update, with the
      params that sampled it. "sampler": the sampler's own log-probs of the tokens it drew
      (`rollout_logp`), which are those of the same params and distribution up to float
      rounding (the `rollout_logp_gap` metric of a "recompute" run shows how close), so
      the log-prob pass is skipped: one forward pass over the batch less per iteration.
      It needs untruncated sampling (`rollout.top_k` 0, `rollout.top_p` 1) and no
      `loss.tis_cap` (whose weights compare the two).
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
      the device does not report it; None = on CPU devices the host's available RAM
      shared by the local devices, elsewhere no check.
    overlap: one-step off-policy rollout/update overlap (`OverlapSection`; off by default).
    jit_cache_dir: JAX's persistent compilation cache, so that a resumed run or the next
      run of the same shapes skips XLA's compilation: "auto" (the default) =
      `$XDG_CACHE_HOME/jaxagent/jit` (else `~/.cache/jaxagent/jit`), a path, or null = off.
      Left alone when `$JAX_COMPILATION_CACHE_DIR` is set or the process already set
      `jax_compilation_cache_dir`.
    """

    model: ModelSection = ModelSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    algo: AlgoSection = AlgoSection()
    warm_start: WarmStartSection = WarmStartSection()
    reward: RewardSection = RewardSection()
    eval: EvalSection = EvalSection()
    loss: LossConfig = LossConfig()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    logprob_rows: int | None = None
    old_logprobs: str = "recompute"
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
    jit_cache_dir: str | None = "auto"

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "micro_batches", "iterations", "checkpoint_every",
                     "keep_checkpoints"):
            _check_int(name, getattr(self, name), 1)
        if self.jit_cache_dir is not None and (not isinstance(self.jit_cache_dir, str) or not self.jit_cache_dir):
            raise ValueError(f"jit_cache_dir must be \"auto\", a directory or null (off), got {self.jit_cache_dir!r}")
        _check_int("seed", self.seed, 0)
        B = self.env.batch_size
        if B % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the rollout batch "
                             f"env.group_size * env.tasks_per_iteration = {B}")
        if (B // self.mini_batches) % self.micro_batches:
            raise ValueError(f"micro_batches ({self.micro_batches}) must divide the mini-batch size "
                             f"{B // self.mini_batches}")
        if self.logprob_rows is not None:
            _check_int("logprob_rows", self.logprob_rows, 1)
            if B % self.logprob_rows:
                raise ValueError(f"logprob_rows ({self.logprob_rows}) must divide the rollout batch "
                                 f"env.group_size * env.tasks_per_iteration = {B}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {list(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        if self.old_logprobs == "sampler":
            refused = [
                (self.rollout.temperature == 0, "rollout.temperature is 0 (greedy decoding has no sampling distribution)"),
                (self.rollout.top_k > 0, f"rollout.top_k is {self.rollout.top_k} (truncated sampling)"),
                (self.rollout.top_p < 1, f"rollout.top_p is {self.rollout.top_p} (truncated sampling)"),
                (self.loss.tis_cap is not None,
                 "loss.tis_cap is set (its weights compare the sampler's log-probs with recomputed ones)"),
            ]
            why = next((reason for bad, reason in refused if bad), None)
            if why:
                raise ValueError(f"old_logprobs='sampler' takes the sampler's log-probs as the old policy's, "
                                 f"but {why}; use old_logprobs='recompute'")
        if self.rollout.temperature > 0 and self.loss.temperature != self.rollout.temperature:
            raise ValueError(f"loss.temperature ({self.loss.temperature}) must equal rollout.temperature "
                             f"({self.rollout.temperature}): the update's log-probs are the sampler's")
        if self.algo.uses_groups and self.env.group_size < 2:
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
                  "warm_start.conclusions_seed (conclusion demonstrations)": (
                      self.warm_start.conclusions_seed,
                      self.warm_start.conclusions * (CONCLUSION_BALANCE_DRAWS if self.warm_start.conclusions_balance
                                                     else 1)),
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
                          num_micro_batches=self.micro_batches, remat=self.model.remat,
                          compute_dtype=self.model.compute_dtype)

