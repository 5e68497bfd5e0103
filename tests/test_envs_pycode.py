"""The `pycode` env and its sandbox (`envs.sandbox`): tasks checked exactly, and code
that tries to escape or abuse the sandbox contained, with the env worker alive after it.

The file-system checks need bubblewrap (the OS package `bubblewrap`, installed by
`.ci/run`); without it the other checks run under the strongest mode that works here,
chosen explicitly, and the sandbox's refusal to run unisolated is checked on a PATH
without bwrap."""

import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import envs
from envs import EnvPool, sandbox
from envs.pycode import TEMPLATES, expert_program, make_task, solve, tool_call
from envs.sandbox import IsolationUnavailableError, Limits, isolation, run_python

BWRAP = sandbox.available("bwrap")
#: the strongest isolation here, asked for explicitly (the default, bwrap, refuses to run without it)
MODE = isolation()
ROOT = Path(__file__).resolve().parents[1]


def test_known_answers():
    # facts from outside the code under test (Project Euler 10's small case, OEIS A000045, A006877)
    assert solve("prime_sum", {"n": 10}) == "17"
    assert solve("prime_sum", {"n": 1000}) == "76127"
    assert solve("fib_mod", {"n": 100, "m": 1000}) == str(354224848179261915075 % 1000)
    assert solve("collatz_longest", {"n": 1000}) == "871"
    assert solve("collatz_longest", {"n": 10}) == "9"
    assert solve("digit_sum_count", {"a": 1, "b": 20, "k": 5}) == "3"  # 5, 14, 19
    assert solve("word_rank", {"words": ["bb", "a", "ab", "c"], "k": 3}) == "ab"
    assert solve("product_residues", {"n": 2, "m": 3}) == "2"  # 1, 2, 2, 4 -> mod 3: {1, 2}
    assert solve("product_residues", {"n": 3, "m": 4}) == "4"  # 1 2 3 2 4 6 3 6 9 -> mod 4: {0, 1, 2, 3}


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_experts_program_agrees_with_the_answer(template):
    for seed in range(4):
        _, params = make_task(template, random.Random(seed))
        r = run_python(expert_program(template, params), isolation_mode=MODE)
        assert r.status == "ok", (template, seed, r)
        assert r.stdout.strip() == solve(template, params), (template, seed)


def test_expert_episodes_succeed_and_mistakes_do_not():
    for seed in range(6):
        env = envs.make("pycode", isolation=MODE)
        obs, info = env.reset(seed=seed)
        assert info["isolation"] == MODE
        total, turns = 0.0, 0
        while True:
            obs, reward, term, trunc, info = env.step(env.expert_action())
            total, turns = total + reward, turns + 1
            if term or trunc:
                break
        assert total == 1.0 and info["success"] and turns == 2
    env = envs.make("pycode", isolation=MODE)
    env.reset(seed=0)
    obs, reward, term, _, info = env.step("<answer>-1</answer>")
    assert term and reward == 0.0 and not info["success"]
    env.reset(seed=0)
    obs, reward, term, _, info = env.step("I think it is 12")
    assert (
        not term
        and reward == env.invalid_penalty
        and "make a tool call or give the final answer" in info["invalid_action"]
    )
    obs, reward, term, _, info = env.step('<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>')
    assert "no tool named 'shell'" in info["invalid_action"]


ABUSE = {
    "reads a file outside": ("print(open('/etc/hostname').read())", None),
    "writes outside its directory": ("open({target!r}, 'w').write('x'); print('wrote')", None),
    "writes its own directory": ("open('a.txt', 'w').write('x'); print(open('a.txt').read())", "ok"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
    "infinite loop": ("while True:\n    pass", "cpu limit"),
    "huge output": ("print('x' * 10**8)", None),
    "memory bomb": ("b = bytearray(8 * 2**30)\nprint(len(b))", "memory limit"),
    "ctypes crash": ("import ctypes\nctypes.string_at(0)", "killed (SIGSEGV)"),
    "opens a socket": (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
        "error",
    ),
    "leaves a process behind": ("import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint('started')", "ok"),
}


def _sandbox_processes():
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "sleep" in " ".join(p.cmdline() or [])]


