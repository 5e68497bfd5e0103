"""Gymnasium toy-text envs as text envs: ``envs.make("gymnasium/Taxi-v4")``.

Known ids get a text rendering and named actions:

- ``FrozenLake-v1`` (actions left, down, right, up), ``Taxi-v4`` (south, north, east,
  west, pickup, dropoff; down/up/right/left accepted), ``CliffWalking-v1`` (up, right,
  down, left): Gymnasium's ``ansi`` rendering with its colour codes removed, plus a
  sentence saying where the agent (and the taxi's passenger and destination) is,
  since the colours carried that.
- ``Blackjack-v1`` (stick, hit): the hand as a sentence (it has no ansi rendering).

Any other id with a ``Discrete`` action space works too: the observation is the
Gymnasium observation (and the ansi rendering if the env has one) and the action is
the action's index. Actions are read from ``<action>X</action>`` or bare text, by
name (case-insensitive) or index; an unknown action gets an explanation and
``invalid_penalty``.

Expert: value iteration on the env's transition table ``P`` where it has one (the
toy-text grid worlds, slippery or not); for Blackjack, a simplified basic strategy.
"""

from __future__ import annotations

import re
from typing import Any

from envs.core import InvalidAction, TextEnv, last_tagged, require

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

ACTIONS = {
    "FrozenLake": ("left", "down", "right", "up"),
    "Taxi": ("south", "north", "east", "west", "pickup", "dropoff"),
    "CliffWalking": ("up", "right", "down", "left"),
    "Blackjack": ("stick", "hit"),
}
SYNONYMS = {
    "Taxi": {
        "down": "south",
        "up": "north",
        "right": "east",
        "left": "west",
        "pick up": "pickup",
        "drop off": "dropoff",
        "pick": "pickup",
        "drop": "dropoff",
    },
    "Blackjack": {"stand": "stick", "stay": "stick"},
    "FrozenLake": {"north": "up", "south": "down", "east": "right", "west": "left"},
    "CliffWalking": {"north": "up", "south": "down", "east": "right", "west": "left"},
}
_TAXI_LOCS = ("R (red)", "G (green)", "Y (yellow)", "B (blue)")
_VI_CACHE: dict = {}


def _family(env_id: str) -> str:
    return env_id.split("-")[0]


