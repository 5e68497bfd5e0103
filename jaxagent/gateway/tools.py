"""Tool calls in the model's own chat template, and back to OpenAI `tool_calls`.

Pure Python: no HTTP framework, no JAX (the tokenizer is whatever the caller holds).

Into the prompt
    `to_template_messages(messages)` turns OpenAI messages into the dicts Hugging Face chat
    templates take, and `template_kwargs(tools)` the keyword arguments of
    `tokenizer.apply_chat_template(messages, **template_kwargs(tools), ...)`:

    * assistant: `{"role": "assistant", "content": <text or "">, "tool_calls": [{"id", "type":
      "function", "function": {"name", "arguments": <dict>}}]}`. OpenAI's arguments are JSON
      text; templates expect an object, so a JSON object is decoded (empty text: `{}`) and
      anything else is passed on as the text it is. Content None becomes "" (templates test
      `if message.content`; some would print "None").
    * tool: `{"role": "tool", "content", "tool_call_id", "name": <the called function>}` (the
      name looked up from the earlier assistant call, for templates that print it).
    * system (developer included) and user: `{"role", "content"}` (and `name` when given).

Out of a completion
    `parse_tool_calls(text, style="hermes", ids=CallIds(seed))` finds Hermes / Qwen2.5 blocks
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (any number). Each becomes a
    `ToolCall` with the next id from `ids` (`call_<24 hex>`) and its arguments re-serialised as
    `json.dumps(arguments, ensure_ascii=False)` (what templates' `tojson` writes, so a
    re-rendered call is the same text). The content is the text outside the blocks: the part
    before the first block without its trailing whitespace, the parts between and after the
    blocks stripped, the non-empty ones joined with "\\n"; None when nothing is left.

    A malformed reply is never an error: an unclosed or stray tag, a nested block, a block
    that is not one JSON object, whose `name` is not a non-empty string, whose `arguments`
    is not an object, or with other keys, makes the whole text plain content with no calls.
    Text without any tag is returned as it is (content = text).

    `apply_tool_choice(text, content, calls, tool_choice, tools)` makes the reply plain
    content when it calls a function the request did not offer: any call under "none", a
    name not in `tools`, or another function than the one `tool_choice` names. Nothing is
    forced: "required" with no call, or several calls with `parallel_tool_calls` false, pass
    unchanged (decoding is not constrained). `parse_reply` does both.

    Streaming: `streamable_prefix(text)` is how much of a partial completion can be sent as
    content already, whatever follows: the text before the first `<tool_call>` (or before a
    trailing partial tag), without its trailing whitespace.

The built-in template
    `TOOL_CHATML_TEMPLATE` is the byte-level tokenizers' ChatML
    (`jaxagent.models.byte_tokenizer.CHATML_TEMPLATE`) with tools. Without tools and tool
    calls it renders exactly what CHATML_TEMPLATE renders. With tools, the system turn (the
    first system message's text, a blank line, then the tool block; or the tool block alone)
    lists each tool's JSON on its own line inside `<tools></tools>` and asks for
    `<tool_call>` blocks. An assistant turn is its content verbatim, then each call as
    `<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>` (a newline before
    each block but a first one with no content). Tool results are a turn of their own,
    `<|im_start|>tool\\n<result><|im_end|>\\n`, one per tool message, in the order of the
    calls they answer (the same turn CHATML_TEMPLATE gives any role).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxagent.gateway.protocol import FunctionChoice, Message, Tool, ToolCall, ToolChoice, parse_messages, parse_tools

STYLES: tuple[str, ...] = ("hermes",)
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TOOLS_INTRO = (
    "# Tools\\n\\nYou can call functions to help with the request. Their signatures are inside "
    "<tools></tools>, one JSON object per line:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nTo call a function, answer with one block per call, each holding the name of the function "
    'and its arguments as a JSON object:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<arguments-object>}\\n</tool_call>"
)

#: ChatML with Hermes-style tool calls for the byte-level tokenizers (see the module docstring).
#: Newlines are written as `{{ '\n' }}` so that Hugging Face's trim_blocks cannot eat them.
TOOL_CHATML_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}<|im_start|>system{{ '\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{{ '\\n\\n' }}{% set ns.start = 1 %}{% endif %}"
    "{{ '" + _TOOLS_INTRO + "' }}"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_OUTRO + "' }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages[ns.start:] %}<|im_start|>{{ m['role'] }}{{ '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' }}{{ f['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}{% endfor %}{% endif %}"
    "<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


class CallIds:
    """Tool-call ids `call_<24 hex>`: the same `seed` gives the same sequence (tests, replays);
    `seed=None` draws them from the operating system's randomness."""

    def __init__(self, seed: int | None = None):
        self._rng: random.Random = random.SystemRandom() if seed is None else random.Random(seed)

    def __call__(self) -> str:
        return f"call_{self._rng.getrandbits(96):024x}"


