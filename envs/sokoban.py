"""Sokoban as text: push every box onto a target.

Levels are generated per seed and are solvable by construction: a room is carved by a
random walk, boxes are put on their targets, and the player then walks backwards
*pulling* boxes for a few hundred random moves; the level is the most scrambled state
seen (every box off its target). Every pull is the reverse of a legal push, so
replaying the walk backwards solves the level. A push-optimal BFS solver (with
dead-square pruning) then confirms each level and is the expert.

Map characters (one row per line): ``#`` wall, ``_`` floor, ``.`` target, ``$`` box,
``*`` box on a target, ``@`` player, ``+`` player on a target.

Action: one of ``up``, ``down``, ``left``, ``right`` (see
:func:`envs.core.parse_direction`). Walking into a wall, or pushing a box into a wall
or another box, leaves the state unchanged (a valid move that achieves nothing).
Reward: 1.0 when every box is on a target (the episode terminates), plus
``step_penalty`` on every step, plus ``noop_penalty`` on a move that leaves the state
unchanged (into a wall, or pushing a box that cannot move); such a move also sets
``info["noop"]``.

Expert: the first move of the solver's plan from the current state (a pure function
of the state, memoised); from an unsolvable state (a box pushed into a corner) it
returns any move.
"""

from __future__ import annotations

import random
from collections import deque

from envs.core import TextEnv, parse_direction

_DIRS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class Level:
    """A static map (walls, targets) with the start positions of the player and boxes.

    Cells are ``row * width + col`` ints.
    """

    def __init__(self, height: int, width: int, walls: frozenset, targets: frozenset, player: int, boxes: frozenset):
        self.height, self.width = height, width
        self.walls, self.targets = walls, targets
        self.player, self.boxes = player, boxes
        self.offsets = {d: dr * width + dc for d, (dr, dc) in _DIRS.items()}
        self._static_key: str | None = None

    def floor(self, cell: int) -> bool:
        return 0 <= cell < self.height * self.width and cell not in self.walls

    def render(self, player: int, boxes) -> str:
        rows = []
        for r in range(self.height):
            row = []
            for c in range(self.width):
                i = r * self.width + c
                if i in self.walls:
                    ch = "#"
                elif i == player:
                    ch = "+" if i in self.targets else "@"
                elif i in boxes:
                    ch = "*" if i in self.targets else "$"
                else:
                    ch = "." if i in self.targets else "_"
                row.append(ch)
            rows.append("".join(row))
        return "\n".join(rows)

    def static_key(self) -> str:
        """The walls and targets, as text: identifies the level (computed once)."""
        if self._static_key is None:
            self._static_key = self.render(-1, ())
        return self._static_key


# ---------------------------------------------------------------- solver


def _reachable(level: Level, start: int, boxes) -> set:
    seen, todo = {start}, [start]
    offs = level.offsets.values()
    while todo:
        cell = todo.pop()
        for o in offs:
            n = cell + o
            if n not in seen and n not in boxes and level.floor(n):
                seen.add(n)
                todo.append(n)
    return seen


def _live_cells(level: Level) -> set:
    """Cells from which a lone box can still be pushed onto some target."""
    live, todo = set(level.targets), list(level.targets)
    while todo:
        b = todo.pop()
        for o in level.offsets.values():
            prev, player = b - o, b - 2 * o
            if prev not in live and level.floor(prev) and level.floor(player):
                live.add(prev)
                todo.append(prev)
    return live


def _walk(level: Level, start: int, goal: int, boxes) -> list[str] | None:
    """Shortest player walk from start to goal avoiding boxes, as directions."""
    if start == goal:
        return []
    prev: dict[int, tuple[int, str] | None] = {start: None}  # cell -> (the cell before, the move)
    todo = deque([start])
    while todo:
        cell = todo.popleft()
        for d, o in level.offsets.items():
            n = cell + o
            if n in prev or n in boxes or not level.floor(n):
                continue
            prev[n] = (cell, d)
            if n == goal:
                path = []
                step = prev[n]
                while step is not None:
                    n, d2 = step
                    path.append(d2)
                    step = prev[n]
                return path[::-1]
            todo.append(n)
    return None


