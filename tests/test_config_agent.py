"""The `agent:` section (`jaxagent.train.config.agent.AgentSection`) and `eval.tasks`:
defaults, validation errors naming the key, the run directory's config.yaml round trip,
the resume check and what `jaxagent config` prints."""

from __future__ import annotations

import pytest

from jaxagent.dataclass_yaml import ConfigError, config_keys, describe_config, dump_yaml, load_config, to_dict
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.agent import AgentSection

AGENT = ["agent.program=my_agent:rollout", "agent.tasks=data/tasks.jsonl"]


def _yaml(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_train_no_agent_program():
    cfg = TrainerConfig()
    assert cfg.agent == AgentSection()
    a = cfg.agent
    assert (a.program, a.tasks, a.concurrency, a.timeout_s, a.imports, a.processes, a.max_staleness) == (
        None,
        None,
        64,
        300.0,
        (),
        2,
        1,
    )
    assert not a.enabled and cfg.eval.tasks is None
    assert to_dict(cfg)["agent"] == {
        "program": None,
        "tasks": None,
        "concurrency": 64,
        "timeout_s": 300.0,
        "imports": [],
        "processes": 2,
        "max_staleness": 1,
        "expert": None,
    }


def test_an_agent_program_from_a_file_and_overrides(tmp_path):
    text = (
        "agent:\n  program: pkg.my_agent:rollout\n  tasks: tasks.jsonl\n  concurrency: 8\n"
        "  timeout_s: 30\n  imports: [agents/, extra_mod]\n  max_staleness: 0\n  processes: 0\n"
        "eval:\n  episodes: 4\n  tasks: pkg.my_tasks:held_out\n"
    )
    cfg = load_config(TrainerConfig, _yaml(tmp_path, text), ["agent.concurrency=16"])
    a = cfg.agent
    assert a.enabled and a.program == "pkg.my_agent:rollout" and a.tasks == "tasks.jsonl"
    assert a.concurrency == 16 and a.timeout_s == 30.0 and isinstance(a.timeout_s, float)
    assert a.imports == ("agents/", "extra_mod") and a.max_staleness == 0 and a.processes == 0
    assert cfg.eval.tasks == "pkg.my_tasks:held_out"
    # tasks as a module:function
    assert load_config(TrainerConfig, None, ["agent.program=a:b", "agent.tasks=a.tasks:make"]).agent.tasks == (
        "a.tasks:make"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["agent.program=my_agent:rollout"], r"agent: tasks is required with program"),
        (["agent.tasks=t.jsonl"], r"agent: tasks \('t.jsonl'\) is set but program is not"),
        (["agent.program=my_agent.rollout", "agent.tasks=t.jsonl"], r"agent: program must look like 'module:function'"),
        (["agent.program=my agent:run", "agent.tasks=t.jsonl"], r"agent: program must look like 'module:function'"),
        ([*AGENT[:1], "agent.tasks=tasks.json"], r"agent: tasks must be a path to a .jsonl file .* or 'module:fun"),
        ([*AGENT, "agent.concurrency=0"], r"agent: concurrency must be an int >= 1, got 0"),
        ([*AGENT, "agent.max_staleness=-1"], r"agent: max_staleness must be an int >= 0, got -1"),
        ([*AGENT, "agent.processes=-1"], r"agent: processes must be an int >= 0, got -1"),
        ([*AGENT, "agent.timeout_s=0"], r"agent: timeout_s must be a finite number of seconds > 0, got 0.0"),
        ([*AGENT, "agent.timeout_s=inf"], r"agent: timeout_s must be a finite number"),
        ([*AGENT, "agent.concurrency=2.5"], r"agent.concurrency: expected int"),
        ([*AGENT, "agent.imports=['']"], r"agent: imports must be a list of module names or directories"),
        ([*AGENT, "eval.tasks=held_out.txt"], r"eval: tasks must be a path to a .jsonl file .* or 'module:function'"),
        (["eval.tasks=held_out.jsonl"], r"eval.tasks \('held_out.jsonl'\) is for agent programs"),
        (["agent.concurency=3"], r"unknown config key 'agent.concurency'; did you mean 'concurrency'\?"),
    ],
)
def test_validation_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, None, overrides)


def test_unknown_keys_in_a_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'agent.programme'.*valid keys of agent: concurrency"):
        load_config(TrainerConfig, _yaml(tmp_path, "agent:\n  programme: a:b\n"))


def test_the_run_config_yaml_round_trips(tmp_path):
    cfg = load_config(
        TrainerConfig, None, [*AGENT, "agent.imports=[agents]", "agent.timeout_s=60", "eval.tasks=held.jsonl"]
    )
    first = dump_yaml(cfg)
    assert "agent:\n  program: my_agent:rollout\n  tasks: data/tasks.jsonl\n" in first
    again = load_config(TrainerConfig, _yaml(tmp_path, first), saved=True)
    assert again == cfg and dump_yaml(again) == first
    # a config.yaml written before the agent section existed still loads (agent off)
    old = to_dict(TrainerConfig())
    del old["agent"], old["eval"]["tasks"]
    import yaml

    assert not load_config(TrainerConfig, _yaml(tmp_path, yaml.safe_dump(old)), saved=True).agent.enabled


def test_a_resumed_run_keeps_its_program_and_tasks():
    from jaxagent.train.rundir import IncompatibleCheckpointError, check_resumable

    saved = to_dict(load_config(TrainerConfig, None, AGENT))
    same = to_dict(load_config(TrainerConfig, None, [*AGENT, "agent.concurrency=4", "agent.timeout_s=10"]))
    check_resumable(saved, same, "ckpt")  # the bounds may change
    for change in ("agent.tasks=other.jsonl", "agent.program=other:rollout"):
        current = to_dict(load_config(TrainerConfig, None, [*AGENT, change]))
        with pytest.raises(IncompatibleCheckpointError, match=change.split("=")[0]):
            check_resumable(saved, current, "ckpt")
    # a checkpoint from before the agent section, resumed without an agent: fine
    old = to_dict(TrainerConfig())
    del old["agent"]
    check_resumable(old, to_dict(TrainerConfig()), "ckpt")


def test_jaxagent_config_shows_the_agent_section_documented():
    lines = describe_config(load_config(TrainerConfig, None, AGENT))
    shown = {line.split(" = ")[0]: line for line in lines}
    for key in ("program", "tasks", "concurrency", "timeout_s", "imports", "max_staleness"):
        assert f"agent.{key}" in shown
    assert shown["agent.program"].startswith("agent.program = my_agent:rollout  # str | None: ")
    assert shown["agent.concurrency"].startswith("agent.concurrency = 64  # int: ")
    assert "eval.tasks" in shown
    undocumented = [k.key for k in config_keys(TrainerConfig()) if k.key.startswith("agent.") and not k.doc]
    assert undocumented == []


def test_the_expert_is_a_program_option_named_as_a_function():
    with pytest.raises(ValueError, match="expert must look like 'module:function'"):
        AgentSection(program="m:f", tasks="t.jsonl", expert="not a spec")
    with pytest.raises(ValueError, match="expert .* is set but program is not"):
        AgentSection(expert="m:f")
    assert AgentSection(program="m:f", tasks="t.jsonl", expert="m:e").expert == "m:e"
