"""Which JAX names this repository uses, and whether each exists in a given JAX release.

The project supports a range of jax releases (pyproject.toml), but CI installs one
(Python 3.11 resolves only 0.10.x). This audit reads the code statically, so it can check
releases that cannot be installed here:

- **usages**: every ``import jax...``, ``from jax... import ...`` and attribute path
  rooted at a jax alias (``jax.lax.psum``, ``jnp.float32`` via ``import jax.numpy as
  jnp``, ``P`` via ``from jax.sharding import PartitionSpec as P``) in jaxagent/, envs/,
  benchmarks/, tests/ and examples/, plus the config flags the code sets or reads
  (``jax.config.update("jax_...")``, ``jax.config.jax_...``, ``$JAX_...``
  environment variables that name a flag);
- **an API index of a release**, from its wheel (or an installed ``jax/`` directory)
  without importing it: its public modules (files outside ``jax/_src``), the names each
  binds at top level (imports, assignments, defs, classes; ``del`` and
  ``if TYPE_CHECKING`` honoured), the names it deprecates or has removed
  (``_deprecations``: a warning, or an ``AttributeError`` when the object is ``None``),
  and the config flags the release defines;
- **resolution**: a usage path is walked through modules, then must be a name of the
  last module. Attributes of objects (``jax.config.update``,
  ``jax.lax.Precision.HIGHEST``) are beyond a static index and are left unchecked here;
  ``tests/test_jax_api.py`` also resolves every path on the installed jax at run time.

A default test cannot download wheels, so the audit writes a snapshot
(``tests/jax_api_audit.json``): for each audited release, the names of the modules the
code touches, their deprecations, and the flags the code uses. Regenerate it after
using a name of a module it does not list, or to audit a newer release::

    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        jax==0.11.2 jax==0.12.1 -d /tmp/jaxwheels     # one version per command
    python tests/jax_api_audit.py /tmp/jaxwheels/jax-*.whl --write

Without ``--write`` it prints, per release, every usage that is missing, deprecated or
removed, and how the touched modules changed between the releases given.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("jaxagent", "envs", "benchmarks", "tests", "examples")
SNAPSHOT = Path(__file__).with_name("jax_api_audit.json")
# Outside JAX's API compatibility policy (docs.jax.dev api_compatibility): may change in
# any release. Used names from these are reported, not refused.
UNSTABLE = ("jax.experimental", "jax.extend", "jax.interpreters", "jax.core", "jax.lib", "jax.example_libraries")
# jaxlib is JAX's compiled backend, with no public Python API beyond its version.
JAXLIB_ALLOWED = {"jaxlib", "jaxlib.__version__"}
_FLAG_NAME = re.compile(r"['\"](jax_[a-z0-9_]+)['\"]")
# what precedes a flag's name where a release defines it: name='jax_x' or bool_state('jax_x'
_FLAG_DEF = re.compile(r"(?:\bname\s*=\s*|(?:_state|_flag)\(\s*)$")
_ENV = re.compile(r"^JAX_[A-Z0-9_]+$")
_MODULE_DUNDERS = {"__file__", "__name__", "__path__", "__spec__", "__doc__"}  # every module has them
_NOT_NAMES = {"__getattr__", "__dir__", "__all__"}


# --- what the code uses -------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    path: str  # dotted: "jax.numpy.float32", or "flag:jax_platforms"
    where: str  # "file.py:line"
    kind: str  # "import" | "attr" | "flag" | "env-flag"


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def file_usages(path: Path, root: Path = ROOT) -> list[Usage]:
    """The jax names, flags and jaxlib names one Python file uses."""
    src = path.read_text()
    if "jax" not in src and "JAX_" not in src:
        return []
    tree = ast.parse(src, filename=str(path))
    rel = path.relative_to(root).as_posix()
    out: list[Usage] = []
    alias: dict[str, str] = {}
    inner: set[int] = set()  # attributes that are the value of another attribute
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("jax", "jaxlib"):
                    out.append(Usage(a.name, f"{rel}:{node.lineno}", "import"))
                    if a.asname:
                        alias[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        alias[top] = top
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in ("jax", "jaxlib")
        ):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append(Usage(full, f"{rel}:{node.lineno}", "import"))
                alias[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if not chain or chain[0] not in alias:
                continue
            full = ".".join([alias[chain[0]]] + chain[1:])
            where = f"{rel}:{node.lineno}"
            parts = full.split(".")
            # jax.config.jax_x (a flag read) and jax.config.update("jax_x", ...)
            if parts[:2] == ["jax", "config"] and len(parts) > 2 and parts[2].startswith("jax_"):
                out.append(Usage(f"flag:{parts[2]}", where, "flag"))
                continue
            out.append(Usage(full, where, "attr"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain = _chain(node.func)
            if (
                chain
                and chain[0] in alias
                and ".".join([alias[chain[0]]] + chain[1:]) == "jax.config.update"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.append(Usage(f"flag:{node.args[0].value}", f"{rel}:{node.lineno}", "flag"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV.match(node.value):
            # checked only where some audited release defines the flag it names
            out.append(Usage(f"flag:{node.value.lower()}", f"{rel}:{node.lineno}", "env-flag"))
    return out


def repo_usages(root: Path = ROOT, dirs=SCANNED) -> list[Usage]:
    out = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out.extend(file_usages(path, root))
    return out


def private(path: str) -> bool:
    """A private name: a ``_``-prefixed component (``jax._src``; dunders aside), or any
    jaxlib name beyond its version."""
    if path.startswith("flag:"):
        return False
    if path.split(".")[0] == "jaxlib":
        return not (path in JAXLIB_ALLOWED or path.startswith("jaxlib.__version__."))
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in path.split("."))


# --- what a release offers ------------------------------------------------------------


@dataclass
class ApiIndex:
    version: str
    modules: set[str] = field(default_factory=set)  # every public module
    names: dict[str, set[str]] = field(default_factory=dict)  # module -> bound names
    deprecated: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> name -> message
    removed: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> name -> message
    flags: set[str] = field(default_factory=set)
    sources: dict[str, str] = field(default_factory=dict, repr=False)  # module -> source, parsed on demand

    def load(self, mod: str) -> set[str] | None:
        """The names ``mod`` binds (parsing its source on first use); None if unknown."""
        if mod not in self.names and mod in self.sources:
            _parse_module(self, mod, self.sources.pop(mod))
        return self.names.get(mod)

    def to_json(self, keep_modules: set[str], keep_flags: set[str]) -> dict:
        keep = sorted(m for m in keep_modules if m in self.modules and self.load(m) is not None)
        return {
            "modules": sorted(self.modules),
            "names": {m: sorted(self.names[m]) for m in keep},
            "deprecated": {m: self.deprecated[m] for m in keep if self.deprecated.get(m)},
            "removed": {m: self.removed[m] for m in keep if self.removed.get(m)},
            "flags": sorted(keep_flags & self.flags),
        }

    @classmethod
    def from_json(cls, version: str, d: dict) -> ApiIndex:
        return cls(
            version,
            set(d["modules"]),
            {m: set(v) for m, v in d["names"].items()},
            d.get("deprecated", {}),
            d.get("removed", {}),
            set(d["flags"]),
        )


def _module_name(rel: str) -> str | None:
    """``jax/numpy/__init__.py`` -> ``jax.numpy``; None for private modules."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bind(stmts, names: set[str], deps: dict) -> None:
    for s in stmts:
        if isinstance(s, ast.Import):
            for a in s.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(s, ast.ImportFrom):
            for a in s.names:
                if a.name != "*":
                    names.add(a.asname or a.name)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(s.name)
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                if isinstance(t, ast.Name) and t.id == "_deprecations" and isinstance(s.value, ast.Dict):
                    for k, v in zip(s.value.keys, s.value.values, strict=True):
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2:
                            try:
                                msg = ast.literal_eval(v.elts[0])
                            except ValueError:
                                msg = ""
                            removed = isinstance(v.elts[1], ast.Constant) and v.elts[1].value is None
                            deps[k.value] = (str(msg), removed)
        elif isinstance(s, ast.Delete):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    names.discard(t.id)
        elif isinstance(s, ast.If):
            if _is_type_checking(s.test):
                _bind(s.orelse, names, deps)  # what runs; the TYPE_CHECKING branch is for type checkers
            else:
                _bind(s.body, names, deps)
                _bind(s.orelse, names, deps)
        elif isinstance(s, ast.Try):
            for block in (s.body, s.orelse, s.finalbody, *[h.body for h in s.handlers]):
                _bind(block, names, deps)
        elif isinstance(s, ast.With):
            _bind(s.body, names, deps)


