"""Agent programs as the trainer's rollout: `ProgramLoop`, the agent loop of a run with
`agent.program` set.

It is an `EpisodeLoop` (`jaxagent.rollout.loop_base`), as the env loop `AgentLoop` is, so
batch collection, evaluation, the estimators, checkpoints and the episode store work
unchanged; `close` stops the gateway it starts. One `run`:

1. one session per row: its task (`TaskPool.task(seed)`), its id, its sampling key id
   `row_offset + i` (so processes that each play part of a batch sample what one would);
2. the user's program, `await program(client, task)`, for every session at once (at most
   `agent.concurrency`; each within `agent.timeout_s`), each with an `openai.AsyncOpenAI`
   pointed at its session's URL on the run's gateway (127.0.0.1, a key made for the run);
3. the run's sampling settings decide every call (`Gateway.run_sampling`: the rollout's
   temperature, top-k / top-p, `rollout.max_tokens_per_turn`, stop strings; greedy for
   greedy evaluation), whatever a request asks;
4. each session's calls become its episode (`records.session_episode`), one row of
   the batch: the tokens trained on are the tokens sampled, the program's reward on the
   last turn, its metrics in the episode's info (a `success` metric decides success;
   else reward > 0).

A session whose messages rewrote its history has several sequences (one per branch,
`SessionLedger.sequences`). Its row packs them one after another, each attending only
within itself with its positions from 0 (`Trajectory.segment_ids`, set on every row of a
program run so the batch has one layout), so every completion is trained in the context
it was sampled in, with one reward and one advantage for the session. When they do not
fit in `rollout.max_context` together, the row keeps the one with the most completion
tokens and then as many of the others as fit (`records.trained_sequences`). The info
records `gateway_sequences` (the session's) and `gateway_untrained_calls` (the calls of
the sequences left out). A program that raises,
times out, returns no number or never calls the model costs its own episode, failed with
that kind (`raised`, `timeout`, `invalid_result`, `no_calls`; `crashed` when the worker
process running it died, `agent.processes`); calls past
`rollout.max_turns` in one session are refused (400), and a program that then fails
ends its episode truncated (`max_turns`), not failed. Episodes with a call sampled more
than `agent.max_staleness` policy versions before the current one are failed as
`stale` (within one `run` the params do not change, so this only drops work that
straddled a `set_params`). These kinds are `jaxagent.failures.PROGRAM_KINDS`.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from jaxagent.failures import NO_CALLS, STALE
from jaxagent.gateway.engine import Engine
from jaxagent.gateway.processes import ProgramProcesses
from jaxagent.gateway.program import SessionOutcome, TaskSource, check_calls, run_openai_sessions
from jaxagent.gateway.protocol import Limits
from jaxagent.gateway.records import session_episode, trained_sequences
from jaxagent.gateway.server import GatewayServer
from jaxagent.gateway.service import Gateway, RunSampling
from jaxagent.rollout.agent_loop import loop_sampler
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.episode import Episode, pack
from jaxagent.rollout.loop_base import EpisodeLoop
from jaxagent.rollout.trajectory import Trajectory


class TaskPool:
    """The pool of a program run (`jaxagent.rollout.loop_base.EpisodePool`): `len(pool)`
    rows, and the task of a seed. It holds no resources: a run's held-out evaluation plays
    a pool of its own (of `eval.tasks` when set)."""

    def __init__(self, tasks: TaskSource, size: int):
        self.tasks = tasks
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    def task(self, seed: int) -> dict:
        return self.tasks.task(int(seed))


@dataclasses.dataclass(frozen=True)
class ProgramSettings:
    """`agent:` of the config, as the loop uses it."""

    program: Any  # the loaded `async def rollout(client, task)`
    concurrency: int
    timeout_s: float
    max_staleness: int
    model_name: str = "policy"
    #: worker processes that run the sessions (`jaxagent.gateway.processes`); 0: threads of
    #: this process (then `program` runs here; else `spec` and `imports` load it there)
    processes: int = 0
    spec: str | None = None
    imports: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or self.processes < 0:
            raise ValueError(f"ProgramSettings: processes must be an int >= 0, got {self.processes!r}")
        if self.processes and not self.spec:
            raise ValueError("ProgramSettings: processes > 0 needs the program's spec ('module:function')")


class ProgramLoop(EpisodeLoop):
    """The rollout of agent programs through the gateway (module docstring).

    Args:
      params, model_config, tokenizer: the policy and its tokenizer (with a chat template).
      config: the run's `AgentLoopConfig` (limits and sampling).
      settings: the `agent:` section's values.
      rows: the most sessions one `run` plays (the batch's rows); the engine's sampler has
        `min(settings.concurrency, rows)` rows (None: `settings.concurrency`).
      mesh, rules: as `AgentLoop`'s.
    """

    def __init__(
        self,
        params,
        model_config,
        tokenizer,
        config,
        settings: ProgramSettings,
        *,
        rows: int | None = None,
        mesh=None,
        rules=None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.timings: dict[str, float] = {}
        self.reward_fn = None
        self.sampler = loop_sampler(params, model_config, config, mesh=mesh, rules=rules)
        self.tokenizer = tokenizer
        self._chat = ChatFormat(tokenizer)
        self._engine: Engine | None = None
        self._gateway: Gateway | None = None
        self._server: GatewayServer | None = None
        self._processes: ProgramProcesses | None = None
        self._runs = 0
        self._rows = rows

    # ------------------------------------------------------------ AgentLoop's interface
    @property
    def chat(self):
        """The tokenizer's `ChatFormat` (its stop tokens end every completion)."""
        return self._chat

    @property
    def stop_sequences(self) -> list[list[int]]:
        return [self.chat.encode(s) for s in self.config.stop_strings]

    def set_params(self, params) -> None:
        """The policy for the next calls (a new version)."""
        if self._engine is None:
            self.sampler.params = params
        else:
            self._engine.set_params(params)

    @property
    def gateway(self) -> Gateway:
        self._start()
        assert self._gateway is not None
        return self._gateway

    @property
    def server(self) -> GatewayServer:
        self._start()
        assert self._server is not None
        return self._server

    def _start(self) -> None:
        if self._gateway is not None:
            return
        stops = self._chat.stop_token_ids
        slots = max(1, min(self.settings.concurrency, self._rows or self.settings.concurrency))
        self._engine = Engine(self.sampler, slots=slots, stop_token_ids=stops, seed=self.config.seed)
        limits = Limits(max_tokens=self.config.max_tokens_per_turn, max_sessions=max(slots, 1) * 4)
        self._gateway = Gateway(
            self._engine,
            self.tokenizer,
            model_name=self.settings.model_name,
            limits=limits,
            run_sampling=RunSampling(self.config.sampling, self.config.max_tokens_per_turn, self.config.stop_strings),
            max_calls=self.config.max_turns,
        )
        self._server = GatewayServer(self._gateway).start()

    def close(self) -> None:
        """Stop the programs' processes, the gateway's server and engine (idempotent)."""
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        if self._server is not None:
            self._server.stop()
        if self._engine is not None:
            self._engine.close()
        self._server = self._engine = self._gateway = None

    def _play(self, pool, seeds, group_ids, *, seed, sampling, row_offset) -> tuple[Trajectory, list[Episode]]:
        """Play one session per row (module docstring; `EpisodeLoop.run` checked the
        arguments); the batch and its episodes."""
        cfg = self.config
        B = len(seeds)
        gateway, server = self.gateway, self.server
        engine = gateway.engine
        engine.seed = int(seed)
        gateway.run_sampling = RunSampling(sampling, cfg.max_tokens_per_turn, cfg.stop_strings)
        self._runs += 1
        tag = f"r{self._runs}-{secrets.token_hex(3)}"
        sids = [f"{tag}-{row_offset + i}" for i in range(B)]
        tasks = [(sid, int(s), pool.task(s)) for sid, s in zip(sids, seeds, strict=True)]
        for i, sid in enumerate(sids):
            gateway.open_session(sid, row_offset + i)
        t0 = time.perf_counter()
        st = self.settings
        try:
            if st.processes:
                if self._processes is None or self._processes.n != st.processes:
                    if self._processes is not None:
                        self._processes.close()
                    self._processes = ProgramProcesses(st.processes)
                assert st.spec is not None  # checked by ProgramSettings
                outcomes = self._processes.run(
                    st.spec,
                    st.imports,
                    tasks,
                    urls={sid: server.base_url(sid) for sid in sids},
                    api_key=server.api_key,
                    concurrency=st.concurrency,
                    timeout_s=st.timeout_s,
                )
                check_calls(outcomes, gateway.calls_made)
            else:
                outcomes = run_openai_sessions(
                    st.program,
                    tasks,
                    base_url=server.base_url,
                    api_key=server.api_key,
                    concurrency=st.concurrency,
                    timeout_s=st.timeout_s,
                    calls_made=gateway.calls_made,
                )
        finally:
            limited = {sid: gateway.at_call_limit(sid) for sid in sids}
            for sid in sids:
                gateway.close_session(sid)
        sequences = dict(gateway.store.drain())
        version = engine.policy_version
        eps = [
            self._episode(i, seeds[i], group_ids[i], outcomes[i], sequences.get(sids[i], []), limited[sids[i]], version)
            for i in range(B)
        ]
        self.timings = {"rollout_s": time.perf_counter() - t0, **{k: float(v) for k, v in engine.stats.items()}}
        if self.reward_fn is not None:
            self.reward_fn(eps)
        traj = pack(eps, max_context=cfg.max_context, max_turns=cfg.max_turns, pad_id=cfg.pad_id, segmented=True)
        return traj, eps

    def _episode(
        self, i: int, seed, group_id: int, out: SessionOutcome, seqs: list, limited: bool, version: int
    ) -> Episode:
        trained = trained_sequences(seqs, self.config.max_context)
        info: dict[str, Any] = dict(out.metrics)
        info.update(
            gateway_sequences=len(seqs),
            gateway_untrained_calls=sum(q.num_turns for q in seqs) - sum(q.num_turns for q in trained),
        )
        if trained:
            ep = session_episode(trained, index=i, seed=seed, group_id=group_id, reward=out.reward, info=info)
            # for transcripts and evaluation details: what the policy wrote (tool calls
            # included, not only the content it was answered with) and what it read
            segs = [seg for q in trained for seg in q.segments()]
            ep.actions = [self._chat.action_text(t) for kind, t, _, _ in segs if kind == "policy"]
            ep.observations = [
                self.tokenizer.decode(t, skip_special_tokens=False) for kind, t, _, _ in segs if kind != "policy"
            ]
        else:
            ep = Episode(index=i, seed=seed, group_id=group_id)
            ep.info = info
        oldest = min((v for q in trained for v in q.policy_versions), default=version)
        stale = oldest < version - self.settings.max_staleness
        if out.failure_kind is not None and limited and trained:
            ep.rewards[-1] = 0.0
            ep.end(truncated=True, reason="max_turns")
        elif out.failure_kind is not None or not trained:
            kind = out.failure_kind or NO_CALLS
            ep.fail({"failure": out.failure_message or kind, "failure_kind": kind, "traceback": out.traceback or ""})
            ep.end_reason = f"program_{kind}"
        elif stale:
            ep.fail(
                {
                    "failure": f"sampled by policy version {oldest}, now {version} "
                    f"(agent.max_staleness={self.settings.max_staleness})",
                    "failure_kind": STALE,
                }
            )
        return ep
