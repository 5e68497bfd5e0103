"""`ProgramSource`: the user's agent program (`agent.program`, written against the OpenAI
client) calls the policy through the gateway, one session per row
(`jaxagent.gateway.loop.ProgramLoop`). Its warm start is the program's episodes against
`agent.expert`, recorded through the gateway (`jaxagent.gateway.demonstrations`), as SFT
demonstrations in the run's tokens; a "bpe" tokenizer is trained on the same
conversations."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from jaxagent.dataclass_yaml import ConfigError
from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
from jaxagent.train.sources import Pools, RolloutSource
from jaxagent.train.warmstart import Demonstration


class ProgramSource(RolloutSource):
    """The agent-program path (module docstring). Its rows pack every sequence of a
    session (a program that rewrote its history), its sampler serves rounds of however
    many calls are waiting, and a tokenizer the run makes gets the ChatML template with
    tools and tool calls (Hermes `<tool_call>`)."""

    packed_sequences = True
    partial_rounds = True
    chat_template = TOOL_CHATML_TEMPLATE

    def __init__(self, config) -> None:
        super().__init__(config)
        self._demonstrations: list | None = None
        self._sources: tuple | None = None

    def _task_sources(self):
        """`(training tasks, held-out tasks or None)`, read once (`check`, then `open_pools`);
        a source that cannot be read is a ConfigError naming its key."""
        if self._sources is None:
            self._sources = self._read_task_sources()
        return self._sources

    def _read_task_sources(self):
        from jaxagent.gateway.program import TaskSource

        a, ev = self.config.agent, self.config.eval
        try:
            tasks = TaskSource(a.tasks, a.imports, what="agent.tasks")
            held = None if ev.tasks is None else TaskSource(ev.tasks, a.imports, what="eval.tasks")
            tasks.task(self.config.env.seed)  # fails here, named, rather than in the first rollout
            if held is not None:
                held.task(ev.seed)
        except (ValueError, TypeError, ImportError, OSError) as e:
            raise ConfigError(str(e)) from None
        return tasks, held

    def _program(self):
        from jaxagent.gateway.program import load_program

        a = self.config.agent
        try:
            return load_program(a.program, a.imports)
        except (ValueError, TypeError, ImportError) as e:
            raise ConfigError(str(e) if str(e).startswith("agent.program") else f"agent.program: {e}") from None

    def check(self) -> str | None:
        """The task sources' first tasks and the program's import; no code sandbox: None."""
        self._task_sources()
        self._program()
        return None

    def open_pools(self, slots: int) -> contextlib.AbstractContextManager[Pools]:
        """`TaskPool`s of `agent.tasks` and (held out) of `eval.tasks`, else of `agent.tasks`
        at the held-out seeds; they hold no resources."""
        from jaxagent.gateway.loop import TaskPool

        tasks, held = self._task_sources()
        train = TaskPool(tasks, slots)
        return contextlib.nullcontext(Pools(train=train, held_out=train if held is None else TaskPool(held, slots)))

    def loop(self, params, model_config, tokenizer, *, rows: int, mesh):
        from jaxagent.gateway.loop import ProgramLoop, ProgramSettings

        a = self.config.agent
        pad = tokenizer.pad_token_id
        settings = ProgramSettings(
            self._program(),
            a.concurrency,
            a.timeout_s,
            a.max_staleness,
            processes=a.processes,
            spec=a.program,
            imports=a.imports,
        )
        loop_config = self.config.rollout.loop_config(0 if pad is None else int(pad))
        return ProgramLoop(params, model_config, tokenizer, loop_config, settings, rows=rows, mesh=mesh)

    @property
    def demonstrations_need_tokenizer(self) -> bool:
        return True  # recorded in the run's own tokens

    def demonstrations(self, tokenizer, log) -> list:
        if self._demonstrations is None:
            self._demonstrations = program_demonstrations(self.config, tokenizer, log)
        return self._demonstrations

    def tokenizer_texts(self, log) -> list[str]:
        if self.config.agent.expert is None:
            raise ConfigError(
                "model.tokenizer 'bpe' with agent.program is trained on the program's episodes against "
                "agent.expert: set agent.expert, or use model.tokenizer 'byte'"
            )
        return program_texts(self.config)


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


def load_program_function(spec: str, imports) -> Callable[..., str]:
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
    from jaxagent.models.byte_tokenizer import byte_chat_tokenizer

    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML_TEMPLATE
    ws = config.warm_start
    # byte tokens: a reply or a conversation is several times longer than in the run's tokens
    recs = _recorded(config, tok, range(ws.seed, ws.seed + 256), 0.0, max_context=65536, max_tokens=4096)
    return ["tool", "system", "user", "assistant"] + [r.text for r in recs if r.text]
