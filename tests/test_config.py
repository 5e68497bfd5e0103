"""Typed configs from YAML + dotted overrides: values, and the errors users see."""

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import pytest

from jaxagent.dataclass_yaml import (
    Bound,
    Bounded,
    ConfigError,
    config_keys,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
)


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"


@dataclass(frozen=True)
class Env:
    name: str
    max_turns: int = 8
    stop: tuple[str, ...] = ()
    kwargs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class Run:
    env: Env
    optim: Optim = Optim()
    seed: int = 0
    use_lora: bool = False
    run_dir: str | None = None


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides_build_the_typed_tree(tmp_path):
    path = _yaml(tmp_path, "env:\n  name: sokoban\n  stop: ['</a>']\noptim:\n  lr: 0.001\n")
    cfg = load_config(
        Run,
        path,
        [
            "optim.lr=1e-5",
            "env.max_turns=3",
            "use_lora=true",
            "env.kwargs={size: 6}",
            "run_dir=null",
            "optim.schedule=cosine",
        ],
    )
    assert cfg == Run(
        env=Env("sokoban", 3, ("</a>",), {"size": 6}), optim=Optim(lr=1e-5, schedule="cosine"), use_lora=True
    )
    assert isinstance(cfg.optim.lr, float) and isinstance(cfg.env.stop, tuple)


def test_int_is_accepted_for_float_but_nothing_else_is_converted():
    assert from_dict(Run, {"env": {"name": "x"}, "optim": {"lr": 1}}).optim.lr == 1.0
    with pytest.raises(ConfigError, match=r"optim.lr: expected float, got str '0.1'"):
        from_dict(Run, {"env": {"name": "x"}, "optim": {"lr": "0.1"}})
    with pytest.raises(ConfigError, match=r"seed: expected int, got bool"):
        from_dict(Run, {"env": {"name": "x"}, "seed": True})


def test_unknown_key_names_the_path_and_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rat'.*valid keys of optim: lr"):
        load_config(Run, _yaml(tmp_path, "env: {name: a}\noptim: {learning_rat: 1.0}\n"))
    with pytest.raises(ConfigError, match=r"'env.max_turn'; did you mean 'max_turns'"):
        load_config(Run, None, ["env.name=a", "env.max_turn=3"])


