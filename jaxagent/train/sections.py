"""The run config's sections of what is trained and how it is collected: `ModelSection`,
`EnvSection`, `RolloutSection`, `AlgoSection`, `RewardSection`, `WarmStartSection`
(`jaxagent.train.config` embeds them in `TrainerConfig` and re-exports them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, ClassVar

from jaxagent import algos
from jaxagent.models import LoraConfig
from jaxagent.train.step_config import OptimizerConfig

#: the estimator inputs (`jaxagent.algos.ESTIMATOR_INPUTS`) the trainer provides: "values"
#: and "turn_values" (the critic's value at each token / at each turn's first policy
#: token) make it build and train a critic; "baselines" makes it play one greedy episode
#: per task (ReMax: the greedy episode's shaped return is its group's baseline).
PROVIDED_INPUTS = (
    "rewards",
    "mask",
    "group_ids",
    "values",
    "turn_rewards",
    "turn_mask",
    "anchor_ids",
    "turn_values",
    "baselines",
    "gamma",
    "lam",
)
#: inputs that come from the critic (consuming one makes the trainer train a critic)
CRITIC_INPUTS = ("values", "turn_values")
MODEL_TYPES = ("qwen2", "llama", "qwen3")
TRUNCATION_MODES = ("keep", "filter", "penalty")
#: config keys a resumed run may not change: they define the policy, the task stream
#: and whether there is a critic (everything else, e.g. `iterations` or `optim.lr`, may change)
RESUME_FIXED = (
    "model",
    "env.name",
    "env.kwargs",
    "env.group_size",
    "env.tasks_per_iteration",
    "env.seed",
    "agent.program",
    "agent.tasks",
    "algo.advantage",
)


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy: a checkpoint (`path`) or a small decoder trained from scratch.

    path: a Hugging Face directory, a `.gguf` file or a packaged model name
      (`jaxagent.models.load_pretrained`); None = from scratch with the fields below.
    tokenizer: "byte" (the in-memory byte-level ChatML tokenizer of
      `jaxagent.models.byte_tokenizer`), "bpe" (a byte-level BPE of `tokenizer_vocab_size`
      tokens trained on the env's text, `jaxagent.models.tokenizer_training.train_bpe_tokenizer`:
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
            raise ValueError(
                f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {self.matmul_precision!r}"
            )
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(f"remat must be false, true, 'full' or 'dots', got {self.remat!r}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), 1)
        _check_int("tokenizer_vocab_size", self.tokenizer_vocab_size, 259)
        if self.tokenizer_pieces not in ("words", "lines", "phrases"):
            raise ValueError(f"tokenizer_pieces must be 'words', 'lines' or 'phrases', got {self.tokenizer_pieces!r}")
        if self.tokenizer == "bpe" and self.path is not None:
            raise ValueError(
                "tokenizer 'bpe' is for models trained from scratch; a checkpoint (path) brings its own tokenizer"
            )
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
    """

    max_turns: int = 2
    max_tokens_per_turn: int = 32
    max_context: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    pipeline_groups: int = 1
    slots: int = 0

    #: keys that moved to another section: old key -> new dotted key (`load_config` names the new one)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"trim_padding": "update.trim_padding", "trim_chunks": "update.trim_chunks"}

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_context", "pipeline_groups"):
            _check_int(name, getattr(self, name), 1)
        _check_int("slots", self.slots, 0)
        if self.slots and self.pipeline_groups > 1:
            raise ValueError(
                f"rollout.slots={self.slots} (continuous scheduling) and rollout.pipeline_groups="
                f"{self.pipeline_groups} are two ways of overlapping env steps; set one"
            )
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

        return AgentLoopConfig(
            max_turns=self.max_turns,
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_context=self.max_context,
            sampling=self.sampling,
            pad_id=pad_id,
            pipeline_groups=self.pipeline_groups,
            slots=self.slots,
        )


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
            raise ValueError(
                f"advantage: estimator {self.advantage!r} was registered without declaring its inputs; "
                f"register it with inputs=(...) from {list(algos.ESTIMATOR_INPUTS)}"
            )
        missing = [n for n in spec.consumes if n not in PROVIDED_INPUTS]
        if missing:
            raise ValueError(
                f"advantage: estimator {self.advantage!r} consumes {missing}, which the trainer does "
                f"not provide (it provides {list(PROVIDED_INPUTS)})"
            )
        params = inspect.signature(spec.fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k in self.estimator_kwargs:
            if k in spec.consumes or (not takes_any and k not in params):
                raise ValueError(
                    f"advantage_kwargs: {k!r} is not a keyword argument of estimator "
                    f"{self.advantage!r} that the trainer leaves free (its parameters: {list(params)})"
                )
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.gigpo_mode not in algos.advantages.GIGPO_MODES:
            raise ValueError(f"gigpo_mode must be one of {list(algos.advantages.GIGPO_MODES)}, got {self.gigpo_mode!r}")
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
            raise ValueError(
                f"dynamic_sampling needs a group estimator (one that consumes group_ids), "
                f"got advantage {self.advantage!r}"
            )

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
    extra: more demonstrations from a source the env or a recipe provides, or null:
      `{source: "module:Class", ...options}`; the class is called with the options and
      gives an object with `seeds()` (its first seed and how many seeds it may play,
      checked against the run's other seed ranges), `rows` (how many demonstrations, at
      most) and `collect(play, log)` (`play(seeds, *, expert=None, final_only=False,
      skip_final=0)` plays this run's env with its expert; `final_only`: SFT trains on a
      demonstration's final action alone, less its first `skip_final` tokens). The
      intake recipe's conclusion demonstrations are one (`envs.intake.demonstrations`).
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
    extra: dict[str, Any] | None = None

    #: keys replaced by a demonstration source (`extra`): old key -> what to set instead
    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        name: f"warm_start.extra: {{source: envs.intake.demonstrations:Conclusions, {new}: ...}}"
        for name, new in (
            ("conclusions", "n"),
            ("conclusions_seed", "seed"),
            ("conclusions_expert", "expert"),
            ("conclusions_skip_tokens", "skip_tokens"),
            ("conclusions_balance", "balance"),
        )
    }

    def __post_init__(self):
        _check_int("episodes", self.episodes, 0)
        if self.extra is not None:
            _ = self.source  # builds it: a bad source or option fails here, naming it
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
        return self.episodes > 0 or self.extra is not None

    @functools.cached_property
    def source(self) -> Any:
        """The object `extra` names (None without one)."""
        return None if self.extra is None else demonstration_source(self.extra)

    @property
    def rows(self) -> int:
        """How many demonstrations the warm start trains on, at most."""
        return self.episodes + (self.source.rows if self.source is not None else 0)


def demonstration_source(spec: Any) -> Any:
    """The object a `warm_start.extra` mapping names: `spec["source"]` ("module:Class")
    imported and called with the mapping's other keys; errors name what is wrong."""
    import importlib

    if not isinstance(spec, dict) or "source" not in spec:
        raise ValueError(
            f"extra must be a mapping with a `source: module:Class` key and its options (or null), got {spec!r}"
        )
    name, options = spec["source"], {k: v for k, v in spec.items() if k != "source"}
    if not isinstance(name, str) or name.count(":") != 1:
        raise ValueError(f"extra.source must be 'module:Class', got {name!r}")
    module, attr = name.split(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"extra.source {name!r}: cannot import {module!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"extra.source {name!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"extra.source {name!r} is not callable")
    try:
        source = obj(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra ({name}): {e}") from None
    for method in ("seeds", "collect"):
        if not callable(getattr(source, method, None)):
            raise ValueError(
                f"extra.source {name!r} gives {type(source).__name__}, which has no {method}() "
                "(a demonstration source has seeds(), rows and collect(play, log))"
            )
    rows, seeds = getattr(source, "rows", None), source.seeds()

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not count(rows):
        raise ValueError(f"extra.source {name!r}: its rows must be an integer >= 0, got {rows!r}")
    if not (isinstance(seeds, tuple) and len(seeds) == 2 and all(map(count, seeds))):
        raise ValueError(
            f"extra.source {name!r}: its seeds() must be (first seed, how many), two integers >= 0, got {seeds!r}"
        )
    return source