def _parse_module(idx: ApiIndex, mod: str, src: str) -> None:
    try:
        tree = ast.parse(src)
    except SyntaxError:  # newer syntax than this Python's (0.12 uses PEP 695 in a few modules):
        return  # listed as a module, its names unknown; a use of one is reported
    names: set[str] = set()
    deps: dict[str, tuple[str, bool]] = {}
    _bind(tree.body, names, deps)
    idx.names[mod] = {n for n in names if (not n.startswith("_") or n.startswith("__")) and n not in _NOT_NAMES}
    for name, (msg, removed) in deps.items():
        idx.names[mod].discard(name)
        (idx.removed if removed else idx.deprecated).setdefault(mod, {})[name] = msg


def index_sources(version: str, sources: dict[str, str]) -> ApiIndex:
    """An index from ``{"jax/numpy/__init__.py": source, ...}``; modules are parsed when
    first resolved against."""
    idx = ApiIndex(version)
    for rel, src in sources.items():
        if "jax_" in src:
            idx.flags.update(
                m.group(1) for m in _FLAG_NAME.finditer(src) if _FLAG_DEF.search(src, max(0, m.start() - 40), m.start())
            )
        mod = _module_name(rel)
        if mod is not None:
            idx.modules.add(mod)
            idx.sources[mod] = src
    return idx


