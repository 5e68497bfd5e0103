"""The gateway's per-session exact-token ledger: prompt token ids per call, the sampled
completions, and the session as training sequences.

Pure Python (numpy, no JAX, no HTTP). One `SessionLedger` holds one agent session's
calls; a `SessionStore` holds the gateway's concurrent sessions.

A call
    The server gets a call's OpenAI-style `messages` (dicts; roles system, user, assistant,
    tool; an assistant message may carry `tool_calls`) and a `render(messages) -> str` that
    applies the model's chat template with `add_generation_prompt=True` (tools included).
    `ledger.prompt(messages, render)` returns a `PromptPlan` (the prompt token ids and how
    they were built); the engine samples; `ledger.record(plan, ...)` stores the completion.
    `ChatFormat.encode` tokenizes every piece of template text.

Which assistant message is a completion
    An assistant message *is* a recorded completion when its key equals that completion's
    key, the key being (content text, tool calls as `(name, arguments)` pairs): the
    `text` and `tool_calls` the gateway returned for it, compared as the text the model
    produced (the arguments string exactly as returned; never a re-serialisation by a
    template; tool call ids are not compared; content None counts as "").

How a prompt is built (first rule that applies)
    1. Extension of call j: the messages are call j's messages (equal after the
       normalisation above, plus `tool_call_id` and `name`) + an assistant message that is
       call j's completion + more messages, and the template renders call j's messages
       as a prefix, i.e. rendering the messages with that assistant message's content
       replaced by a mark (its tool calls left out) gives exactly call j's prompt text
       before the mark. Then ::

           prompt = prompt_j + completion_j (as sampled) + encode(segment)

       where `segment` is the rendered text after the mark: the end-of-turn the template
       writes after the assistant turn and the new messages up to the generation prompt;
       when completion_j ended with the sampled end-of-turn token (the first of
       `ChatFormat.stop_token_ids` when the template has an end-of-turn text), the
       template's end-of-turn text is left out of the segment (it was sampled). This is
       how `ChatFormat` builds an observation segment. `plan.extends == j`. Any later
       assistant message of the new messages that is a recorded completion is spliced as
       in rule 2. The longest such extension wins (the latest call on ties).
    2. Splice (a rewritten history: an edited or invented assistant message, dropped
       messages, another system prompt or tools): every assistant message that is a
       recorded completion (the call with exactly its preceding messages if there is one,
       else the latest with its key) is replaced by a mark, and ::

           prompt = encode(t_0) + completion_1 + encode(t_1) + ... + completion_m + encode(t_m)

       with `t_i` the rendered text between the marks (each `t_i` after a completion that
       ended with the end-of-turn token without the template's end-of-turn text). Used
       only where the rendered text around the completions agrees with the rendering of
       the real messages: the real rendering starts with `t_0`, ends with `t_m` and holds
       `t_1 .. t_{m-1}` in that order in between, each mark occurs exactly once, and each
       `t_i` after an end-of-turn-ended completion starts with the end-of-turn text.
    3. Otherwise (a first call, no recorded completion among the messages, or a template
       whose rendering fails those checks): `encode(render(messages))`.

Guarantees
    * A recorded completion is never replaced by a re-tokenisation of its text: wherever
      a prompt holds one (rules 1 and 2), it holds its ids exactly as recorded, at the
      positions `plan.spliced` lists. An assistant message tokenised as text (invented by
      the program, edited, or under rule 3) is listed in `plan.text_assistants`; those of
      them whose key does equal a recorded completion (re-tokenised: rule 3, or rule 1/2's
      checks failed for them) in `plan.retokenised`, so a server can count or warn.
    * Under rule 1 the earlier call's prompt + completion is an exact prefix of the new
      prompt, so a chain of extending calls is one token sequence, and the new tokens are
      only the segment's: the text between pieces is never merged across a piece
      boundary (as in `ChatFormat`, prompt tokens are the pieces' tokens, which may differ
      from tokenizing the whole rendering at once at those boundaries).
    * Not guaranteed: that the template's own rendering of an echoed assistant message
      equals what was sampled (a template re-serialising tool-call JSON differently still
      gets the sampled ids), nor exactness for templates that render an assistant turn's
      surroundings depending on its content or rewrite earlier turns (e.g. drop earlier
      reasoning): the checks send those to rule 2 or 3.

Reuse (for the engine's KV cache)
    `plan.reused` is the largest n such that `plan.prompt_ids[:n]` equals the first n
    tokens of some recorded call's sequence (its prompt + completion) in this session;
    `plan.reuse_from` is that call (the latest on ties; None when n == 0). Under rule 1,
    `reused >= len(prompt_j) + len(completion_j)`. The engine may keep the KV cache of
    positions `[0, r)` of call `reuse_from`'s sequence with
    `r = min(plan.reused, len(plan.prompt_ids) - 1, positions it actually holds for that
    sequence)` (a decode loop usually holds no KV for the last sampled token; at least one
    prompt token must be fed to get the next token's logits), must drop what it cached
    beyond r, and prefill `plan.prompt_ids[r:]` at positions r onward. When it holds
    another call's sequence instead, `ledger.shared_prefix(plan, call)` says how much of
    that one is valid; when it holds none, r = 0.

Sequences (`ledger.sequences()`)
    Calls form branches: a call that extends the latest call of a branch continues that
    branch; any other call (rules 2 and 3, or an extension of a call another call already
    extended: a retry or a fork) starts a new branch. A branch is one `Sequence`: tokens =
    its last call's prompt + completion; `loss_mask` 1 exactly on the completion tokens of
    the branch's own calls, with the sampler's log-probs there (0 elsewhere). Every
    completion is trained exactly once, in the branch it was recorded in (the only
    context its log-probs are valid for); in another branch's prompt it is context (mask
    0). All sequences of a session share its episode's reward and advantage: they carry
    the `session_id`, and the caller attaches the reward (`Sequence.to_episode`).

Threads
    Each ledger has its own lock (a session's calls come one at a time, but a misbehaving
    program cannot corrupt it); `SessionStore` guards its sessions with a lock. Template
    text is tokenized under one module-wide lock (a fast tokenizer shared by threads).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxagent.gateway.records import (
    Call,
    CompletionKey,
    NormMessage,
    PromptPlan,
    Sequence,
    SessionClosed,
    ToolCallsKey,
    _frozen,
)

if TYPE_CHECKING:  # the rollout imports JAX (through its package); this module must not
    from jaxagent.rollout.chat import ChatFormat

__all__ = ["ContextTooLong", "Render", "SessionLedger", "completion_key"]

#: `render(messages) -> str`: the chat template applied with `add_generation_prompt=True`
Render = Callable[[list[dict[str, Any]]], str]

_MARK = "\x00JAXAGENT-COMPLETION-{}\x00"
#: message keys that hold what the model produced (left out of a marked assistant message)
_BODY_KEYS = frozenset({"content", "tool_calls", "function_call", "reasoning_content"})
#: extension candidates tried per call (each costs one rendering)
_MAX_CANDIDATES = 8
_ENCODE_LOCK = threading.Lock()
_LEDGER_IDS = itertools.count(1)


# ---------------------------------------------------------------------------- errors
class ContextTooLong(ValueError):
    """A call's prompt has more tokens than the context limit (`tokens`, `limit`)."""

    def __init__(self, tokens: int, limit: int):
        self.tokens, self.limit = int(tokens), int(limit)
        super().__init__(f"the prompt has {self.tokens} tokens, more than the context limit of {self.limit} tokens")