def test_ill_typed_override_and_literal_choices():
    with pytest.raises(ConfigError, match=r"env.max_turns: expected int, got 'three'"):
        load_config(Run, None, ["env.name=a", "env.max_turns=three"])
    with pytest.raises(ConfigError, match=r"optim.schedule: must be one of \['constant', 'cosine'\]"):
        load_config(Run, None, ["env.name=a", "optim.schedule=linear"])
    with pytest.raises(ConfigError, match=r"use_lora: expected a bool"):
        load_config(Run, None, ["env.name=a", "use_lora=maybe"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(Run, None, ["env.name"])
    with pytest.raises(ConfigError, match="seed holds a value of type int, not a section"):
        load_config(Run, None, ["seed.x=1"])


def test_missing_required_and_post_init_errors_are_prefixed():
    with pytest.raises(ConfigError, match=r"env.name: required, but not set"):
        from_dict(Run, {"env": {}})
    with pytest.raises(ConfigError, match=r"env: max_turns must be >= 1, got 0"):
        from_dict(Run, {"env": {"name": "a", "max_turns": 0}})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Run, _yaml(tmp_path, "env: [unclosed\n"))
    # a syntax error names its line and column
    with pytest.raises(ConfigError, match=r"\.yaml, line 3, column 3: not valid YAML \(.*found ':'\)"):
        load_config(Run, _yaml(tmp_path, "seed: 1\nenv:\n  : : [\n  name: a\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Run, _yaml(tmp_path, "- a\n- b\n"))


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(Run, None, ["env.name=countdown", "env.stop=[x, y]", "optim.warmup_steps=5"])
    assert to_dict(cfg)["env"]["stop"] == ["x", "y"]
    again = load_config(Run, _yaml(tmp_path, dump_yaml(cfg)))
    assert again == cfg


@dataclass(frozen=True)
class Limits:
    memory_mb: float | None = 16384  # an int default of a float field
    cpu_s: float = 300
    count: int = 3


def test_an_int_default_of_a_float_field_is_written_as_a_float(tmp_path):
    # A run writes its config.yaml from the defaults; a resumed run reads that file back,
    # where the value passes through the field's type. The two files must say the same.
    first = dump_yaml(load_config(Limits, None))
    assert "memory_mb: 16384.0" in first and "cpu_s: 300.0" in first and "count: 3\n" in first
    second = dump_yaml(load_config(Limits, _yaml(tmp_path, first)))
    assert second == first


def test_the_trainer_config_yaml_is_a_fixed_point_of_load_and_dump(tmp_path):
    from pathlib import Path

    from jaxagent.train.config import TrainerConfig

    recipe = Path(__file__).resolve().parents[1] / "configs" / "intake.yaml"
    first = dump_yaml(load_config(TrainerConfig, recipe))
    second = dump_yaml(load_config(TrainerConfig, _yaml(tmp_path, first)))
    assert second == first
    # a section left out of the file is built from its defaults, not read: the same holds
    first = dump_yaml(load_config(TrainerConfig, _yaml(tmp_path, "model: {tokenizer: byte}\n")))
    second = dump_yaml(load_config(TrainerConfig, _yaml(tmp_path, first)))
    assert second == first


def test_yaml_1_2_numbers_in_files(tmp_path):
    # PyYAML alone (YAML 1.1) reads `1e-4` as the string "1e-4"; a config file means a float.
    import yaml

    assert yaml.safe_load("lr: 1e-4")["lr"] == "1e-4"
    cfg = load_config(Run, _yaml(tmp_path, "env: {name: a}\noptim:\n  lr: 1e-4\n"))
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    for text, value in (("2E5", 2e5), ("-3e-2", -3e-2), (".5", 0.5), ("1.", 1.0), ("+1.5e+3", 1.5e3)):
        assert load_config(Run, _yaml(tmp_path, f"env: {{name: a}}\noptim: {{lr: {text}}}\n")).optim.lr == value
    # Ints stay ints, words stay words.
    assert load_config(Run, _yaml(tmp_path, "env: {name: e5}\nseed: 12\n")).env.name == "e5"


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path):
    text = "env:\n  name: a\noptim:\n  lr: 0.1\n  warmup_steps: 3\n  lr: 0.2\n"
    with pytest.raises(
        ConfigError, match=r"line 6, column 3: not valid YAML \(duplicate key 'lr' \(first set on line 4\)\)"
    ):
        load_config(Run, _yaml(tmp_path, text))
    with pytest.raises(ConfigError, match=r"duplicate key 'env'"):
        load_config(Run, _yaml(tmp_path, "env: {name: a}\nseed: 1\nenv: {name: b}\n"))


@dataclass(frozen=True)
class Bounds(Bounded):
    count: Annotated[int, Bound(ge=1)] = 1
    rate: Annotated[float, Bound(ge=0, le=1)] = 0.5
    limit: Annotated[float | None, Bound(gt=0)] = None
    wait_s: Annotated[float, Bound(gt=0, unit="seconds")] = 1.0
    scale: Annotated[float, Bound()] = 1.0
    top: Annotated[float, Bound(gt=0, le=1)] = 1.0
    name: str = "x"


@dataclass(frozen=True)
class Ruled(Bounds):
    def __post_init__(self):
        super().__post_init__()
        if self.count > 5 and self.limit is None:
            raise ValueError("count > 5 needs a limit")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(count=0), "count must be an int >= 1, got 0"),
        (dict(count=True), "count must be an int >= 1, got True"),  # a bool is no int
        (dict(count=2.0), "count must be an int >= 1, got 2.0"),
        (dict(rate=1.5), r"rate must be a number in \[0, 1\], got 1.5"),
        (dict(limit=0.0), "limit must be a finite number > 0 or null, got 0.0"),
        (dict(limit=float("inf")), "limit must be a finite number > 0 or null, got inf"),
        (dict(wait_s=-1), "wait_s must be a finite number of seconds > 0, got -1"),
        (dict(scale=float("nan")), "scale must be a finite number, got nan"),
        (dict(scale="1"), "scale must be a finite number, got '1'"),
        (dict(top=0.0), r"top must be a number in \(0, 1\], got 0.0"),
    ],
)
def test_declared_bounds_are_checked_on_construction_naming_the_key_and_the_bound(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Bounds(**kwargs)
    with pytest.raises(ValueError, match=f"^{message}$"):  # a subclass's own rules run after them
        Ruled(**kwargs)


def test_values_within_bounds_and_the_rules_after_them():
    ok = Bounds(count=3, rate=0, limit=2, wait_s=0.5, scale=-7.0, top=1)
    assert (ok.count, ok.rate, ok.limit) == (3, 0, 2)
    assert Bounds(limit=None).limit is None
    with pytest.raises(ValueError, match="count > 5 needs a limit"):
        Ruled(count=6)
    # the loader reads the type through the Annotated, and prefixes the bound's error
    assert from_dict(Bounds, {"rate": 1, "count": 2}) == Bounds(rate=1.0, count=2)
    with pytest.raises(ConfigError, match=r"^config: count must be an int >= 1, got 0$"):
        load_config(Bounds, None, ["count=0"])
    with pytest.raises(ConfigError, match=r"count: expected int, got 'x'"):
        load_config(Bounds, None, ["count=x"])
    assert [k.type for k in config_keys(Bounds())][:3] == ["int", "float", "float | None"]


def test_a_bound_on_a_field_that_is_not_a_number_is_an_error():
    @dataclass(frozen=True)
    class Wrong(Bounded):
        name: Annotated[str, Bound(ge=1)] = "a"

    with pytest.raises(TypeError, match=r"Wrong.name: a Bound needs an int or float field, not str"):
        Wrong()


@dataclass(frozen=True)
class Overlap:
    off_policy: bool = False
    REMOVED_KEYS: ClassVar[dict[str, str]] = {"max_staleness": "it only ever took 1; leave it out"}


@dataclass(frozen=True)
class WithOverlap:
    overlap: Overlap = Overlap()


def test_a_removed_key_is_refused_saying_why_and_dropped_from_a_saved_config(tmp_path):
    text = "overlap:\n  off_policy: true\n  max_staleness: 1\n"
    message = r"config key overlap.max_staleness was removed: it only ever took 1; leave it out"
    with pytest.raises(ConfigError, match=message):
        load_config(WithOverlap, _yaml(tmp_path, text))
    with pytest.raises(ConfigError, match=message):
        load_config(WithOverlap, None, ["overlap.max_staleness=2"])
    assert load_config(WithOverlap, _yaml(tmp_path, text), saved=True) == WithOverlap(Overlap(True))
