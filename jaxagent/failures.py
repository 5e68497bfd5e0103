"""Every way a worker can fail an episode: the words of ``failure_kind``.

Two worker pools run user code for the trainer, and either can fail one episode (never
the run) with a failure kind: the env pool (``envs.pool``, the ``info["failure_kind"]``
of a failed result) and the agent programs' pool (``jaxagent.gateway.program``, a
session's ``SessionOutcome.failure_kind``, and ``jaxagent.gateway.loop.ProgramLoop``,
the failed episode's). The trainer counts an iteration's failed episodes per kind, the
metric ``failed_<kind>`` (``failed_timeout``, ``failed_no_calls``, ...), whichever pool
failed them, so a failure both pools can have is one word here for both.

The kinds, and which pool can produce each:

- ``raised`` (both): the user's code raised an exception: the env's ``reset``,
  ``step``, ``expert_action`` or its factory; the agent program, or loading it in its
  worker process. Its traceback is kept.
- ``crashed`` (both): the process running the code died (a segfault, ``os._exit``, an
  OOM kill), or an env worker did not start within ``startup_timeout``.
- ``timeout`` (both): the code ran past its time: an env call past ``step_timeout`` /
  ``reset_timeout`` (its worker is then killed); a program past ``agent.timeout_s``, or
  a program worker process that held up its sessions past their time.
- ``invalid_result`` (both): the code returned what its contract does not allow: an env
  result that is not a valid one (``envs.core``); a program's return that is not a
  finite reward or a dict with a finite numeric ``reward`` and numeric metrics.
- ``unpicklable`` (env pool): an env's result could not be pickled in the worker, or
  unpickled in the pool's process.
- ``memory_limit`` (env pool): the env allocated past its worker's ``memory_limit_mb``.
- ``cpu_limit`` (env pool): an env call used more than ``cpu_limit_s`` CPU seconds (the
  kernel ended the worker).
- ``replay_diverged`` (env pool): replaying an episode into a restarted worker gave
  other observations than the first time (the env is not deterministic).
- ``worker_lost`` (env pool): the worker died again and again without running any env,
  or no result came back.
- ``no_calls`` (agent programs): the program returned without one call through its
  client, so there is nothing to train on.
- ``stale`` (agent programs): the episode has a call sampled more than
  ``agent.max_staleness`` policy versions before the current one (``ProgramLoop``).

A judge's failures (``jaxagent.rewards.judge``, ``judge_*``) are not a worker's and are
named there. Standard library only, and imports nothing: ``envs`` (plain Python, no
JAX) and the gateway's ``program`` module import it at module level.
"""

#: the user's code (an env's, an agent program's) raised an exception
RAISED = "raised"
#: the process running the user's code died, or an env worker did not start in time
CRASHED = "crashed"
#: the user's code ran past its time limit
TIMEOUT = "timeout"
#: the user's code returned something its contract does not allow
INVALID_RESULT = "invalid_result"
#: an env's result could not be pickled in the worker, or unpickled in the pool's process
UNPICKLABLE = "unpicklable"
#: the env allocated past its worker's ``memory_limit_mb``
MEMORY_LIMIT = "memory_limit"
#: the env call used more than ``cpu_limit_s`` CPU seconds (the kernel ended the worker)
CPU_LIMIT = "cpu_limit"
#: replaying the episode into a restarted env worker gave other observations
REPLAY_DIVERGED = "replay_diverged"
#: the env worker died again and again without running any env, or no result came back
WORKER_LOST = "worker_lost"
#: the agent program returned without one call through its client
NO_CALLS = "no_calls"
#: the program's episode has a call sampled more than ``agent.max_staleness`` policy
#: versions ago
STALE = "stale"

#: Every ``info["failure_kind"]`` a failed result of the env pool can carry.
ENV_POOL_KINDS = (
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
#: Every kind an agent program's episode can fail with: a session's
#: ``SessionOutcome.failure_kind`` (all but ``stale``), or ``stale``, which
#: ``ProgramLoop`` gives the episode.
PROGRAM_KINDS = (RAISED, TIMEOUT, INVALID_RESULT, NO_CALLS, CRASHED, STALE)
#: The env pool's failures its worker caught and reported, going on running; the worker
#: is restarted after them unless ``restart_on_exception=False`` (the other kinds
#: restart it anyway).
CAUGHT_KINDS = (RAISED, INVALID_RESULT, UNPICKLABLE, MEMORY_LIMIT)
