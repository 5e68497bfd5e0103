"""W13: agent programs through the gateway vs the in-process agent loop (issue 52).

Workload (docs/results/benchmarks.md, W13): 64 sessions (8 tasks x 8 episodes), each a 4-call
tool-using agent: the task's question, then 4 policy turns, each answered with a fixed
tool result. The model is a random from-scratch decoder with the byte ChatML tokenizer
(259 ids) and the gateway's tool template (`jaxagent.gateway.tools.TOOL_CHATML_TEMPLATE`):
`--model small` (default) is a 2-layer hidden-64 Qwen2-style decoder (W9's
`--small-model` sizes), `tiny` is `models.tiny_config()` (hidden 32), `w1` is W1's sizes
(4 layers, hidden 256). Temperature 1.0, 32 tokens a turn, context 1,024; a random
model rarely samples the end-of-turn token, so both sides decode about 32 tokens a turn.

Systems, the same weights, tasks, seeds and limits, timed alternately after one warm-up
rollout each (compilations, the gateway's start):

  agent_loop  `AgentLoop.run` (turn-synchronous, the default config) on an in-process
              `EnvPool` (`num_workers=0`) of `ToolEnv`: the system prompt is the text the
              tool template renders for `TOOLS`, the first observation the task's
              question, each action answered with `RESULT` as a user turn; the episode
              ends (terminated) after its 4th turn.
  gateway     `ProgramLoop.run` (`jaxagent.gateway.loop`): `rollout(client, task)` below,
              an agent written as any `openai` user writes one (`AsyncOpenAI`, chat
              messages, `tools=TOOLS`; a reply's tool calls answered with `tool` messages,
              else the result as a user message), 64 sessions at once through the
              OpenAI-compatible server (uvicorn on 127.0.0.1) and its engine, the
              programs in a thread of this process (`agent.processes: 0`; what the call
              latency parts below time).
  gateway_processes  the same, the programs in `--processes` worker processes of their
              own (default 2 = `agent.processes`' default; `jaxagent.gateway.processes`)

The three render the same prompt and observation tokens (`same_prompts`,
`same_observations` check it on the warm-up rollouts; the script exits non-zero
otherwise, or when an episode failed or did not play its 4 turns).

Figures, medians over `--repeats` (default 5): rollout seconds and rollout tokens/s
(sampled policy tokens / wall seconds; the gateway's sampled tokens are its engine's
`completion_tokens`), `ratio_vs_agent_loop` (the goal: >= 0.8), and the gateway's
overhead per call two ways:

  extra_wall_ms_per_call  (gateway rollout s - agent-loop rollout s) / calls, the medians:
                          what the gateway adds to the rollout's wall time, per call
  call latency parts      per call, means over the timed repeats: `client_ms` the
                          program's own timing of `await client.chat.completions.create`;
                          `service_ms` the gateway's `Gateway.chat` (timed by wrapping it
                          on the instance: ledger + engine + reply); `queued_ms` /
                          `round_ms` the engine's `Completion.queued_s` / `round_s`;
                          hence `http_ms` = client - service (client, HTTP, JSON, event
                          loops), `ledger_ms` = service - queued - round (template
                          rendering, tokenisation, decoding the reply, recording), and
                          `overhead_ms_per_call` = http + ledger (all but the engine)
  rollout timeline        `to_first_call_s` (the run's start to its first call in the
                          service: sessions opened, clients made), `engine_rounds_s` (the
                          rounds' durations summed; `rounds_s` each), `between_rounds_s`
                          (the rest: calls on their way between rounds)
  no-model floor          `no_model_rollout_s`: the same program, sessions and gateway
                          path (server, service, ledger, client) with a responder in place
                          of the engine, replying `--tokens` tokens at once
                          (`jaxagent.gateway.demonstrations.record`): the gateway's rollout
                          can be no faster than this on the same cores

    python benchmarks/w13_gateway.py [--quick] [--repeats 5] [--out benchmarks/results/w13_gateway.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _jsonl import emit  # noqa: E402

import envs  # noqa: E402

#: the agent's one tool (OpenAI's function-tool form)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a fact.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
#: what every tool call returns
RESULT = "lookup: 42 (from the reference table)"
#: policy turns (calls) per episode
TURNS = 4
#: client-side seconds of each call, when a benchmark collects them (None: not collected)
CALL_SECONDS: list[float] | None = None


def task(seed: int) -> dict:
    """The task of episode seed `seed`."""
    return {"question": f"Task {seed}: what is the value of item {seed}? Use the lookup tool."}


async def rollout(client, task: dict) -> float:
    """The agent program: 4 calls, each reply answered with the tool's result."""
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(TURNS):
        t0 = time.perf_counter()
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        if CALL_SECONDS is not None:
            CALL_SECONDS.append(time.perf_counter() - t0)
        msg = reply.choices[0].message
        turn = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in msg.tool_calls
            ]
            messages.append(turn)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in msg.tool_calls]
        else:
            messages += [turn, {"role": "user", "content": RESULT}]
    return 0.0


