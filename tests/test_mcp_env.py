"""MCPTools (envs/adapters/mcp_env.py) against a real stdio MCP server (tests/mcp_server_fixture.py),
and the example agent program (examples/agents/mcp_agent.py) against a scripted fake OpenAI client."""

import asyncio
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from envs_testlib import no_leftover_processes  # noqa: F401  (autouse fixture)

pytest.importorskip("mcp")
psutil = pytest.importorskip("psutil")

from envs.adapters.mcp_env import MCPServerError, MCPTools  # noqa: E402

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server_fixture.py"))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_tools_are_listed_with_their_schemas_and_a_call_round_trips():
    async def body():
        async with MCPTools(SERVER) as tools:
            return (
                await tools.tools(),
                await tools.call("add", '{"a": 2, "b": 3}'),
                await tools.call("add", {"a": -7, "b": 3}),
            )

    listed, five, minus_four = run(body())
    assert [t["type"] for t in listed] == ["function"] * len(listed)
    by_name = {t["function"]["name"]: t["function"] for t in listed}
    assert set(by_name) == {"add", "lookup", "sleep", "pid", "picture"}
    add = by_name["add"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["type"] == "object"
    assert {k: v["type"] for k, v in add["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}
    assert sorted(add["parameters"]["required"]) == ["a", "b"]
    assert by_name["lookup"]["parameters"]["properties"]["key"]["type"] == "string"
    assert (five, minus_four) == ("5", "-4")


def test_a_misbehaving_call_gives_error_text_and_the_session_goes_on():
    async def body():
        async with MCPTools(SERVER) as tools:
            out = {
                "unknown": await tools.call("subtract", {"a": 1, "b": 2}),
                "bad_json": await tools.call("add", '{"a": 2, "b":'),
                "not_object": await tools.call("add", "[2, 3]"),
                "bad_args": await tools.call("add", {"a": "two", "b": 3}),
                "tool_error": await tools.call("lookup", {"key": "capital of Spain"}),
                "found": await tools.call("lookup", '{"key": "capital of France"}'),
                "image": await tools.call("picture", ""),
            }
            t0 = time.monotonic()
            out["timeout"] = await tools.call("sleep", {"seconds": 30}, timeout_s=0.5)
            out["timeout_took"] = time.monotonic() - t0
            out["after"] = await tools.call("add", {"a": 20, "b": 22})
            return out

    out = run(body())
    assert out["unknown"].startswith("error: unknown tool 'subtract'") and "add, lookup" in out["unknown"]
    assert out["bad_json"].startswith("error: the arguments of 'add' are not valid JSON")
    assert out["not_object"] == "error: the arguments of 'add' must be a JSON object, got list"
    assert out["bad_args"].startswith("error: ") and "valid integer" in out["bad_args"]
    assert out["tool_error"].startswith("error: ") and "no entry for 'capital of Spain'" in out["tool_error"]
    assert out["found"] == "Paris"
    assert out["image"] == "[image content: image/png]"
    assert out["timeout"] == "error: tool 'sleep' did not finish within 0.5 s"
    assert out["timeout_took"] < 5
    assert out["after"] == "42"


def test_the_server_process_is_gone_after_the_block_even_when_it_raises():
    async def body():
        async with MCPTools(SERVER) as tools:
            pid = int(await tools.call("pid"))
            assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            raise KeyError(pid)

    with pytest.raises(KeyError) as caught:
        run(body())
    pid = caught.value.args[0]
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"MCP server {pid} still running after the context exited"
        time.sleep(0.05)


def test_a_server_that_dies_mid_session_costs_the_call_not_the_run():
    async def body():
        async with MCPTools(SERVER) as tools:
            psutil.Process(int(await tools.call("pid"))).kill()
            await asyncio.sleep(0.1)
            return await tools.call("add", {"a": 1, "b": 2}, timeout_s=10)

    assert run(body()) == "error: tool 'add' failed: MCPError: Connection closed"


def test_a_server_that_cannot_start_raises_naming_its_command():
    async def enter(command, **kw):
        async with MCPTools(command, **kw):
            pass

    with pytest.raises(MCPServerError, match="no-such-mcp-server-x7.*could not be started"):
        run(enter(["no-such-mcp-server-x7", "--stdio"]))
    exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(MCPServerError, match=r"sys\.exit\(3\).*could not be started"):
        run(enter(exits, start_timeout_s=10))
    silent = [sys.executable, "-c", "import sys; sys.stdin.read()"]  # reads, never answers
    with pytest.raises(MCPServerError, match="no answer to the MCP handshake within 0.5 s"):
        run(enter(silent, start_timeout_s=0.5))


def test_misuse_is_named():
    with pytest.raises(ValueError, match="list of strings"):
        MCPTools("python server.py")
    with pytest.raises(RuntimeError, match="not open"):
        run(MCPTools(SERVER).call("add", {"a": 1, "b": 2}))


# ------------------------------------------------------------- the example agent program


class FakeCompletions:
    """`client.chat.completions`: records each request; the first reply calls `add`, the
    next answers with what the last tool message said (so the reward depends on it)."""

    def __init__(self):
        self.requests = []

    async def create(self, **request):
        from openai.types.chat import ChatCompletion

        self.requests.append(json.loads(json.dumps(request)))
        n = len(self.requests)
        if n == 1:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1234, "b": 4321}'},
                    }
                ],
            }
        else:
            tool_says = [m["content"] for m in request["messages"] if m["role"] == "tool"][-1]
            message = {"role": "assistant", "content": f"The sum is <answer>{tool_says}</answer>."}
        finish = "tool_calls" if n == 1 else "stop"
        return ChatCompletion.model_validate(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": 0,
                "model": request["model"],
                "choices": [{"index": 0, "finish_reason": finish, "message": message}],
            }
        )


@pytest.mark.parametrize("answer, max_turns, reward", [("5555", 6, 1.0), ("5556", 6, 0.0), ("5555", 1, 0.0)])
def test_example_agent_runs_the_tool_calls_and_scores_the_answer(answer, max_turns, reward):
    pytest.importorskip("openai")
    from examples.agents import mcp_agent

    completions = FakeCompletions()
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    task = {"prompt": "What is 1234 + 4321?", "answer": answer, "mcp_server": SERVER, "max_turns": max_turns}
    assert run(mcp_agent.rollout(client, task)) == reward

    first = completions.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["add", "lookup", "sleep", "pid", "picture"]
    assert first["messages"][-1] == {"role": "user", "content": "What is 1234 + 4321?"}
    assert len(completions.requests) == min(max_turns, 2)
    if max_turns > 1:
        second = completions.requests[1]["messages"]
        assert second[-2]["role"] == "assistant" and second[-2]["tool_calls"][0]["function"]["name"] == "add"
        assert second[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5555"}


def test_tools_follow_the_listing_cursor():
    import mcp.types

    pages = {
        None: {"tools": [{"name": "a", "inputSchema": {"type": "object"}}], "nextCursor": "page2"},
        "page2": {"tools": [{"name": "b", "description": "B.", "inputSchema": {"type": "object", "required": ["x"]}}]},
    }
    asked = []

    class Session:
        async def list_tools(self, params=None):
            asked.append(params and params.cursor)
            return mcp.types.ListToolsResult.model_validate(pages[params and params.cursor])

    tools = MCPTools(["unused"])
    tools._session = Session()
    listed = run(tools.tools())
    assert asked == [None, "page2"]
    assert [t["function"] for t in listed] == [
        {"name": "a", "description": "", "parameters": {"type": "object"}},
        {"name": "b", "description": "B.", "parameters": {"type": "object", "required": ["x"]}},
    ]
