"""The OpenAI chat-completions wire format of the gateway: requests in, responses out.

Pure Python (no HTTP framework, no JAX). The server calls `parse_request` on a body, runs
the engine and answers with `responses.completion_response`, or streams
`responses.stream_chunks` / `chunk` through `sse` and ends with `SSE_DONE`; a
`RequestError` is answered with `err.status` and `error_body(err)`.

Requests (`parse_request` -> `ChatRequest`)
    Accepted: `model`, `messages` (system, developer (read as system), user, assistant with
    optional `tool_calls`, tool with `tool_call_id`; content as text or a list of text parts,
    joined with "\\n"), `tools` (functions), `tool_choice`, `temperature`, `top_p`,
    `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `logprobs`, `top_logprobs`,
    `stream`, `stream_options.include_usage`, `n` (1), `parallel_tool_calls`, and the
    identifiers `user`, `metadata`, `safety_identifier`, `prompt_cache_key` (never change
    what is sampled). JSON null counts as absent (`model`, `messages` excepted). A known
    OpenAI parameter that is not implemented is refused (`unsupported_parameter`) unless it
    has its neutral value: `n: 1`, `frequency_penalty: 0`, `presence_penalty: 0`,
    `logit_bias: {}`, `response_format: {"type": "text"}`, `modalities: ["text"]`,
    `store: false`; any other key is refused (`unknown_parameter`). Unknown keys inside a
    message are ignored (clients echo e.g. `annotations`). A tool message's `tool_call_id`
    must be the id of a tool call of an earlier assistant message.

Errors (`RequestError(status, message, param, code, type)`)
    `param` names the field (`"messages[3].content"`, `"temperature"`; None for the body as
    a whole) and the message starts with it. 400 bad request, 401 key, 404 unknown model, 413
    body too large, 429 too many sessions. A message shows a wrong value only when it is a
    number, a boolean or a string (cut to 40 characters), never message content, and is at
    most 1000 characters.

Responses, streams and the `jaxagent` extension are built by `jaxagent.gateway.responses`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

#: the most stop sequences, tools and top log-probs a request may ask for (OpenAI's limits)
MAX_STOP = 4
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20

_ECHO_CHARS = 40
_MESSAGE_CHARS = 1000
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_INT64 = (-(2**63), 2**63 - 1)

#: OpenAI's error type for each status (other 4xx: invalid_request_error; 5xx: server_error)
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


# ---------------------------------------------------------------- errors
def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (see `ERROR_TYPES`)."""
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RequestError(Exception):
    """A request the gateway refuses: an HTTP status (4xx, or 5xx for the server's own
    failures), a message that starts with the field it names, OpenAI's `param`, `code` and
    `type` (derived from the status when not given). The message is capped at 1000 characters."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"RequestError: status must be an HTTP error status (400..599), got {status!r}")
        self.status = status
        self.message = _cap(str(message), _MESSAGE_CHARS)
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        super().__init__(self.message)

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def error_body(err: RequestError) -> dict:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def authentication_error() -> RequestError:
    """401 for a missing or wrong bearer key (the key sent is never shown)."""
    return RequestError(
        401,
        "Authorization: missing or wrong API key; send the gateway's key as `Authorization: Bearer <key>`",
        code="invalid_api_key",
    )


def session_limit_error(limit: int) -> RequestError:
    """429 when a new session would exceed `Limits.max_sessions`."""
    return RequestError(
        429, f"too many concurrent sessions (the limit is {limit}); retry when one ends", code="too_many_sessions"
    )


def context_length_error(prompt_tokens: int, max_tokens: int, context_length: int) -> RequestError:
    """400 (param "messages") when the prompt plus the completion's budget exceed the context."""
    return RequestError(
        400,
        f"messages: the prompt is {prompt_tokens} tokens and max_tokens asks for {max_tokens} more, "
        f"over the model's context of {context_length} tokens; shorten the messages or lower max_tokens",
        param="messages",
        code="context_length_exceeded",
    )


