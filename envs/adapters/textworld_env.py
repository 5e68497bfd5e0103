"""TextWorld games: ``envs.make("textworld/tw-simple")``.

Game types are TextWorld's challenges (``tw-simple``, ``tw-coin_collector``,
``tw-treasure_hunter``, ``tw-cooking``). ``reset(seed)`` plays the game that
TextWorld's ``tw-make`` generates for that seed, built locally (4-7 s) the first time
and cached as ``<cache_dir>/<game type>/<options hash>/seed-<seed>.z8`` (written
atomically, so concurrent workers may share the cache). Default cache dir:
``$JAXAGENT_TEXTWORLD_CACHE`` or ``~/.cache/jaxagent/textworld``.

Observation: the game's text (its banner and status line removed); with
``show_commands=True`` (default) followed by the admissible commands. Action: a text
command, read from ``<action>...</action>`` or the first line of the response; an
empty command gets ``invalid_penalty``. Reward: the change in the game's score.
Terminated when the game is won or lost.

Expert: TextWorld's own walkthrough from the current state (``policy_commands``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any

from envs.core import InvalidAction, TextEnv, last_tagged, require

DEFAULT_OPTIONS = {
    "tw-simple": ["--rewards", "dense", "--goal", "detailed"],
    "tw-coin_collector": ["--level", "5"],
    "tw-treasure_hunter": ["--level", "5"],
    "tw-cooking": ["--recipe", "1", "--take", "1", "--go", "1", "--split", "train"],
}


def default_cache_dir() -> str:
    return os.environ.get(
        "JAXAGENT_TEXTWORLD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxagent", "textworld")
    )


def _tw_make() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "tw-make")
    found = here if os.path.exists(here) else shutil.which("tw-make")
    if not found:
        raise FileNotFoundError(
            "TextWorld's tw-make script was not found next to the Python "
            "interpreter or on PATH; reinstall the extra 'envs-textworld'"
        )
    return found


def game_file(game_type: str, seed: int, options: list[str], cache_dir: str) -> str:
    """The path of the game for (game_type, options, seed), generating it if needed."""
    tag = hashlib.sha1(" ".join(options).encode()).hexdigest()[:10]
    folder = os.path.join(cache_dir, game_type, tag)
    path = os.path.join(folder, f"seed-{seed}.z8")
    if os.path.exists(path) and os.path.exists(path[:-3] + ".json"):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as tmp:
        out = os.path.join(tmp, "game.z8")
        cmd = [sys.executable, _tw_make(), game_type, *options, "--seed", str(seed), "--output", out, "--silent", "-f"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"tw-make failed for {game_type} seed {seed} (options {options}): "
                f"{(proc.stderr or proc.stdout).strip()[-1500:]}"
            )
        # The .json describes the game (for the walkthrough); move it first so a
        # present .z8 always has its .json.
        os.replace(os.path.join(tmp, "game.json"), path[:-3] + ".json")
        os.replace(out, path)
    return path


_BANNER_LINE = re.compile(r"^[\s_|$\\/]*\$\$[\s_|$\\/]*$|^\s*_{4,}.*$")


def clean_feedback(text: str) -> str:
    """The game text without TextWorld's ASCII banner and trailing prompt/status line."""
    lines = text.split("\n")
    last_banner = -1
    for i, line in enumerate(lines[:40]):
        if _BANNER_LINE.match(line) and line.strip():
            last_banner = i
    lines = lines[last_banner + 1 :]
    text = "\n".join(lines)
    text = re.sub(r"\n>[^\n]*$", "", text.rstrip())
    return text.strip()


class TextWorldGame(TextEnv):
    """A TextWorld challenge as a text env (see the module docstring).

    Args:
      game_type: one of ``DEFAULT_OPTIONS`` (TextWorld's challenges).
      options: ``tw-make`` options for this type (default ``DEFAULT_OPTIONS[game_type]``).
      cache_dir: where generated games are kept.
      show_commands: append the admissible commands to each observation.
      max_steps, invalid_penalty: as in :class:`envs.core.TextEnv`.
    """

    has_expert = True

    def __init__(
        self,
        game_type: str,
        options: list[str] | None = None,
        cache_dir: str | None = None,
        show_commands: bool = True,
        max_steps: int = 100,
        invalid_penalty: float = -0.1,
    ):
        self._tw = require("textworld", f"textworld/{game_type}", "textworld", "envs-textworld")
        if game_type not in DEFAULT_OPTIONS:
            raise ValueError(f"unknown TextWorld game type {game_type!r}; known: {', '.join(DEFAULT_OPTIONS)}")
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty)
        self.game_type = game_type
        self.options = list(DEFAULT_OPTIONS[game_type] if options is None else options)
        self.cache_dir = cache_dir or default_cache_dir()
        self.show_commands = show_commands
        # TextWorld's objects (its module is imported by `require`, so their type is Any):
        self._env: Any = None  # the game's environment, started on the first reset
        self._state: Any = None  # its last game state
        self._score = 0
        self.game_path = ""

    @property
    def system_prompt(self) -> str:
        return (
            "You are playing a text adventure game. Read the description, follow the objective, "
            "and type one command per turn (for example 'open door', 'go east', 'take key'). "
            f"{self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return "Answer with one command, e.g. <action>go east</action>."

    def _render(self, text: str) -> str:
        if self.show_commands and self._state.admissible_commands:
            text += "\nAdmissible commands: " + ", ".join(self._state.admissible_commands) + "."
        return text

    def _reset(self, seed: int):
        path = game_file(self.game_type, seed, self.options, self.cache_dir)
        if self._env is None or path != self.game_path:
            if self._env is not None:
                self._env.close()
            infos = self._tw.EnvInfos(
                admissible_commands=True,
                policy_commands=True,
                score=True,
                max_score=True,
                won=True,
                lost=True,
                facts=True,
            )
            with warnings.catch_warnings():
                # Jericho does not know generated games; TextWorld tracks the score itself.
                warnings.filterwarnings("ignore", message=".*is not fully supported")
                self._env = self._tw.start(path, request_infos=infos)
            self.game_path = path
        self._state = self._env.reset()
        self._score = self._state.score or 0
        return self._render(clean_feedback(self._state.feedback)), {
            "max_score": self._state.max_score,
            "game_file": path,
        }

    def _step(self, action: str):
        tagged = last_tagged(action, "action")
        command = tagged if tagged is not None else (action.strip().splitlines() or [""])[0]
        command = command.strip().strip("`'\"").strip()
        if not command:
            raise InvalidAction("the command is empty")
        self._state, score, done = self._env.step(command)
        reward = (score or 0) - self._score
        self._score = score or 0
        info = {
            "score": self._score,
            "max_score": self._state.max_score,
            "won": bool(self._state.won),
            "lost": bool(self._state.lost),
            "command": command,
        }
        return self._render(clean_feedback(self._state.feedback)), float(reward), bool(done), info

    def state_key(self):
        facts = sorted(str(f) for f in (self._state.facts or ()))
        digest = hashlib.sha1("\n".join(facts).encode()).hexdigest()
        game = os.path.relpath(self.game_path, self.cache_dir)  # type/options-hash/seed-N.z8
        return ("textworld", game, digest)

    def expert_action(self) -> str:
        cmds = self._state.policy_commands or []
        return f"<action>{cmds[0] if cmds else 'look'}</action>"

    def close(self):
        if self._env is not None:
            self._env.close()
            self._env = None


def make(game_type: str, **kwargs) -> TextWorldGame:
    return TextWorldGame(game_type, **kwargs)