def solve(level: Level, player: int, boxes, max_states: int = 200_000) -> list[str] | None:
    """A push-optimal solution from (player, boxes) as a list of moves, or None.

    Breadth-first over box configurations (the player's position normalised to the
    smallest reachable cell); pushes onto dead squares are pruned. None when the
    state is unsolvable or ``max_states`` is exceeded.
    """
    boxes = frozenset(boxes)
    if boxes <= level.targets:
        return []
    live = _live_cells(level)
    if any(b not in live for b in boxes):
        return None
    start_reach = _reachable(level, player, boxes)
    start = (min(start_reach), boxes)
    # state (normalised player, boxes) -> (the state before, the box pushed, the push)
    parent: dict[tuple[int, frozenset[int]], tuple[tuple[int, frozenset[int]], int, str] | None] = {start: None}
    frontier = deque([(start, start_reach)])
    goal_state = None
    while frontier and goal_state is None:
        state, reach = frontier.popleft()
        _, bx = state
        for b in sorted(bx):
            for d, o in level.offsets.items():
                dest = b + o
                if (b - o) not in reach or dest in bx or not level.floor(dest) or dest not in live:
                    continue
                nb = (bx - {b}) | {dest}
                nreach = _reachable(level, b, nb)
                nstate = (min(nreach), nb)
                if nstate in parent:
                    continue
                parent[nstate] = (state, b, d)
                if nb <= level.targets:
                    goal_state = nstate
                    break
                if len(parent) > max_states:
                    return None
                frontier.append((nstate, nreach))
            if goal_state is not None:
                break
    if goal_state is None:
        return None
    pushes = []
    push = parent[goal_state]
    while push is not None:
        s, b, d = push
        pushes.append((b, d))
        push = parent[s]
    pushes.reverse()
    moves: list[str] = []
    pos, bx = player, set(boxes)
    for b, d in pushes:
        o = level.offsets[d]
        walk = _walk(level, pos, b - o, bx)
        assert walk is not None, "the search pushed a box from a cell the player cannot reach"
        moves.extend(walk)
        moves.append(d)
        bx.remove(b)
        bx.add(b + o)
        pos = b
    return moves


# ---------------------------------------------------------------- generation


def _carve_room(height: int, width: int, rng: random.Random) -> set:
    """Floor cells carved by a random walk in the interior (the border stays wall)."""
    inner = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    target_floor = max(6, int(0.6 * len(inner)))
    r, c = rng.choice(inner)
    floor = {(r, c)}
    d = rng.choice(list(_DIRS.values()))
    steps = 0
    while len(floor) < target_floor and steps < 20 * len(inner):
        steps += 1
        if rng.random() < 0.35:
            d = rng.choice(list(_DIRS.values()))
        nr, nc = r + d[0], c + d[1]
        if 1 <= nr < height - 1 and 1 <= nc < width - 1:
            r, c = nr, nc
            floor.add((r, c))
            if rng.random() < 0.3:  # widen corridors into rooms
                sr, sc = r + d[1], c + d[0]
                if 1 <= sr < height - 1 and 1 <= sc < width - 1:
                    floor.add((sr, sc))
    return floor