# ---------------------------------------------------------------------------- keys
def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts, joined as the protocol joins them
        return "\n".join(str(_field(p, "text") or "") for p in content)
    return str(content)


def _tool_calls_key(tool_calls: Iterable[Any] | None) -> ToolCallsKey:
    out = []
    for call in tool_calls or ():
        fn = _field(call, "function") or call  # OpenAI's {"function": {...}} or a flat {name, arguments}
        args = _field(fn, "arguments")
        if not isinstance(args, str):
            args = "" if args is None else json.dumps(args, ensure_ascii=False, sort_keys=True)
        out.append((str(_field(fn, "name") or ""), args))
    return tuple(out)


def completion_key(content: Any, tool_calls: Iterable[Any] | None = None) -> CompletionKey:
    """The key an assistant message and a completion are matched by: (content text, tool
    calls as `(name, arguments)`). `content` None is ""; a list of text parts is joined with
    "\\n"; tool calls are OpenAI dicts (`{"function": {"name", "arguments"}}`), flat
    `{"name", "arguments"}` dicts or objects with those attributes; arguments given as a
    string are kept verbatim (a dict is JSON with sorted keys)."""
    return _content_text(content), _tool_calls_key(tool_calls)


def _normalize(message: Mapping[str, Any]) -> NormMessage:
    return (
        str(message.get("role") or ""),
        _content_text(message.get("content")),
        _tool_calls_key(message.get("tool_calls")),
        str(message.get("tool_call_id") or ""),
        str(message.get("name") or ""),
    )