def _bad(param: str, message: str, code: str = "invalid_value", status: int = 400) -> RequestError:
    return RequestError(status, f"{param}: {message}", param=param, code=code)


def _shown(value: Any) -> str:
    """A value for an error message: numbers and booleans, short strings cut to 40
    characters; anything else only by its JSON kind (so no content or secret is echoed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _cap(repr(value), _ECHO_CHARS)
    if isinstance(value, str):
        return repr(_cap(value, _ECHO_CHARS))
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# ---------------------------------------------------------------- limits and the request
@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request (and the server) may ask for; every field a positive integer."""

    max_request_bytes: int = 4 * 1024 * 1024
    max_messages: int = 512
    #: the most completion tokens one request may ask for (max_tokens / max_completion_tokens)
    max_tokens: int = 4096
    #: concurrent sessions the server admits (enforced by the server, `session_limit_error`)
    max_sessions: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        """OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class Message:
    """One request message. `role` is system (developer included), user, assistant or tool;
    `content` is None only for an assistant message with tool calls."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    #: a tool message's id of the call it answers
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        """The message as an OpenAI request dict (tool call arguments as the text given)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call (`parameters`: its JSON schema; treat it as read-only)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None

    def to_dict(self) -> dict:
        """OpenAI's `{"type": "function", "function": {"name", "description"?, "parameters"?}}`
        (what chat templates render; `strict` is left out)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class FunctionChoice:
    """`tool_choice` naming one function: the model must call `name`."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request. Sampling fields are None when the request did
    not set them (the server decides); `max_tokens` is whichever of max_tokens /
    max_completion_tokens was given; `tool_choice` defaults to "auto" with tools, else "none"."""

    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "none"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


# ---------------------------------------------------------------- request parsing
_SUPPORTED = frozenset(
    "model messages tools tool_choice temperature top_p max_tokens max_completion_tokens stop seed logprobs "
    "top_logprobs stream stream_options n user parallel_tool_calls metadata safety_identifier prompt_cache_key".split()
)
#: known OpenAI parameters that are not implemented, with the value that means "not used"
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "store": False,
}
_UNSUPPORTED = frozenset(
    "audio function_call functions moderation prediction prompt_cache_options prompt_cache_retention "
    "reasoning_effort service_tier verbosity web_search_options".split()
) | frozenset(_NEUTRAL)


def _whole(message: str, status: int = 400, code: str = "invalid_json") -> RequestError:
    return RequestError(status, message, code=code)


