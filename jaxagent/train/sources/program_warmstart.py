"""The warm start of an agent-program run (`agent.program` with `agent.expert`): the
program's episodes against the expert, recorded through the gateway
(`jaxagent.gateway.demonstrations`), as SFT demonstrations, and the text a "bpe"
tokenizer is trained on."""

from __future__ import annotations

from jaxagent.train.warmstart import Demonstration


def _recorded(config, tokenizer, seeds, noise: float, *, max_context: int | None = None, max_tokens: int | None = None):
    from jaxagent.gateway.demonstrations import record
    from jaxagent.gateway.program import TaskSource, load_program

    a, r = config.agent, config.rollout
    return record(
        load_program(a.program, a.imports),
        TaskSource(a.tasks, a.imports),
        list(seeds),
        tokenizer,
        load_program_function(a.expert, a.imports),
        max_context=max_context or r.max_context,
        max_turns=r.max_turns,
        max_tokens=max_tokens or r.max_tokens_per_turn,
        noise=noise,
        concurrency=min(a.concurrency, 64),
        timeout_s=a.timeout_s,
    )


def load_program_function(spec: str, imports) -> object:
    """`agent.expert`: a plain function, imported as `agent.program` is."""
    from jaxagent.gateway.program import resolve

    fn = resolve(spec, "agent.expert", imports)
    if not callable(fn):
        raise TypeError(f"agent.expert {spec!r} is not callable")
    return fn


def program_demonstrations(config, tokenizer, log=print) -> list[Demonstration]:
    """`warm_start.episodes` episodes of the program against `agent.expert` (with
    `warm_start.expert_noise`) on seeds `warm_start.seed, ...`, as demonstrations in
    `tokenizer`'s tokens. An episode whose program failed, or that made no call, is left
    out (counted in the log line)."""
    ws = config.warm_start
    recs = _recorded(config, tokenizer, range(ws.seed, ws.seed + ws.episodes), ws.expert_noise)
    demos = []
    for rec in recs:
        seq, out = rec.sequence, rec.outcome
        if seq is None or out.failure_kind is not None:
            continue
        success = bool(out.metrics.get("success", out.reward > 0))
        demos.append(
            Demonstration(
                seed=rec.seed,
                system_prompt=None,
                observations=[],
                actions=[t for q in rec.sequences for t in q.texts],
                rewards=[out.reward],
                done=True,
                success=success,
                noisy_actions=0,
                # the session's sequences packed in one row, each attending within itself
                tokens=[t for q in rec.sequences for t in q.tokens.tolist()],
                loss_mask=[m for q in rec.sequences for m in q.loss_mask.tolist()],
                segment_ids=[k + 1 for k, q in enumerate(rec.sequences) for _ in range(len(q))],
            )
        )
    failed = len(recs) - len(demos)
    log(
        f"warm start: {len(demos)} demonstrations of {config.agent.program} against {config.agent.expert}"
        + (f" ({failed} episodes failed or made no call, left out)" if failed else "")
    )
    if not demos:
        first = next((r.outcome for r in recs if r.outcome.failure_kind is not None), None)
        why = "" if first is None else f"; the first: {first.failure_kind}: {first.failure_message}\n{first.traceback}"
        raise RuntimeError(f"warm start: every episode of {config.agent.program} against the expert failed{why}")
    return demos


def program_texts(config) -> list[str]:
    """The conversations of 256 noise-free expert episodes (seeds from `warm_start.seed`),
    rendered with the byte-level template: the corpus of a "bpe" tokenizer."""
    from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
    from jaxagent.models.byte_tokenizer import byte_chat_tokenizer

    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML_TEMPLATE
    ws = config.warm_start
    # byte tokens: a reply or a conversation is several times longer than in the run's tokens
    recs = _recorded(config, tok, range(ws.seed, ws.seed + 256), 0.0, max_context=65536, max_tokens=4096)
    return ["tool", "system", "user", "assistant"] + [r.text for r in recs if r.text]