@pytest.mark.parametrize("name", list(ABUSE))
def test_abuse_is_contained_and_the_worker_survives(name):
    code, want = ABUSE[name]
    # outside /tmp (private to the sandbox under bwrap): beside this file
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".sandbox-escape-{os.getpid()}")
    code = code.format(target=target)
    # the CPU-limit case gets a wall limit far above its CPU limit: on a loaded machine (CI runs
    # three test workers on two cores) a busy loop may get a third of a core, and it must
    # still meet its CPU limit before its wall limit
    wall_s, cpu_s = (15, 1) if want == "cpu limit" else (3, 2)
    fns = [
        functools.partial(
            envs.make, "pycode", wall_s=wall_s, cpu_s=cpu_s, memory_mb=256, max_output=200, isolation=MODE
        )
    ] * 2
    with EnvPool(fns, num_workers=1, step_timeout=60) as pool:
        pool.reset([0, 1])
        t0 = time.monotonic()
        (obs, reward, term, trunc, info), _ = pool.step([tool_call(code), None])
        assert not info.get("failed"), info  # a tool result, not a worker failure
        assert time.monotonic() - t0 < 20
        status = info["tool_status"]
        if want is not None:
            assert status == want, (name, obs)
        if name == "reads a file outside":
            assert status == "ok"  # the file system is readable (read-only under bwrap)
        if name == "writes outside its directory":
            if BWRAP:
                escaped = os.path.exists(target)
                if escaped:
                    os.remove(target)
                # read-only, or (a checkout under /tmp, which bwrap hides) not there at all
                assert status == "error" and not escaped, obs
                assert "Read-only file system" in obs or "No such file or directory" in obs, obs
            else:  # documented: without bwrap the file system is not isolated
                pytest.skip(f"isolation {isolation()!r}: writes outside the sandbox are not prevented")
        if name == "huge output":
            assert status == "output limit" and len(obs) < 600 and "[output truncated]" in obs, obs
        if name == "opens a socket":
            assert "stdout:\nconnected" not in obs and ("Network is unreachable" in obs or "Errno" in obs), obs
        # nothing is left running, and the same worker still plays both slots
        assert not _sandbox_processes()
        (obs, *_), (obs2, *_) = pool.step([tool_call("print(6 * 7)"), tool_call("print(1 + 1)")])
        assert "stdout:\n42" in obs and "stdout:\n2" in obs2
        assert pool.stats["restarts"] == 0


@pytest.mark.parametrize(
    "code, want",
    [
        ("while True:\n    pass", "cpu limit"),
        ("import ctypes\nctypes.string_at(0)", "killed (SIGSEGV)"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGBUS)", "killed (SIGBUS)"),
        ("import sys\nsys.exit(3)", "error"),
        ("print(6 * 7)", "ok"),
    ],
)
def test_the_unshare_fallback_reports_limits_and_signals(code, want):
    # the isolation used where bwrap is missing: a signal that ends the code must reach the
    # status through the unshare wrapper (it once read as a plain error there)
    if not sandbox.available("unshare"):
        pytest.skip("unshare cannot create namespaces on this machine")
    res = run_python(code, Limits(wall_s=15, cpu_s=1, memory_mb=256), isolation_mode="unshare")
    assert res.isolation == "unshare"
    assert res.status == want, res
    if want == "ok":
        assert res.stdout.strip() == "42"
    if code.startswith("import sys"):
        assert res.returncode == 3


def test_limits_are_checked():
    with pytest.raises(ValueError, match="Limits.wall_s must be a number > 0"):
        Limits(wall_s=0)
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="templates must be a non-empty subset"):
        envs.make("pycode", templates=("nope",))