# ---------------------------------------------------------------- into the template
def _template_arguments(arguments: str) -> Any:
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def to_template_messages(messages: Sequence[Message | Mapping[str, Any]]) -> list[dict]:
    """OpenAI messages (parsed `Message`s, or raw request dicts, which are validated with
    `protocol.parse_messages`) as the dicts Hugging Face chat templates take (see the
    module docstring)."""
    given = [m for m in messages if isinstance(m, Message)]
    parsed = tuple(given) if len(given) == len(messages) else parse_messages([_raw(m) for m in messages])
    names: dict[str, str] = {}
    out: list[dict] = []
    for m in parsed:
        d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _template_arguments(c.arguments)},
                }
                for c in m.tool_calls
            ]
            names.update((c.id, c.name) for c in m.tool_calls)
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names:
                d["name"] = names[m.tool_call_id]
        elif m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _raw(m: Message | Mapping[str, Any]) -> Mapping[str, Any]:
    """A message as a request dict (for validating a mixed list once)."""
    return m.to_dict() if isinstance(m, Message) else m


def template_kwargs(tools: Sequence[Tool | Mapping[str, Any]]) -> dict:
    """Keyword arguments for `apply_chat_template`: `{"tools": [<OpenAI function tool>, ...]}`,
    or `{}` without tools (so templates render no tool block). Raw dicts are validated with
    `protocol.parse_tools`."""
    if not tools:
        return {}
    given = [t for t in tools if isinstance(t, Tool)]
    parsed = tuple(given) if len(given) == len(tools) else parse_tools([_raw_tool(t) for t in tools])
    return {"tools": [t.to_dict() for t in parsed]}


def _raw_tool(t: Tool | Mapping[str, Any]) -> Mapping[str, Any]:
    return t.to_dict() if isinstance(t, Tool) else t


# ---------------------------------------------------------------- out of a completion
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _hermes_call(inner: str) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of one block's inside, or None when it is malformed."""
    try:
        obj = json.loads(inner, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not set(obj) <= {"name", "arguments"}:
        return None
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(
    text: str, *, style: str = "hermes", ids: Callable[[], str] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """`(content, tool_calls)` of a completion's text (see the module docstring); `ids` gives
    each call's id (default: a `CallIds()` drawing from the operating system)."""
    if style not in STYLES:
        raise ValueError(f"parse_tool_calls: unknown style {style!r} (known: {', '.join(STYLES)})")
    if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
        return text, []
    pieces: list[str] = []
    found: list[tuple[str, str]] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            if TOOL_CALL_CLOSE in tail:
                return text, []
            pieces.append(tail)
            break
        before = text[pos:start]
        end = text.find(TOOL_CALL_CLOSE, start)
        if TOOL_CALL_CLOSE in before or end < 0:
            return text, []
        inner = text[start + len(TOOL_CALL_OPEN) : end]
        call = None if TOOL_CALL_OPEN in inner else _hermes_call(inner)
        if call is None:
            return text, []
        pieces.append(before)
        found.append(call)
        pos = end + len(TOOL_CALL_CLOSE)
    trimmed = [pieces[0].rstrip()] + [p.strip() for p in pieces[1:-1]] + [pieces[-1].strip()]
    content = "\n".join(p for p in trimmed if p) or None
    next_id = ids if ids is not None else CallIds()
    return content, [ToolCall(next_id(), name, arguments) for name, arguments in found]


def apply_tool_choice(
    text: str,
    content: str | None,
    tool_calls: Sequence[ToolCall],
    tool_choice: ToolChoice,
    tools: Sequence[Tool],
) -> tuple[str | None, list[ToolCall]]:
    """`(content, tool_calls)` after the request's tool policy: `(text, [])` (the whole
    completion as plain content) when a call names a function the request did not offer
    (see the module docstring); else the calls unchanged."""
    if not tool_calls:
        return content, []
    offered = {t.name for t in tools}
    if tool_choice == "none":
        offered = set()
    elif isinstance(tool_choice, FunctionChoice):
        offered &= {tool_choice.name}
    if any(c.name not in offered for c in tool_calls):
        return text, []
    return content, list(tool_calls)


def parse_reply(
    text: str,
    *,
    tools: Sequence[Tool],
    tool_choice: ToolChoice,
    ids: Callable[[], str] | None = None,
    style: str = "hermes",
) -> tuple[str | None, list[ToolCall]]:
    """`parse_tool_calls` then `apply_tool_choice`: the reply's content and tool calls."""
    content, calls = parse_tool_calls(text, style=style, ids=ids)
    return apply_tool_choice(text, content, calls, tool_choice, tools)


def streamable_prefix(text: str) -> int:
    """How many characters of a partial completion are content whatever the model writes
    next: up to the first `<tool_call>` (or a trailing start of one), trailing whitespace
    held back. A caller streams `text[sent:streamable_prefix(text)]` as it grows and, at the
    end, the rest of the parsed content (a reply that becomes plain content begins with the
    same text)."""
    cut = text.find(TOOL_CALL_OPEN)
    if cut < 0:
        cut = len(text)
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALL_OPEN[:k]):
                cut -= k
                break
    return len(text[:cut].rstrip())