def index_wheel(wheel: Path) -> ApiIndex:
    with zipfile.ZipFile(wheel) as z:
        sources = {n: z.read(n).decode() for n in z.namelist() if n.startswith("jax/") and n.endswith(".py")}
    version = re.match(r"jax-([^-]+)-", wheel.name).group(1)
    return index_sources(version, sources)


def index_installed() -> ApiIndex:
    import jax

    pkg = Path(jax.__file__).parent
    sources = {f"jax/{p.relative_to(pkg).as_posix()}": p.read_text() for p in pkg.rglob("*.py")}
    return index_sources(jax.__version__, sources)


# --- resolution ---------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    status: str  # ok | object | deprecated | removed | missing | private | unknown-module
    detail: str = ""


def resolve(path: str, idx: ApiIndex) -> Finding:
    """Whether ``path`` exists in the release ``idx`` indexes (statically)."""
    if private(path):
        return Finding("private", "a private name (jax._src, a _name, or jaxlib internals)")
    if path.startswith("flag:"):
        flag = path[5:]
        return Finding("ok") if flag in idx.flags else Finding("missing", f"config flag {flag} is not defined")
    if path in JAXLIB_ALLOWED:
        return Finding("ok")
    if path.startswith("jaxlib.__version__."):
        return Finding("object", "attribute of a str")
    parts = path.split(".")
    mod = parts[0]
    for i, part in enumerate(parts[1:], 1):
        idx.load(mod)
        if part in idx.removed.get(mod, {}):
            return Finding("removed", idx.removed[mod][part])
        if part in idx.deprecated.get(mod, {}):
            return Finding("deprecated", idx.deprecated[mod][part])
        if f"{mod}.{part}" in idx.modules:
            mod = f"{mod}.{part}"
            continue
        if part in _MODULE_DUNDERS:
            return Finding("ok")
        names = idx.load(mod)
        if names is None:
            return Finding(
                "unknown-module",
                f"{mod}'s names are not in this index (regenerate the snapshot "
                "from the wheels, with a Python that parses the module)",
            )
        if part in names:
            rest = ".".join(parts[i + 1 :])
            return (
                Finding("object", f"attribute {rest} of {mod}.{part} not checked statically") if rest else Finding("ok")
            )
        return Finding("missing", f"{mod} has no {part}")
    return Finding("ok")


def touched_modules(usages: list[Usage], idx: ApiIndex) -> set[str]:
    """The modules a resolution of the usages reads names from (in ``idx``)."""
    out = set()
    for u in usages:
        if u.path.startswith("flag:") or private(u.path) or u.path.split(".")[0] != "jax":
            continue
        parts = u.path.split(".")
        mod = "jax"
        out.add(mod)
        for part in parts[1:]:
            if f"{mod}.{part}" in idx.modules:
                mod = f"{mod}.{part}"
                out.add(mod)
            else:
                break
    return out


