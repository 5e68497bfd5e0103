"""The agent loop's schedulers and the env's cut hook, without a model: one module per
scheduler, `AgentLoop.run` only dispatches, and an env's `cut_outcome` reaches the
loop's cut through the env protocol (`envs.TextEnv` carries it in the info)."""

import pytest

import envs
from envs import core
from jaxagent.rollout import agent_loop, continuous_loop, episode, pipelined_loop, sync_loop


class _Counter(envs.TextEnv):
    """Counts to 3; a cut-off episode scores -(steps left)."""

    def __init__(self, cut: bool):
        super().__init__(max_steps=4)
        self.cut = cut
        self.n = 0

    system_prompt = "count"
    action_format = "a number"

    def _reset(self, seed):
        self.n = 0
        return "0", {"start": True}

    def _step(self, action):
        self.n += 1
        return str(self.n), 1.0, self.n >= 3, {"n": self.n}

    def state_key(self):
        return (self.n,)

    def cut_outcome(self, info):
        return (-float(3 - self.n), {**info, "cut_off": True}) if self.cut else None


def test_the_cut_key_is_the_env_protocols():
    assert episode.CUT_KEY == core.CUT_KEY == "if_cut"


def test_a_text_env_carries_its_cut_outcome_while_the_episode_goes_on():
    env = _Counter(cut=True)
    obs, info = env.reset(0)
    assert list(info) == ["start", "if_cut", "seed"]
    assert info["if_cut"] == {"reward": -3.0, "info": {"start": True, "cut_off": True}}
    _, _, term, trunc, info = env.step("1")
    assert not (term or trunc) and info["if_cut"] == {"reward": -2.0, "info": {"n": 1, "cut_off": True}}
    assert list(info) == ["n", "if_cut", "step"]
    env.step("2")
    _, _, term, _, info = env.step("3")
    assert term and "if_cut" not in info  # a finished episode is not cut
    # the default hook adds nothing
    plain = _Counter(cut=False)
    assert "if_cut" not in plain.reset(0)[1] and "if_cut" not in plain.step("1")[4]
    assert envs.Env.cut_outcome(plain, {}) is None


def test_episode_cut_applies_the_envs_cut_outcome():
    env = _Counter(cut=True)
    env.reset(0)
    ep = episode.Episode(index=0, seed=0, group_id=0)
    ep.rewards.append(0.5)
    ep.info = dict(env.step("1")[4])
    ep.cut("context_full")
    assert ep.truncated and ep.end_reason == "context_full"
    assert ep.rewards == [pytest.approx(0.5 - 2.0)] and ep.info == {"n": 1, "cut_off": True}
    # without one, the episode just ends truncated
    ep = episode.Episode(index=1, seed=0, group_id=0, rewards=[0.5], info={"n": 1})
    ep.cut("max_turns")
    assert ep.truncated and ep.rewards == [0.5] and ep.info == {"n": 1}


@pytest.mark.parametrize(
    "kw, module", [({}, sync_loop), ({"pipeline_groups": 2}, pipelined_loop), ({"slots": 2}, continuous_loop)]
)
def test_run_dispatches_to_one_scheduler(monkeypatch, kw, module):
    called = []
    for m in (sync_loop, pipelined_loop, continuous_loop):
        monkeypatch.setattr(
            m, "run", lambda ro, m=m: called.append(m) or [ep.end(done=True, reason="x") for ep in ro.episodes]
        )
    loop = object.__new__(agent_loop.AgentLoop)  # no model: run only dispatches
    loop.config = agent_loop.AgentLoopConfig(max_context=64, max_turns=2, **kw)
    loop.profile, loop.reward_fn, loop.sampler, loop.chat, loop.stop_sequences = False, None, None, None, []
    traj, eps = loop.run([None] * 3, seeds=[0, 1, 2])
    assert called == [module] and [ep.end_reason for ep in eps] == ["x"] * 3
    assert traj.tokens.shape == (3, 64) and set(loop.timings) >= {"rollout_s", "host_s"}
