"""`jaxagent.specs`: the one "module:attr" resolver (agent programs and tasks, a judge's
fn, a warm start's demonstration source) and the one JSONL task reader (`agent.tasks`,
`envs.make("qa/jsonl")`), standard library only, so that `envs` may use it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent.specs import is_spec, read_jsonl_tasks, resolve_spec

ROOT = Path(__file__).resolve().parents[1]


def test_resolve_spec_follows_a_dotted_attribute_and_names_the_key_in_every_error():
    assert resolve_spec("os.path:join", "k") is __import__("os").path.join
    assert resolve_spec("collections:OrderedDict.fromkeys", "k") == __import__("collections").OrderedDict.fromkeys
    assert is_spec("a.b:c.d") and not is_spec("a.b.c") and not is_spec("a:b:c") and not is_spec(3)
    with pytest.raises(ValueError, match=r"^my.key must look like 'module:Class' .*, got 'a b:c'$"):
        resolve_spec("a b:c", "my.key", form="module:Class")
    with pytest.raises(
        ValueError, match=r"^my.key 'no_such_mod_xyz:f': no module named 'no_such_mod_xyz' \(looked up on"
    ):
        resolve_spec("no_such_mod_xyz:f", "my.key")
    with pytest.raises(ValueError, match=r"^my.key 'os:no_such_attr': module 'os' has no attribute 'no_such_attr'$"):
        resolve_spec("os:no_such_attr", "my.key")


def test_resolve_spec_names_a_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "spec_raises_xyz.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "spec_missing_dep_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"'spec_raises_xyz:f': importing 'spec_raises_xyz' failed: RuntimeError: boom"
    ):
        resolve_spec("spec_raises_xyz:f", "k")
    with pytest.raises(ValueError, match=r"importing 'spec_missing_dep_xyz' failed: ModuleNotFoundError"):
        resolve_spec("spec_missing_dep_xyz:f", "k")
    for name in ("spec_raises_xyz", "spec_missing_dep_xyz"):
        sys.modules.pop(name, None)


def test_read_jsonl_tasks_gives_line_numbers_and_names_the_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    # a line separator inside a JSON string is part of the line (str.splitlines would cut it)
    path.write_text('{"q": "a"}\n\n' + json.dumps({"q": "b\u2028c"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_jsonl_tasks(path, "k") == [(1, {"q": "a"}), (3, {"q": "b\u2028c"})]
    path.write_text('{"q": "a"}\n"text"\n')
    with pytest.raises(ValueError, match=r"t\.jsonl, line 2: a task must be a JSON object, got str"):
        read_jsonl_tasks(path, "k")
    path.write_bytes(b'{"q": "\xff"}\n')
    with pytest.raises(ValueError, match=r"^k: cannot read .*t\.jsonl"):
        read_jsonl_tasks(path, "k")
    with pytest.raises(ValueError, match=r"^k: task file not found: .*nope\.jsonl"):
        read_jsonl_tasks(tmp_path / "nope.jsonl", "k")


def test_envs_reads_its_task_files_loading_no_jax_and_of_jaxagent_only_its_stdlib_modules(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    code = (
        f"import sys, envs; e = envs.make('qa/jsonl', path={str(path)!r}); e.reset(0); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxagent', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    # `import envs` loads the failure kinds its pool reports (stdlib only, `jaxagent.failures`)
    assert out.stdout.strip() == "['jaxagent', 'jaxagent.failures', 'jaxagent.specs']"
