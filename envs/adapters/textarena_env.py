"""TextArena single-player games: ``envs.make("textarena/TowerOfHanoi-v0")``.

Any TextArena game id that supports one player (``Sudoku-v0``, ``TowerOfHanoi-v0``,
``Minesweeper-v0``, ``FifteenPuzzle-v0``, ``GuessTheNumber-v0``, ...) . The game is
built without TextArena's wrappers, and each observation is the text of the messages
the game sent since the previous turn (its prompt with the rules comes first).
Actions are passed to the game as written (from ``<action>...</action>`` if present,
else the whole response): the game's own rules judge them, and its invalid-move
handling applies. An empty action gets ``invalid_penalty``. Reward: the game's
reward for player 0 when the game ends (TextArena reports it on close), else 0.

Games that need more players, an API key or data that is not installed fail at
construction or reset with a message naming the game.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
import sys
from typing import Any

from envs.core import InvalidAction, TextEnv, last_tagged, require

_ADDR = re.compile(r" at 0x[0-9a-f]+")


class TextArenaGame(TextEnv):
    """A single-player TextArena game (see the module docstring).

    Args:
      game_id: the TextArena id, e.g. ``"TowerOfHanoi-v0"``.
      max_steps, invalid_penalty: as in :class:`envs.core.TextEnv`.
      **game_kwargs: passed to ``textarena.make``.
    """

    def __init__(self, game_id: str, max_steps: int = 100, invalid_penalty: float = -0.1, **game_kwargs):
        self._ta = require("textarena", f"textarena/{game_id}", "textarena", "envs-textarena")
        from textarena.envs.registration import ENV_REGISTRY  # type: ignore[import-untyped]

        if game_id not in ENV_REGISTRY:
            raise ValueError(f"unknown TextArena game {game_id!r}")
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty)
        self.game_id = game_id
        self.game_kwargs = game_kwargs
        self._game: Any = None  # the TextArena game being played (textarena has no types)
        self._seed = 0
        # the game's own states of `random` and `numpy.random` between its calls
        self._rng_states: tuple[tuple[Any, ...], Any] | None = None

    @property
    def system_prompt(self) -> str:
        return (
            f"You are playing the puzzle game {self.game_id}. Follow the game's instructions and "
            f"make one move per turn in the format it asks for. {self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return "Write your move inside action tags, e.g. <action>[A C]</action>, in the game's own move format."

    def _messages(self) -> str:
        _, messages = self._game.get_observation()
        parts = []
        for msg in messages or []:
            if isinstance(msg, tuple) and len(msg) == 3:
                sender, text, kind = msg
                if getattr(kind, "name", "") == "PLAYER_ACTION":
                    continue
                parts.append(str(text))
            else:
                parts.append(str(msg))
        return "\n".join(parts)

    @contextlib.contextmanager
    def _own_rng(self, seed: int | None = None):
        """Run game code with this env's own global RNG state.

        TextArena games draw from the process-global ``random`` (and some from
        ``numpy.random``), e.g. Minesweeper places its mines on the first move; swapping
        the state in and out keeps an episode deterministic given its seed even when
        other envs in the same process draw in between.
        """
        np = sys.modules.get("numpy")
        saved = (random.getstate(), np.random.get_state() if np is not None else None)
        if seed is not None:
            random.seed(seed)
            if np is not None:
                np.random.seed(seed % 2**32)
        elif self._rng_states is not None:
            random.setstate(self._rng_states[0])
            if np is not None and self._rng_states[1] is not None:
                np.random.set_state(self._rng_states[1])
        try:
            yield
        finally:
            self._rng_states = (random.getstate(), np.random.get_state() if np is not None else None)
            random.setstate(saved[0])
            if np is not None and saved[1] is not None:
                np.random.set_state(saved[1])

    def _reset(self, seed: int):
        with self._own_rng(seed):
            return self._reset_game(seed)

    def _reset_game(self, seed: int):
        if self._game is not None:
            self._game.close()
        from textarena.envs.registration import ENV_REGISTRY

        raw = f"{self.game_id}-raw"
        game_id = raw if raw in ENV_REGISTRY else self.game_id  # without TextArena's wrappers
        self._game = self._ta.make(game_id, **self.game_kwargs)
        try:
            self._game.reset(num_players=1, seed=seed)
        except (AssertionError, ValueError) as e:
            raise ValueError(f"textarena/{self.game_id} cannot be played by one player: {e}") from e
        self._seed = seed
        return self._messages(), {}

    def _step(self, action: str):
        tagged = last_tagged(action, "action")
        move = (tagged if tagged is not None else action).strip()
        if not move:
            raise InvalidAction("the move is empty")
        with self._own_rng():
            return self._play(move)

    def _play(self, move: str):
        done, info = self._game.step(move)
        text = self._messages()
        reward = 0.0
        out = {"game_info": _plain(info)}
        if done:
            rewards, game_info = self._game.close()
            reward = float((rewards or {}).get(0, 0.0))
            out["game_info"] = _plain(game_info)
            self._game = None
        return text, reward, bool(done), out

    def state_key(self):
        if self._game is None:
            return ("textarena", self.game_id, self._seed, "over", self._steps)
        state = _ADDR.sub("", repr(getattr(self._game.state, "game_state", None)))
        return ("textarena", self.game_id, hashlib.sha1(state.encode()).hexdigest())

    def close(self):
        if self._game is not None:
            try:
                self._game.close()
            except Exception:
                pass
            self._game = None


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def make(game_id: str, **kwargs) -> TextArenaGame:
    return TextArenaGame(game_id, **kwargs)
