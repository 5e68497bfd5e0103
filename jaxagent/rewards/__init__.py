"""Episode rewards from outside the env: judge clients (`jaxagent.rewards.judge`) and
their scores as the rewards of a rollout's episodes (`jaxagent.rewards.episodes`).

Standard library only; importing this package loads nothing else of jaxagent. The judge
on a local model, `LocalJudge` (`jaxagent.rewards.local`: JAX, the models and the
sampler), is imported on first use of the name.
"""

from jaxagent.rewards.episodes import JudgeReward, episode_messages
from jaxagent.rewards.judge import (
    COMBINE_MODES,
    DEFAULT_PROMPT,
    FAILURE_KINDS,
    CallableJudge,
    Judge,
    JudgeItem,
    JudgeResult,
    combine,
    make_judge,
    parse_score,
    render_prompt,
    render_transcript,
)
from jaxagent.rewards.openai_judge import OpenAIJudge

__all__ = [
    "JudgeReward",
    "episode_messages",
    "COMBINE_MODES",
    "DEFAULT_PROMPT",
    "FAILURE_KINDS",
    "CallableJudge",
    "Judge",
    "JudgeItem",
    "JudgeResult",
    "LocalJudge",
    "OpenAIJudge",
    "combine",
    "make_judge",
    "parse_score",
    "render_prompt",
    "render_transcript",
]


def __getattr__(name):
    if name == "LocalJudge":
        from jaxagent.rewards.local import LocalJudge

        return LocalJudge
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