# ------------------------------------------------------------------ failing closed
@pytest.fixture
def without_bwrap(tmp_path, monkeypatch):
    """This machine as one without bubblewrap: a PATH that holds only `unshare` (where it
    exists), and the sandbox's probes of what works run afresh."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("unshare"):
        (bin_dir / "unshare").symlink_to(shutil.which("unshare"))
    monkeypatch.setenv("PATH", str(bin_dir))
    sandbox.available.cache_clear()
    yield bin_dir
    sandbox.available.cache_clear()


def test_without_bubblewrap_the_sandbox_refuses_to_run(without_bwrap):
    assert not sandbox.available("bwrap")
    with pytest.raises(IsolationUnavailableError) as err:
        run_python("print(1)")
    message = str(err.value)
    assert "bubblewrap is not installed" in message and "apt-get install bubblewrap" in message
    assert "isolation_mode='unshare' or 'none'" in message and "read and write" in message
    with pytest.raises(IsolationUnavailableError, match="env.kwargs.isolation: unshare"):
        envs.make("pycode")
    # less, accepted deliberately, runs and says which
    res = run_python("print(6 * 7)", isolation_mode="none")
    assert (res.status, res.stdout.strip(), res.isolation) == ("ok", "42", "none")
    if sandbox.available("unshare"):
        env = envs.make("pycode", isolation="unshare")
        assert env.reset(seed=0)[1]["isolation"] == "unshare"
    else:
        with pytest.raises(IsolationUnavailableError, match="isolation 'unshare' does not work"):
            envs.make("pycode", isolation="unshare")
    with pytest.raises(ValueError, match="isolation must be one of"):
        run_python("print(1)", isolation_mode="chroot")


def test_a_pycode_run_without_bubblewrap_is_refused_before_compiling(without_bwrap, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxagent",
        "train",
        "--config",
        str(ROOT / "configs" / "toolmath_grpo.yaml"),
        "env.name=pycode",
        "env.kwargs={}",
        f"run_dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "config error" in out.stderr and "apt-get install bubblewrap" in out.stderr
    assert "env.kwargs.isolation: unshare" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_weaker_sandbox_accepted_is_logged_summarised_and_shown(tmp_path):
    """`env.kwargs.isolation: none` (it works on every machine): the run says so at start,
    `summary.json` records it, and `jaxagent view` marks the run."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "jaxagent",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny_countdown_grpo.yaml"),
        "env.name=pycode",
        "env.kwargs={isolation: none, max_turns: 2}",
        "rollout.max_context=1024",
        "env.tasks_per_iteration=1",
        "env.group_size=2",
        "update.mini_batches=1",
        "iterations=1",
        f"run_dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "code sandbox: isolation 'none' accepted by env.kwargs.isolation" in out.stdout
    import json

    assert json.loads((run_dir / "summary.json").read_text())["sandbox_isolation"] == "none"
    from jaxagent import view

    run, _ = view.read_run(run_dir)
    assert run["summary"]["sandbox_isolation"] == "none"
    site = view.write_site([run_dir], tmp_path / "site")
    if shutil.which("chromium") and shutil.which("chromedriver"):
        from browser_testlib import chromium_driver
        from selenium.webdriver.common.by import By

        driver = chromium_driver()
        try:
            driver.get(site.as_uri())
            chips = driver.find_elements(By.CSS_SELECTOR, "#run-list .sandbox-warning")
            assert [c.text.strip() for c in chips] == ["sandbox: none, not isolated"]
        finally:
            driver.quit()


# ------------------------------------------------------------------ escapes per isolation mode
#: probes of the sandbox's walls. Each prints what it could reach; `escaped(out, ctx)` reads
#: that. The network probe lists interfaces (a sandbox without a network has only `lo`)
#: and sends nothing. Which walls each mode has is what the module docstring says.
ESCAPES = {
    "writes the host's /tmp": (
        "open({tmp_target!r}, 'w').write('x'); print('wrote')",
        lambda out, ctx: os.path.exists(ctx["tmp_target"]),
    ),
    "writes through a symlink out of its directory": (
        "import os\nos.symlink({tmp_target!r}, 'link')\nopen('link', 'w').write('x'); print('wrote')",
        lambda out, ctx: os.path.exists(ctx["tmp_target"]),
    ),
    "sees the host's network interfaces": (
        "import socket\nprint(sorted(n for _, n in socket.if_nameindex()))",
        lambda out, ctx: out.strip() not in ("['lo']", "[]"),
    ),
    "sees the host's processes": (
        "import os\nprint(sum(p.isdigit() for p in os.listdir('/proc')))",
        lambda out, ctx: out.strip().isdigit() and int(out) > 20,
    ),
    "leaves a process outside its group": (
        "import os\nif os.fork() == 0:\n    os.setsid()\n"
        "    os.execv('/bin/sleep', ['sleep', {sleep!r}])\nprint('started')",
        lambda out, ctx: _outlives_the_run(),
    ),
    # signal 0 to this process (a check that sends nothing) and SIGTERM to the probe's
    # `victim`, a `sleep` this test started as the user the code runs as
    "signals a host process": (
        "import os, signal\nprint('pidns', os.readlink('/proc/self/ns/pid'))\n"
        "for pid, sig in (({pid}, 0), ({victim}, signal.SIGTERM)):\n"
        "    try:\n        os.kill(pid, sig)\n        print(pid, 'sent')\n"
        "    except OSError as e:\n        print(pid, type(e).__name__)",
        lambda out, ctx: _signalled(out, ctx),
    ),
    # the environment and command line of this process, of the code's parent and of the victim,
    # printed as short hashes (an environment is longer than the output returned)
    "reads the parent's /proc": (
        "import hashlib, os\nfor pid in ({pid}, os.getppid(), {victim}):\n    for name in ('environ', 'cmdline'):\n"
        "        try:\n            data = open(f'/proc/{{pid}}/{{name}}', 'rb').read()\n"
        "            print(pid, name, hashlib.sha256(data).hexdigest()[:16])\n"
        "        except OSError as e:\n            print(pid, name, type(e).__name__)",
        lambda out, ctx: _read_host_proc(out, ctx),
    ),
}
#: the probe's `sleep` argument: 30 seconds and this process's id, so that no other test
#: process's leftover is taken for ours
SLEEP = f"30.{os.getpid()}"
#: what each mode leaves open (everything else is contained); bubblewrap leaves nothing.
#: Under unshare the code has its own PID namespace (it cannot name, so cannot signal, a
#: process outside it) and its own user namespace (the kernel lets it read no other
#: namespace's process's environment), but the host's /proc: it reads command lines there.
#: Under none it signals, and reads the environment of, every process of its user (the
#: victim; as root the code runs as `nobody`, so not this process; else this process too).
OPEN = {
    "bwrap": set(),
    "unshare": {
        "writes the host's /tmp",
        "writes through a symlink out of its directory",
        "sees the host's processes",
        "reads the parent's /proc",
    },
    "none": {
        "writes the host's /tmp",
        "writes through a symlink out of its directory",
        "sees the host's network interfaces",
        "sees the host's processes",
        "leaves a process outside its group",
        "signals a host process",
        "reads the parent's /proc",
    },
}


