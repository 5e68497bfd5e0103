"""Transparent huge pages for the big host buffers of XLA:CPU (and torch), on request.

On Linux with glibc, a jitted step's temporary buffer (4.5 GB for W10's LoRA update of
SmolLM2-135M) is allocated with `mmap` at every call and freed after it, so every call
faults in all of its pages again, 4 KiB at a time: 1.1 million minor page faults and
2.2-3.2 s of kernel time per W10 step on the 2-core benchmark machine, about a quarter of
the step. glibc 2.35 and later can ask the kernel for 2 MiB transparent huge pages on
those mappings (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which `madvise`s them
`MADV_HUGEPAGE`): the same step then takes 2,160-2,300 faults and 0.4-0.6 s of kernel
time (`benchmarks/README.md`, W10).

It is not the default: through the whole trainer (three iterations of the SmolLM2
FrozenLake recipe, LoRA, 8 micro-batches, two runs each way) the same setting cut page
faults from 9.0-9.4 to 1.5-1.7 million but doubled the kernel time (34 s -> 59-64 s a
run) and left the update phase where it was (docs/results/benchmarks.md, W10). Set
`JAXAGENT_HUGEPAGES=1` to turn it on.

The setting is read once, when the process starts, so the `jaxagent` command
re-executes itself with it (the same process id, arguments and interpreter) before
doing anything else; worker processes inherit it. Nothing changes unless
`JAXAGENT_HUGEPAGES` is `1` (or `on`, `true`, `yes`), and not then either when the
process already has a `glibc.malloc.hugetlb` setting, when the kernel's transparent
huge pages are not `madvise` (with `always` every big mapping gets them without
asking, and glibc's setting does nothing; with `never` none does), when the C library
is not glibc 2.35+, or off Linux. Library
imports never re-execute: only the command-line entry point calls
:func:`reexec_if_needed`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
SWITCH = "JAXAGENT_HUGEPAGES"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_ok() -> bool:
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return False
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def _thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def wanted(
    env: Mapping[str, str] | None = None, *, thp_mode: str | None = "auto", glibc_ok: bool | None = None
) -> bool:
    """Whether a process started with `env` should get the huge-page malloc setting."""
    env = os.environ if env is None else env
    if env.get(SWITCH, "").strip().lower() not in ("1", "on", "true", "yes"):
        return False  # off unless asked for
    if "glibc.malloc.hugetlb" in env.get("GLIBC_TUNABLES", ""):
        return False  # already set (by us, or by the user, to any value)
    if not sys.platform.startswith("linux"):
        return False
    if not (_glibc_ok() if glibc_ok is None else glibc_ok):
        return False
    mode = _thp_mode() if thp_mode == "auto" else thp_mode
    return mode == "madvise"  # `always` gives huge pages without asking; `never`, none


def environ(env: Mapping[str, str] | None = None, **kwargs) -> dict[str, str]:
    """A copy of `env` (default `os.environ`) with the setting added when :func:`wanted`."""
    env = dict(os.environ if env is None else env)
    if wanted(env, **kwargs):
        old = env.get("GLIBC_TUNABLES", "")
        env["GLIBC_TUNABLES"] = f"{old}:{TUNABLE}" if old else TUNABLE
    return env


def reexec_if_needed() -> None:
    """Re-execute this process with the setting when :func:`wanted` (does not return
    then); otherwise return at once. Call before any work: nothing after the call runs
    twice only if nothing ran before it."""
    if not wanted():
        return
    argv = list(getattr(sys, "orig_argv", None) or [])
    if not argv or not sys.executable:
        return
    env = environ()
    for stream in (sys.stdout, sys.stderr):  # what was printed must not be lost with the old image
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # could not re-execute: carry on without huge pages
