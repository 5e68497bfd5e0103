"""FrozenLake as text: walk from S to G on a procedurally generated frozen lake.

Map: a ``size`` x ``size`` grid of ``S`` (start, top-left), ``F`` (frozen, safe),
``H`` (hole: the episode ends with reward 0) and ``G`` (goal, bottom-right: reward 1).
Each seed draws holes independently with probability ``hole_prob`` and keeps the
map only if a path from S to G exists, so every map is solvable.

Observation: the grid, one row per line, cells separated by spaces, the agent shown
as ``P``, followed by its row/column. Action: one of ``up``, ``down``, ``left``,
``right`` (see :func:`envs.core.parse_direction` for what is accepted). Walking into
the edge leaves the agent in place.

Slippery (``slippery=True``): like Gymnasium's FrozenLake, the agent moves in the
intended direction with probability 1/3 and in each of the two perpendicular
directions with probability 1/3; the draws come from the episode's seed.

Expert: value iteration on the known dynamics (shortest path when not slippery),
which maximises the probability of reaching G. ``expert_action(style="blind")`` is a
weaker demonstrator for warm starts: it walks toward G without looking at the holes.
"""

from __future__ import annotations

import random
from collections import deque

from envs.core import InvalidAction, TextEnv, parse_direction

_MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_PERPENDICULAR = {"left": ("up", "down"), "right": ("down", "up"), "up": ("left", "right"), "down": ("right", "left")}


def step_on(pos: tuple[int, int], direction: str, size: int) -> tuple[int, int]:
    """The cell one move from `pos` on a `size` x `size` map; a move off the map stays put."""
    r, c = pos[0] + _MOVES[direction][0], pos[1] + _MOVES[direction][1]
    return (r, c) if 0 <= r < size and 0 <= c < size else pos


def moves_toward_goal(pos: tuple[int, int], size: int) -> list[str]:
    """The moves from `pos` that bring the agent closer to G (bottom-right) and stay on the
    map: `right`, `down`, both, or none at G itself."""
    r, c = pos
    return [d for d, ok in (("right", c < size - 1), ("down", r < size - 1)) if ok]


def generate_map(size: int, hole_prob: float, rng: random.Random) -> tuple[str, ...]:
    """A solvable map as a tuple of row strings over ``SFHG``."""
    while True:
        grid = [["H" if rng.random() < hole_prob else "F" for _ in range(size)] for _ in range(size)]
        grid[0][0], grid[-1][-1] = "S", "G"
        rows = tuple("".join(r) for r in grid)
        if _reachable(rows):
            return rows


def _reachable(rows) -> bool:
    n = len(rows)
    seen, todo = {(0, 0)}, deque([(0, 0)])
    while todo:
        r, c = todo.popleft()
        if rows[r][c] == "G":
            return True
        for dr, dc in _MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and rows[nr][nc] != "H" and (nr, nc) not in seen:
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


