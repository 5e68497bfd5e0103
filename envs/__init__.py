"""Text environments for multi-turn agent RL, and a fault-tolerant pool to run them.

- :class:`Env` (``envs.core``): the protocol, Gymnasium-style with text in and out,
  plus a system prompt, an action-format description, a hashable state key and an
  optional expert.
- :func:`make`: build an env by name: ``frozenlake``, ``sokoban``, ``countdown``,
  ``toolmath``, ``qa/jsonl``, ``qa/tfds``, ``reasoning_gym/<dataset>``,
  ``gymnasium/<id>``, ``textworld/<game type>``, ``textarena/<game id>``.
- :class:`EnvPool`: slots of envs stepped in batches by worker processes, with
  per-step timeouts; a crash, hang or error ends only that episode.
- :mod:`envs.tasks`: question/answer task sources with exact verifiers.

This package is plain Python: it does not import JAX, nor ``jaxagent`` but for two
standard-library-only modules: ``jaxagent.failures`` (the failure kinds of the pool's
failed results, shared with the agent programs' pool; ``import envs`` loads it, and so
the light ``jaxagent`` package), and ``jaxagent.specs`` (the JSONL task reader it
shares with the gateway), imported when a task file is read, never by ``import envs``.
"""

from envs.core import (
    Env,
    InvalidAction,
    MissingExtraError,
    TextEnv,
    import_modules,
    is_known,
    known_envs,
    make,
    make_with_imports,
    register,
)
from envs.pool import EnvPool, EnvPoolError
from envs.tasks import JsonlTasks, ListTasks, QAEnv, ReasoningGymTasks, Task, TaskSource, TfdsTasks


def rollout(env: Env, seed: int, policy=None, max_turns: int = 1000) -> list[dict]:
    """Play one episode, returning its transcript: one dict per turn with ``action``,
    ``observation``, ``reward``, ``terminated``, ``truncated`` (the first entry holds
    the reset observation and no action).

    ``policy(observation, env) -> action text``; by default the env's expert.
    """
    if policy is None:
        if not env.has_expert:
            raise ValueError(f"{type(env).__name__} has no expert; pass a policy")
        policy = lambda obs, e: e.expert_action()  # noqa: E731
    obs, info = env.reset(seed)
    transcript = [
        {"action": None, "observation": obs, "reward": 0.0, "terminated": False, "truncated": False, "info": info}
    ]
    for _ in range(max_turns):
        action = policy(obs, env)
        obs, reward, terminated, truncated, info = env.step(action)
        transcript.append(
            {
                "action": action,
                "observation": obs,
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "info": info,
            }
        )
        if terminated or truncated:
            break
    return transcript


__all__ = [
    "Env",
    "TextEnv",
    "InvalidAction",
    "MissingExtraError",
    "make",
    "register",
    "known_envs",
    "import_modules",
    "make_with_imports",
    "is_known",
    "EnvPool",
    "EnvPoolError",
    "Task",
    "TaskSource",
    "ListTasks",
    "JsonlTasks",
    "ReasoningGymTasks",
    "TfdsTasks",
    "QAEnv",
    "rollout",
]
