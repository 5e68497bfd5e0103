"""What the gateway's session ledger records (`jaxagent.gateway.sessions`): a call's
prompt plan, a recorded call, a session's training sequences, and the errors of a
session. Pure Python and numpy (`Sequence.to_episode` imports the rollout when called).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the rollout imports JAX (through its package); this module must not
    from jaxagent.rollout.episode import Episode

#: tool calls as the model produced them: `((name, arguments), ...)`
ToolCallsKey = tuple[tuple[str, str], ...]
#: what an assistant message must equal to be a recorded completion: (content, tool calls)
CompletionKey = tuple[str, ToolCallsKey]
#: a message as compared between calls: (role, content, tool calls, tool_call_id, name)
NormMessage = tuple[str, str, ToolCallsKey, str, str]


class TooManySessions(RuntimeError):
    """`SessionStore.open` of a new session while `max_sessions` sessions are open."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        super().__init__(f"{self.limit} sessions are open, the most this gateway serves at once (max_sessions)")


class SessionClosed(RuntimeError):
    """A call in, or an `open` of, a session that was closed (and not yet drained)."""


class UnknownSession(LookupError):
    """No open or closed session has this id."""


# ---------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class PromptPlan:
    """A call's prompt, as `SessionLedger.prompt` decided it (see the module docstring).

    `prompt_ids`: the token ids to condition on; `prompt_text`: the template's rendering of
    the call's messages; `extends`: the call this one extends (rule 1) or None; `reused` /
    `reuse_from`: the longest prefix shared with a recorded call's sequence, and that call;
    `spliced`: `(call, position)` of every recorded completion placed in the prompt as
    sampled; `text_assistants`: indices of the assistant messages tokenised as text;
    `retokenised`: those of them whose key equals a recorded completion's.
    """

    prompt_ids: tuple[int, ...]
    prompt_text: str
    extends: int | None
    reused: int
    reuse_from: int | None
    spliced: tuple[tuple[int, int], ...]
    text_assistants: tuple[int, ...]
    retokenised: tuple[int, ...]
    messages: tuple[NormMessage, ...] = dataclasses.field(repr=False, compare=False)
    _owner: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call of a session: its prompt (`plan`'s), the sampled completion ids
    and log-probs, the policy version and finish reason, the key it is matched by (`text`,
    `tool_calls`), the call it extends, and its branch."""

    index: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: str
    text: str
    tool_calls: ToolCallsKey
    extends: int | None
    branch: int
    ended_with_end_of_turn: bool
    spliced: tuple[tuple[int, int], ...]
    text_assistants: tuple[int, ...]
    messages: tuple[NormMessage, ...] = dataclasses.field(repr=False, compare=False)
    prompt_text: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def key(self) -> CompletionKey:
        return self.text, self.tool_calls

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens."""
        return len(self.prompt_ids) + len(self.completion_ids)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Sequence:
    """One training sequence of a session (one branch; see the module docstring).

    Per token (`[n]` arrays, read-only): `tokens` int32; `loss_mask` int32, 1 exactly on
    the completion tokens of this branch's own calls; `logprobs` float32, the sampler's
    log-prob there, 0 elsewhere; `turn_ids` int32, the turn (0, 1, ... in this sequence)
    of each trained token, -1 elsewhere; `kinds`: "policy" where `loss_mask` is 1,
    "prompt" before the first such token, "observation" after it (tool results, user
    turns, template text, an invented assistant message, another branch's completion).
    These are `Episode`'s marks: `Episode.add(kind, tokens, logp, turn)` run by run (what
    `segments` lists) rebuilds `tokens`, `loss_mask`, `logp` (= `logprobs`) and
    `turn_ids`; `to_episode` does it. Per trained call (turn order): `calls` (ledger
    indices), `policy_versions`, `finish_reasons`, `texts`.
    """

    session_id: str
    branch: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    turn_ids: np.ndarray
    kinds: tuple[str, ...]
    calls: tuple[int, ...]
    policy_versions: tuple[int, ...]
    finish_reasons: tuple[str, ...]
    texts: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_turns(self) -> int:
        return len(self.calls)

    def segments(self) -> list[tuple[str, list[int], list[float], int]]:
        """`(kind, tokens, logprobs, turn)` runs: a "policy" run is one call's completion
        (turn >= 0), any other run has turn -1."""
        out: list[tuple[str, list[int], list[float], int]] = []
        start = 0
        for i in range(1, len(self) + 1):
            if i == len(self) or (self.kinds[i], self.turn_ids[i]) != (self.kinds[start], self.turn_ids[start]):
                out.append(
                    (
                        self.kinds[start],
                        self.tokens[start:i].tolist(),
                        self.logprobs[start:i].tolist(),
                        int(self.turn_ids[start]),
                    )
                )
                start = i
        return out

    def to_episode(self, **kw: Any) -> Episode:
        """This sequence alone as an episode: `session_episode([self], **kw)`."""
        return session_episode([self], **kw)


def main_sequence(sequences: list[Sequence]) -> Sequence | None:
    """The sequence of a session that one batch row trains: the one with the most
    completion tokens (None for a session that made no call)."""
    return max(sequences, key=lambda q: int(q.loss_mask.sum()), default=None)


def trained_sequences(sequences: list[Sequence], max_tokens: int) -> list[Sequence]:
    """The sequences of a session its episode trains, in branch order: all of them when
    their tokens together fit in one row of `max_tokens`; else the main sequence
    (`main_sequence`) and, while they fit, the others with the most completion tokens
    first. [] for a session that made no call."""
    if sum(len(q) for q in sequences) <= max_tokens:
        return list(sequences)
    main = main_sequence(sequences)
    assert main is not None
    keep, used = {main.branch}, len(main)
    for q in sorted(sequences, key=lambda q: -int(q.loss_mask.sum())):
        if q.branch not in keep and used + len(q) <= max_tokens:
            keep.add(q.branch)
            used += len(q)
    return [q for q in sequences if q.branch in keep]


def session_episode(
    sequences: list[Sequence],
    *,
    index: int,
    seed: Any,
    group_id: int,
    reward: float,
    done: bool = True,
    truncated: bool = False,
    end_reason: str = "program_returned",
    info: dict | None = None,
) -> Episode:
    """A session's sequences (at least one, e.g. `trained_sequences`'s) as one finished
    `jaxagent.rollout.episode.Episode`, one row: each sequence's segments added in order,
    each sequence after the first begun by `Episode.start_sequence` (its tokens attend
    only within it, its positions restart at 0: `pack(segmented=True)`). One turn per
    trained call, numbered across the row (`rewards` 0 but the last turn's = `reward`, so
    the episode's return is the session's reward and every sequence shares its
    advantage), `actions` the calls' texts, `finish_reasons`; `done` / `truncated` /
    `end_reason` / `info` as given. Imports `jaxagent.rollout.episode` (and so JAX)."""
    from jaxagent.rollout.episode import Episode

    if not sequences:
        raise ValueError("session_episode: a session without sequences has no episode")
    ep = Episode(index=index, seed=seed, group_id=group_id)
    turns = 0
    for i, seq in enumerate(sequences):
        if i:
            ep.start_sequence()
        for kind, toks, lps, turn in seq.segments():
            ep.add(kind, toks, lps if kind == "policy" else None, turn=turn + turns if turn >= 0 else -1)
        turns += seq.num_turns
    ep.rewards = [0.0] * max(turns - 1, 0) + ([float(reward)] if turns else [])
    ep.state_keys = [None] * turns
    ep.actions = [t for seq in sequences for t in seq.texts]
    ep.finish_reasons = [r for seq in sequences for r in seq.finish_reasons]
    ep.info = dict(info or {})
    ep.end(done=done, truncated=truncated, reason=end_reason)
    return ep
