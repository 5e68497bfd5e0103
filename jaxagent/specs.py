"""What a config names outside the package: an object by a "module:attr" spec
(`resolve_spec`: `agent.program`, `agent.tasks`, a judge's `fn`, `warm_start.extra.source`)
and the tasks of a JSONL file (`read_jsonl_tasks`: `agent.tasks`, `envs.make("qa/jsonl")`).

Standard library only, and it imports nothing of the package: `envs` (which otherwise
imports nothing of `jaxagent`) and the gateway's program module import it where they
read a task file or resolve a spec, not at module level (`tests/test_envs_core.py`,
`tests/test_gateway_program.py`); so does an env worker, which never loads JAX.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any

#: "module:attr": a dotted module name, one colon, a dotted attribute path
SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def is_spec(spec: Any) -> bool:
    """Whether `spec` is a string of the form "module:attr" (dotted names either side)."""
    return isinstance(spec, str) and bool(SPEC.match(spec))


def resolve_spec(spec: str, what: str, *, form: str = "module:attr", where: str = "sys.path") -> Any:
    """The object the "module:attr" string `spec` names: the module imported, then the
    attribute path (dotted: "module:Class.method") looked up in it.

    `ValueError` naming the key `what` and the spec, one format for every key:
    "{what} must look like '{form}' ..., got {spec!r}" (not of the form),
    "{what} {spec!r}: no module named ... (looked up on {where})" (the module is missing),
    "{what} {spec!r}: importing ... failed: <error>" (it raised on import, or one of its
    own imports is missing) and "{what} {spec!r}: module ... has no attribute ...".
    `form` is how the key's value is described ("module:function", "module:Class");
    `where` where modules are looked up (the caller may have extended `sys.path`).
    """
    if not is_spec(spec):
        raise ValueError(
            f"{what} must look like {form!r} (a dotted module, one colon, a dotted name in it), got {spec!r}"
        )
    module_name, attr = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"{what} {spec!r}: no module named {module_name!r} (looked up on {where})") from None
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    except Exception as err:  # noqa: BLE001 - an error the module raises on import, named
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def read_jsonl_tasks(path: str | os.PathLike, what: str) -> list[tuple[int, dict]]:
    """The tasks of a JSONL file, one JSON object a line, with their line numbers
    (1-based; blank lines are skipped). `ValueError` naming the file, and the line when
    one is at fault: "{what}: task file not found: {path}", "{what}: cannot read {path}:
    ...", "{path}, line {n}: not valid JSON (...)", "{path}, line {n}: a task must be a
    JSON object, got list", "{what}: {path} has no tasks (no non-blank line)"."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ValueError(f"{what}: task file not found: {p}")
    tasks = []
    try:
        with open(p, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{p}, line {number}: not valid JSON ({err.msg}, column {err.colno})") from None
                if not isinstance(task, dict):
                    raise ValueError(f"{p}, line {number}: a task must be a JSON object, got {type(task).__name__}")
                tasks.append((number, task))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{what}: cannot read {p}: {err}") from None
    if not tasks:
        raise ValueError(f"{what}: {p} has no tasks (no non-blank line)")
    return tasks