class ToolEnv(envs.TextEnv):
    """The same episodes for the agent loop: the task's question, then `RESULT` after each
    action; terminated after `TURNS` actions."""

    action_format = "Call the lookup tool."

    def __init__(self, system_prompt: str):
        super().__init__(max_steps=TURNS)
        self._system_prompt = system_prompt

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    def state_key(self):
        return ("w13", self._seed, self._steps)

    def _reset(self, seed):
        return task(seed)["question"], {}

    def _step(self, action):
        return RESULT, 0.0, self._steps >= TURNS, {}


def tool_system_prompt(tokenizer) -> str:
    """The system turn's text the template renders for `TOOLS` (what the gateway's prompt holds)."""
    from jaxagent.gateway.tools import template_kwargs

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True, **template_kwargs(TOOLS)
    )
    head = "<|im_start|>system\n"
    assert text.startswith(head), text[:80]
    return text[len(head) : text.index("<|im_end|>")]


def policy_tokens(eps) -> int:
    return sum(len(t) for e in eps for k, t in e.segments if k == "policy")


def segments(eps, kind):
    return [[tuple(t) for k, t in e.segments if k == kind] for e in eps]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8, help="tasks")
    ap.add_argument("--group-size", type=int, default=8, help="episodes (sessions) per task")
    ap.add_argument("--tokens", type=int, default=32, help="max tokens per turn (both sides)")
    ap.add_argument("--model", choices=("tiny", "small", "w1"), default="small")
    ap.add_argument("--processes", type=int, default=2, help="worker processes of gateway_processes (agent.processes)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="2 tasks x 2 sessions, 8 tokens, the tiny model: a smoke run")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    global CALL_SECONDS
    import jax
    import openai

    from jaxagent import models as M
    from jaxagent.gateway.loop import ProgramLoop, ProgramSettings, TaskPool
    from jaxagent.gateway.program import TaskSource
    from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
    from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
    from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

    if args.quick:
        args.groups, args.group_size, args.tokens, args.model = 2, 2, 8, "tiny"
    repeats = args.repeats or (1 if args.quick else 5)
    B = args.groups * args.group_size
    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML_TEMPLATE
    model = M.tiny_config(vocab_size=len(tok))
    if args.model == "small":
        model = dataclasses.replace(model, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16)
    elif args.model == "w1":
        from w1_generate import W1

        model = dataclasses.replace(W1, vocab_size=len(tok))
    params = M.init_params(jax.random.key(0), model, std=0.02)
    cfg = AgentLoopConfig(
        max_turns=TURNS, max_tokens_per_turn=args.tokens, max_context=1024, sampling=SamplingConfig(1.0), seed=1
    )
    system = tool_system_prompt(tok)
    seeds = [g for g in range(args.groups) for _ in range(args.group_size)]
    group_ids = list(seeds)
    agent = AgentLoop(params, model, tok, cfg)
    settings = ProgramSettings(rollout, concurrency=B, timeout_s=600.0, max_staleness=0)
    tasks = TaskPool(TaskSource("w13_gateway:task", [str(Path(__file__).resolve().parent)]), B)
    prompt_tokens = len(agent.chat.prompt_tokens(system, task(0)["question"]))
    obs_tokens = len(agent.chat.observation_tokens(RESULT, after_end_of_turn=False))
    common = {
        "workload": "W13",
        "episodes": B,
        "groups": args.groups,
        "group_size": args.group_size,
        "turns": TURNS,
        "calls": B * TURNS,
        "tokens_per_turn": args.tokens,
        "prompt_tokens": prompt_tokens,
        "obs_tokens": obs_tokens,
        "max_context": cfg.max_context,
        "model": args.model,
        "model_shape": {
            k: getattr(model, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        },
        "repeats": repeats,
        "quick": args.quick,
        "jax": jax.__version__,
        "openai": openai.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *(argv or sys.argv[1:])]),
    }
    print(
        f"W13: {B} sessions x {TURNS} calls, prompt {prompt_tokens} tokens, observations {obs_tokens} tokens, "
        f"{args.tokens} tokens a turn, model {args.model}",
        file=sys.stderr,
    )
    timings = {"agent_loop": [], "gateway": [], "gateway_processes": []}
    in_threads = settings
    in_process = dataclasses.replace(
        settings, processes=args.processes, spec="w13_gateway:rollout", imports=(str(Path(__file__).resolve().parent),)
    )
    outs = {}
    with (
        envs.EnvPool([lambda: ToolEnv(system)] * B, num_workers=0) as pool,
        ProgramLoop(params, model, tok, cfg, settings) as gw,
    ):
        gateway = gw.gateway
        served: list[tuple[float, float, float]] = []  # per call: service, queued, round seconds
        chat = gateway.chat

        async def timed_chat(session_id, request):
            t0 = time.perf_counter()
            result = await chat(session_id, request)
            c = result.completion
            served.append((time.perf_counter() - t0, c.queued_s, c.round_s, t0))
            return result

        gateway.chat = timed_chat  # the server looks the method up per request

        def timed_gateway(program_settings, rep):
            """`(out, start, wall seconds, engine stats)` of one gateway rollout with these settings."""
            gw.settings = program_settings
            before, traced = dict(engine.stats), dict(gw.sampler.trace_counts)
            t0 = time.perf_counter()
            out = gw.run(tasks, seeds, group_ids, seed=rep)
            wall = time.perf_counter() - t0
            stats = {k: v - before.get(k, 0) for k, v in engine.stats.items()}
            stats["compilations"] = sum(gw.sampler.trace_counts.values()) - sum(traced.values())
            return out, t0, wall, stats

        engine = gateway.engine
        for rep in range(repeats + 1):  # round 0: warm-up
            t0 = time.perf_counter()
            out = agent.run(pool, seeds, group_ids, seed=rep)
            wall = agent_wall = time.perf_counter() - t0
            if rep == 0:
                outs["agent_loop"] = out
            else:
                timings["agent_loop"].append({"rollout_s": wall, "tokens": policy_tokens(out[1])})
            # the programs in worker processes of their own (the trainer's default, agent.processes: 2)
            out, _, wall_p, stats_p = timed_gateway(in_process, rep)
            if rep == 0:
                outs["gateway_processes"] = out
            else:
                timings["gateway_processes"].append(
                    {"rollout_s": wall_p, "tokens": stats_p["completion_tokens"], "stats": stats_p}
                )
            # in threads of this process (agent.processes: 0), each call timed by the program
            CALL_SECONDS, served[:] = [], []
            out, started, wall, stats = timed_gateway(in_threads, rep)
            if rep == 0:
                outs["gateway"] = out
            else:
                timings["gateway"].append(
                    {
                        "rollout_s": wall,
                        "tokens": stats["completion_tokens"],
                        "stats": stats,
                        "client": list(CALL_SECONDS),
                        "served": list(served),
                        # the engine's rounds (each call of a round carries its duration), and
                        # the seconds from the run's start to its first call in the service
                        "rounds": sorted({r for _, _, r, _ in served}),
                        "to_first_call_s": min(t for _, _, _, t in served) - started,
                    }
                )
            CALL_SECONDS = None
            if rep:
                timings["agent_loop"][-1]["phases"] = dict(agent.timings)
            print(
                f"W13: round {rep}/{repeats} agent_loop {agent_wall:.2f}s "
                f"gateway {wall:.2f}s (engine: {stats.get('rounds', 0)} rounds, {stats.get('calls', 0)} calls), "
                f"in a worker process {wall_p:.2f}s ({stats_p.get('rounds', 0)} rounds)",
                file=sys.stderr,
            )
    # the floor: the same program through the same gateway path with no model at all (a
    # responder that replies a fixed text of `--tokens` tokens at once): what the client,
    # HTTP, the service and the ledger cost by themselves
    from jaxagent.gateway.demonstrations import record

    def fixed_reply(text, noise=0.0, rng=None):
        return "x" * (args.tokens - 1)  # byte tokens, + the end-of-turn token = --tokens tokens

    floor = []
    for rep in range(repeats + 1):  # round 0: warm-up
        t0 = time.perf_counter()
        rec = record(
            rollout,
            tasks.tasks,
            list(range(B)),  # one session per seed (its id is the seed's)
            tok,
            fixed_reply,
            max_context=cfg.max_context,
            max_turns=TURNS,
            max_tokens=args.tokens,
            concurrency=B,
            timeout_s=600.0,
        )
        if rep:
            floor.append(time.perf_counter() - t0)
        if any(r.outcome.failure_kind for r in rec):
            print("W13: check failed: a session of the no-model floor failed", file=sys.stderr)
            sys.exit(1)
    print(f"W13: no-model floor {statistics.median(floor):.2f}s (median of {repeats})", file=sys.stderr)
    load = round(os.getloadavg()[0], 2)

    # checks (the warm-up rollouts): every episode played its 4 turns, on the same tokens
    (_, al_eps), (_, gw_eps) = outs["agent_loop"], outs["gateway"]
    problems = []
    gp_eps = outs["gateway_processes"][1]
    for name, eps in (("agent_loop", al_eps), ("gateway", gw_eps), ("gateway_processes", gp_eps)):
        bad = [e.index for e in eps if e.failed or len(segments([e], "policy")[0]) != TURNS]
        if bad:
            problems.append(f"{name}: episodes {bad[:8]} failed or did not play {TURNS} turns")
    same_prompts = segments(al_eps, "prompt") == segments(gw_eps, "prompt")
    # the same sampling keys (seed, row) and tokens: equal turns, but for float rounding
    same_policy = sum(a == b for a, b in zip(segments(al_eps, "policy"), segments(gw_eps, "policy"), strict=True))
    same_observations = {s for e in segments(al_eps, "observation") for s in e} == {
        s for e in segments(gw_eps, "observation") for s in e
    }
    if not same_prompts:
        problems.append("the first prompts differ")
    if not same_observations:
        problems.append("the observation segments differ")
    gateway_sequences = max(e.info.get("gateway_sequences", 0) for e in gw_eps)
    if problems:
        print("W13: check failed: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)

    med = {k: statistics.median(t["rollout_s"] for t in ts) for k, ts in timings.items()}
    rate = {k: statistics.median(t["tokens"] / t["rollout_s"] for t in ts) for k, ts in timings.items()}
    g = timings["gateway"]
    client = [s for t in g for s in t["client"]]
    served_all = [s for t in g for s in t["served"]]
    calls = len(client)
    if calls != repeats * B * TURNS or len(served_all) != calls:
        print(f"W13: check failed: timed {calls} client calls, {len(served_all)} served", file=sys.stderr)
        sys.exit(1)

    def ms(xs):
        return round(1000 * statistics.fmean(xs), 3)

    parts = {
        "client_ms": ms(client),
        "service_ms": ms([s for s, _, _, _ in served_all]),
        "queued_ms": ms([q for _, q, _, _ in served_all]),
        "round_ms": ms([r for _, _, r, _ in served_all]),
    }
    parts["http_ms"] = round(parts["client_ms"] - parts["service_ms"], 3)
    parts["ledger_ms"] = round(parts["service_ms"] - parts["queued_ms"] - parts["round_ms"], 3)
    mid = sorted(g, key=lambda t: t["rollout_s"])[len(g) // 2]  # the median run
    engine_s = statistics.median(sum(t["rounds"]) for t in g)
    to_first = statistics.median(t["to_first_call_s"] for t in g)
    timeline = {
        "to_first_call_s": round(to_first, 4),
        "engine_rounds_s": round(engine_s, 4),
        "between_rounds_s": round(med["gateway"] - to_first - engine_s, 4),
        "rounds_s": [round(r, 4) for r in sorted(mid["rounds"], reverse=True)],
    }
    al_phases = {
        k: round(statistics.median(t["phases"].get(k, 0.0) for t in timings["agent_loop"]), 4)
        for k in ("decode_wait_s", "append_s", "env_wait_s")
    }
    # programs in worker processes against in threads: the same keys and tokens (but for
    # float rounding: a round's rows may be batched in other shapes)
    same_in_processes = sum(a == b for a, b in zip(segments(gp_eps, "policy"), segments(gw_eps, "policy"), strict=True))
    checks = {
        "same_prompts": same_prompts,
        "same_observations": same_observations,
        "same_policy_turns": f"{same_policy}/{B}",
        "load_avg_1m": load,
    }
    emit(
        {
            **common,
            "system": "agent_loop",
            "rollout_s": round(med["agent_loop"], 4),
            "all_rollout_s": [round(t["rollout_s"], 4) for t in timings["agent_loop"]],
            "tokens_per_s": round(rate["agent_loop"], 1),
            "policy_tokens": [t["tokens"] for t in timings["agent_loop"]],
            **al_phases,
            "share_prompts": cfg.share_prompts,
            "compilations": dict(agent.sampler.trace_counts),
            **checks,
        },
        args.out,
    )
    emit(
        {
            **common,
            "system": "gateway",
            "rollout_s": round(med["gateway"], 4),
            "all_rollout_s": [round(t["rollout_s"], 4) for t in g],
            "tokens_per_s": round(rate["gateway"], 1),
            "policy_tokens": [t["tokens"] for t in g],
            "ratio_vs_agent_loop": round(rate["gateway"] / rate["agent_loop"], 3),
            "extra_wall_ms_per_call": round(1000 * (med["gateway"] - med["agent_loop"]) / (B * TURNS), 3),
            "overhead_ms_per_call": round(parts["http_ms"] + parts["ledger_ms"], 3),
            "no_model_rollout_s": round(statistics.median(floor), 4),
            "no_model_ms_per_call": round(1000 * statistics.median(floor) / (B * TURNS), 3),
            **parts,
            **timeline,
            "engine": {k: int(v) for k, v in sorted(mid["stats"].items())},
            "gateway_sequences_max": gateway_sequences,
            "compilations": dict(gw.sampler.trace_counts),
            **checks,
        },
        args.out,
    )
    gp = timings["gateway_processes"]
    mid_p = sorted(gp, key=lambda t: t["rollout_s"])[len(gp) // 2]
    emit(
        {
            **common,
            "system": "gateway_processes",
            "processes": args.processes,
            "rollout_s": round(med["gateway_processes"], 4),
            "all_rollout_s": [round(t["rollout_s"], 4) for t in gp],
            "tokens_per_s": round(rate["gateway_processes"], 1),
            "policy_tokens": [t["tokens"] for t in gp],
            "ratio_vs_agent_loop": round(rate["gateway_processes"] / rate["agent_loop"], 3),
            "same_policy_turns_as_threads": f"{same_in_processes}/{B}",
            "extra_wall_ms_per_call": round(1000 * (med["gateway_processes"] - med["agent_loop"]) / (B * TURNS), 3),
            "engine": {k: int(v) for k, v in sorted(mid_p["stats"].items())},
            **checks,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
