"""Adapters to external environment libraries, each behind an optional extra.

``gymnasium/<id>`` (extra ``envs-gym``), ``reasoning_gym/<dataset>`` (``envs-reasoning``,
in :mod:`envs.tasks`), ``textworld/<game type>`` (``envs-textworld``) and
``textarena/<game id>`` (``envs-textarena``). Each module imports its library only
when an env is built, and raises :class:`envs.core.MissingExtraError` naming the
extra when the library is missing.

:mod:`envs.adapters.mcp_env` (extra ``agents``) is of another kind: ``MCPTools`` gives an
agent program (``agent.program``, ``examples/agents``) the tools of an MCP server.
"""
