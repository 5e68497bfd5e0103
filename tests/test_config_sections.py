"""The run config's sections (`jaxagent.train.config`): every declared bound is checked
when a section is built, whichever way; the update's temperature is the rollout's (no
`loss.temperature`); `overlap.max_staleness` is gone; `rollout:` builds the agent loop's
config from its fields by name."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from jaxagent.dataclass_yaml import ConfigError, declared_bounds, dump_yaml, load_config, to_dict
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.rollout import RolloutSection
from jaxagent.train.config.step import LossConfig, LossSection, StepConfig


def _config_classes() -> list[type]:
    """Every config dataclass of the run: `TrainerConfig`, its sections and what they nest,
    and the jitted step's `StepConfig` / `LossConfig`."""
    seen: list[type] = []
    todo = [TrainerConfig, StepConfig, LossConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            for option in (tp, *typing.get_args(tp)):
                if isinstance(option, type) and dataclasses.is_dataclass(option):
                    todo.append(option)
    return seen


def _outside(bound, kind):
    """A value of type `kind` just outside `bound`."""
    if bound.ge is not None:
        return kind(bound.ge - 1)
    if bound.gt is not None:
        return kind(bound.gt)
    if bound.le is not None:
        return kind(bound.le + 1)
    return float("inf")


BOUNDED = [(cls, name, bound, kind) for cls in _config_classes() for name, bound, kind, _ in declared_bounds(cls)]


def test_the_simple_bounds_are_declared_and_there_are_many():
    assert len(BOUNDED) >= 60
    assert {cls.__name__ for cls, *_ in BOUNDED} >= {"ModelSection", "EnvSection", "RolloutSection", "LossConfig"}


@pytest.mark.parametrize("cls, name, bound, kind", BOUNDED, ids=[f"{c.__name__}.{n}" for c, n, *_ in BOUNDED])
def test_every_declared_bound_refuses_a_value_outside_it(cls, name, bound, kind):
    """Built directly (as tests and code do), a section refuses a value outside a field's
    bound with an error naming the key and the bound: no section's `__post_init__` skips
    the check (`super().__post_init__()`). Bools are not ints."""
    bad = _outside(bound, kind)
    with pytest.raises(ValueError, match=rf"^{name} must be (an int|a number|a finite number)\b.*, got "):
        cls(**{name: bad})
    if kind is int:
        with pytest.raises(ValueError, match=rf"^{name} must be an int .*, got True$"):
            cls(**{name: True})


def test_bound_errors_from_a_config_name_the_section_key_and_bound():
    cases = {
        "model.num_layers=0": r"model: num_layers must be an int >= 1, got 0",
        "model.tokenizer_vocab_size=258": r"model: tokenizer_vocab_size must be an int >= 259, got 258",
        "env.step_timeout=0": r"env: step_timeout must be a finite number of seconds > 0, got 0.0",
        "env.worker_memory_mb=0": r"env: worker_memory_mb must be a finite number > 0 or null, got 0.0",
        "rollout.top_p=0": r"rollout: top_p must be a number in \(0, 1\], got 0.0",
        "rollout.temperature=-1": r"rollout: temperature must be a finite number >= 0, got -1.0",
        "algo.gamma=1.5": r"algo: gamma must be a number in \[0, 1\], got 1.5",
        "algo.reward_scale=inf": r"algo: reward_scale must be a finite number, got inf",
        "loss.clip_c=1": r"loss: clip_c must be a finite number > 1 or null, got 1.0",
        "optim.b2=2": r"optim: b2 must be a number in \[0, 1\], got 2.0",
        "update.logprob_rows=0": r"update: logprob_rows must be an int >= 1 or null, got 0",
        "eval.temperature=-0.5": r"eval: temperature must be a finite number >= 0 or null, got -0.5",
        "iterations=0": r"config: iterations must be an int >= 1, got 0",
        "device_memory_gb=-1": r"config: device_memory_gb must be a finite number > 0 or null, got -1.0",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=f"^{message}$"):
            load_config(TrainerConfig, None, [override])


# ---------------------------------------------------------------- loss.temperature


def test_the_update_computes_its_log_probs_at_the_rollout_temperature():
    for rollout, update in ((1.0, 1.0), (0.7, 0.7), (1.3, 1.3), (0.0, 1.0)):  # greedy: temperature 1, as before
        cfg = load_config(TrainerConfig, None, [f"rollout.temperature={rollout}"])
        assert type(cfg.loss) is LossSection
        sc = cfg.step_config
        assert type(sc.loss) is LossConfig and sc.loss.temperature == update
        assert {f.name: getattr(sc.loss, f.name) for f in dataclasses.fields(cfg.loss)} == to_dict(cfg.loss)
    cfg = load_config(TrainerConfig, None, ["loss.kl_coef=0.1", "loss.tis_cap=2.0", "rollout.temperature=0.5"])
    assert (cfg.step_config.loss.kl_coef, cfg.step_config.loss.tis_cap) == (0.1, 2.0)
    assert "temperature" not in to_dict(cfg)["loss"] and "loss.temperature" not in dump_yaml(cfg)


def test_loss_temperature_is_refused_naming_rollout_temperature(tmp_path):
    message = r"config key loss.temperature moved to rollout.temperature: set rollout.temperature instead"
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temperature: 0.7\nloss:\n  policy_loss: ppo\n  temperature: 0.7\n")
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, path)
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, None, ["loss.temperature=0.7"])
    # the config.yaml of a run from before: it resumes, at its rollout's temperature
    assert load_config(TrainerConfig, path, saved=True).step_config.loss.temperature == 0.7
    # a LossConfig (the step's, with a temperature) is not the loss section
    with pytest.raises(ValueError, match="loss must be a LossSection .* rollout.temperature"):
        TrainerConfig(loss=LossConfig(temperature=0.7))


