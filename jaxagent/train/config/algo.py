"""The run config's `algo:` and `reward:` sections: the advantage estimator and reward
shaping (`AlgoSection`), and an LLM judge's reward (`RewardSection`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated, Any

from jaxagent import algos
from jaxagent.dataclass_yaml import Bound, Bounded
from jaxagent.train.config.rollout import TRUNCATION_MODES

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


@dataclasses.dataclass(frozen=True)
class AlgoSection(Bounded):
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
    gamma: Annotated[float, Bound(ge=0, le=1)] = 1.0
    lam: Annotated[float, Bound(ge=0, le=1)] = 1.0
    gigpo_step_weight: float = 1.0
    gigpo_mode: str = "mean_norm"
    reward_scale: Annotated[float, Bound()] = 1.0
    reward_clip: Annotated[float | None, Bound(gt=0)] = None
    truncation: str = "keep"
    truncation_penalty: Annotated[float, Bound()] = -1.0
    kl_reward_coef: Annotated[float, Bound(ge=0)] = 0.0
    kl_reward_kind: str = "k1"
    advantage_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    dynamic_sampling: bool = False
    max_sampling_rounds: Annotated[int, Bound(ge=1)] = 3

    def __post_init__(self):
        super().__post_init__()
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
        if self.gigpo_mode not in algos.advantages.GIGPO_MODES:
            raise ValueError(f"gigpo_mode must be one of {list(algos.advantages.GIGPO_MODES)}, got {self.gigpo_mode!r}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {list(TRUNCATION_MODES)}, got {self.truncation!r}")
        if self.kl_reward_kind.removesuffix("+") not in algos.KL_KINDS:
            raise ValueError(f"kl_reward_kind must be one of {list(algos.KL_KINDS)}, got {self.kl_reward_kind!r}")
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
class RewardSection(Bounded):
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
    weight: Annotated[float, Bound()] = 1.0
    on_failure: str = "drop"

    def __post_init__(self):
        super().__post_init__()
        if self.judge is not None and not isinstance(self.judge, dict):
            raise ValueError(f"judge must be a mapping (a judge spec) or null, got {self.judge!r}")
        if self.mode not in ("replace", "add"):
            raise ValueError(f"mode must be 'replace' or 'add', got {self.mode!r}")
        if self.on_failure not in ("drop", "env"):
            raise ValueError(f"on_failure must be 'drop' or 'env', got {self.on_failure!r}")
        if self.mode == "replace" and self.weight != 1.0:
            raise ValueError(f"weight ({self.weight}) applies to mode 'add' only; 'replace' uses the score as is")