def checked(usages: list[Usage], indexes: list[ApiIndex]) -> list[Usage]:
    """The usages to check: env-var flags only where some release defines the flag."""
    known = set().union(*(i.flags for i in indexes))
    return [u for u in usages if u.kind != "env-flag" or u.path[5:] in known]


def problems(usages: list[Usage], idx: ApiIndex) -> list[tuple[Usage, Finding]]:
    out = []
    for u in usages:
        f = resolve(u.path, idx)
        if f.status not in ("ok", "object"):
            out.append((u, f))
    return out


def unstable(usages: list[Usage]) -> set[str]:
    return {u.path for u in usages if any(u.path == m or u.path.startswith(m + ".") for m in UNSTABLE)}


# --- the snapshot -------------------------------------------------------------------


def write_snapshot(indexes: list[ApiIndex], usages: list[Usage], path: Path = SNAPSHOT) -> None:
    flags = {u.path[5:] for u in checked(usages, indexes) if u.path.startswith("flag:")}
    data = {
        "about": "Written by tests/jax_api_audit.py from the jax wheels of these releases: the names of "
        "the jax modules this repository touches, their deprecations, and the config flags it "
        "uses. tests/test_jax_api.py checks the code against it.",
        "releases": {i.version: i.to_json(touched_modules(usages, i), flags) for i in indexes},
    }
    # one line per module: small diffs when a release is added
    text = json.dumps(data, indent=1, sort_keys=True)
    text = re.sub(r"\[\n\s+([^\[\]{}]*?)\n\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.write_text(text + "\n")


def read_snapshot(path: Path = SNAPSHOT) -> list[ApiIndex]:
    data = json.loads(path.read_text())
    return [
        ApiIndex.from_json(v, d)
        for v, d in sorted(data["releases"].items(), key=lambda kv: tuple(map(int, kv[0].split("."))))
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="*", type=Path, help="jax-*.whl files (default: the snapshot)")
    ap.add_argument("--installed", action="store_true", help="also the jax installed here")
    ap.add_argument("--write", action="store_true", help=f"write {SNAPSHOT.name} from the wheels")
    args = ap.parse_args(argv)
    usages = repo_usages()
    audited = [index_wheel(w) for w in args.wheels] if args.wheels else read_snapshot()
    indexes = audited + ([index_installed()] if args.installed else [])
    use = checked(usages, indexes)
    paths = sorted({u.path for u in use})
    print(f"{len(use)} uses of {len(paths)} distinct jax names/flags in {', '.join(SCANNED)}")
    bad = 0
    for idx in indexes:
        found = problems(use, idx)
        bad += len(found)
        print(f"\njax {idx.version}: {len(found) or 'no'} problem(s)")
        for u, f in found:
            print(f"  {u.where}: {u.path}: {f.status}: {f.detail}")
    print(
        "\noutside JAX's compatibility policy (may change in any release):", ", ".join(sorted(unstable(use))) or "none"
    )
    objects = sorted({u.path for u in use if resolve(u.path, audited[-1]).status == "object"})
    print(
        f"attributes of objects, not checked statically (tests/test_jax_api.py resolves them on the installed jax): "
        f"{', '.join(objects) or 'none'}"
    )
    if len(audited) > 1:
        first, last = audited[0], audited[-1]
        print(f"\nnames of the touched modules, {first.version} -> {last.version}:")
        for m in sorted(touched_modules(use, first) | touched_modules(use, last)):
            a, b = first.load(m) or set(), last.load(m) or set()
            gone, new = sorted(a - b), sorted(b - a)
            newly_dep = sorted(set(last.deprecated.get(m, {})) - set(first.deprecated.get(m, {})))
            if gone or new or newly_dep:
                print(f"  {m}: removed {gone or '-'}; added {new or '-'}; newly deprecated {newly_dep or '-'}")
        fgone = sorted({f for f in first.flags} - last.flags) if args.wheels else []
        if fgone:
            print(f"  config flags gone: {fgone}")
    if args.write:
        if not args.wheels:
            ap.error("--write needs the wheels")
        write_snapshot(audited, usages)
        print(f"\nwrote {SNAPSHOT.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
