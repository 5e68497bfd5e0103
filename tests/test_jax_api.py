"""The code uses only public JAX names that exist, undeprecated, in every jax release the
pin admits: the installed one (0.10.2 on Python 3.11) checked here at run time, the newer
ones (Python >= 3.12, not installable here) against the names their wheels define
(tests/jax_api_audit.json, written by tests/jax_api_audit.py)."""

import importlib
import os
import tomllib
import warnings
from pathlib import Path

import jax
import jax_api_audit as A
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = (
    "download the wheels and run `python tests/jax_api_audit.py /tmp/jaxwheels/jax-*.whl --write` (see its docstring)"
)


@pytest.fixture(scope="module")
def usages():
    return A.repo_usages()


@pytest.fixture(scope="module")
def snapshot():
    return A.read_snapshot()


def _jax_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return [r for r in reqs if r.name == "jax"]


def test_no_private_jax_names(usages):
    """jax._src (and any _name, or jaxlib beyond its version) may change in any release."""
    bad = sorted(f"{u.where}: {u.path}" for u in usages if A.private(u.path))
    assert bad == [], "private JAX names (use the public API):\n" + "\n".join(bad)


def test_every_name_resolves_on_the_installed_jax(usages):
    """At run time, each used path through modules and objects alike, with a deprecation
    warning counted as a failure; flags through jax.config."""
    bad = []
    for path in sorted({u.path for u in usages} - A.JAXLIB_ALLOWED):
        if path.startswith("flag:"):
            continue
        if path.startswith("jaxlib.__version__."):
            continue
        obj, parts = jax, path.split(".")
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            try:
                for i, part in enumerate(parts[1:], 1):
                    try:
                        obj = getattr(obj, part)
                    except AttributeError:  # a submodule not imported by its parent
                        obj = importlib.import_module(".".join(parts[: i + 1]))
            except (AttributeError, ImportError, DeprecationWarning) as err:
                bad.append(f"{path}: {type(err).__name__}: {err}")
    flags = {u.path[5:] for u in A.checked(usages, [A.index_installed()]) if u.path.startswith("flag:")}
    bad += [f"flag {f} not in jax.config" for f in sorted(flags) if not hasattr(jax.config, f)]
    assert bad == [], f"on jax {jax.__version__}:\n" + "\n".join(bad)


def test_every_name_exists_in_every_audited_release(usages, snapshot):
    use = A.checked(usages, snapshot)
    report = []
    for idx in snapshot:
        report += [f"jax {idx.version}: {u.where}: {u.path}: {f.status}: {f.detail}" for u, f in A.problems(use, idx)]
    assert report == [], "\n".join(report) + (
        f"\n(a name of a module the snapshot does not list: {REGENERATE})"
        if any("unknown-module" in r for r in report)
        else ""
    )


def test_the_audit_reads_the_installed_jax_as_it_is(usages, snapshot):
    """The static index of the installed release agrees with the snapshot's entry for it,
    and with jax itself: a check of the parser the newer releases are read with."""
    installed = A.index_installed()
    (entry,) = [i for i in snapshot if i.version == installed.version] or [None]
    assert entry is not None, f"the snapshot has no entry for the installed jax {installed.version}: {REGENERATE}"
    assert installed.modules == entry.modules
    for mod in entry.names:
        assert installed.load(mod) == entry.names[mod], mod
        live = importlib.import_module(mod)
        missing = sorted(n for n in entry.names[mod] if not hasattr(live, n))
        assert missing == [], f"the index says {mod} binds {missing}, which jax {jax.__version__} lacks"
    assert {f for f in entry.flags} <= installed.flags


def test_the_pin_admits_only_audited_releases(snapshot):
    """Every jax requirement (core and the accelerator extras) names the same range, the
    installed release and every audited one are in it, and each minor series the range
    admits has an audited release: widening the pin needs a new audit."""
    pins = _jax_pins()
    specs = {str(r.specifier) for r in pins}
    assert len(specs) == 1, f"the jax requirements differ: {sorted(map(str, pins))}"
    spec = pins[0].specifier
    assert spec.contains(jax.__version__)
    audited = [Version(i.version) for i in snapshot]
    assert all(spec.contains(v) for v in audited), f"{audited} outside {spec}"
    lo = min(Version(s.version) for s in spec if s.operator == ">=")
    (hi,) = [Version(s.version) for s in spec if s.operator == "<"]
    series = (
        [(lo.major, m) for m in range(lo.minor, hi.minor + 1) if Version(f"{lo.major}.{m}") < hi]
        if hi.major == lo.major
        else None
    )
    assert series is not None, f"{spec}: a range over a major version boundary needs this test extended"
    have = {(v.major, v.minor) for v in audited}
    assert [s for s in series if s not in have] == [], f"{spec} admits series with no audited release: {REGENERATE}"


@pytest.mark.skipif(
    not os.environ.get("JAXAGENT_JAX_WHEELS"),
    reason="set JAXAGENT_JAX_WHEELS to a folder of jax-*.whl to re-derive the snapshot",
)
def test_the_snapshot_matches_the_wheels(usages, snapshot):
    folder = Path(os.environ["JAXAGENT_JAX_WHEELS"])
    for idx in snapshot:
        wheel = folder / f"jax-{idx.version}-py3-none-any.whl"
        if not wheel.exists():
            continue
        fresh = A.index_wheel(wheel)
        assert fresh.modules == idx.modules, idx.version
        for mod, names in idx.names.items():
            assert fresh.load(mod) == names, (idx.version, mod)
