"""The gateway's service: one chat-completions call from a parsed request to a reply,
without HTTP (the server, `jaxagent.gateway.server`, is the HTTP side).

`Gateway.chat(session_id, request)`:

1. the session's ledger builds the prompt (`SessionLedger.prompt`: the model's chat
   template with the request's tools; earlier completions that the messages repeat are
   placed as the tokens actually sampled, never re-tokenised);
2. the engine samples it (`Engine.submit`), on the session's live KV cache;
3. the completion's text (special tokens dropped, a matched stop string cut off, as
   OpenAI does) is parsed into content and tool calls with the template's tool-call
   format (`tools.parse_reply`: a malformed call stays plain content);
4. the ledger records the call (prompt ids, completion ids, log-probs, policy version),
   keyed by the reply it returned, so the session's next call can find it.

Sampling settings: with `run_sampling` (training and evaluation) the run's own settings
decide, whatever a request asks (its temperature, top_p, seed, max_tokens and stop are
ignored), so what is trained is what the run's policy samples; without it (`jaxagent
serve`) the request's are honoured, within `Limits.max_tokens`. Either way the `sampling`
of the reply's `jaxagent` extension says what was used.

Sessions: `open_session(id, key_id)` before a program runs (training), `close_session`
after; `ephemeral()` a one-call session for a request that names none (`jaxagent serve`,
keyed by the request's `seed` when it has one).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from jaxagent.gateway.engine import Completion, Engine, EngineClosed
from jaxagent.gateway.protocol import (
    ChatRequest,
    Limits,
    Message,
    RequestError,
    ToolCall,
    context_length_error,
    session_limit_error,
)
from jaxagent.gateway.records import SessionClosed, TooManySessions, UnknownSession
from jaxagent.gateway.responses import (
    AssistantMessage,
    Sampling,
    TokenLogprob,
    Usage,
    finish_reason_of,
    jaxagent_extension,
)
from jaxagent.gateway.sessions import ContextTooLong
from jaxagent.gateway.store import SessionStore
from jaxagent.gateway.tools import CallIds, parse_reply, template_kwargs, to_template_messages
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RunSampling:
    """The run's own sampling settings, used for every call whatever the request asks."""

    sampling: SamplingConfig
    max_tokens: int
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"RunSampling.max_tokens must be a positive int, got {self.max_tokens!r}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclasses.dataclass(frozen=True)
class ChatResult:
    """One answered call: what the server writes as a completion or a stream."""

    id: str
    created: int
    model: str
    message: AssistantMessage
    finish_reason: Any
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None
    extension: dict
    completion: Completion


def request_message_dicts(messages: tuple[Message, ...]) -> list[dict]:
    """Parsed messages as OpenAI dicts (tool call arguments as the text given), the form the
    session ledger keys and renders."""
    return [m.to_dict() for m in messages]


def _message(d: dict) -> Message:
    """A message dict of `request_message_dicts`' form (or a ledger's marked variant) as a
    `Message`, without validation."""
    calls = tuple(
        ToolCall(str(c.get("id", "")), str(c["function"]["name"]), str(c["function"].get("arguments", "")))
        for c in d.get("tool_calls") or ()
    )
    return Message(d["role"], d.get("content"), calls, d.get("tool_call_id"), d.get("name"))


