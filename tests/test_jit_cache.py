"""JAX's persistent compilation cache (`jit_cache_dir`): on by default in the user's
cache directory, a chosen directory, or off; an outer choice
(`$JAX_COMPILATION_CACHE_DIR`, as this suite sets) is kept. Each case runs in a fresh
process: a process picks its cache once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys, jax, jax.numpy as jnp
from jaxagent.dataclass_yaml import load_config
from jaxagent.train import build
from jaxagent.train.config import TrainerConfig
cfg = load_config(TrainerConfig, None, sys.argv[1:])
chosen = build.compilation_cache(cfg)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()
print(json.dumps({"chosen": chosen}))
"""


def probe(tmp_path, *overrides, env=None):
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    environ.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **(env or {}))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *overrides], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["chosen"]


def entries(path) -> list:
    return [p for p in Path(path).rglob("*") if p.is_file()] if Path(path).exists() else []


@pytest.mark.parametrize("case", ["auto", "path", "off", "outer"])
def test_the_compilation_cache_is_where_the_config_says(tmp_path, case):
    if case == "auto":
        assert probe(tmp_path) == str(tmp_path / "xdg" / "jaxagent" / "jit")
        assert entries(tmp_path / "xdg" / "jaxagent" / "jit")
    elif case == "path":
        assert probe(tmp_path, f"jit_cache_dir={tmp_path / 'mine'}") == str(tmp_path / "mine")
        assert entries(tmp_path / "mine") and not entries(tmp_path / "xdg")
    elif case == "off":
        assert probe(tmp_path, "jit_cache_dir=null") is None
        assert not entries(tmp_path / "xdg")
    else:
        outer = tmp_path / "outer"
        assert probe(
            tmp_path, f"jit_cache_dir={tmp_path / 'mine'}", env={"JAX_COMPILATION_CACHE_DIR": str(outer)}
        ) == str(outer)
        assert entries(outer) and not entries(tmp_path / "mine")


def test_a_cache_directory_that_cannot_be_made_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, f"jit_cache_dir={tmp_path / 'file' / 'sub'}"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert f"jit_cache_dir: cannot create {tmp_path / 'file' / 'sub'}" in out.stderr, out.stderr[-2000:]
