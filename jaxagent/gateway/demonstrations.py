"""Demonstrations recorded through the gateway: the user's agent program, run unchanged
against an expert instead of the policy, gives the warm start's token sequences.

`record(...)` serves a gateway whose engine is a `ResponderEngine`: each call's reply is
the expert's text for the conversation so far (`respond(prompt_text, noise=, rng=)`:
`prompt_text` is the chat template's rendering the policy would be conditioned on, up to
and including the generation prompt), tokenized and closed with the template's
end-of-turn token, exactly where a policy's sampled completion would stand. The session
ledger records it like any completion, so each demonstration is the token sequence the
program's episode would be with the policy in the expert's place: the same prompts,
tool results and template text, the loss on the expert's replies.

The expert is `agent.expert: module:function`, with `noise` (`warm_start.expert_noise`:
how often it should answer at random, its own business) and `rng` (a `random.Random`
seeded by the session's task seed, so a demonstration set is a function of its seeds).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from jaxagent.gateway.engine import Completion
from jaxagent.gateway.program import SessionOutcome, TaskSource, run_openai_sessions
from jaxagent.gateway.protocol import Limits
from jaxagent.gateway.records import Sequence as TrainingSequence
from jaxagent.gateway.records import main_sequence, trained_sequences
from jaxagent.gateway.server import GatewayServer
from jaxagent.gateway.service import Gateway, RunSampling
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.sampling import SamplingConfig

Respond = Callable[..., str]


class ResponderEngine:
    """An `Engine` stand-in whose replies are `respond`'s (module docstring): no model, no
    device; the gateway's service, ledger and server run as they do for the policy."""

    def __init__(self, tokenizer, respond: Respond, *, max_context: int, noise: float = 0.0):
        self.tokenizer = tokenizer
        self.respond = respond
        self.max_context = int(max_context)
        self.noise = float(noise)
        self.seed = 0
        self.policy_version = 0
        self.stats: dict[str, int] = {"calls": 0}
        chat = ChatFormat(tokenizer)
        self._eot = chat.stop_token_ids[0] if chat.stop_token_ids else None
        self._chat = chat
        self._rngs: dict[str, random.Random] = {}

    def open(self, session_id: str, key_id: int) -> None:
        self._rngs[session_id] = random.Random(f"{key_id}/expert")

    def close_session(self, session_id: str) -> None:
        self._rngs.pop(session_id, None)

    def submit(self, session_id: str, prompt_ids, *, max_new_tokens: int, sampling=None, stop_sequences=()):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
            reply = self.respond(text, noise=self.noise, rng=self._rngs[session_id])
            if not isinstance(reply, str):
                raise TypeError(f"the expert returned {type(reply).__name__}, expected the reply's text")
            ids = self._chat.encode(reply) + ([self._eot] if self._eot is not None else [])
            ids = ids[: max(1, min(max_new_tokens, self.max_context - len(prompt_ids)))]
            reason = "stop_token" if self._eot is not None and ids[-1] == self._eot else "max_new_tokens"
            self.stats["calls"] += 1
            future.set_result(Completion(tuple(ids), tuple(0.0 for _ in ids), reason, 0, 0))
        except Exception as err:  # the call fails (a 500), the session's program sees it
            future.set_exception(err)
        return future

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Recorded:
    """One demonstration: the task's seed, the session's main training sequence (None when
    the program made no call; `records.main_sequence`), the program's outcome, the main
    sequence as text (for a tokenizer's training corpus), and the sequences its row
    trains (`records.trained_sequences` within `max_context`: more than one when the
    program rewrote its history)."""

    seed: int
    sequence: TrainingSequence | None
    outcome: SessionOutcome
    text: str
    sequences: list[TrainingSequence] = dataclasses.field(default_factory=list)


def record(
    program,
    tasks: TaskSource,
    seeds: Sequence[int],
    tokenizer,
    respond: Respond,
    *,
    max_context: int,
    max_turns: int,
    max_tokens: int,
    noise: float = 0.0,
    concurrency: int = 16,
    timeout_s: float = 120.0,
) -> list[Recorded]:
    """Run `program` on the tasks of `seeds` with `respond` as the model (module docstring)."""

    engine: Any = ResponderEngine(tokenizer, respond, max_context=max_context, noise=noise)
    gateway = Gateway(
        engine,
        tokenizer,
        model_name="expert",
        limits=Limits(max_tokens=max_tokens, max_sessions=max(len(seeds), 1)),
        run_sampling=RunSampling(SamplingConfig(), max_tokens),
        max_calls=max_turns,
    )
    tag = secrets.token_hex(3)
    sids = [f"demo-{tag}-{s}" for s in seeds]
    with GatewayServer(gateway) as server:
        for sid, s in zip(sids, seeds, strict=True):
            gateway.open_session(sid, int(s))
        outcomes = run_openai_sessions(
            program,
            [(sid, int(s), tasks.task(int(s))) for sid, s in zip(sids, seeds, strict=True)],
            base_url=server.base_url,
            api_key=server.api_key,
            concurrency=concurrency,
            timeout_s=timeout_s,
            calls_made=gateway.calls_made,
        )
        for sid in sids:
            gateway.close_session(sid)
    sequences = dict(gateway.store.drain())
    out = []
    for sid, s, outcome in zip(sids, seeds, outcomes, strict=True):
        seqs = sequences.get(sid, [])
        main = main_sequence(seqs)
        text = "" if main is None else tokenizer.decode(main.tokens.tolist(), skip_special_tokens=False)
        out.append(Recorded(int(s), main, outcome, text, trained_sequences(seqs, max_context)))
    return out