class GymnasiumText(TextEnv):
    """A Gymnasium env with a discrete action space, as text (see the module docstring).

    Args:
      env_id: the Gymnasium id, e.g. ``"Taxi-v4"``.
      max_steps: step limit (default: the id's ``max_episode_steps``, else 200).
      invalid_penalty: reward for an unknown action.
      **gym_kwargs: passed to ``gymnasium.make`` (e.g. ``is_slippery=False``).
    """

    def __init__(self, env_id: str, max_steps: int | None = None, invalid_penalty: float = -0.1, **gym_kwargs):
        gym = require("gymnasium", f"gymnasium/{env_id}", "gymnasium", "envs-gym")
        try:
            spec = gym.spec(env_id)
        except Exception as e:
            raise ValueError(f"unknown Gymnasium env id {env_id!r}: {e}") from None
        family = _family(env_id)
        render = "ansi" if family in ("FrozenLake", "Taxi", "CliffWalking") else None
        try:
            self.env = gym.make(env_id, render_mode=render, **gym_kwargs)
        except Exception as e:
            raise ValueError(f"gymnasium.make({env_id!r}) failed: {type(e).__name__}: {e}") from e
        if not isinstance(self.env.action_space, gym.spaces.Discrete):
            self.env.close()
            raise ValueError(
                f"gymnasium/{env_id}: only Discrete action spaces can be named in text, "
                f"this one is {self.env.action_space}"
            )
        super().__init__(max_steps=max_steps or spec.max_episode_steps or 200, invalid_penalty=invalid_penalty)
        self.env_id, self.family, self.gym_kwargs = env_id, family, dict(gym_kwargs)
        n = int(self.env.action_space.n)
        self.actions = ACTIONS.get(family, tuple(str(i) for i in range(n)))
        self.synonyms = SYNONYMS.get(family, {})
        self.obs: Any = None  # the last Gymnasium observation (an int, a tuple for Blackjack)
        self.has_expert = hasattr(self.env.unwrapped, "P") or family == "Blackjack"

    @property
    def system_prompt(self) -> str:
        rules = {
            "FrozenLake": "Walk on the frozen lake from S to the goal G without falling into a hole H "
            "(F is safe ice). The ice may be slippery.",
            "Taxi": "Drive the taxi to the passenger, pick them up, drive to the destination and drop "
            "them off. The map's letters R, G, Y, B are the four stops; '|' is a wall.",
            "CliffWalking": "Walk from the start x at the bottom left to the target T at the bottom "
            "right without stepping on the cliff C. Every step costs 1; the cliff "
            "costs 100 and sends you back.",
            "Blackjack": "Play blackjack against the dealer: get closer to 21 than the dealer without "
            "going over. Aces count 1 or 11.",
        }.get(self.family, f"You control the Gymnasium environment {self.env_id}.")
        return f"{rules} {self.action_format}"

    @property
    def action_format(self) -> str:
        names = ", ".join(self.actions)
        return f"Answer with one action, e.g. <action>{self.actions[0]}</action>; the actions are: {names}."

    def _describe(self, obs) -> str:
        u = self.env.unwrapped
        if self.family == "Blackjack":
            player, dealer, ace = obs
            return (
                f"Your hand sums to {player}{' (with a usable ace)' if ace else ''}. "
                f"The dealer shows {'an ace' if dealer == 1 else dealer}."
            )
        text = _ANSI.sub("", self.env.render() or "").strip("\n") if self.env.render_mode == "ansi" else ""
        if self.family == "Taxi":
            row, col, passenger, dest = u.decode(int(obs))
            where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_LOCS[passenger]}"
            text += (
                f"\nThe taxi is at row {row + 1}, column {col + 1}. The passenger is {where}; "
                f"the destination is {_TAXI_LOCS[dest]}."
            )
        elif self.family in ("FrozenLake", "CliffWalking"):
            ncol = u.ncol if hasattr(u, "ncol") else u.shape[1]
            text += f"\nYou are at row {int(obs) // ncol + 1}, column {int(obs) % ncol + 1}."
        elif self.family not in ACTIONS:
            text = (text + "\n" if text else "") + f"Observation: {_hashable(obs)!r}"
        return text

    def _reset(self, seed: int):
        self.obs, info = self.env.reset(seed=seed)
        return self._describe(self.obs), _plain(info)

    def _parse(self, action: str) -> int:
        tagged = last_tagged(action, "action")
        text = (tagged if tagged is not None else action).strip().strip(".!'\"`*[]() ").lower()
        text = self.synonyms.get(text, text)
        if text in self.actions:
            return self.actions.index(text)
        if text.isdigit() and int(text) < len(self.actions):
            return int(text)
        if tagged is None:
            words = re.findall(r"[a-z]+", text)
            found = {self.synonyms.get(w, w) for w in words} & set(self.actions)
            if len(found) == 1:
                return self.actions.index(found.pop())
        if not text:
            raise InvalidAction("the action is empty")
        raise InvalidAction(f"unknown action {text[:40]!r}")

    def _step(self, action: str):
        a = self._parse(action)
        self.obs, reward, terminated, truncated, info = self.env.step(a)
        info = _plain(info)
        info["action_index"] = a
        text = self._describe(self.obs)
        if truncated and not terminated:
            # The Gymnasium time limit: surface it as our own truncation.
            self._steps = self.max_steps
        return text, float(reward), bool(terminated), info

    def state_key(self):
        return ("gymnasium", self.env_id, _hashable(self.obs))

    def expert_action(self) -> str:
        if self.family == "Blackjack":
            player, dealer, ace = self.obs
            stick = player >= 17 or (not ace and player >= 13 and 2 <= dealer <= 6) or (ace and player >= 19)
            return f"<action>{'stick' if stick else 'hit'}</action>"
        key = (self.env_id, tuple(sorted(self.gym_kwargs.items())))
        policy = _VI_CACHE.get(key)
        if policy is None:
            policy = _VI_CACHE[key] = _value_iteration(self.env.unwrapped.P)
        return f"<action>{self.actions[policy[int(self.obs)]]}</action>"

    def close(self):
        self.env.close()


def _hashable(obs):
    """A Gymnasium observation as nested tuples of Python numbers."""
    if hasattr(obs, "tolist"):
        obs = obs.tolist()
    if isinstance(obs, (list, tuple)):
        return tuple(_hashable(x) for x in obs)
    if isinstance(obs, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in obs.items()))
    return obs


def _plain(info: dict) -> dict:
    out = {}
    for k, v in info.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        out[k] = v
    return out


def _value_iteration(P, gamma: float = 0.99, tol: float = 1e-9) -> list[int]:
    """Greedy policy of the optimal Q on a transition table P[s][a] = [(p, s', r, done)]."""
    n = len(P)
    value = [0.0] * n

    def q(s, a):
        return sum(p * (r + (0.0 if done else gamma * value[s2])) for p, s2, r, done in P[s][a])

    for _ in range(5000):
        delta = 0.0
        for s in range(n):
            best = max(q(s, a) for a in P[s])
            delta = max(delta, abs(best - value[s]))
            value[s] = best
        if delta < tol:
            break
    return [max(sorted(P[s]), key=lambda a: q(s, a)) for s in range(n)]


def make(env_id: str, **kwargs) -> GymnasiumText:
    return GymnasiumText(env_id, **kwargs)
