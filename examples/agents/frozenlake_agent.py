"""An agent that crosses a frozen lake with a `move` tool, written against ``openai``.

The agent program of the recipe `configs/gateway_frozenlake.yaml`: each episode makes a
4x4 FrozenLake map (``envs.make("frozenlake")``, a new map with holes for every seed),
shows it to the model, and runs the model's ``move`` tool calls on it until the model
reaches the goal, falls in a hole, or has made `MAX_CALLS` calls. Nothing in it knows it
is being trained: it is the tool-calling loop any ``openai`` user writes.

- `task(seed)`: the task of a seed, ``{"seed": seed}`` (``agent.tasks``).
- `rollout(client, task)`: one episode; returns ``{"reward", "success", "moves"}``.
- `expert(prompt_text, noise=, rng=)`: the warm start's expert (``agent.expert``): the
  shortest safe path's next move on the last map of the conversation, or with
  probability ``noise`` a random move.
"""

from __future__ import annotations

import json
import re
from collections import deque

import envs

SYSTEM = "Reach G on the frozen lake without falling into a hole H. P is you. Call move once a turn."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one square.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": ["up", "down", "left", "right"]}},
                "required": ["direction"],
            },
        },
    }
]
MAX_CALLS = 8
DIRECTIONS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def task(seed: int) -> dict:
    return {"seed": int(seed)}


def board(observation: str) -> str:
    """The map lines of an env observation (without its sentences)."""
    return "\n".join(line for line in observation.splitlines() if re.fullmatch(r"[SFHGP](?: [SFHGP])*", line))


async def rollout(client, task: dict) -> dict:
    env = envs.make("frozenlake", size=4, hole_prob=0.2)
    try:
        obs, _ = env.reset(seed=task["seed"])
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": board(obs)}]
        reward, moves = 0.0, 0
        for _ in range(MAX_CALLS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Call move."})
                continue
            done = False
            for k, call in enumerate(message.tool_calls):
                if k or done:  # one move a turn
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "One move a turn."})
                    continue
                try:
                    direction = json.loads(call.function.arguments).get("direction")
                except (ValueError, AttributeError):
                    direction = None
                if direction not in DIRECTIONS:
                    hint = "Use up, down, left or right."
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": hint})
                    continue
                obs, r, terminated, truncated, _ = env.step(f"<action>{direction}</action>")
                moves += 1
                reward += float(r)
                done = terminated or truncated
                messages.append({"role": "tool", "tool_call_id": call.id, "content": board(obs) or obs})
            if done:
                break
        return {"reward": reward, "success": reward > 0, "moves": moves}
    finally:
        env.close()


def _last_map(text: str) -> list[list[str]]:
    """The last map in a rendered conversation (special tokens such as `<|im_end|>` cut
    the lines they touch)."""
    runs, run = [], []
    for line in re.sub(r"<\|[^|]*\|>", "\n", text).splitlines():
        if re.fullmatch(r"[SFHGP](?: [SFHGP])+", line.strip()):
            run.append(line.strip().split(" "))
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs[-1] if runs else []


def expert(prompt_text: str, *, noise: float = 0.0, rng=None) -> str:
    """The next move of a shortest safe path on the conversation's last map (or, with
    probability `noise`, a random move), as the tool call the program expects."""
    grid = _last_map(prompt_text)
    direction = None
    if rng is not None and noise and rng.random() < noise:
        direction = rng.choice(list(DIRECTIONS))
    if direction is None and grid:
        n = len(grid)
        start = next(((r, c) for r in range(n) for c in range(n) if grid[r][c] == "P"), None)
        goal = next(((r, c) for r in range(n) for c in range(n) if grid[r][c] == "G"), None)
        if start is not None and goal is not None:
            first: dict[tuple[int, int], str | None] = {start: None}
            queue = deque([start])
            while queue and goal not in first:
                r, c = queue.popleft()
                for name, (dr, dc) in DIRECTIONS.items():
                    nxt = (r + dr, c + dc)
                    if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in first and grid[nxt[0]][nxt[1]] != "H":
                        first[nxt] = first[(r, c)] or name
                        queue.append(nxt)
            direction = first.get(goal)
    direction = direction or "right"
    return '<tool_call>{"name": "move", "arguments": {"direction": "' + direction + '"}}</tool_call>'
