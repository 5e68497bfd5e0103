"""One-step off-policy overlap: the next iteration's rollout runs while this one updates.

`OffPolicyRollouts.start(collect, staleness)` runs `collect()` (a rollout over a copy
of the pre-update params, from a fixed stream position: it reads no trainer state) in
one background thread; `result()` waits for it and returns a `Pending` with the
rollout, its seconds and its staleness (the updates its params lag behind: 0 for the
first batch of a run or after a resume, then 1). The update corrects the lag by
truncated importance sampling against the sampler's log-probs (`loss.tis_cap`).

The thread only runs the function it is given and hands its result back through the
future: no trainer state is written from it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Pending:
    """A finished background rollout."""

    collected: Any  # what `collect()` returned
    seconds: float  # its wall time in the thread
    staleness: int  # updates its params lag behind the ones it is trained with


class OffPolicyRollouts:
    """The rollout thread (module docstring); `close()` waits for it and shuts it down."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None

    @property
    def pending(self) -> bool:
        """A rollout was started and not yet taken with `result()`."""
        return self._future is not None

    def start(self, collect: Callable[[], Any], *, staleness: int) -> None:
        if self._future is not None:
            raise RuntimeError("OffPolicyRollouts.start: a rollout is already in flight")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxagent-rollout")

        def run():
            t0 = time.perf_counter()
            out = collect()
            return Pending(out, time.perf_counter() - t0, staleness)

        self._future = self._pool.submit(run)

    def result(self) -> Pending:
        """The running rollout's result (waits; re-raises its error)."""
        future, self._future = self._future, None
        if future is None:
            raise RuntimeError("OffPolicyRollouts.result: no rollout in flight")
        return future.result()

    def wait(self) -> None:
        """Waits for a running rollout (before the loop or env pool is used otherwise);
        its result stays available to `result()`."""
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def discard(self) -> None:
        """Waits for a running rollout and drops it (the run stops)."""
        self.wait()
        self._future = None

    def close(self) -> None:
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