def _load(body: bytes | bytearray | memoryview | Mapping[str, Any], limits: Limits) -> dict:
    """The body as a dict, its size checked first (a dict: its size as compact JSON)."""
    limit = limits.max_request_bytes
    if isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
        if len(raw) > limit:
            raise _whole(f"the request body is {len(raw)} bytes, over the limit of {limit}", 413, "request_too_large")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except UnicodeDecodeError as e:
            raise _whole(f"the request body is not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise _whole(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise _whole(f"the request body is not valid JSON: {_cap(str(e), 80)}") from None
    elif isinstance(body, Mapping):
        data = dict(body)
        try:
            size = len(json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
        except (TypeError, ValueError, RecursionError) as e:
            raise _whole(f"the request is not JSON data: {_cap(str(e), 80)}") from None
        if size > limit:
            raise _whole(f"the request is {size} bytes as JSON, over the limit of {limit}", 413, "request_too_large")
    else:
        raise TypeError(f"parse_request: body must be bytes or a dict, got {type(body).__name__}")
    if not isinstance(data, dict):
        raise _whole(f"the request body must be a JSON object, got {_shown(data)}")
    return data


def _is_neutral(key: str, value: Any) -> bool:
    """Whether a known but unimplemented parameter carries its "not used" value."""
    if key not in _NEUTRAL or isinstance(value, bool) is not isinstance(_NEUTRAL[key], bool):
        return False
    return bool(value == _NEUTRAL[key])


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _expect(value: Any, param: str, kinds: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise _bad(param, f"expected {what}, got {_shown(value)}", "invalid_type")
    if not isinstance(value, kinds):
        raise _bad(param, f"expected {what}, got {_shown(value)}", "invalid_type")
    return value


def _number(value: Any, param: str, low: float, high: float, low_open: bool = False) -> float:
    x = float(_expect(value, param, (int, float), "a number"))
    if not math.isfinite(x) or x > high or (x <= low if low_open else x < low):
        span = f"{'more than' if low_open else 'from'} {low:g} {'and at most' if low_open else 'to'} {high:g}"
        raise _bad(param, f"expected a number {span}, got {_shown(value)}")
    return x


_int = functools.partial(_expect, kinds=int, what="an integer")
_bool = functools.partial(_expect, kinds=bool, what="a boolean")
_str = functools.partial(_expect, kinds=str, what="a string")
_object = functools.partial(_expect, kinds=dict, what="an object")
_array = functools.partial(_expect, kinds=list, what="an array")


def _opt(check: Any, value: Any, param: str, default: Any = None) -> Any:
    """`check(value, param)`, or `default` when the value is null / absent."""
    return default if value is None else check(value, param)


def _content(message: dict, p: str, required: bool) -> str | None:
    """A message's content as text: a string, or text parts joined with "\\n"."""
    value = message.get("content")
    if value is None:
        if required:
            raise _bad(
                f"{p}.content", "this message needs content (a string or a list of text parts)", "missing_content"
            )
        return None
    if isinstance(value, str):
        return value
    parts = _expect(value, f"{p}.content", (str, list), "a string or a list of text parts")
    if not parts:
        raise _bad(f"{p}.content", "expected at least one content part, got an empty array")
    texts = []
    for j, part in enumerate(parts):
        q = f"{p}.content[{j}]"
        _object(part, q)
        kind = part.get("type")
        if kind != "text":
            raise _bad(f"{q}.type", f"only text parts are supported, got {_shown(kind)}", "unsupported_value")
        texts.append(_str(part.get("text"), f"{q}.text"))
    return "\n".join(texts)


def _tool_calls(value: Any, p: str) -> tuple[ToolCall, ...]:
    calls = []
    for j, raw in enumerate(_array(value, f"{p}.tool_calls")):
        q = f"{p}.tool_calls[{j}]"
        _object(raw, q)
        kind = raw.get("type", "function")
        if kind != "function":
            raise _bad(f"{q}.type", f"only function tool calls are supported, got {_shown(kind)}", "unsupported_value")
        call_id = _str(raw.get("id"), f"{q}.id")
        if not call_id:
            raise _bad(f"{q}.id", "expected a non-empty string")
        function = _object(raw.get("function"), f"{q}.function")
        name = _str(function.get("name"), f"{q}.function.name")
        arguments = _str(function.get("arguments"), f"{q}.function.arguments")
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def parse_messages(value: Any, *, param: str = "messages", max_messages: int | None = None) -> tuple[Message, ...]:
    """Validate OpenAI request messages (the `messages` of a request) into `Message`s.
    Raises `RequestError` naming the field, e.g. `messages[3].content`."""
    messages = _array(value, param)
    if not messages:
        raise _bad(param, "expected at least one message, got an empty array", "empty_array")
    if max_messages is not None and len(messages) > max_messages:
        raise _bad(param, f"{len(messages)} messages, over the limit of {max_messages}", "too_many_messages")
    out: list[Message] = []
    call_ids: set[str] = set()
    for i, raw in enumerate(messages):
        p = f"{param}[{i}]"
        _object(raw, p)
        role = raw.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            code = "unsupported_value" if role == "function" else "invalid_value"
            raise _bad(f"{p}.role", f"expected system, developer, user, assistant or tool, got {_shown(role)}", code)
        name = _opt(_str, raw.get("name"), f"{p}.name")
        if role == "assistant":
            for key in ("function_call", "refusal", "audio"):
                if raw.get(key) is not None:
                    raise _bad(f"{p}.{key}", f"assistant messages with {key} are not supported", "unsupported_value")
            calls = _tool_calls(raw["tool_calls"], p) if raw.get("tool_calls") is not None else ()
            content = _content(raw, p, required=not calls)
            call_ids.update(c.id for c in calls)
            out.append(Message("assistant", content, calls, name=name))
        elif role == "tool":
            content = _content(raw, p, required=True)
            call_id = _str(raw.get("tool_call_id"), f"{p}.tool_call_id")
            if call_id not in call_ids:
                raise _bad(
                    f"{p}.tool_call_id",
                    f"no earlier assistant message has a tool call with id {_shown(call_id)}",
                    "unknown_tool_call_id",
                )
            out.append(Message("tool", content, tool_call_id=call_id, name=name))
        else:
            content = _content(raw, p, required=True)
            out.append(Message("system" if role == "developer" else role, content, name=name))
    return tuple(out)


def parse_tools(value: Any, *, param: str = "tools") -> tuple[Tool, ...]:
    """Validate a request's `tools` (functions only; names unique, OpenAI's name pattern)."""
    tools = _array(value, param)
    if len(tools) > MAX_TOOLS:
        raise _bad(param, f"{len(tools)} tools, over the limit of {MAX_TOOLS}")
    out: list[Tool] = []
    for i, raw in enumerate(tools):
        p = f"{param}[{i}]"
        _object(raw, p)
        if raw.get("type") != "function":
            raise _bad(
                f"{p}.type", f"only function tools are supported, got {_shown(raw.get('type'))}", "unsupported_value"
            )
        function = _object(raw.get("function"), f"{p}.function")
        name = _str(function.get("name"), f"{p}.function.name")
        if not _TOOL_NAME.fullmatch(name):
            raise _bad(f"{p}.function.name", f"expected 1 to 64 of a-z, A-Z, 0-9, _ and -, got {_shown(name)}")
        if any(t.name == name for t in out):
            raise _bad(f"{p}.function.name", f"a second tool named {_shown(name)}", "duplicate_tool_name")
        description = _opt(_str, function.get("description"), f"{p}.function.description")
        parameters = _opt(_object, function.get("parameters"), f"{p}.function.parameters")
        strict = _opt(_bool, function.get("strict"), f"{p}.function.strict")
        out.append(Tool(name, description, parameters, strict))
    return tuple(out)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _bad("tool_choice", f'expected "none", "auto", "required" or a function, got {_shown(value)}')
        if value == "required" and not tools:
            raise _bad("tool_choice", '"required" needs tools')
        return cast(ToolChoice, value)
    choice = _expect(value, "tool_choice", (str, dict), "a string or an object")
    if choice.get("type") != "function":
        raise _bad(
            "tool_choice.type", f'only "function" is supported, got {_shown(choice.get("type"))}', "unsupported_value"
        )
    name = _str(_object(choice.get("function"), "tool_choice.function").get("name"), "tool_choice.function.name")
    if not any(t.name == name for t in tools):
        raise _bad("tool_choice.function.name", f"no tool named {_shown(name)} in tools")
    return FunctionChoice(name)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else _expect(value, "stop", (str, list), "a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    for j, s in enumerate(stops):
        q = "stop" if isinstance(value, str) else f"stop[{j}]"
        if not _str(s, q):
            raise _bad(q, "a stop sequence must not be empty")
    return tuple(stops)


def _max_tokens(data: dict, limits: Limits) -> int | None:
    given = {k: data[k] for k in ("max_tokens", "max_completion_tokens") if data.get(k) is not None}
    for key, value in given.items():
        if _int(value, key) < 1:
            raise _bad(key, f"expected an integer of at least 1, got {_shown(value)}")
        if value > limits.max_tokens:
            raise _bad(key, f"{value} is over this gateway's limit of {limits.max_tokens} tokens")
    if len(set(given.values())) > 1:
        raise _bad("max_completion_tokens", "differs from max_tokens; give one of them (or the same value)")
    return next(iter(given.values()), None)


def parse_request(body: bytes | Mapping[str, Any], *, limits: Limits, models: Sequence[str] | None) -> ChatRequest:
    """Validate a chat-completions request body (raw bytes, or already decoded JSON).

    `models`: the model names served (an unknown `model` is a 404), or None to accept any
    name. Raises `RequestError` for every bad request (see the module docstring); a body of
    another Python type is a TypeError (a programming error, not a bad request)."""
    if isinstance(models, str):
        raise TypeError("parse_request: models must be a sequence of names, not a string")
    data = _load(body, limits)
    for key, value in data.items():
        if key in _SUPPORTED:
            continue
        if key in _UNSUPPORTED:
            if value is None or _is_neutral(key, value):
                continue
            raise _bad(key, "this parameter is not supported by the gateway", "unsupported_parameter")
        shown = _cap(key, _ECHO_CHARS)
        raise _bad(shown, "unrecognized request parameter", "unknown_parameter")

    if data.get("model") is None:
        raise _bad("model", "this parameter is required", "missing_required_parameter")
    model = _str(data["model"], "model")
    if models is not None and model not in models:
        available = _cap(", ".join(models), 200) or "none"
        raise _bad("model", f"no model {_shown(model)} here (available: {available})", "model_not_found", status=404)
    if data.get("messages") is None:
        raise _bad("messages", "this parameter is required", "missing_required_parameter")
    messages = parse_messages(data["messages"], max_messages=limits.max_messages)
    tools = parse_tools(data["tools"]) if data.get("tools") is not None else ()
    tool_choice = _tool_choice(data.get("tool_choice"), tools)

    get = data.get
    n = get("n")
    if n is not None and _int(n, "n") != 1:
        raise _bad("n", f"only one choice per request is supported, got {_shown(n)}", "unsupported_value")
    seed = _opt(_int, get("seed"), "seed")
    if seed is not None and not _INT64[0] <= seed <= _INT64[1]:
        raise _bad("seed", f"expected a 64-bit signed integer, got {_shown(seed)}")
    logprobs = _opt(_bool, get("logprobs"), "logprobs", False)
    top_logprobs = _opt(_int, get("top_logprobs"), "top_logprobs", 0)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"expected an integer from 0 to {MAX_TOP_LOGPROBS}, got {_shown(top_logprobs)}")
    if get("top_logprobs") is not None and not logprobs:
        raise _bad("top_logprobs", "needs logprobs set to true")
    stream = _opt(_bool, get("stream"), "stream", False)
    options = _opt(_object, get("stream_options"), "stream_options", {})
    if get("stream_options") is not None and not stream:
        raise _bad("stream_options", "only allowed when stream is true")
    for key, value in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise _bad(f"stream_options.{_cap(key, _ECHO_CHARS)}", "unrecognized stream option", "unknown_parameter")
        _opt(_bool, value, f"stream_options.{key}")
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        _opt(_str, get(key), key)
    _opt(_object, get("metadata"), "metadata")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_opt(_bool, get("parallel_tool_calls"), "parallel_tool_calls", True),
        temperature=_opt(functools.partial(_number, low=0.0, high=2.0), get("temperature"), "temperature"),
        top_p=_opt(functools.partial(_number, low=0.0, high=1.0, low_open=True), get("top_p"), "top_p"),
        max_tokens=_max_tokens(data, limits),
        stop=_stop(get("stop")),
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        user=get("user"),
    )