def _leftovers() -> list:
    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if (p.info["cmdline"] or [])[:2] == ["sleep", SLEEP] and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def _outlives_the_run(deadline_s: float = 5.0) -> bool:
    """Whether the probe's `sleep` runs on after the sandbox returned: it may take a
    loaded machine a while to exec it, and one dying with its namespace may still show
    for a moment, so it must be seen alive twice, half a second apart."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if _leftovers():
            time.sleep(0.5)
            return bool(_leftovers())
        time.sleep(0.1)
    return False


def _kill_leftovers():
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [])[:2] == ["sleep", SLEEP]:
            p.kill()


def _victim(marker: str) -> subprocess.Popen:
    """A process outside the sandbox of the user the code runs as (`nobody` when this
    process is root, else this process's user: then it stands for this process), with
    `marker` in its environment."""
    user = dict(user=sandbox.NOBODY, group=sandbox.NOBODY, extra_groups=[]) if sandbox._drops_privileges() else {}
    return subprocess.Popen(
        ["sleep", "30"],
        env={"JAXAGENT_ESCAPE_MARKER": marker, "PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        **user,
    )


def _signalled(out: str, ctx: dict) -> bool:
    """Whether the victim died of the probe's SIGTERM, or signal 0 reached this process. The
    latter counts only from this PID namespace: in another the same number names another
    process (its own init, where this process is pid 1 in a container)."""
    victim = ctx["victim_proc"]
    try:
        if victim.wait(timeout=2 if f"{victim.pid} sent" in out else 0.05) == -signal.SIGTERM:
            return True
    except subprocess.TimeoutExpired:
        pass
    return f"{ctx['pid']} sent" in out and f"pidns {os.readlink('/proc/self/ns/pid')}" in out


def _read_host_proc(out: str, ctx: dict) -> bool:
    """Whether the probe read this process's environment or command line, or the victim's
    environment (its hash, against the files as this process reads them)."""
    import hashlib

    def digest(pid, name):
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]

    secrets = {digest(ctx["pid"], "environ"), digest(ctx["pid"], "cmdline"), digest(ctx["victim"], "environ")}
    secrets.discard(hashlib.sha256(b"").hexdigest()[:16])  # an empty file (bwrap's init's environment) says nothing
    return any(line.split()[-1] in secrets for line in out.splitlines() if line.strip())


@pytest.mark.parametrize("mode", list(OPEN))
def test_each_isolation_mode_contains_what_it_says(mode, tmp_path):
    """Under bubblewrap every probe is contained; under a weaker mode, accepted
    deliberately, the probes it leaves open do escape (so the probes work) and the others
    are contained. Limits (CPU, memory, output, processes) hold in every mode:
    `test_abuse_is_contained_and_the_worker_survives`."""
    if not sandbox.available(mode):
        pytest.skip(f"isolation {mode!r} does not work on this machine")
    for name, (code, escaped) in ESCAPES.items():
        marker = f"{os.getpid()}-{mode}-{random.getrandbits(64):x}"
        victim = _victim(marker)
        ctx = {
            "tmp_target": f"/tmp/jaxagent-escape-{os.getpid()}-{mode}-{abs(hash(name))}",
            "sleep": SLEEP,
            "pid": os.getpid(),
            "victim": victim.pid,
            "victim_proc": victim,
        }
        try:
            res = run_python(code.format(**ctx), Limits(wall_s=5, cpu_s=3, memory_mb=256), isolation_mode=mode)
            got = escaped(res.stdout, ctx)
        finally:
            victim.kill()
            victim.wait()
            _kill_leftovers()
            if os.path.exists(ctx["tmp_target"]):
                os.remove(ctx["tmp_target"])
        assert got == (name in OPEN[mode]), (mode, name, "escaped" if got else "contained", res)
