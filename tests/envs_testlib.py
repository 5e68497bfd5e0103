"""Shared fixtures for the environment tests."""

import time

import pytest


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every pool a test starts is closed: no worker outlives its test."""
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before
            and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[p.cmdline() for p in left]}"
