"""The install works off this machine: every pin in constraints.txt is a plain PyPI
release (no local version label such as +cpu, no URL or path), and pyproject.toml
declares its license the way current setuptools accepts without a deprecation warning."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def test_constraints_pin_plain_pypi_releases():
    pins = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        assert req.url is None, f"constraints.txt:{n}: {line} points at a URL or path, not PyPI"
        (spec,) = req.specifier
        assert spec.operator == "==", f"constraints.txt:{n}: {line} is not an exact pin"
        assert Version(spec.version).local is None, (
            f"constraints.txt:{n}: {line} carries a local version label, which no PyPI release has"
        )
        pins[req.name.lower().replace("_", "-")] = spec.version
    assert pins["torch"] == "2.13.0" and "jax" in pins and "mkdocs" in pins


def test_pyproject_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    # SPDX license strings need setuptools 77 (a table is deprecated there)
    (setuptools,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert re.fullmatch(r"setuptools>=(\d+)", setuptools) and int(setuptools.split(">=")[1]) >= 77
    extras = project["project"]["optional-dependencies"]
    assert {"test", "docs", "cuda", "envs-all", "wandb", "mlflow", "tensorboard", "bench", "tpu"} <= set(extras)
