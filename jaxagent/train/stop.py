"""SIGINT and SIGTERM during a run: stop at the end of the iteration, checkpointed.

The first SIGINT (Ctrl-C) or SIGTERM (what clusters send before preemption) during the RL
iterations lets the iteration in progress finish; the trainer then saves a checkpoint
and raises `Interrupted`, so the env pool is closed and the command exits with one line
and status 128 + the signal number (130, 143). A second signal, or the first one outside
the iterations (warm start, evaluation before RL), or in a run of several processes
(which must stop at the same iteration), raises `Interrupted` at once: the iteration in
progress is abandoned, and the newest checkpoint is the one to resume from.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by `signum`; `saved_iteration`: the checkpoint written on the
    way out (None when the iteration in progress was abandoned)."""

    def __init__(self, signum: int, saved_iteration: int | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.saved_iteration = saved_iteration


class StopRequests:
    """Installs the handlers (in the main thread only) for the `with` block; `graceful`
    (set by the trainer around each iteration) makes the first signal a request that
    `requested` reports, instead of an immediate `Interrupted`."""

    def __init__(self, log=print) -> None:
        self.log = log
        self.graceful = False
        self.signum: int | None = None
        self._previous: dict = {}
        self._unraisable: Callable[[sys.UnraisableHookArgs], object] | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            # A signal can arrive while Python runs a finalizer or a gc callback (JAX has
            # one), where the exception the handler raises is printed as "Exception ignored
            # in ..." and dropped. The stop is then still requested (`signum` is set, and
            # the iteration ends with a checkpoint), so the dropped exception is not shown.
            self._unraisable = sys.unraisablehook
            sys.unraisablehook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        previous = getattr(self, "_unraisable", None)
        if previous is not None:
            sys.unraisablehook = previous
            self._unraisable = None

    def _hook(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, Interrupted):
            return
        (self._unraisable or sys.__unraisablehook__)(unraisable)

    def _handle(self, signum, frame) -> None:
        if self.signum is None and self.graceful:
            self.signum = signum
            self.log(
                f"{signal.Signals(signum).name}: stopping after this iteration, with a checkpoint "
                "(send it again to stop now)"
            )
            return
        self.signum = self.signum or signum
        raise Interrupted(signum)