def _reverse_play(level: Level, rng: random.Random, num_moves: int):
    """Pull boxes away from their targets; the most scrambled state with all boxes moved."""
    player, boxes = level.player, set(level.targets)
    best, best_score = None, 0
    dirs = list(level.offsets.values())
    for _ in range(num_moves):
        o = rng.choice(dirs)
        nxt = player + o
        if not level.floor(nxt) or nxt in boxes:
            continue
        behind = player - o
        if behind in boxes and rng.random() < 0.6:
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
        if any(b in level.targets for b in boxes):
            continue
        score = sum(
            min(
                abs(b // level.width - t // level.width) + abs(b % level.width - t % level.width) for t in level.targets
            )
            for b in boxes
        )
        if score > best_score:
            best, best_score = (player, frozenset(boxes)), score
    return best


def generate_level(
    height: int, width: int, num_boxes: int, rng: random.Random, max_tries: int = 200
) -> tuple[Level, list[str]]:
    """A solvable level and a push-optimal solution from its start."""
    for _ in range(max_tries):
        floor = _carve_room(height, width, rng)
        if len(floor) < num_boxes * 2 + 3:
            continue
        cells = sorted(r * width + c for r, c in floor)
        walls = frozenset(i for i in range(height * width) if i not in set(cells))
        picks = rng.sample(cells, num_boxes + 1)
        targets = frozenset(picks[:num_boxes])
        proto = Level(height, width, walls, targets, picks[-1], targets)
        start = _reverse_play(proto, rng, num_moves=300)
        if start is None:
            continue
        level = Level(height, width, walls, targets, start[0], start[1])
        plan = solve(level, level.player, level.boxes)
        if plan and len(plan) >= 3 * num_boxes:  # skip trivial levels
            return level, plan
    raise RuntimeError(
        f"could not generate a {height}x{width} Sokoban level with {num_boxes} "
        f"boxes in {max_tries} tries; use a larger room or fewer boxes"
    )


class Sokoban(TextEnv):
    """Text Sokoban; see the module docstring.

    Args:
      height, width: map size including the outer wall (>= 5 each).
      num_boxes: boxes (and targets), >= 1.
      max_steps: step limit (default 100).
      step_penalty: reward added on every step (e.g. -0.01).
      invalid_penalty: reward for an action that names no single direction.
      noop_penalty: reward added for a move that changes nothing (default 0.0; e.g.
        -0.1). A success-only reward cannot tell a no-op from a useful move, so a
        greedy policy can loop on one; this charges for it.
    """

    has_expert = True
    random_actions = tuple(f"<action>{d}</action>" for d in ("up", "down", "left", "right"))

    def __init__(
        self,
        height: int = 7,
        width: int = 7,
        num_boxes: int = 2,
        max_steps: int = 100,
        step_penalty: float = 0.0,
        invalid_penalty: float = -0.1,
        noop_penalty: float = 0.0,
    ):
        for name, v, lo in (("height", height, 5), ("width", width, 5), ("num_boxes", num_boxes, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if num_boxes * 3 + 2 > (height - 2) * (width - 2):
            raise ValueError(f"num_boxes={num_boxes} does not fit a {height}x{width} room")
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty)
        self.height, self.width, self.num_boxes = height, width, num_boxes
        for name, penalty in (("step_penalty", step_penalty), ("noop_penalty", noop_penalty)):
            if (
                isinstance(penalty, bool)
                or not isinstance(penalty, (int, float))
                or penalty != penalty
                or abs(penalty) == float("inf")
            ):
                raise ValueError(f"{name} must be a finite number, got {penalty!r}")
        self.step_penalty = float(step_penalty)
        self.noop_penalty = float(noop_penalty)
        self.level: Level | None = None
        self.player = -1
        self.boxes: frozenset = frozenset()
        self._expert_moves: dict = {}

    @property
    def system_prompt(self) -> str:
        return (
            "You are playing Sokoban. The map uses these characters: # wall, _ floor, . target, "
            "$ box, * box on a target, @ you, + you standing on a target. Move one cell at a time. "
            "Walking into a box pushes it one cell further if that cell is free; you cannot pull "
            "boxes, and a box pushed into a corner can never be moved out. Push every box onto a "
            f"target. {self.action_format}"
        )

    @property
    def action_format(self) -> str:
        return (
            "Answer with one move: <action>up</action>, <action>down</action>, "
            "<action>left</action> or <action>right</action>."
        )

    def _reset(self, seed: int):
        self.level, plan = generate_level(self.height, self.width, self.num_boxes, random.Random(seed))
        self.player, self.boxes = self.level.player, self.level.boxes
        self._expert_moves = {(self.player, self.boxes): plan[0]}
        return self._render("A new level."), {"solution_moves": len(plan)}

    @property
    def _level(self) -> Level:
        """The level being played (``reset`` makes it)."""
        if self.level is None:
            raise RuntimeError("Sokoban: reset() the env first")
        return self.level

    def _render(self, lead: str) -> str:
        on = sum(b in self._level.targets for b in self.boxes)
        return f"{lead}\n{self._level.render(self.player, self.boxes)}\nBoxes on targets: {on} of {len(self.boxes)}."

    def _step(self, action: str):
        level = self._level
        d = parse_direction(action)
        o = level.offsets[d]
        nxt = self.player + o
        reward = self.step_penalty
        noop = False
        if not level.floor(nxt):
            lead = f"You move {d} into a wall; nothing happens."
            noop = True
        elif nxt in self.boxes:
            beyond = nxt + o
            if not level.floor(beyond) or beyond in self.boxes:
                lead = f"You push {d} but the box does not move."
                noop = True
            else:
                self.boxes = (self.boxes - {nxt}) | {beyond}
                self.player = nxt
                lead = f"You push a box {d}."
        else:
            self.player = nxt
            lead = f"You move {d}."
        if noop:
            return self._render(lead), reward + self.noop_penalty, False, {"noop": True}
        solved = self.boxes <= level.targets
        if solved:
            return self._render(lead + " Every box is on a target: solved!"), reward + 1.0, True, {"success": True}
        return self._render(lead), reward, False, {}

    def state_key(self):
        return ("sokoban", self._level.static_key(), self.player, tuple(sorted(self.boxes)))

    def expert_action(self) -> str:
        # A pure function of the state (the first move of the solver's plan from here),
        # so that an episode rebuilt by replay gets the same expert moves.
        state = (self.player, self.boxes)
        move = self._expert_moves.get(state)
        if move is None:
            plan = solve(self._level, self.player, self.boxes)
            move = plan[0] if plan else "up"  # unsolvable from here: any move
            self._expert_moves[state] = move
        return f"<action>{move}</action>"
