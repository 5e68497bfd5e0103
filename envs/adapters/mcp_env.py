"""Tools from an MCP server for an agent program: ``async with MCPTools([...]) as tools``.

An agent program (see ``examples/agents/``) that talks to a model through the ``openai``
client can give it the tools of any `Model Context Protocol <https://modelcontextprotocol.io>`_
server. :class:`MCPTools` starts the server as a subprocess speaking MCP over stdio,
initializes the session, and offers two things:

- :meth:`MCPTools.tools`: the server's tools as OpenAI chat-completions tool dicts,
  ``{"type": "function", "function": {"name", "description", "parameters"}}``, where
  ``parameters`` is the MCP tool's JSON Schema (``inputSchema``), ready for
  ``client.chat.completions.create(..., tools=...)``;
- :meth:`MCPTools.call`: runs one tool call, with the arguments as the model wrote them
  (a dict, or the JSON text of ``tool_call.function.arguments``), and returns the result
  as text for a ``{"role": "tool", ...}`` message.

A misbehaving tool costs the call, not the run: an unknown tool name, arguments that are
not a JSON object, a tool that reports an error (``isError``), a call past its timeout, or
a server that died mid-session all give a text starting with ``error:`` that the model can
read. A server that cannot start (no such command, it exits, it never answers the
handshake) raises :class:`MCPServerError` naming the command. On exit the server's stdin
is closed and, if it does not exit within a grace period, its whole process group is
killed (the ``mcp`` SDK's stdio shutdown), so no server process outlives the block.

Needs the ``mcp`` package (extra ``agents``): its 2.x API, or 1.x from 1.25 (older releases
lack parts used here, and do not import with current pydantic). Fields are read under
either name (``input_schema``/``inputSchema``, ``is_error``/``isError``), and timeouts are
this module's own cancel scopes, not the SDK's (seconds in 2.x, a timedelta in 1.x).
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TextIO

from envs.core import require


class MCPServerError(RuntimeError):
    """An MCP server could not be started or did not complete the MCP handshake."""


def _import_mcp():
    mcp = require("mcp", "MCPTools", "mcp", "agents")
    stdio = require("mcp.client.stdio", "MCPTools", "mcp", "agents")
    return mcp, stdio.StdioServerParameters, stdio.stdio_client


def _field(obj: Any, snake: str, camel: str, default: Any = None) -> Any:
    """A model field under its 2.x (snake_case) or 1.x (camelCase) attribute name."""
    return getattr(obj, snake) if hasattr(obj, snake) else getattr(obj, camel, default)


def _describe(item: Any) -> str:
    """A content item of a tool result as text; a non-text item described briefly."""
    kind = getattr(item, "type", type(item).__name__)
    if kind == "text":
        return item.text
    if kind == "resource":
        resource = item.resource
        text = getattr(resource, "text", None)
        return text if text is not None else f"[resource {resource.uri}: {_field(resource, 'mime_type', 'mimeType')}]"
    if kind == "resource_link":
        return f"[resource link {item.uri}]"
    mime = _field(item, "mime_type", "mimeType")
    return f"[{kind} content{f': {mime}' if mime else ''}]"


class MCPTools:
    """The tools of one MCP server started over stdio, as an async context manager.

    ``command`` is the server's argv (``["python", "server.py"]``, ``["npx", "-y", "pkg"]``);
    ``env`` adds variables to the few the SDK passes on (``PATH``, ``HOME``, ...); ``cwd``
    is the server's working directory; ``start_timeout_s`` bounds the start and each tool
    listing; the server's stderr goes to ``errlog`` (default: ours). See the module docstring.
    """

    def __init__(
        self,
        command: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        start_timeout_s: float = 30.0,
        errlog: TextIO | None = None,
    ):
        if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
            raise ValueError(f"MCPTools command must be a non-empty list of strings (argv), got {command!r}")
        self.command = list(command)
        self.env, self.cwd, self.start_timeout_s = env, cwd, start_timeout_s
        self.errlog = errlog
        self._stack: AsyncExitStack | None = None
        self._session: Any = None
        self._tools: list[dict] | None = None

    async def __aenter__(self) -> MCPTools:
        import anyio

        mcp, StdioServerParameters, stdio_client = _import_mcp()
        params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env, cwd=self.cwd)
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            # The transport and the session hold task groups open until __aexit__, so only the
            # handshake sits in the timeout's cancel scope (cancel scopes must nest).
            streams = await stack.enter_async_context(stdio_client(params, errlog=_stderr(self.errlog)))
            self._session = await stack.enter_async_context(mcp.ClientSession(streams[0], streams[1]))
            with anyio.fail_after(self.start_timeout_s):
                await self._session.initialize()
        except BaseException as e:
            await _close_quietly(stack)
            self._session = None
            if not isinstance(e, Exception):
                raise
            if isinstance(e, TimeoutError):
                why = f"no answer to the MCP handshake within {self.start_timeout_s:g} s"
            elif isinstance(e, OSError):
                why = _why(e)
            else:
                why = f"{_why(e)} (did it exit, or is it not an MCP server on stdio? its stderr may say)"
            raise MCPServerError(f"MCP server {self.command!r} could not be started: {why}") from e
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info) -> None:
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            await _close_quietly(stack)

    def _require_session(self) -> Any:
        if self._session is None:
            raise RuntimeError("MCPTools is not open: use it as `async with MCPTools(command) as tools:`")
        return self._session

    async def tools(self) -> list[dict]:
        """The server's tools as OpenAI chat-completions tool dicts (listed once, then cached)."""
        import anyio

        session = self._require_session()
        if self._tools is None:
            listed, cursor = [], None
            with anyio.fail_after(self.start_timeout_s):
                while True:
                    page = await _list_tools_page(session, cursor)
                    listed.extend(page.tools)
                    cursor = _field(page, "next_cursor", "nextCursor")
                    if not cursor:
                        break
            self._tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": _field(t, "input_schema", "inputSchema") or {"type": "object", "properties": {}},
                    },
                }
                for t in listed
            ]
        return self._tools

    async def call(self, name: str, arguments: dict | str | None = None, timeout_s: float = 30.0) -> str:
        """Runs tool ``name`` and returns its text result, or a text starting with ``error:``.

        ``arguments`` is a dict or its JSON text (an empty string or None is ``{}``).
        Text content items are joined by newlines; other items are described briefly.
        """
        import anyio

        session = self._require_session()
        known = [t["function"]["name"] for t in await self.tools()]
        if name not in known:
            return f"error: unknown tool {name!r}; the tools are: {', '.join(known) or '(none)'}"
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                return f"error: the arguments of {name!r} are not valid JSON ({e.msg} at char {e.pos})"
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
        try:
            with anyio.fail_after(timeout_s):
                result = await session.call_tool(name, arguments)
        except TimeoutError:
            return f"error: tool {name!r} did not finish within {timeout_s:g} s"
        except Exception as e:
            return f"error: tool {name!r} failed: {_why(e)}"
        text = "\n".join(_describe(item) for item in result.content)
        if _field(result, "is_error", "isError", False):
            return f"error: {text or f'tool {name!r} reported an error'}"
        return text


async def _list_tools_page(session: Any, cursor: str | None) -> Any:
    if cursor is None:
        return await session.list_tools()
    import mcp.types

    return await session.list_tools(params=mcp.types.PaginatedRequestParams(cursor=cursor))


def _stderr(errlog: TextIO | None) -> Any:
    """Where the server's stderr goes: ``errlog``, else ours if it is a real file, else nowhere."""
    if errlog is not None:
        return errlog
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file descriptor
        return subprocess.DEVNULL


def _why(e: BaseException) -> str:
    """The innermost message of an exception, looking inside exception groups."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def _close_quietly(stack: AsyncExitStack) -> None:
    """Closes the session and stops the server; a server that already died is no error here."""
    try:
        await stack.aclose()
    except Exception:
        pass
