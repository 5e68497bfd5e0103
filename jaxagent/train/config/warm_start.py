"""The run config's `warm_start:` section: SFT on expert demonstrations before RL
(`WarmStartSection`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any, ClassVar

from jaxagent.dataclass_yaml import Bound, Bounded
from jaxagent.train.config.step import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class WarmStartSection(Bounded):
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

    episodes: Annotated[int, Bound(ge=0)] = 0
    seed: Annotated[int, Bound(ge=0)] = 1_000_000
    expert_noise: Annotated[float, Bound(ge=0, le=1)] = 0.0
    expert: dict[str, Any] = dataclasses.field(default_factory=dict)
    only_successful: bool = False
    epochs: Annotated[int, Bound(ge=1)] = 1
    batch_size: Annotated[int, Bound(ge=1)] = 32
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
        super().__post_init__()
        if self.extra is not None:
            _ = self.source  # builds it: a bad source or option fails here, naming it
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
    from jaxagent.specs import resolve_spec

    if not isinstance(spec, dict) or "source" not in spec:
        raise ValueError(
            f"extra must be a mapping with a `source: module:Class` key and its options (or null), got {spec!r}"
        )
    name, options = spec["source"], {k: v for k, v in spec.items() if k != "source"}
    obj = resolve_spec(name, "extra.source", form="module:Class")
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
