"""The env pool's failure kinds: what ``info["failure_kind"]`` of a failed result says.

The trainer counts an iteration's failed episodes per kind (the metric
``failed_<kind>``), whichever worker pool failed them: this pool, or the agent
programs' (``jaxagent.gateway.program``). A failure both pools can have is spelled the
same in both: ``raised`` (the user's code raised an exception), ``crashed`` (the process
running it died), ``timeout`` (it ran past its time) and ``invalid_result`` (it
returned something its contract does not allow); ``tests/test_gateway_program.py``
checks that the two modules agree. The words live in two modules, not one, because
neither package may import the other: ``envs`` is plain Python without ``jaxagent``
(``tests/test_envs_core.py``), and the gateway plays no env (``tests/test_layering.py``).

Stdlib only, like the rest of the pool.
"""

from __future__ import annotations

# ---------------------------------------------------------------- the words both pools share

#: the env's code (``reset``, ``step``, ``expert_action``, its factory) raised an exception
RAISED = "raised"
#: the worker process died (a segfault, ``os._exit``, an OOM kill), or did not start
#: within ``startup_timeout``
CRASHED = "crashed"
#: the call ran past ``step_timeout`` / ``reset_timeout`` (its worker is then killed)
TIMEOUT = "timeout"
#: the env returned something that is not a valid result (see ``envs.core``)
INVALID_RESULT = "invalid_result"

# ---------------------------------------------------------------- the pool's own

#: the result cannot be pickled in the worker, or unpickled in the pool's process
UNPICKLABLE = "unpicklable"
#: the env allocated past the worker's ``memory_limit_mb``
MEMORY_LIMIT = "memory_limit"
#: the env call used more than ``cpu_limit_s`` CPU seconds (the kernel ended the worker)
CPU_LIMIT = "cpu_limit"
#: replaying the episode into a restarted worker gave other observations
REPLAY_DIVERGED = "replay_diverged"
#: the worker died again and again without running any env, or no result came back
WORKER_LOST = "worker_lost"

#: Every ``info["failure_kind"]`` a failed result can carry.
FAILURE_KINDS = (
    RAISED,
    INVALID_RESULT,
    UNPICKLABLE,
    TIMEOUT,
    CRASHED,
    MEMORY_LIMIT,
    CPU_LIMIT,
    REPLAY_DIVERGED,
    WORKER_LOST,
)
#: Failures the worker caught and reported, going on running; the worker is restarted
#: after them unless ``restart_on_exception=False`` (the other kinds restart it anyway).
CAUGHT_KINDS = (RAISED, INVALID_RESULT, UNPICKLABLE, MEMORY_LIMIT)