class FrozenLake(TextEnv):
    """Text FrozenLake; see the module docstring.

    Args:
      size: side of the square map (>= 2).
      hole_prob: probability that a cell other than S and G is a hole.
      slippery: stochastic moves as in Gymnasium's FrozenLake.
      max_steps: step limit (default ``4 * size * size``).
      invalid_penalty: reward for an action that names no single direction.
    """

    has_expert = True
    random_actions = tuple(f"<action>{d}</action>" for d in ("up", "down", "left", "right"))

    def __init__(
        self,
        size: int = 4,
        hole_prob: float = 0.2,
        slippery: bool = False,
        max_steps: int | None = None,
        invalid_penalty: float = -0.1,
    ):
        if not isinstance(size, int) or size < 2:
            raise ValueError(f"size must be an int >= 2, got {size!r}")
        if not 0.0 <= hole_prob < 0.6:
            raise ValueError(f"hole_prob must be in [0, 0.6), got {hole_prob!r}")
        super().__init__(max_steps=max_steps or 4 * size * size, invalid_penalty=invalid_penalty)
        self.size, self.hole_prob, self.slippery = size, float(hole_prob), bool(slippery)
        self.rows: tuple[str, ...] = ()
        self.pos = (0, 0)
        self._rng = random.Random(0)
        self._policy: dict | None = None

    @property
    def system_prompt(self) -> str:
        slip = (
            "The ice is slippery: you move in the direction you chose only one time in three; "
            "otherwise you slide to one of the two sides. "
            if self.slippery
            else ""
        )
        return (
            "You are on a frozen lake drawn as a grid. S is the start, F is frozen ice (safe), "
            "H is a hole (falling in ends the game), G is the goal, and P marks where you are. "
            "Reach G without falling into a hole. Moving into the edge of the grid leaves you "
            f"in place. {slip}{self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return (
            "Answer with one move: <action>up</action>, <action>down</action>, "
            "<action>left</action> or <action>right</action>."
        )

    def _reset(self, seed: int):
        rng = random.Random(seed)
        self.rows = generate_map(self.size, self.hole_prob, rng)
        self._rng = random.Random(rng.getrandbits(64))
        self.pos = (0, 0)
        self._policy = None
        return self._render("You stand at the start."), {"map": "\n".join(self.rows)}

    def _render(self, lead: str) -> str:
        lines = []
        for r, row in enumerate(self.rows):
            lines.append(" ".join("P" if (r, c) == self.pos else ch for c, ch in enumerate(row)))
        r, c = self.pos
        return f"{lead}\n" + "\n".join(lines) + f"\nYou are at row {r + 1}, column {c + 1}."

    def _move(self, pos, direction):
        return step_on(pos, direction, self.size)

    def _step(self, action: str):
        direction = parse_direction(action)
        actual = direction
        if self.slippery:
            actual = self._rng.choice((direction, *_PERPENDICULAR[direction]))
        self.pos = self._move(self.pos, actual)
        cell = self.rows[self.pos[0]][self.pos[1]]
        lead = f"You move {direction}." if actual == direction else f"You try to move {direction} but slide {actual}."
        info = {"moved": actual}
        if cell == "H":
            return self._render(lead + " You fall into a hole. Game over."), 0.0, True, {**info, "success": False}
        if cell == "G":
            return self._render(lead + " You reach the goal!"), 1.0, True, {**info, "success": True}
        return self._render(lead), 0.0, False, info

    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        info["map"] = "\n".join(self.rows)  # on every step, an invalid one too: `summarize` replays on it
        return obs, reward, terminated, truncated, info

    def state_key(self):
        return ("frozenlake", self.rows, self.pos)

    def summarize(self, episodes: list[dict]) -> dict:
        """The env's own summary of evaluated episodes (each a dict with `actions` and the
        last `info`, as `jaxagent eval` writes them), replayed on each episode's map:

        - ``move_share``: the share of actions naming each direction, and ``invalid``;
        - ``hole_rate``: episodes that ended in a hole;
        - ``avoidable_hole_rate``: episodes that stepped into a hole from a cell where a
          move toward G (right or down, on the map) led onto ice or G: what a walker that
          reads the holes next to it never does, and a walker blind to them often does.

        Slippery maps (the move taken is not the move chosen) and episodes without
        actions or a map (one that failed in the pool) count only in ``move_share``."""
        moves = {d: 0 for d in ("up", "down", "left", "right", "invalid")}
        replayed = holes = avoidable = 0
        for ep in episodes:
            actions, info = ep.get("actions") or [], ep.get("info") or {}
            for a in actions:
                try:
                    moves[parse_direction(a)] += 1
                except InvalidAction:
                    moves["invalid"] += 1
            rows = info.get("map", "").split("\n")
            if self.slippery or not actions or not info.get("map"):
                continue
            n = len(rows)
            replayed += 1
            pos = (0, 0)
            for a in actions:
                try:
                    d = parse_direction(a)
                except InvalidAction:
                    continue
                nxt = step_on(pos, d, n)
                if rows[nxt[0]][nxt[1]] == "H":
                    holes += 1
                    avoidable += any(
                        rows[r][c] != "H" for r, c in (step_on(pos, t, n) for t in moves_toward_goal(pos, n))
                    )
                    break
                pos = nxt
                if rows[pos[0]][pos[1]] == "G":
                    break
        total = sum(moves.values())
        out: dict[str, object] = {"move_share": {d: k / total for d, k in moves.items()} if total else {}}
        if replayed:
            out.update(replayed_episodes=replayed, hole_rate=holes / replayed, avoidable_hole_rate=avoidable / replayed)
        return out

    # ---------------------------------------------------------------- expert

    def _compute_policy(self) -> dict:
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        terminal = {p for p in cells if self.rows[p[0]][p[1]] in "HG"}
        value = {p: (1.0 if self.rows[p[0]][p[1]] == "G" else 0.0) for p in cells}
        # Discounting prefers shorter routes among equally safe ones.
        gamma = 0.999

        def q(p, d):
            outcomes = (d, *_PERPENDICULAR[d]) if self.slippery else (d,)
            return sum(gamma * value[self._move(p, o)] for o in outcomes) / len(outcomes)

        for _ in range(10_000):
            delta = 0.0
            for p in cells:
                if p in terminal:
                    continue
                best = max(q(p, d) for d in _MOVES)
                delta = max(delta, abs(best - value[p]))
                value[p] = best
            if delta < 1e-12:
                break
        return {p: max(("up", "right", "down", "left"), key=lambda d: q(p, d)) for p in cells if p not in terminal}

    def expert_action(self, style: str = "expert", salt: int = 0) -> str:
        """The demonstrator's move: ``style="expert"``, value iteration (module docstring);
        ``style="blind"``, a walker that knows where G is but never looks at the holes:
        it takes one of the moves toward G (right or down, whichever stay on the map),
        picked by a hash of the map, its position and ``salt`` (a coin flip per state
        that is still a function of the state). On 3x3 maps with ``hole_prob=0.3`` it
        reaches G about 45% of the time, where a walker that only avoids stepping onto
        a visible hole reaches it about 89% of the time: a warm start that RL can
        improve by reading the map."""
        if style == "blind":
            r, c = self.pos
            toward = moves_toward_goal(self.pos, self.size)
            if not toward:
                return "<action>right</action>"
            pick = random.Random(f"{'/'.join(self.rows)}|{r},{c}|{salt}").randrange(len(toward))
            return f"<action>{toward[pick]}</action>"
        if style != "expert":
            raise ValueError(f"frozenlake expert_action: style must be 'expert' or 'blind', got {style!r}")
        if salt:
            raise ValueError("frozenlake expert_action: salt applies to style='blind' only")
        if self._policy is None:
            self._policy = self._compute_policy()
        return f"<action>{self._policy.get(self.pos, 'right')}</action>"
