"""A small MCP server over stdio for the tests: ``python tests/mcp_server_fixture.py``.

Tools: ``add(a, b)`` (integers), ``lookup(key)`` in a small table (an unknown key is a
tool error, ``isError``), ``sleep(seconds)`` (for timeouts), ``pid()`` (this process's
id, to check that the server is gone after the client closes) and ``picture()`` (an
image content item, to check how non-text results are described).

A failure the model should read is raised as ``ToolError``: in mcp 2.x any other exception
reaches the client only as "Error executing tool <name>". Built with ``mcp``'s high-level
server: ``MCPServer`` in mcp 2.x, ``FastMCP`` in 1.x.
"""

import asyncio
import base64
import os

try:
    from mcp.server.mcpserver import Image
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as Server
    from mcp.server.fastmcp import Image
    from mcp.server.fastmcp.exceptions import ToolError

TABLE = {"capital of France": "Paris", "boiling point of water": "100 C", "answer": "42"}

# A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

server = Server("jaxagent-test-tools", log_level="ERROR")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """Look a fact up by its key."""
    if key not in TABLE:
        raise ToolError(f"no entry for {key!r}; keys: {', '.join(sorted(TABLE))}")
    return TABLE[key]


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep for some seconds, then say so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds} s"


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def picture() -> Image:
    """A tiny PNG image."""
    return Image(data=PNG, format="png")


if __name__ == "__main__":
    server.run()
