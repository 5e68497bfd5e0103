"""A judge's score as the reward of a rollout's episodes: `JudgeReward`.

    loop.reward_fn = JudgeReward(make_judge(spec), mode="replace", on_failure="drop")

`AgentLoop.run` calls it with the batch's finished episodes before packing them. Each
episode that ended without an env failure becomes a `JudgeItem` (its system prompt,
observations as "user" and actions as "assistant", in order; the env's final info), and
the whole batch goes to the judge in one `score_batch` call (concurrent calls, a
deadline: a slow or failing judge costs its episodes, never the run).

- A score: the episode's last turn reward becomes `combine(env reward, score, mode,
  weight)`; `info["judge"]` records the score, the env's reward and the seconds.
- A failure, `on_failure="drop"`: the episode fails (`failure_kind` = the judge's,
  e.g. "judge_timeout"), so the trainer leaves it out of the loss and counts it in
  `failed_<kind>`. `on_failure="env"`: it keeps the env's reward, and `info["judge"]`
  records the failure.

`JudgeReward.from_config(section)` builds it from the trainer's `reward` section (None
when `reward.judge` is null).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxagent.rewards.judge import Judge, JudgeItem, combine, make_judge


def episode_messages(ep) -> list[dict]:
    """An episode's conversation as chat messages: the system prompt, then each
    observation ("user") and the action that followed it ("assistant")."""
    out = []
    if ep.system_prompt:
        out.append({"role": "system", "content": str(ep.system_prompt)})
    for k, obs in enumerate(ep.observations):
        out.append({"role": "user", "content": str(obs)})
        if k < len(ep.actions):
            out.append({"role": "assistant", "content": str(ep.actions[k])})
    return out


class JudgeReward:
    """See the module docstring."""

    def __init__(self, judge: Judge, *, mode: str = "replace", weight: float = 1.0, on_failure: str = "drop"):
        if on_failure not in ("drop", "env"):
            raise ValueError(f"on_failure must be 'drop' or 'env', got {on_failure!r}")
        combine(0.0, 0.0, mode, weight)  # a bad mode or weight is named now, not per episode
        self.judge, self.mode, self.weight, self.on_failure = judge, mode, float(weight), on_failure
        #: counts of the last call: scored, failed by kind
        self.last: dict[str, int] = {}

    @classmethod
    def from_config(cls, section) -> JudgeReward | None:
        if section.judge is None:
            return None
        return cls(make_judge(section.judge), mode=section.mode, weight=section.weight, on_failure=section.on_failure)

    def __call__(self, episodes: Sequence) -> None:
        todo = [ep for ep in episodes if not ep.failed and ep.rewards]
        self.last = {"judged": len(todo)}
        if not todo:
            return
        items = [JudgeItem(key=i, messages=episode_messages(ep), info=dict(ep.info or {})) for i, ep in enumerate(todo)]
        for ep, res in zip(todo, self.judge.score_batch(items), strict=True):
            env_reward = float(ep.rewards[-1])
            if res.score is not None:
                ep.rewards[-1] = combine(env_reward, res.score, self.mode, self.weight)
                ep.info = {
                    **(ep.info or {}),
                    "judge": {"score": res.score, "env_reward": env_reward, "seconds": res.seconds},
                }
                continue
            self.last[res.failure_kind] = self.last.get(res.failure_kind, 0) + 1
            if self.on_failure == "env":
                ep.info = {**(ep.info or {}), "judge": {"failure_kind": res.failure_kind, "detail": res.detail}}
            else:
                ep.fail({"failure": f"judge: {res.detail}", "failure_kind": res.failure_kind})
