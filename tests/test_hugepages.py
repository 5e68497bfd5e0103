"""The command line's huge-page malloc setting (`jaxagent.hugepages`): off unless asked
for, when it applies, and that it re-executes the same process once with it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent import hugepages as H

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import os, sys; print('start', os.getpid(), flush=True); "
    "from jaxagent.hugepages import reexec_if_needed; reexec_if_needed(); "
    "print('tunables', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''), flush=True)"
)


def _run(env):
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", H.SWITCH)}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


def test_wanted_only_when_asked_for_and_where_it_applies():
    # off by default, and for any value but a yes
    for env in ({"PATH": "/bin"}, {H.SWITCH: "0"}, {H.SWITCH: "off"}, {H.SWITCH: ""}, {H.SWITCH: "2"}):
        assert not H.wanted(env, thp_mode="madvise", glibc_ok=True)
    base = {"PATH": "/bin", H.SWITCH: "1"}
    for yes in ("on", "True", " yes "):
        assert H.wanted({**base, H.SWITCH: yes}, thp_mode="madvise", glibc_ok=True) is sys.platform.startswith("linux")
    assert H.wanted(base, thp_mode="madvise", glibc_ok=True) is sys.platform.startswith("linux")
    assert not H.wanted(base, thp_mode="always", glibc_ok=True)  # huge pages without asking: nothing to do
    assert not H.wanted(base, thp_mode="never", glibc_ok=True)
    assert not H.wanted(base, thp_mode=None, glibc_ok=True)  # no THP file
    assert not H.wanted(base, thp_mode="madvise", glibc_ok=False)  # musl, or glibc before 2.35
    # already set, by us or by the user (to any value): never set twice
    assert not H.wanted({**base, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, thp_mode="madvise", glibc_ok=True)


def test_environ_appends_to_the_users_tunables():
    if not sys.platform.startswith("linux"):
        pytest.skip("the setting is for Linux")
    on = {H.SWITCH: "1"}
    env = H.environ({**on, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, thp_mode="madvise", glibc_ok=True)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert H.environ(on, thp_mode="madvise", glibc_ok=True)["GLIBC_TUNABLES"] == H.TUNABLE
    assert "GLIBC_TUNABLES" not in H.environ(on, thp_mode="never", glibc_ok=True)
    assert "GLIBC_TUNABLES" not in H.environ({}, thp_mode="madvise", glibc_ok=True)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert H._thp_mode(str(f)) == "madvise"
    f.write_text("always madvise [never]\n")
    assert H._thp_mode(str(f)) == "never"
    assert H._thp_mode(str(tmp_path / "missing")) is None


def test_reexec_runs_the_same_process_again_once_with_the_setting():
    proc = _run(_clean_env(**{H.SWITCH: "1"}))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    starts = [ln.split() for ln in lines if ln.startswith("start")]
    tun = [ln.split() for ln in lines if ln.startswith("tunables")]
    assert len(tun) == 1
    if H.wanted(_clean_env(**{H.SWITCH: "1"})):
        # executed twice (the second time with the setting), as one process id
        assert len(starts) == 2 and starts[0][1] == starts[1][1] == tun[0][1]
        assert tun[0][2:] == [H.TUNABLE]
    else:
        assert len(starts) == 1 and tun[0][2:] == []


def test_off_by_default_and_an_existing_setting_is_left_alone():
    proc = _run(_clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("start") == 1 and proc.stdout.split("\n")[1].split()[2:] == []
    proc = _run(_clean_env(GLIBC_TUNABLES="glibc.malloc.hugetlb=0", **{H.SWITCH: "1"}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("start") == 1 and proc.stdout.split("\n")[1].split()[2:] == ["glibc.malloc.hugetlb=0"]


def test_the_command_line_gets_the_setting_and_python_calls_do_not(monkeypatch):
    # a Python call of main(argv) never re-executes (tests, notebooks)
    from jaxagent import cli

    monkeypatch.setattr(H, "reexec_if_needed", lambda: (_ for _ in ()).throw(AssertionError("re-executed")))
    assert cli.main(["envs"]) == 0
    # the command line does when asked: main() re-executes this same process (one pid, the
    # setting added) before any of the command's work, which then runs once
    probe = (
        "import os, sys; print('start', os.getpid(), os.environ.get('GLIBC_TUNABLES', '-'), flush=True); "
        "sys.argv = ['jaxagent', 'envs']; from jaxagent.cli import main; main()"
    )
    env = _clean_env(**{H.SWITCH: "1"})
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    starts = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("start ")]
    assert proc.stdout.split().count("intake") == 1
    if H.wanted(env):
        assert [s[1] for s in starts] == [starts[0][1]] * 2
        assert [s[2] for s in starts] == ["-", H.TUNABLE]
    else:
        assert len(starts) == 1


def test_reexec_calls_execve_with_the_setting(monkeypatch):
    # in this process, whatever the machine: execve is replaced by a recorder
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, list(argv), dict(env)))
        raise OSError("recorded")  # as a failed exec: reexec_if_needed carries on

    monkeypatch.setattr(H.os, "execve", fake_execve)
    monkeypatch.setattr(H, "_glibc_ok", lambda: True)
    monkeypatch.setattr(H, "_thp_mode", lambda path=H.THP_ENABLED: "madvise")
    monkeypatch.setattr(H.sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(H.SWITCH, raising=False)
    H.reexec_if_needed()
    assert calls == []  # off by default
    monkeypatch.setenv(H.SWITCH, "1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    H.reexec_if_needed()
    assert len(calls) == 1
    path, argv, env = calls[0]
    assert path == sys.executable and argv == list(sys.orig_argv)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + H.TUNABLE
    assert env[H.SWITCH] == "1"
