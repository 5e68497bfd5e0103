"""Optional native CPU kernel for GAE, built on first use and called through XLA's FFI.

A reverse ``lax.scan`` over T steps pays XLA's per-iteration cost plus two
transposes (time-major scanning of a ``[B, T]`` array); one C++ pass per row
backwards in time is bound by memory bandwidth instead. The kernel
(``native/gae_cpu.cc``) is compiled with the system C++ compiler against the
FFI headers that ship with jaxlib, cached under ``$JAXAGENT_CACHE`` (default
``~/.cache/jaxagent``) by a hash of its source and the jaxlib version, and
registered once per process.

Nothing here is required: without a compiler, on GPU/TPU, with traced (non-
constant) ``gamma``/``lam``, or with ``JAXAGENT_NATIVE=0``, ``gae`` uses the
pure-JAX scan. Set ``JAXAGENT_NATIVE=require`` to make a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxagent_gae_f32"
_SOURCE = Path(__file__).with_name("native") / "gae_cpu.cc"
_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXAGENT_CACHE", Path.home() / ".cache" / "jaxagent"))


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> Path:
    """Compile the kernel (atomically, into the cache) unless already there."""
    import jaxlib

    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib.__version__.encode()).hexdigest()[:16]
    out = _cache_dir() / f"gae_cpu-{key}.so"
    if out.exists():
        return out
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        cxx,
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-I{jax.ffi.include_dir()}",
        str(_SOURCE),
        "-o",
        tmp,
        "-lpthread",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent reader sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """Whether the native kernel is built and registered (builds it on first call)."""
    mode = os.environ.get("JAXAGENT_NATIVE", "1").lower()
    if mode in ("0", "false", "off", "no"):
        return False
    with _lock:
        if "ok" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxagentGaeF32), platform="cpu")
                _state["lib"] = lib  # keep the library loaded
                _state["ok"] = True
            except Exception as err:  # noqa: BLE001 - any failure means "use the scan"
                if mode == "require":
                    raise
                warnings.warn(
                    f"jaxagent: native GAE kernel unavailable, using lax.scan ({err})", RuntimeWarning, stacklevel=3
                )
                _state["ok"] = False
        return _state["ok"]


def gae(r, v, valid, gamma: float, lam: float, whiten: bool):
    """``(advantages, returns)`` from the kernel (whitened in the kernel when
    ``whiten``); masked steps are never read and come out 0. CPU only: callers
    dispatch by platform."""
    shape = jax.ShapeDtypeStruct(r.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (shape, shape), vmap_method="sequential")
    # gamma·lam is rounded once from double, as a Python-scalar product would be.
    return call(r, v, valid, gamma=np.float32(gamma), gamma_lam=np.float32(gamma * lam), whiten=np.int32(bool(whiten)))
