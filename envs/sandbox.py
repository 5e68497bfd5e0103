"""Run untrusted Python code in a fresh, limited, isolated subprocess (the `pycode` tool).

    result = run_python("print(sum(range(10)))", limits=Limits())
    result.stdout            # "45\n"
    result.status            # "ok", "error" (non-zero exit), "timeout", "killed (SIGSEGV)", ...

Each call:

- runs `python3 -I -S -c CODE` (isolated mode: no user site, no PYTHON* variables, no
  current directory on `sys.path`) with an empty environment, in a new temporary
  directory that is removed afterwards, in its own session;
- under resource limits set in the child before it runs (`resource.setrlimit`): CPU
  seconds, address space, the size of any file it writes (stdout and stderr go to files
  in the temporary directory, so this also caps the output), open files and processes
  (the kernel does not hold root to a process limit, so a root caller runs the code as
  user `nobody`, 65534);
- under a wall-clock timeout, after which the whole process group is killed;
- isolated by `bubblewrap` when the `bwrap` command works (the OS package
  `bubblewrap`): a read-only view of the file system with `/tmp` and the home
  directories hidden, the temporary directory as the only writable place, no network
  (`--unshare-net`), its own PID namespace and `/proc` (every process it started dies
  with it, and it can neither see nor signal a process outside) and no way back to the
  parent's terminal (`--new-session`). Without bwrap, `unshare -rnpf` gives no network
  and its own PID and user namespaces (it cannot signal a process outside, nor read one's
  environment), but the file system is NOT isolated: the code can read and write
  whatever the worker's user can, and `/proc` is the host's (it sees every process and
  its command line). Without either, only the limits and the process group apply: the
  code can signal, and read the `/proc` of, every process of its user (as root it runs as
  `nobody`, so not the worker, but other runs' code; as another user, the worker too).

It fails closed: `run_python` runs under bubblewrap unless the caller asks for less
(`isolation_mode="unshare"` or `"none"`, `pycode`'s `isolation` option), and a mode that
does not work on this machine is an `IsolationUnavailableError` naming what is missing,
how to install it and the option that accepts less, never a silent fallback.
`isolation()` says which is the strongest mode that works here, and `pycode` reports the
mode in use in every reset's info.

The output returned is at most `Limits.max_output` characters of stdout (its start) and
of stderr (its end, where the error is).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ISOLATIONS = ("bwrap", "unshare", "none")
#: what each mode leaves open, for messages and the run's log
WEAKER = {
    "unshare": "no network and its own PID namespace, but the code can read and write whatever this "
    "user can outside its directory",
    "none": "resource limits and a process group only: the code has this user's network, files and processes",
}
#: where the temporary directory appears inside bwrap (on its private /tmp)
SANDBOX_DIR = "/tmp/sandbox"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits of one run. wall_s: wall-clock seconds; cpu_s: CPU seconds; memory_mb:
    address space; file_mb: the largest file it may write (output included); max_files:
    open file descriptors; max_procs: processes and threads of the sandbox (enforced by
    `RLIMIT_NPROC` for non-root users, and by the PID namespace's end for everyone);
    max_output: characters of stdout / stderr returned."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 8
    max_files: int = 64
    max_procs: int = 64
    max_output: int = 2000

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"Limits.{f.name} must be a number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Result:
    status: str  # "ok", "error", "timeout", "killed (SIGNAME)", "output limit", "memory limit"
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    isolation: str


#: the user the code runs as when this process is root: the kernel does not apply
#: RLIMIT_NPROC to root, so a fork bomb would otherwise fill the machine's process table
NOBODY = 65534


def _drops_privileges() -> bool:
    return os.geteuid() == 0


def _others_can_run(path: str) -> bool:
    import stat

    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        try:
            if not os.stat(os.sep.join(parts[:i])).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@functools.cache
def interpreter() -> str:
    """The Python the code runs on: this one (its real file: a virtualenv's link may sit in a
    hidden directory), or, when the code runs as `NOBODY` and cannot reach it, the system's."""
    here = os.path.realpath(sys.executable)
    if not _drops_privileges() or _others_can_run(here):
        return here
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _others_can_run(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError(
        f"no Python interpreter that user {NOBODY} may run: {here} is in a directory closed to "
        "other users and there is no /usr/bin/python3"
    )


def _user_tasks(uid: int) -> int:
    """Processes and threads of `uid` now (what RLIMIT_NPROC counts for it)."""
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return n


def _works(cmd: list[str]) -> bool:
    try:
        return (
            subprocess.run(
                cmd + [interpreter(), "-I", "-S", "-c", "pass"],
                capture_output=True,
                timeout=20,
                preexec_fn=_limit_child(Limits()),
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


class IsolationUnavailableError(RuntimeError):
    """The isolation a sandbox run asks for does not work on this machine."""


@functools.cache
def available(mode: str) -> bool:
    """Whether isolation `mode` works on this machine (a trial run of the interpreter)."""
    if mode == "bwrap":
        return bool(shutil.which("bwrap")) and _works(_bwrap_prefix(tempfile.gettempdir()))
    if mode == "unshare":
        return bool(shutil.which("unshare")) and _works(_unshare_prefix())
    return mode == "none"


def isolation() -> str:
    """ "bwrap", "unshare" or "none": the strongest isolation that works on this machine."""
    return next(mode for mode in ISOLATIONS if available(mode))


def require_isolation(mode: str = "bwrap", *, accept_less: str = "isolation_mode='unshare' or 'none'") -> str:
    """`mode` if it works on this machine, else `IsolationUnavailableError` saying what is
    missing, how to install it, and (`accept_less`: the caller's option) how to accept a
    weaker mode deliberately."""
    if mode not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {list(ISOLATIONS)}, got {mode!r}")
    if available(mode):
        return mode
    if mode == "bwrap":
        what = (
            "bubblewrap is not installed (no `bwrap` on PATH)"
            if not shutil.which("bwrap")
            else "`bwrap` is installed but cannot start a sandbox here (are user namespaces disabled?)"
        )
        raise IsolationUnavailableError(
            f"the code sandbox isolates the file system with bubblewrap, and {what}: install it "
            f"(apt-get install bubblewrap), or accept weaker isolation deliberately with {accept_less} "
            f"(unshare: {WEAKER['unshare']}; none: {WEAKER['none']})"
        )
    raise IsolationUnavailableError(
        f"isolation {mode!r} does not work on this machine ("
        + ("no `unshare` on PATH" if not shutil.which("unshare") else "`unshare --user` cannot start here")
        + f"); the strongest that works is {isolation()!r}"
    )


def _bwrap_prefix(workdir: str) -> list[str]:
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    for hidden in ("/home", "/root"):
        if os.path.isdir(hidden):
            cmd += ["--tmpfs", hidden]
    base = os.path.dirname(os.path.dirname(interpreter()))  # its prefix, also under a hidden dir
    if base.startswith(("/home/", "/root/")):
        cmd += ["--ro-bind", base, base]
    cmd += [
        "--bind",
        workdir,
        SANDBOX_DIR,
        "--chdir",
        SANDBOX_DIR,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv",
        "HOME",
        SANDBOX_DIR,
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--",
    ]
    return cmd


def _unshare_prefix() -> list[str]:
    # `sh` between unshare and the code: a child killed by a signal (SIGXCPU at the CPU
    # limit) becomes sh's exit code 128 + n, which unshare passes on (`; exit $?` keeps sh
    # from exec'ing the interpreter in its place). Without it, unshare re-raises the signal
    # on itself, and where that fails ("sigprocmask unblock failed") it exits 1: the limit
    # would read as an ordinary error. sh adds its own line for a killed job to stderr
    # ("CPU time limit exceeded", "Segmentation fault").
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "--",
        "/bin/sh",
        "-c",
        '"$@"; exit $?',
        "sh",
    ]


def _limit_child(limits: Limits):
    """The function run in the child between fork and exec: its resource limits, then (as
    root) the switch to `NOBODY`. RLIMIT_NPROC counts all processes of the real user, so
    for another user it is set to that user's current count plus `max_procs`."""
    import resource

    drop = _drops_privileges()
    nproc = int(limits.max_procs) + (_user_tasks(NOBODY) if drop else _user_tasks(os.getuid()))

    def set_limits():
        mb = 2**20
        cpu = math.ceil(limits.cpu_s)
        for res, soft, hard in (
            (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU first, SIGKILL a second later
            (resource.RLIMIT_AS, int(limits.memory_mb * mb), int(limits.memory_mb * mb)),
            (resource.RLIMIT_FSIZE, int(limits.file_mb * mb), int(limits.file_mb * mb)),
            (resource.RLIMIT_NOFILE, int(limits.max_files), int(limits.max_files)),
            (resource.RLIMIT_NPROC, nproc, nproc),
            (resource.RLIMIT_CORE, 0, 0),
        ):
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError):
                pass  # e.g. a hard limit already lower
        if drop:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    return set_limits


def run_python(code: str, limits: Limits = Limits(), *, isolation_mode: str = "bwrap") -> Result:
    """Runs `code` as described in the module docstring, under `isolation_mode` (bubblewrap
    unless the caller accepts less; `IsolationUnavailableError` where that mode does not
    work here). Never raises for what the code does (a crash, a timeout or a limit is the
    result's `status`)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    mode = require_isolation(isolation_mode)
    workdir = tempfile.mkdtemp(prefix="jaxagent-pycode-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if _drops_privileges():  # the code's only writable place
            for path in (workdir, os.path.join(workdir, "main.py")):
                os.chown(path, NOBODY, NOBODY)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        if mode == "bwrap":
            argv = _bwrap_prefix(workdir) + [interpreter(), "-I", "-S", f"{SANDBOX_DIR}/main.py"]
            cwd = workdir
        elif mode == "unshare":
            argv = _unshare_prefix() + [interpreter(), "-I", "-S", os.path.join(workdir, "main.py")]
            cwd = workdir
        else:
            argv = [interpreter(), "-I", "-S", os.path.join(workdir, "main.py")]
            cwd = workdir
        env = {} if mode == "bwrap" else {"PATH": "/usr/bin:/bin", "HOME": workdir}
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                start_new_session=True,
                preexec_fn=_limit_child(limits),
            )
            status = None
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_group(proc)
        seconds = time.monotonic() - t0
        stdout, stderr = _read(out_path, limits.max_output), _read(err_path, limits.max_output, tail=True)
        code_ = proc.returncode
        if status is None:
            status = _status(code_, stderr, limits, wrapped=mode != "none")
        return Result(status=status, stdout=stdout, stderr=stderr, returncode=code_, seconds=seconds, isolation=mode)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills the run's process group (background processes it left too) and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _read(path: str, limit: int, tail: bool = False) -> str:
    """At most `limit` characters of a file: its start, or (`tail`, for stderr, whose last
    line holds the error) its end."""
    try:
        with open(path, "rb") as f:
            if tail:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 4 * limit - 4))
            data = f.read(4 * limit + 4)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if len(text) <= limit:
        return text
    return "[output truncated]\n" + text[-limit:] if tail else text[:limit] + "\n[output truncated]"


def _status(code: int | None, stderr: str, limits: Limits, wrapped: bool = False) -> str:
    """The result's status from the exit code; `wrapped`: the code ran under bwrap or
    unshare, which report a child killed by signal n as exit code 128 + n."""
    if code == 0:
        return "ok"
    if code is not None and code < 0:
        sig = -code
        if sig == signal.SIGXFSZ:
            return "output limit"
        if sig == signal.SIGXCPU:
            return "cpu limit"
        try:
            return f"killed ({signal.Signals(sig).name})"
        except ValueError:
            return f"killed (signal {sig})"
    if (
        code is not None
        and 128 < code <= 128 + 64
        and (wrapped or code - 128 in (signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSEGV, signal.SIGKILL, signal.SIGABRT))
    ):
        # the unshare / bwrap wrapper reports the child's signal as 128 + n (an exit code in
        # that range read the same way: `sys.exit(139)` looks like a SIGSEGV there)
        return _status(-(code - 128), stderr, limits)
    if "MemoryError" in stderr:
        return "memory limit"
    if "File too large" in stderr:  # a write past file_mb that the code caught as OSError
        return "output limit"
    return "error"