def _key(m: NormMessage) -> CompletionKey:
    return m[1], m[2]


def _agrees(text: str, pieces: list[str]) -> bool:
    """`text` is `pieces[0] + x_1 + pieces[1] + ... + x_m + pieces[m]` for some strings x_i."""
    if len(pieces) == 1:
        return text == pieces[0]
    if not text.startswith(pieces[0]):
        return False
    pos = len(pieces[0])
    for piece in pieces[1:-1]:  # leftmost matches in order: a decomposition exists iff this finds one
        at = text.find(piece, pos)
        if at < 0:
            return False
        pos = at + len(piece)
    return text.endswith(pieces[-1]) and len(text) - len(pieces[-1]) >= pos


# ---------------------------------------------------------------------------- ledger
class SessionLedger:
    """The exact-token record of one agent session (see the module docstring).

    Args:
      chat: the model's `ChatFormat` (its `encode`, `end_of_turn_text`, `stop_token_ids`).
      max_context: the most prompt tokens a call may have (`ContextTooLong` beyond).
      session_id: carried by the session's `Sequence`s.
    """

    def __init__(self, chat: ChatFormat, *, max_context: int, session_id: str = ""):
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        self.chat = chat
        self.max_context = max_context
        self.session_id = session_id
        eot_text = getattr(chat, "end_of_turn_text", None)
        stops = tuple(getattr(chat, "stop_token_ids", ()))
        self._eot_text: str | None = eot_text if stops else None
        self._eot_id: int | None = int(stops[0]) if eot_text is not None and stops else None
        self._calls: list[Call] = []
        self._sequences: list[np.ndarray] = []  # per call: prompt + completion
        self._tips: list[int] = []  # per branch: its latest call
        self._by_key: dict[CompletionKey, list[int]] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._id = next(_LEDGER_IDS)

    # ------------------------------------------------------------ public
    @property
    def calls(self) -> tuple[Call, ...]:
        with self._lock:
            return tuple(self._calls)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """No more calls: `prompt` and `record` raise `SessionClosed` from now on."""
        with self._lock:
            self._closed = True

    def prompt(self, messages: list[dict[str, Any]], render: Render) -> PromptPlan:
        """The prompt of a call with these (validated) `messages`; `render` applies the chat
        template with the generation prompt. Changes nothing (`record` does). Raises
        `ContextTooLong` when the prompt has more than `max_context` tokens."""
        with self._lock:
            self._check_open()
            msgs = [dict(m) for m in messages]
            if not msgs:
                raise ValueError("a call needs at least one message")
            norm = tuple(_normalize(m) for m in msgs)
            true_text = render(msgs)
            if not isinstance(true_text, str):
                raise TypeError(f"render returned {type(true_text).__name__}, expected the rendered text")
            built = self._extension(msgs, norm, render, true_text) or self._splice(msgs, norm, render, true_text)
            ids, extends, spliced, text_assistants = built
            if len(ids) > self.max_context:
                raise ContextTooLong(len(ids), self.max_context)
            reused, reuse_from = self._longest_shared(ids)
            return PromptPlan(
                prompt_ids=tuple(ids),
                prompt_text=true_text,
                extends=extends,
                reused=reused,
                reuse_from=reuse_from,
                spliced=tuple(spliced),
                text_assistants=tuple(text_assistants),
                retokenised=tuple(k for k in text_assistants if _key(norm[k]) in self._by_key),
                messages=norm,
                _owner=self._id,
            )

    def record(
        self,
        plan: PromptPlan,
        completion_ids: Iterable[int],
        logprobs: Iterable[float],
        policy_version: int,
        finish_reason: str,
        text: str | None,
        tool_calls: Iterable[Any] | None = None,
    ) -> Call:
        """Stores a call: `plan` from this ledger's `prompt`, the sampled `completion_ids`
        (stop token included when one was sampled) and their `logprobs`, the weights'
        `policy_version`, the `finish_reason`, and the assistant message the gateway
        returned for it: its content `text` and `tool_calls` (the key a later call's
        assistant message must equal to be this completion). Returns the `Call`."""
        ids = tuple(int(t) for t in completion_ids)
        lps = tuple(float(x) for x in logprobs)
        if len(lps) != len(ids):
            raise ValueError(f"{len(ids)} completion tokens but {len(lps)} log-probs")
        with self._lock:
            self._check_open()
            if plan._owner != self._id:
                raise ValueError("this PromptPlan was made by another SessionLedger")
            index = len(self._calls)
            j = plan.extends
            if j is not None and self._tips[self._calls[j].branch] == j:
                branch = self._calls[j].branch
                self._tips[branch] = index
            else:
                branch = len(self._tips)
                self._tips.append(index)
            call = Call(
                index=index,
                prompt_ids=plan.prompt_ids,
                completion_ids=ids,
                logprobs=lps,
                policy_version=int(policy_version),
                finish_reason=str(finish_reason),
                text=_content_text(text),
                tool_calls=_tool_calls_key(tool_calls),
                extends=j,
                branch=branch,
                ended_with_end_of_turn=bool(ids) and self._eot_id is not None and ids[-1] == self._eot_id,
                spliced=plan.spliced,
                text_assistants=plan.text_assistants,
                messages=plan.messages,
                prompt_text=plan.prompt_text,
            )
            self._calls.append(call)
            self._sequences.append(np.asarray(plan.prompt_ids + ids, np.int64))
            self._by_key.setdefault(call.key, []).append(index)
            return call

    def shared_prefix(self, plan: PromptPlan, call: int) -> int:
        """How many leading tokens `plan.prompt_ids` shares with call `call`'s sequence."""
        with self._lock:
            return self._shared(np.asarray(plan.prompt_ids, np.int64), self._sequences[call])

    def sequences(self) -> list[Sequence]:
        """The session as training sequences, one per branch in the order the branches
        began (see the module docstring); [] before the first recorded call."""
        with self._lock:
            return [self._branch_sequence(b, tip) for b, tip in enumerate(self._tips)]

    # ------------------------------------------------------------ building prompts
    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.session_id!r} is closed")

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        with _ENCODE_LOCK:
            return [int(t) for t in self.chat.encode(text)]

    def _completion_for(self, norm: tuple[NormMessage, ...], k: int) -> Call | None:
        """The recorded completion assistant message k is: the latest with its key whose
        call had exactly the messages before k, else the latest with its key."""
        found = self._by_key.get(_key(norm[k]))
        if not found:
            return None
        for i in reversed(found):
            if self._calls[i].messages == norm[:k]:
                return self._calls[i]
        return self._calls[found[-1]]

    def _matches(self, norm: tuple[NormMessage, ...], start: int) -> list[tuple[int, Call]]:
        out = []
        for k in range(start, len(norm)):
            if norm[k][0] == "assistant":
                call = self._completion_for(norm, k)
                if call is not None:
                    out.append((k, call))
        return out

    def _marked_pieces(
        self, messages: list[dict[str, Any]], marks: list[tuple[int, Call]], render: Render, true_text: str
    ) -> list[str] | None:
        """The rendered text around the marked assistant messages (eot text dropped after a
        completion that sampled it), or None when the checks of rule 2 fail."""
        marked = list(messages)
        tags = []
        for i, (k, _call) in enumerate(marks):
            tag = _MARK.format(i)
            marked[k] = {**{key: v for key, v in messages[k].items() if key not in _BODY_KEYS}, "content": tag}
            tags.append(tag)
        try:
            text = render(marked)
        except Exception:  # a template that refuses the marked messages: no splicing
            return None
        if not isinstance(text, str):
            return None
        pieces, pos = [], 0
        for tag in tags:
            at = text.find(tag)
            if at < pos or text.count(tag) != 1:
                return None
            pieces.append(text[pos:at])
            pos = at + len(tag)
        pieces.append(text[pos:])
        if not _agrees(true_text, pieces):
            return None
        for i, (_k, call) in enumerate(marks, start=1):
            if call.ended_with_end_of_turn:
                eot = self._eot_text or ""
                if not pieces[i].startswith(eot):
                    return None
                pieces[i] = pieces[i][len(eot) :]
        return pieces

    def _assemble(
        self, ids: list[int], spliced: list[tuple[int, int]], marks: list[tuple[int, Call]], after: list[str]
    ) -> None:
        for (_k, call), piece in zip(marks, after, strict=True):
            spliced.append((call.index, len(ids)))
            ids.extend(call.completion_ids)
            ids.extend(self._encode(piece))

    def _extension(
        self, messages: list[dict[str, Any]], norm: tuple[NormMessage, ...], render: Render, true_text: str
    ) -> tuple[list[int], int | None, list[tuple[int, int]], list[int]] | None:
        """Rule 1, or None."""
        candidates = [
            c
            for c in self._calls
            if len(c.messages) < len(norm)
            and norm[len(c.messages)][0] == "assistant"
            and _key(norm[len(c.messages)]) == c.key
            and norm[: len(c.messages)] == c.messages
        ]
        candidates.sort(key=lambda c: (len(c.messages), c.index), reverse=True)
        for c in candidates[:_MAX_CANDIDATES]:
            n = len(c.messages)
            rest = self._matches(norm, n + 1)
            for marks in ([(n, c), *rest], [(n, c)]) if rest else ([(n, c)],):
                pieces = self._marked_pieces(messages, marks, render, true_text)
                if pieces is None or pieces[0] != c.prompt_text:
                    continue
                ids, spliced = list(c.prompt_ids), list(c.spliced)
                self._assemble(ids, spliced, marks, pieces[1:])
                marked = {k for k, _ in marks}
                text_assistants = list(c.text_assistants) + [
                    k for k in range(n + 1, len(norm)) if norm[k][0] == "assistant" and k not in marked
                ]
                return ids, c.index, spliced, text_assistants
        return None

    def _splice(
        self, messages: list[dict[str, Any]], norm: tuple[NormMessage, ...], render: Render, true_text: str
    ) -> tuple[list[int], int | None, list[tuple[int, int]], list[int]]:
        """Rule 2, else rule 3."""
        marks = self._matches(norm, 0)
        pieces = self._marked_pieces(messages, marks, render, true_text) if marks else None
        if pieces is None:
            marks, pieces = [], [true_text]
        ids = self._encode(pieces[0])
        spliced: list[tuple[int, int]] = []
        self._assemble(ids, spliced, marks, pieces[1:])
        marked = {k for k, _ in marks}
        text_assistants = [k for k in range(len(norm)) if norm[k][0] == "assistant" and k not in marked]
        return ids, None, spliced, text_assistants

    @staticmethod
    def _shared(a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if diff.size else n

    def _longest_shared(self, ids: list[int]) -> tuple[int, int | None]:
        a = np.asarray(ids, np.int64)
        best, best_call = 0, None
        for i, seq in enumerate(self._sequences):
            n = self._shared(a, seq)
            if n > 0 and n >= best:
                best, best_call = n, i
        return best, best_call

    # ------------------------------------------------------------ sequences
    def _branch_sequence(self, branch: int, tip: int) -> Sequence:
        own = []
        call: Call | None = self._calls[tip]
        while call is not None and call.branch == branch:
            own.append(call)
            call = self._calls[call.extends] if call.extends is not None else None
        own.reverse()
        tokens = self._sequences[tip].astype(np.int32)
        n = len(tokens)
        mask = np.zeros(n, np.int32)
        logprobs = np.zeros(n, np.float32)
        turn_ids = np.full(n, -1, np.int32)
        for turn, c in enumerate(own):
            start, stop = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
            if tokens[start:stop].tolist() != list(c.completion_ids):  # rule 1 makes this impossible
                raise RuntimeError(f"call {c.index}'s completion is not at its place in branch {branch}")
            mask[start:stop] = 1
            logprobs[start:stop] = c.logprobs
            turn_ids[start:stop] = turn
        trained = np.flatnonzero(mask)
        first = int(trained[0]) if trained.size else n
        kinds = tuple("prompt" if i < first else ("policy" if mask[i] else "observation") for i in range(n))
        return Sequence(
            session_id=self.session_id,
            branch=branch,
            tokens=_frozen(tokens),
            loss_mask=_frozen(mask),
            logprobs=_frozen(logprobs),
            turn_ids=_frozen(turn_ids),
            kinds=kinds,
            calls=tuple(c.index for c in own),
            policy_versions=tuple(c.policy_version for c in own),
            finish_reasons=tuple(c.finish_reason for c in own),
            texts=tuple(c.text for c in own),
        )
