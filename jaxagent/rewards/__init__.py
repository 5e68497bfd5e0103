"""Episode rewards from outside the env: judge clients (`jaxagent.rewards.judge`) and
their scores as the rewards of a rollout's episodes (`jaxagent.rewards.episodes`).

Standard library only; importing this package loads nothing else of jaxagent.
"""
from jaxagent.rewards.judge import (COMBINE_MODES, DEFAULT_PROMPT, FAILURE_KINDS, CallableJudge, Judge, JudgeItem,
                                    JudgeResult, OpenAIJudge, combine, make_judge, parse_score, render_transcript)

from jaxagent.rewards.episodes import JudgeReward, episode_messages

__all__ = ["JudgeReward", "episode_messages", "COMBINE_MODES", "DEFAULT_PROMPT", "FAILURE_KINDS", "CallableJudge", "Judge", "JudgeItem", "JudgeResult",
           "OpenAIJudge", "combine", "make_judge", "parse_score", "render_transcript"]