class Gateway:
    """Chat completions on `engine` for `tokenizer`'s chat template (module docstring).

    Args:
      engine: the `Engine` (its sampler holds the policy).
      tokenizer: a transformers tokenizer with a chat template (tools rendered by it).
      model_name: the id `GET /v1/models` lists; any `model` a request names is accepted.
      limits: the request limits (`max_sessions` bounds the open sessions).
      run_sampling: the run's settings (training, evaluation), or None to honour requests.
      call_ids: tool-call ids (default: drawn from the operating system).
      max_calls: the most calls one session may make (None: no limit); one more is a 400
        with code `session_call_limit` (`at_call_limit` tells which sessions hit it).
      open_on_demand: a call naming a session that is not open opens it (`jaxagent serve`;
        at `limits.max_sessions` the least recently used session is closed for it); False:
        such a call is a 404 (training: the trainer opens its sessions).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        *,
        model_name: str,
        limits: Limits | None = None,
        run_sampling: RunSampling | None = None,
        call_ids: Callable[[], str] | None = None,
        max_calls: int | None = None,
        open_on_demand: bool = False,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_format = ChatFormat(tokenizer)
        self.model_name = model_name
        self.limits = limits if limits is not None else Limits()
        self.run_sampling = run_sampling
        self.created = int(time.time())
        self.store = SessionStore(
            self.chat_format, max_context=engine.max_context - 1, max_sessions=self.limits.max_sessions
        )
        self._call_ids = call_ids or CallIds()
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._limited: set[str] = set()
        if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
            raise ValueError(f"Gateway: max_calls must be a positive int or None, got {max_calls!r}")
        self.max_calls = max_calls
        self.open_on_demand = bool(open_on_demand)
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ephemeral = itertools.count()

    # ------------------------------------------------------------ sessions
    def open_session(self, session_id: str, key_id: int) -> None:
        """A session a program will call (its sampling key id `key_id`)."""
        self.store.open(session_id)
        self.engine.open(session_id, key_id)
        with self._lock:
            self._calls[session_id] = 0

    def close_session(self, session_id: str, *, discard: bool = False) -> None:
        """No more calls; the session's sequences wait in `store.drain()` (unless `discard`)."""
        self.engine.close_session(session_id)
        with self._lock:
            self._calls.pop(session_id, None)
            self._limited.discard(session_id)
            self._recent.pop(session_id, None)
        if session_id in self.store:
            self.store.close(session_id, discard=discard)

    def calls_made(self, session_id: str) -> int:
        with self._lock:
            return self._calls.get(session_id, 0)

    def at_call_limit(self, session_id: str) -> bool:
        """Whether a call of the session was refused for `max_calls`."""
        with self._lock:
            return session_id in self._limited

    # ------------------------------------------------------------ a call
    async def chat(self, session_id: str | None, request: ChatRequest) -> ChatResult:
        """Answer `request` in session `session_id` (None: a one-call session). Raises
        `RequestError` (the server's 4xx) for an unknown or closed session, too many
        sessions, or a context too long."""
        if session_id is not None:
            if session_id not in self.store:
                if not self.open_on_demand:
                    raise RequestError(404, f"no open session {session_id!r}", code="session_not_found")
                self._open_on_demand(session_id)
            with self._lock:
                self._recent[session_id] = None
                self._recent.move_to_end(session_id)
            return await self._chat(session_id, request)
        sid = f"ephemeral-{next(self._ephemeral)}-{secrets.token_hex(4)}"
        key = request.seed if request.seed is not None and self.run_sampling is None else abs(hash(sid)) % 2**31
        try:
            self.open_session(sid, key)
        except TooManySessions as err:
            raise session_limit_error(err.limit) from None
        try:
            return await self._chat(sid, request)
        finally:
            self.close_session(sid, discard=True)

    def _open_on_demand(self, session_id: str) -> None:
        """Open a client's own session, closing the least recently used one at the limit."""
        if len(session_id) > 128:
            raise RequestError(400, "the session id in the URL is over 128 characters", code="invalid_session")
        with self._lock:
            full = len(self.store) >= self.limits.max_sessions
            oldest = next(iter(self._recent), None) if full else None
            if oldest is not None:
                del self._recent[oldest]
        if oldest is not None:
            self.close_session(oldest, discard=True)
        try:
            self.open_session(session_id, zlib.crc32(session_id.encode()))
        except TooManySessions as err:
            raise session_limit_error(err.limit) from None
        except ValueError:  # opened by a concurrent call of the same session
            pass

    def _settings(self, request: ChatRequest) -> tuple[SamplingConfig, int, tuple[str, ...], list[list[int]], Sampling]:
        rs = self.run_sampling
        if rs is not None:
            s = rs.sampling
            used = Sampling(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k or None,
                max_tokens=rs.max_tokens,
                seed=self.engine.seed,
                stop=rs.stop,
                greedy=s.temperature == 0,
                source="run",
            )
            return s, rs.max_tokens, rs.stop, [self.chat_format.encode(x) for x in rs.stop], used
        temperature = 1.0 if request.temperature is None else float(request.temperature)
        top_p = 1.0 if request.top_p is None else float(request.top_p)
        max_tokens = self.limits.max_tokens if request.max_tokens is None else request.max_tokens
        s = SamplingConfig(temperature=temperature, top_p=top_p)
        used = Sampling(
            temperature=temperature,
            top_p=top_p,
            top_k=None,
            max_tokens=max_tokens,
            seed=request.seed,
            stop=request.stop,
            greedy=temperature == 0,
            source="request",
        )
        return s, max_tokens, request.stop, [self.chat_format.encode(x) for x in request.stop], used

    async def _chat(self, session_id: str, request: ChatRequest) -> ChatResult:
        try:
            ledger = self.store.get(session_id)
        except (UnknownSession, SessionClosed) as err:
            raise RequestError(404, str(err), code="session_not_found") from None
        kwargs = template_kwargs(request.tools)

        def render(messages: list[dict]) -> str:
            # the ledger renders the request's (validated) messages, and variants of them with
            # an assistant message's body replaced by a mark: converted as they are, unchecked
            out = self.tokenizer.apply_chat_template(
                to_template_messages([_message(m) for m in messages]),
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
            return str(out)

        with self._lock:
            if self.max_calls is not None and self._calls.get(session_id, 0) >= self.max_calls:
                self._limited.add(session_id)
                raise RequestError(
                    400,
                    f"messages: this session has made its {self.max_calls} calls, the most one episode may "
                    "make (rollout.max_turns)",
                    param="messages",
                    code="session_call_limit",
                )
        sampling, max_tokens, stop, stop_ids, used = self._settings(request)
        messages = request_message_dicts(request.messages)
        try:
            plan = await asyncio.to_thread(ledger.prompt, messages, render)
        except ContextTooLong as err:
            raise context_length_error(err.tokens, max_tokens, self.engine.max_context) from None
        except SessionClosed as err:
            raise RequestError(404, str(err), code="session_not_found") from None
        if plan.num_tokens >= self.engine.max_context:
            raise context_length_error(plan.num_tokens, max_tokens, self.engine.max_context)
        future = self.engine.submit(
            session_id, plan.prompt_ids, max_new_tokens=max_tokens, sampling=sampling, stop_sequences=stop_ids
        )
        with self._lock:
            self._calls[session_id] = self._calls.get(session_id, 0) + 1
        try:
            done = await asyncio.wrap_future(future)
        except EngineClosed as err:  # the session ended, or the gateway is shutting down
            if session_id not in self.store:
                raise RequestError(404, str(err), code="session_not_found") from None
            raise RequestError(503, str(err), code="gateway_closed") from None
        text = self._text(done, stop)
        content, calls = parse_reply(text, tools=request.tools, tool_choice=request.tool_choice, ids=self._call_ids)
        message = AssistantMessage(content if content is not None or calls else "", tuple(calls))
        try:
            ledger.record(
                plan,
                done.ids,
                done.logprobs,
                done.policy_version,
                done.reason,
                message.content,
                [c.to_dict() for c in message.tool_calls],
            )
        except SessionClosed as err:  # ended (e.g. its program's timeout) while this call sampled
            raise RequestError(404, str(err), code="session_not_found") from None
        usage = Usage(plan.num_tokens, len(done.ids), done.reused)
        ext = jaxagent_extension(
            prompt_token_ids=plan.prompt_ids,
            completion_token_ids=done.ids,
            policy_version=done.policy_version,
            sampling=used,
            completion_logprobs=done.logprobs,
        )
        logprobs = None
        if request.logprobs:
            logprobs = tuple(
                TokenLogprob.from_bytes(self._token_bytes(t), lp) for t, lp in zip(done.ids, done.logprobs, strict=True)
            )
        return ChatResult(
            id=f"chatcmpl-{secrets.token_hex(12)}",
            created=int(time.time()),
            model=request.model,
            message=message,
            finish_reason=finish_reason_of(message, "stop" if done.stopped else "length"),
            usage=usage,
            logprobs=logprobs,
            extension=ext,
            completion=done,
        )

    def _text(self, done: Completion, stop: tuple[str, ...]) -> str:
        """The completion's text: special tokens dropped, and a stop string it ended with cut off."""
        text = self.tokenizer.decode(list(done.ids), skip_special_tokens=True)
        if done.reason == "stop_sequence":
            for s in stop:
                if text.endswith(s):
                    return text[: -len(s)]
        return text

    def _token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8", "replace")
