"""What the pool's two sides share: the item ops, the messages on the pipe, the
progress array, the shape of an item's result, and the pool's error (the failure kinds
are in ``jaxagent.failures``).

An *item* is one env call for one slot, ``(slot, op, arg)``; a *batch* is the list of
items the parent sends one worker at a time. The worker answers each item with::

    ("ok", payload, digest)            payload: the reset / step result, the expert's
                                       action, or None for a replay
    ("fail", kind, message, traceback) kind: one of ``jaxagent.failures.ENV_POOL_KINDS``

Messages, parent to worker: ``(RUN, seq, items)``, ``(RESEND,)`` (the batch's results
could not be unpickled in the parent: send them one by one), ``(EXIT,)``. Worker to
parent: ``(READY, pid)`` once, then per batch ``(DONE, results)`` or
``(ITEMS, [pickled result, ...])``.

The progress array (three doubles in shared memory, written by the worker, read by the
parent for its timeouts): ``[PROGRESS_ITEM]`` the index in the batch of the item
running (-1 between batches), ``[PROGRESS_STARTED]`` its start time
(``time.monotonic``, one clock for all processes), ``[PROGRESS_DONE]`` the sequence
number of the last batch finished.
"""

from __future__ import annotations

#: Seconds within which a worker notices that the pool's process died and exits.
PARENT_POLL_S = 0.2

# Item ops. RESET / STEP are also the ops of `EnvPool.send`; EXPERT asks a slot's env
# for its expert's action; REPLAY rebuilds an episode in a restarted worker.
RESET, STEP, REPLAY, EXPERT = "reset", "step", "replay", "expert"

# Message tags.
RUN, RESEND, EXIT = "run", "resend", "exit"
READY, DONE, ITEMS = "ready", "done", "items"

# Indices into the progress array.
PROGRESS_ITEM, PROGRESS_STARTED, PROGRESS_DONE = 0, 1, 2


class EnvPoolError(RuntimeError):
    """The pool itself cannot go on (e.g. workers cannot be started at all)."""
