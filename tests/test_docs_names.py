"""Every backticked `jaxagent.…` or `envs.…` name resolves: in the docstrings of the
modules under jaxagent/ and envs/ (any string statement: module, class, function and
attribute docstrings), in docs/**/*.md and in README.md (there also the names of the API
pages' `::: module` directives). A name resolves when its longest
importable module prefix imports and the rest is found attribute by attribute: a module's
or a class's attribute, a dataclass field (or a field's own fields, through its default
or its annotation), a class annotation, or an attribute a method sets on `self`. A call
in the backticks (`envs.make("qa/jsonl")`, `jaxagent.code_platform()`) names its callee.
Names the reorganisation moved go stale silently otherwise."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: `name`, ``name``: one line of inline code
TICK = re.compile(r"(`+)([^`\n]+?)\1")
#: a dotted name of the two packages, then optionally one call
REF = re.compile(r"^((?:jaxagent|envs)(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
#: fenced code blocks of a Markdown page (their backticks are not inline code)
FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
#: an API page's mkdocstrings directive: `::: jaxagent.rollout`
DIRECTIVE = re.compile(r"^::: +(\S+)", re.M)

#: stale references in files another change is reworking, to be fixed there (then taken
#: out of this set: the test fails on an entry that resolves or is gone); (file, name)
KNOWN_PENDING: set[tuple[str, str]] = set()


def references() -> list[tuple[str, int, str]]:
    """(file relative to the root, line, dotted name) of every reference."""
    refs: list[tuple[str, int, str]] = []

    def scan(text: str, rel: str, first_line: int) -> None:
        for m in TICK.finditer(text):
            ref = REF.match(m.group(2).strip())
            if ref:
                refs.append((rel, first_line + text[: m.start()].count("\n"), ref.group(1)))

    for package in ("jaxagent", "envs"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                    if isinstance(node.value.value, str):
                        scan(node.value.value, rel, node.value.lineno)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        rel = path.relative_to(ROOT).as_posix()
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
        scan(text, rel, 1)
        for m in DIRECTIVE.finditer(text):
            refs.append((rel, 1 + text[: m.start()].count("\n"), m.group(1)))
    return refs


def _sets_on_self(cls: type, name: str) -> bool:
    """Whether a method of `cls` (or of a base in the package) assigns `self.<name>`."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in ("jaxagent", "envs"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=[^=]", source):
            return True
    return False


def _member(obj, name: str):
    """`obj`'s `name`, as the docs mean it; raises LookupError when there is none."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if inspect.isclass(obj):
        fields = getattr(obj, "__dataclass_fields__", {})
        if name in fields:
            field = fields[name]
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
        hints: dict = {}
        for klass in reversed(obj.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
        if name in hints:
            try:
                return typing.get_type_hints(obj)[name]
            except Exception:  # noqa: BLE001 - an annotation that does not evaluate: the name still exists
                return None
        if _sets_on_self(obj, name):
            return None
    raise LookupError(name)


def resolve(name: str) -> str | None:
    """None when `name` resolves, else why not."""
    parts = name.split(".")
    module, k = None, len(parts)
    while k > 0:
        try:
            module = importlib.import_module(".".join(parts[:k]))
            break
        except ModuleNotFoundError as err:
            if err.name != ".".join(parts[:k]) and not ".".join(parts[:k]).startswith(f"{err.name}."):
                return f"importing {'.'.join(parts[:k])} failed: {err}"
            k -= 1
    if module is None:
        return "no module"
    obj = module
    for i, part in enumerate(parts[k:], k):
        if obj is None:  # past an attribute known only by name (set in __init__, an annotation)
            return None
        try:
            obj = _member(obj, part)
        except LookupError:
            return f"{'.'.join(parts[:i])} has no {part!r}"
    return None


def test_every_backticked_dotted_name_resolves():
    refs = references()
    assert len(refs) > 100, f"only {len(refs)} references found: is the scan broken?"
    bad = []
    pending_seen = set()
    for rel, line, name in refs:
        why = resolve(name)
        if why is None:
            continue
        if (rel, name) in KNOWN_PENDING:
            pending_seen.add((rel, name))
            continue
        bad.append(f"{rel}:{line}: {name} ({why})")
    assert not bad, "names that do not resolve:\n" + "\n".join(bad)
    fixed = KNOWN_PENDING - pending_seen
    assert not fixed, f"KNOWN_PENDING entries that resolve now or are gone (remove them): {sorted(fixed)}"


def test_the_resolver_follows_modules_classes_fields_and_calls():
    assert resolve("jaxagent.train.update.trimmed.TrimmedUpdate") is None
    assert resolve("envs.EnvPool.step") is None
    assert resolve("envs") is None
    # a dataclass field without a default (not a class attribute), and one past a field's default
    assert resolve("jaxagent.rollout.episode.Episode.index") is None
    assert resolve("jaxagent.rollout.agent_loop.AgentLoopConfig.sampling.temperature") is None
    # an attribute only `__init__` sets
    assert resolve("jaxagent.rollout.agent_loop.AgentLoop.reward_fn") is None
    assert "has no 'nope'" in resolve("jaxagent.rollout.episode.Episode.nope")
    assert "has no 'no_such_module'" in resolve("jaxagent.no_such_module.f")
    got = [(n, REF.match(n).group(1)) for n in ('envs.make("qa/jsonl", path=...)', "jaxagent.code_platform()")]
    assert got == [
        ('envs.make("qa/jsonl", path=...)', "envs.make"),
        ("jaxagent.code_platform()", "jaxagent.code_platform"),
    ]
    assert REF.match("jaxagent.train.X = 3") is None and REF.match("jaxagent/train/x.py") is None
