"""The shape the trainer's code keeps (docs/explanations/design.md): functions short
enough to read, the rollout source chosen in one place, one import path for the run
config, no probing of collaborators for what they can do."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 90


def python_files(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_function_of_the_package_is_longer_than_a_screen():
    long = []
    for path in python_files("jaxagent"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == [], long


def test_the_rollout_source_is_chosen_in_one_place():
    """In `jaxagent/train/`, only `build.rollout_source` (and the sources themselves) read
    `agent.program`; the config package defines the key and validates it by its section
    (`agent.enabled`)."""
    readers = []
    for path in python_files("jaxagent/train"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("jaxagent/train/sources/") or rel.startswith("jaxagent/train/config/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "program":
                inner = node.value
                if isinstance(inner, ast.Attribute) and inner.attr == "agent":
                    readers.append(f"{rel}:{node.lineno}")
    assert [r.split(":")[0] for r in readers] == ["jaxagent/train/build.py"], readers


def test_no_code_probes_a_loop_or_pool_for_what_it_can_do():
    """Collaborators keep a written contract (`EpisodeLoop`, `RolloutSource`): nothing asks
    a loop or a pool whether it has a method."""
    probes = []
    pattern = re.compile(r"(hasattr|getattr)\((loop|pool)\b")
    for path in python_files("jaxagent", "envs"):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                probes.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert probes == [], probes


def test_the_run_config_has_one_import_path():
    """`TrainerConfig` is imported from `jaxagent.train.config` only (no re-exports)."""
    elsewhere = []
    for path in python_files("jaxagent", "envs", "tests", "benchmarks", "examples"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "TrainerConfig" for a in node.names):
                if node.module != "jaxagent.train.config":
                    elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module}")
    assert elsewhere == [], elsewhere
    import jaxagent.train
    import jaxagent.train.trainer

    assert not hasattr(jaxagent.train, "TrainerConfig")
    assert "TrainerConfig" not in jaxagent.train.trainer.__all__
