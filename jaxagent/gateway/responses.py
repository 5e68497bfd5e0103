"""The gateway's answers in the OpenAI chat-completions wire format: completions, stream
chunks, server-sent events and the `jaxagent` extension (requests and errors:
`jaxagent.gateway.protocol`). Pure Python.

Streams
    A first chunk with the role, content deltas, one delta per tool call (index, id, type,
    name and the whole arguments), the chunk with `finish_reason` and, with
    `stream_options.include_usage`, a usage chunk with no choices (the others then carry
    `"usage": null`).

The `jaxagent` extension
    A top-level `jaxagent` object on a response (in a stream: on the `finish_reason` chunk),
    built by `jaxagent_extension`; the `openai` client keeps it (`completion.model_extra`):

    * `prompt_token_ids`: the prompt the policy was conditioned on (when a session extends an
      earlier call: the whole sequence, earlier completions as the tokens actually sampled);
    * `completion_token_ids`: the sampled tokens, the stop token included when sampled;
    * `completion_logprobs` (optional): the sampler's log-probability of each of them;
    * `policy_version`: the version of the weights that sampled them;
    * `sampling` (`Sampling.to_dict`): the settings actually used: temperature, top_p, top_k,
      max_tokens, seed, stop, greedy, and `source`: "request" when the request's settings
      were honoured (`jaxagent serve`), "run" when the run's own decided (training, evaluation).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxagent.gateway.protocol import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "tool_calls")
#: the top-level key of the extension in responses and final chunks
EXTENSION_KEY = "jaxagent"
#: the smallest log-probability written (OpenAI's stand-in for "very unlikely"; JSON has no -inf)
MIN_LOGPROB = -9999.0
SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------- response values
@dataclasses.dataclass(frozen=True)
class AssistantMessage:
    """The reply: text content (None only when the reply is tool calls) and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.content is None and not self.tool_calls:
            raise ValueError("AssistantMessage: content may be None only when there are tool calls")

    def to_dict(self) -> dict:
        """OpenAI's message object (`tool_calls` only when there are some)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        return {**out, "tool_calls": [c.to_dict() for c in self.tool_calls]} if self.tool_calls else out


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of one call; `cached_tokens`: prompt tokens whose KV cache was reused
    (reported as `prompt_tokens_details.cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"Usage.{name} must be a non-negative integer, got {value!r}")
        if self.cached_tokens is not None and self.cached_tokens > self.prompt_tokens:
            raise ValueError("Usage.cached_tokens cannot exceed prompt_tokens")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        out["total_tokens"] = self.total_tokens
        if self.cached_tokens is None:
            return out
        return {**out, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def token_text(raw: bytes) -> str:
    """A token's text for logprobs: its UTF-8 text, or `bytes:\\xNN...` when its bytes are not
    valid UTF-8 on their own (OpenAI's convention for part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclasses.dataclass(frozen=True)
class TopLogprob:
    """One candidate at a position: its text, log-probability and bytes (None if unknown).
    A log-probability below -9999 or not finite is written as -9999.0 (JSON has no -inf)."""

    token: str
    logprob: float
    raw: bytes | None = None

    def to_dict(self) -> dict:
        lp = float(self.logprob)
        lp = lp if math.isfinite(lp) and lp >= MIN_LOGPROB else MIN_LOGPROB
        return {"token": self.token, "logprob": lp, "bytes": None if self.raw is None else list(self.raw)}


@dataclasses.dataclass(frozen=True)
class TokenLogprob(TopLogprob):
    """A sampled token's log-probability, with the most likely candidates at its position."""

    top_logprobs: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_bytes(cls, raw: bytes, logprob: float, top: Sequence[tuple[bytes, float]] = ()) -> TokenLogprob:
        """From a token's bytes (and `(bytes, logprob)` candidates)."""
        return cls(token_text(raw), logprob, raw, tuple(TopLogprob(token_text(b), lp, b) for b, lp in top))

    def to_dict(self) -> dict:
        return {**super().to_dict(), "top_logprobs": [t.to_dict() for t in self.top_logprobs]}


def logprobs_body(tokens: Sequence[TokenLogprob] | None) -> dict | None:
    """A choice's `logprobs` object, `{"content": [...], "refusal": null}` (None stays None)."""
    return None if tokens is None else {"content": [t.to_dict() for t in tokens], "refusal": None}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling settings actually used for a completion (the extension's `sampling`)."""

    temperature: float
    top_p: float
    top_k: int | None
    max_tokens: int
    seed: int | None
    stop: tuple[str, ...] = ()
    greedy: bool = False
    #: "request": the request's settings were honoured; "run": the run's own settings decided
    source: Literal["request", "run"] = "request"

    def __post_init__(self) -> None:
        if self.source not in ("request", "run"):
            raise ValueError(f'Sampling.source must be "request" or "run", got {self.source!r}')
        object.__setattr__(self, "stop", tuple(self.stop))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "stop": list(self.stop)}


def jaxagent_extension(
    *,
    prompt_token_ids: Sequence[int],
    completion_token_ids: Sequence[int],
    policy_version: int,
    sampling: Sampling,
    completion_logprobs: Sequence[float] | None = None,
) -> dict:
    """The `jaxagent` extension object (see the module docstring)."""
    out: dict[str, Any] = {
        "prompt_token_ids": [int(t) for t in prompt_token_ids],
        "completion_token_ids": [int(t) for t in completion_token_ids],
        "policy_version": int(policy_version),
        "sampling": sampling.to_dict(),
    }
    if completion_logprobs is None:
        return out
    if len(completion_logprobs) != len(completion_token_ids):
        n, m = len(completion_logprobs), len(completion_token_ids)
        raise ValueError(f"jaxagent_extension: {n} completion log-probs for {m} completion tokens")
    return {**out, "completion_logprobs": [float(x) for x in completion_logprobs]}


def finish_reason_of(message: AssistantMessage, sampler_reason: Literal["stop", "length"]) -> FinishReason:
    """The reply's finish_reason: "tool_calls" when it calls tools, else the sampler's
    ("stop": end of turn or a stop sequence; "length": the token budget ran out)."""
    if sampler_reason not in ("stop", "length"):
        raise ValueError(f'finish_reason_of: the sampler reason must be "stop" or "length", got {sampler_reason!r}')
    return "tool_calls" if message.tool_calls else sampler_reason


def _object_head(kind: str, id: str, model: str, created: int, finish_reason: str | None = None) -> dict:
    if finish_reason is not None and finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {', '.join(FINISH_REASONS)}, got {finish_reason!r}")
    return {"id": id, "object": kind, "created": int(created), "model": model}


def completion_response(
    id: str,
    model: str,
    created: int,
    message: AssistantMessage,
    finish_reason: FinishReason,
    usage: Usage,
    logprobs: Sequence[TokenLogprob] | None = None,
    extension: dict | None = None,
) -> dict:
    """A `chat.completion` object with one choice; `extension` (from `jaxagent_extension`)
    goes under the top-level `jaxagent` key."""
    out = _object_head("chat.completion", id, model, created, finish_reason)
    choice = {"index": 0, "message": message.to_dict(), "logprobs": logprobs_body(logprobs)}
    out.update(choices=[{**choice, "finish_reason": finish_reason}], usage=usage.to_dict())
    return out if extension is None else {**out, EXTENSION_KEY: extension}


# ---------------------------------------------------------------- streaming
def role_delta() -> dict:
    """The first chunk's delta: the role, and empty content."""
    return {"role": "assistant", "content": ""}


def content_delta(text: str) -> dict:
    return {"content": text}


def tool_call_delta(index: int, call: ToolCall) -> dict:
    """A whole tool call as one delta (`index`: its position among the reply's calls)."""
    return {"tool_calls": [{"index": index, **call.to_dict()}]}


def chunk(
    id: str,
    model: str,
    created: int,
    delta: Mapping[str, Any],
    *,
    finish_reason: FinishReason | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    include_usage: bool = False,
    extension: dict | None = None,
) -> dict:
    """A `chat.completion.chunk` with one choice. `include_usage`: the stream ends with a
    usage chunk, so this one carries `"usage": null`; `extension` goes on the last chunk."""
    out = _object_head("chat.completion.chunk", id, model, created, finish_reason)
    choice = {"index": 0, "delta": dict(delta), "logprobs": logprobs_body(logprobs), "finish_reason": finish_reason}
    out["choices"] = [choice]
    if include_usage:
        out["usage"] = None
    return out if extension is None else {**out, EXTENSION_KEY: extension}


def usage_chunk(id: str, model: str, created: int, usage: Usage) -> dict:
    """The optional last chunk (`stream_options.include_usage`): no choices, the usage."""
    return {**_object_head("chat.completion.chunk", id, model, created), "choices": [], "usage": usage.to_dict()}


def stream_chunks(
    id: str,
    model: str,
    created: int,
    message: AssistantMessage,
    finish_reason: FinishReason,
    usage: Usage,
    *,
    include_usage: bool = False,
    logprobs: Sequence[TokenLogprob] | None = None,
    extension: dict | None = None,
) -> list[dict]:
    """A finished reply as the chunks of a stream: role, content (with the log-probs), one
    chunk per tool call, the finish chunk (with the extension, and the log-probs when there
    was no content), then the usage chunk when `include_usage`."""
    head = (id, model, created)
    out = [chunk(*head, role_delta(), include_usage=include_usage)]
    if message.content:
        out.append(chunk(*head, content_delta(message.content), logprobs=logprobs, include_usage=include_usage))
        logprobs = None
    out += [chunk(*head, tool_call_delta(i, c), include_usage=include_usage) for i, c in enumerate(message.tool_calls)]
    last = chunk(
        *head, {}, finish_reason=finish_reason, logprobs=logprobs, include_usage=include_usage, extension=extension
    )
    out.append(last)
    return out + [usage_chunk(*head, usage)] if include_usage else out


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <compact JSON>\\n\\n` for an object, `data: <text>\\n\\n`
    for a one-line string (`sse("[DONE]") == SSE_DONE`)."""
    if isinstance(data, str) and ("\n" in data or "\r" in data):
        raise ValueError("sse: a string event must be one line")
    text = (
        data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    )
    return f"data: {text}\n\n".encode()


def models_response(model_ids: Sequence[str], created: int, owned_by: str = "jaxagent") -> dict:
    """`GET /v1/models`: `{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}`."""
    data = [{"id": m, "object": "model", "created": int(created), "owned_by": owned_by} for m in model_ids]
    return {"object": "list", "data": data}
