"""EnvPool: many text envs stepped in batches by host worker processes, fault-tolerant.

Slot ``i`` of the pool holds one env built from ``env_fns[i]`` (an env name for
:func:`envs.make`, or a zero-argument callable returning an env) in worker process
``i % num_workers``.

The pool has one asynchronous API: ``send({slot: (op, arg), ...})`` starts resets
(``("reset", seed)``) and steps (``("step", action)``) of some slots, whatever other
slots are doing, and ``poll(timeout)`` returns ``{slot: result}`` for those finished so
far (waiting up to ``timeout`` for the first); ``in_flight()`` lists the slots still
owed a result. A worker runs its slots' items one after another, in batches, so a slow
step holds the other slots of its worker only; an item sent to a busy worker starts when
the worker's current batch is done.

The batch calls are written on top of it. ``reset(seeds)`` and ``step(actions)`` act
on all slots at once (``None`` in a slot's place leaves it alone) and return one result
per slot, in slot order. ``submit_reset`` / ``submit_step`` / ``collect`` split such a
call in two so the caller can decode the next actions on the device while the envs
step: ``submit_*`` sends the work to the workers and returns a :class:`PoolCall` handle
at once, ``ready(handle)`` says without blocking whether its results are all in, and
``collect(handle)`` waits for them. One batch call is in flight at a time (a pipelined
caller alternates sub-batches: submit A, decode B, collect A, submit B, ...), and not
while ``send`` results are outstanding (nor ``send`` / ``poll`` while a batch call is in
flight). Every guarantee below (timeouts, fault isolation, replay, determinism) holds
the same for both, and whether the caller collects at once or later, since timeouts are
measured from when each item starts in its worker, not from when the caller collects.

Faults end only the episode that caused them. A step that raises, returns something
that is not a valid 5-tuple (see ``envs.core``), returns a result that cannot be
pickled, runs past ``step_timeout``, or kills its worker process (segfault,
``os._exit``, OOM kill) returns, for that slot only::

    ("", 0.0, False, True, {"failed": True, "failure_kind": KIND, "failure": MESSAGE,
                            "traceback": TEXT_OR_NONE})

with KIND one of ``raised``, ``invalid_result``, ``unpicklable``, ``timeout``,
``crashed``, ``memory_limit``, ``cpu_limit`` (the optional per-worker resource limits),
``replay_diverged``, ``worker_lost`` (``jaxagent.failures.ENV_POOL_KINDS``: one module
names the failures of both worker pools, the env pool's and the agent programs'; a
reset failure returns ``("", info)`` with the same info). The worker process is then
restarted (after an env raised too, unless ``restart_on_exception=False``, which keeps
the process and drops only the faulty env). Every other episode of that worker is rebuilt in the new
worker by replaying its seed and actions; the observations the replay produces are
checked against digests of those first seen, so a healthy episode's transcript is
exactly that of a fault-free run (an env that is not deterministic given its seed and
actions is reported as ``replay_diverged`` instead of silently continuing).

Results are deterministic given the seeds and actions: they do not depend on the
number of workers or on faults in other slots. This asks of an env what replay needs
anyway: that it be deterministic given its seed and actions, keeping its randomness
per instance (``random.Random(seed)``) rather than in process-global state, and that
its expert (``expert_actions``) be a function of the state.

Process hygiene: workers are started with the ``spawn`` context (never ``fork``: the
parent may have JAX and its threads loaded), ignore SIGINT (the parent shuts them
down, also after Ctrl-C, through ``close``, a context manager, or at interpreter
exit), and exit by themselves within ``PARENT_POLL_S`` when the parent process dies.
A call interrupted in the parent (Ctrl-C during ``collect``) closes the pool, since
results still in flight could otherwise be credited to a later call. A pool is used
from one thread.

Cost: one message to and one from each worker per batch (all its slots' items
together); see ``benchmarks/w5_envpool.py`` for the measured overhead.

The modules: ``pool`` (the parent side: :class:`EnvPool`, its slots, calls and fault
handling), ``process`` (the parent's handle on one worker process), ``worker`` (what
runs in the worker processes: the env calls, the limits, the worker's loop) and
``protocol`` (what both sides share: ops, messages, the error). The failure kinds are
``jaxagent.failures``'s (standard library only, shared with the agent programs' pool).
"""

from envs.pool.pool import EnvPool, PoolCall
from envs.pool.protocol import PARENT_POLL_S, EnvPoolError

__all__ = ["EnvPool", "EnvPoolError", "PoolCall", "PARENT_POLL_S"]
