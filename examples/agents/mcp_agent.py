"""An agent that answers a question with the tools of an MCP server, written against ``openai``.

Train it with ``agent.program: examples.agents.mcp_agent:rollout`` (see README.md here);
run it against any OpenAI-compatible endpoint with ``python -m examples.agents.mcp_agent``
(set ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``MCP_AGENT_MODEL``).

The task dict (one line of the ``agent.tasks`` JSONL file):

- ``prompt`` (str, required): the question for the model;
- ``answer`` (str or number, required): the expected final answer;
- ``mcp_server`` (list of str, required): the argv that starts the MCP server over stdio,
  e.g. ``["python", "tests/mcp_server_fixture.py"]``; a first element ``"python"`` runs
  the interpreter running this program (``sys.executable``), so the server sees the same
  packages;
- ``mcp_env`` (dict, optional): environment variables for the server; ``mcp_cwd``
  (str, optional): its working directory;
- ``system`` (str, optional): the system prompt (default: :data:`SYSTEM`);
- ``max_turns`` (int, optional): model calls at most (default 6); ``tool_timeout_s``
  (float, optional): seconds one tool call may take (default 30).

The episode: the model sees the question and the server's tools; each ``tool_calls`` it
makes is run (a tool's error comes back as text in the tool message, so the model can
retry), until it answers without a tool call or runs out of turns. The reward is 1.0 when
the answer in its final message (the text of ``<answer>...</answer>`` if there is one,
else the whole message) equals ``task["answer"]`` after normalising case, whitespace and
a trailing full stop, and 0.0 otherwise (also when the turns run out).
"""

from __future__ import annotations

import re
import sys

import openai

from envs.adapters.mcp_env import MCPTools

SYSTEM = (
    "You answer questions using the tools you are given. Call tools as needed; when you "
    "know the answer, reply with it as <answer>...</answer> and call no tool."
)
MODEL = "policy"  # any name: the trainer's gateway serves the policy under every name


def normalise(text: str) -> str:
    """Lower case, single spaces, no trailing full stop."""
    return " ".join(str(text).split()).lower().rstrip(".")


def final_answer(text: str | None) -> str:
    """The text of the last ``<answer>...</answer>`` in ``text``, or all of it."""
    found = re.findall(r"<answer>(.*?)</answer>", text or "", flags=re.DOTALL)
    return (found[-1] if found else text or "").strip()


async def rollout(client: openai.AsyncOpenAI, task: dict) -> float:
    """One episode of ``task`` (see the module docstring); returns the reward, 1.0 or 0.0."""
    for key in ("prompt", "answer", "mcp_server"):
        if key not in task:
            raise ValueError(f"mcp_agent task needs {key!r} (keys: prompt, answer, mcp_server); got {sorted(task)}")
    command = list(task["mcp_server"])
    if command and command[0] == "python":
        command[0] = sys.executable
    max_turns = int(task.get("max_turns", 6))
    messages: list[dict] = [
        {"role": "system", "content": task.get("system", SYSTEM)},
        {"role": "user", "content": task["prompt"]},
    ]
    answer = ""
    async with MCPTools(command, env=task.get("mcp_env"), cwd=task.get("mcp_cwd")) as mcp:
        tools = await mcp.tools()
        for _ in range(max_turns):
            response = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
            message = response.choices[0].message
            if not message.tool_calls:
                answer = final_answer(message.content)
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments},
                        }
                        for c in message.tool_calls
                    ],
                }
            )
            for call in message.tool_calls:
                result = await mcp.call(
                    call.function.name, call.function.arguments, timeout_s=float(task.get("tool_timeout_s", 30))
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 1.0 if answer and normalise(answer) == normalise(task["answer"]) else 0.0


if __name__ == "__main__":
    import asyncio
    import json
    import os

    MODEL = os.environ.get("MCP_AGENT_MODEL", MODEL)
    example = {"prompt": "What is 1234 + 4321? Use the add tool.", "answer": "5555"}
    example["mcp_server"] = ["python", "tests/mcp_server_fixture.py"]
    print(json.dumps({"reward": asyncio.run(rollout(openai.AsyncOpenAI(), example))}))
