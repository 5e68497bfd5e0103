"""The update's static settings: `OptimizerConfig` (AdamW, its schedule and clipping),
`LossConfig` (what the RL update minimises: the run config's `loss:` keys, `LossSection`,
and the temperature of the log-probs, which is the rollout's) and `StepConfig`, which
embeds both and is the static argument of the jitted steps (`jaxagent.train.update`).
Each validates itself on construction; frozen, so hashable.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

from jaxagent import algos
from jaxagent.dataclass_yaml import Bound, Bounded

SCHEDULES = ("constant", "cosine", "linear")


TIS_LEVELS = ("token", "sequence")


#: `LossConfig.kl_turns`: the policy tokens the KL term covers.
KL_TURNS = ("all", "last")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Bounded):
    """AdamW with linear warm-up, a decay schedule and global-norm clipping.

    Learning rate at update `s` (0-based count of *applied* updates), `W = warmup_steps`,
    `S = total_steps`, `r = final_lr_ratio`::

        warm(s) = min(1, (s + 1) / W)                (1 when W = 0; the first update is not wasted at lr 0)
        p(s)    = clip((s - W) / (S - W), 0, 1)
        constant: lr * warm(s)
        linear:   lr * warm(s) * (1 - (1 - r) p(s))
        cosine:   lr * warm(s) * (r + (1 - r) (1 + cos(pi p(s))) / 2)

    Weight decay (decoupled, AdamW) applies to kernels, embeddings and LoRA adapters,
    not to norm scales or biases. `max_grad_norm=None` turns clipping off.

    lr: the learning rate after the warm-up (the peak of a decaying schedule).
    warmup_steps: `W`, updates of linear warm-up (0 = none).
    schedule: "constant", "linear" or "cosine": the decay after the warm-up.
    total_steps: `S`, the update at which a linear or cosine decay ends (an int greater
      than `warmup_steps`; None only with "constant").
    final_lr_ratio: `r`, the decayed rate as a fraction of `lr`, in [0, 1].
    weight_decay: AdamW's decoupled weight decay (0 = none).
    b1, b2, eps: Adam's moment decay rates and denominator constant.
    max_grad_norm: clip the gradient to this global norm (None = no clipping).
    """

    lr: Annotated[float, Bound(ge=0)] = 1e-6
    warmup_steps: Annotated[int, Bound(ge=0)] = 0
    schedule: str = "constant"
    total_steps: int | None = None
    final_lr_ratio: Annotated[float, Bound(ge=0, le=1)] = 0.0
    weight_decay: Annotated[float, Bound(ge=0)] = 0.0
    b1: Annotated[float, Bound(ge=0, le=1)] = 0.9
    b2: Annotated[float, Bound(ge=0, le=1)] = 0.999
    eps: Annotated[float, Bound(ge=0)] = 1e-8
    max_grad_norm: Annotated[float | None, Bound(gt=0)] = 1.0

    def __post_init__(self):
        super().__post_init__()
        n = "OptimizerConfig"
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{n}.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "constant" and (
            not isinstance(self.total_steps, int) or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"{n}.total_steps must be an int > warmup_steps ({self.warmup_steps}) for the "
                f"{self.schedule!r} schedule, got {self.total_steps!r}"
            )


@dataclasses.dataclass(frozen=True)
class LossSection(Bounded):
    """What the RL update minimises (the formulas: `jaxagent.train.update.losses`): the
    run config's `loss:` keys. The jitted step's `LossConfig` is these and the temperature
    of the log-probs, `rollout.temperature` (`TrainerConfig.step_config`).

    policy_loss: a name registered in `jaxagent.algos` ("ppo", "gspo", "cispo", ...).
    agg_mode, clip_low, clip_high: None = that loss's own default (PPO: token-mean,
      0.2/0.2; GSPO: seq-mean-token-mean, 3e-4/4e-4). The KL and entropy terms use the
      same aggregation mode.
    clip_c: dual-clip constant (> 1) for losses that take it (PPO); None = off.
    kl_coef, kl_kind: KL-to-reference loss term (`algos.kl` kinds: k1, abs, k2, k3 and
      their "+" straight-through forms); needs `ref_logp` in the batch when kl_coef > 0.
    kl_turns: the policy tokens the KL term covers: "all", or "last" (each episode's
      last policy turn alone, e.g. intake's assessment; the trainer builds the batch's
      `kl_mask` from the turn ids, and the step requires it).
    entropy_coef: entropy bonus (subtracted from the loss).
    tis_cap, tis_level: truncated importance-sampling weights
      `min(exp(old_logp - rollout_logp), cap)` (`algos.tis_weights`) multiplied into the
      policy loss; None = off. Needs `rollout_logp` in the batch.
    seq_len_norm: the constant T of "seq-mean-token-sum-norm" (None = padded length).
    value_clip, value_agg_mode: the critic's clipped value loss.
    """

    policy_loss: str = "ppo"
    agg_mode: str | None = None
    clip_low: Annotated[float | None, Bound(ge=0)] = None
    clip_high: Annotated[float | None, Bound(ge=0)] = None
    clip_c: Annotated[float | None, Bound(gt=1)] = 3.0
    kl_coef: Annotated[float, Bound(ge=0)] = 0.0
    kl_kind: str = "k3"
    kl_turns: str = "all"
    entropy_coef: Annotated[float, Bound(ge=0)] = 0.0
    tis_cap: Annotated[float | None, Bound(gt=0)] = None
    tis_level: str = "token"
    seq_len_norm: Annotated[int | None, Bound(ge=1)] = None
    value_clip: Annotated[float, Bound(ge=0)] = 0.5
    value_agg_mode: str = "token-mean"

    #: keys that moved to another section: old key -> new dotted key (`load_config` names the new one)
    MOVED_KEYS: ClassVar[dict[str, str]] = {"temperature": "rollout.temperature"}

    def __post_init__(self):
        super().__post_init__()
        n = type(self).__name__
        algos.get_policy_loss(self.policy_loss)  # raises naming the known losses
        for name in ("agg_mode", "value_agg_mode"):
            v = getattr(self, name)
            if v is not None and v not in algos.AGG_MODES:
                raise ValueError(f"{n}.{name} must be one of {list(algos.AGG_MODES)}, got {v!r}")
        kind = self.kl_kind.removesuffix("+")
        if kind not in algos.KL_KINDS:
            raise ValueError(
                f"{n}.kl_kind must be one of {list(algos.KL_KINDS)} (optionally with '+'), got {self.kl_kind!r}"
            )
        if self.kl_turns not in KL_TURNS:
            raise ValueError(f"{n}.kl_turns must be one of {list(KL_TURNS)}, got {self.kl_turns!r}")
        if self.kl_turns != "all" and not self.kl_coef:
            raise ValueError(f"{n}.kl_turns={self.kl_turns!r} places the KL loss term, which is off: set kl_coef > 0")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"{n}.tis_level must be one of {list(TIS_LEVELS)}, got {self.tis_level!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig(LossSection):
    """The update's loss as the jitted step takes it: the `loss:` keys (`LossSection`) and
    the temperature of its log-probs.

    temperature: the temperature the update's log-probs are computed at: the sampler's,
      so that they are those of the distribution the rollout sampled from
      (`TrainerConfig.step_config` sets `rollout.temperature`, 1 for a greedy rollout).
    """

    temperature: Annotated[float, Bound(gt=0)] = 1.0

    MOVED_KEYS: ClassVar[dict[str, str]] = {}  # a field here, not a key of the run config


@dataclasses.dataclass(frozen=True)
class StepConfig(Bounded):
    """Everything static about an update (hashable: a static argument of the jitted steps).

    loss, optim: what is minimised and how the parameters move.
    critic_optim: the critic's optimizer (None = the same as `optim`).
    num_micro_batches: the mini-batch's rows are cut into this many equal micro-batches
      whose gradients are accumulated (memory, not maths: the result is the same).
    remat, seq_chunk, vocab_chunk: forwarded to the model (`token_logprobs`).
    compute_dtype: the forward passes run on the params cast to this dtype (None = the
      params' own): mixed precision with float32 params and "bfloat16". Gradients,
      updates and the optimizer state keep the params' dtype.
    """

    loss: LossConfig = LossConfig()
    optim: OptimizerConfig = OptimizerConfig()
    critic_optim: OptimizerConfig | None = None
    num_micro_batches: Annotated[int, Bound(ge=1)] = 1
    remat: bool | str = False
    seq_chunk: Annotated[int, Bound(ge=1)] = 128
    vocab_chunk: Annotated[int, Bound(ge=1)] = 8192
    compute_dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"StepConfig.compute_dtype must be None, 'float32' or 'bfloat16', got {self.compute_dtype!r}"
            )
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(f"StepConfig.remat must be False, True, 'full' or 'dots', got {self.remat!r}")

    @property
    def critic_optimizer(self) -> OptimizerConfig:
        return self.optim if self.critic_optim is None else self.critic_optim