# ---------------------------------------------------------------- overlap.max_staleness


def test_overlap_max_staleness_is_gone(tmp_path):
    with pytest.raises(ConfigError, match=r"config key overlap.max_staleness was removed: .*one update"):
        load_config(TrainerConfig, None, ["overlap.max_staleness=1"])
    saved = to_dict(TrainerConfig())
    saved["overlap"]["max_staleness"] = 1  # as a run's config.yaml said it before
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert load_config(TrainerConfig, path, saved=True) == TrainerConfig()
    assert "max_staleness" not in to_dict(TrainerConfig())["overlap"]
    assert TrainerConfig().agent.max_staleness == 1  # the agent program's bound is another key


# ---------------------------------------------------------------- rollout


def test_every_rollout_key_is_a_field_of_the_agent_loop_or_its_sampling_config():
    """`RolloutSection` builds `AgentLoopConfig` and `SamplingConfig` from its fields by
    name: each key must be a field of one of them, of the same type, or it would be lost."""
    from jaxagent.rollout import AgentLoopConfig, SamplingConfig

    section = typing.get_type_hints(RolloutSection)
    targets = {cls: typing.get_type_hints(cls) for cls in (AgentLoopConfig, SamplingConfig)}
    for f in dataclasses.fields(RolloutSection):
        owners = [cls for cls, hints in targets.items() if f.name in hints]
        assert len(owners) == 1, f"rollout.{f.name} is a field of {owners}"
        assert targets[owners[0]][f.name] == section[f.name], f.name
    rollout = RolloutSection(
        max_turns=3, max_tokens_per_turn=7, max_context=99, temperature=0.5, top_k=4, top_p=0.9, slots=2
    )
    loop = rollout.loop_config(pad_id=5)
    assert loop.sampling == SamplingConfig(temperature=0.5, top_k=4, top_p=0.9)
    assert (loop.max_turns, loop.max_tokens_per_turn, loop.max_context, loop.slots, loop.pad_id) == (3, 7, 99, 2, 5)
    assert loop.pipeline_groups == 1
