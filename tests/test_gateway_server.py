"""The gateway served over HTTP on the real sampler, called with the real `openai` client
(`AsyncOpenAI`) on 127.0.0.1: sessions, batching, KV reuse, exact tokens, tool calls,
streaming, and the refusals.

References are independent of the gateway: the log-probs of every trained token come
from a full forward pass of the model over the whole sequence (`token_logprobs`, the
training pass, not the sampler's KV cache), and expected token lists are written from
their bytes (the byte tokenizer: a text is its UTF-8 bytes, ChatML specials 256..258).
"""

import asyncio
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxagent import models as M
from jaxagent.gateway.engine import Engine
from jaxagent.gateway.protocol import Limits
from jaxagent.gateway.server import GatewayServer
from jaxagent.gateway.service import Gateway, RunSampling
from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.models.logprobs import token_logprobs
from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.sampling import SamplingConfig

EOS, IM_START, IM_END = 256, 257, 258
MAX_LEN = 384


def b(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture(scope="module")
def model():
    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML_TEMPLATE
    cfg = tiny_config(vocab_size=len(tok))
    params = M.init_params(jax.random.key(0), cfg, std=0.3)
    return tok, cfg, params


@pytest.fixture(scope="module")
def served(model):
    tok, cfg, params = model
    engine = Engine(Sampler(params, cfg, max_len=MAX_LEN), slots=8, stop_token_ids=[IM_END, EOS], seed=3)
    gateway = Gateway(
        engine,
        tok,
        model_name="tiny",
        limits=Limits(max_tokens=64, max_sessions=16, max_request_bytes=64 * 1024),
        run_sampling=RunSampling(SamplingConfig(temperature=1.0), max_tokens=12),
    )
    with GatewayServer(gateway) as server:
        yield gateway, server
    engine.close()


def client(server, session=None, key=None):
    return openai.AsyncOpenAI(
        base_url=server.base_url(session), api_key=key or server.api_key, max_retries=0, timeout=60
    )


def full_pass_logprobs(params, cfg, tokens):
    """log p(token_t | tokens_<t) from one forward pass over the whole sequence."""
    logp, _ = token_logprobs(params, cfg, jnp.asarray([tokens], jnp.int32))
    return np.asarray(logp[0], np.float64)


async def three_turns(server, session, user_texts):
    """A plain chat program: each turn appends the reply and the next user message."""
    c = client(server, session)
    messages, replies = [], []
    try:
        for text in user_texts:
            messages.append({"role": "user", "content": text})
            r = await c.chat.completions.create(model="anything", messages=messages, temperature=0.0, max_tokens=3)
            replies.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    finally:
        await c.close()
    return replies


def test_concurrent_sessions_are_batched_and_their_trained_tokens_are_the_sampled_ones(model, served):
    tok, cfg, params = model
    gateway, server = served
    sessions = [f"t1-{i}" for i in range(6)]
    for i, sid in enumerate(sessions):
        gateway.open_session(sid, key_id=i)
    rounds_before = gateway.engine.stats["rounds"]

    async def main():
        texts = [[f"hello {i}", "go on", "and again"] for i in range(6)]
        return await asyncio.gather(*(three_turns(server, s, t) for s, t in zip(sessions, texts, strict=True)))

    replies = asyncio.run(main())
    for sid in sessions:
        gateway.close_session(sid)
    drained = dict(gateway.store.drain())
    # 18 calls in fewer rounds than calls: sessions shared decodes
    assert gateway.engine.stats["rounds"] - rounds_before < 18
    for sid, rs in zip(sessions, replies, strict=True):
        (seq,) = drained[sid]  # each call extended the last: one sequence
        ext = [r.model_extra["jaxagent"] for r in rs]
        # the run's settings decided, not the request's temperature 0 / max_tokens 3
        assert all(e["sampling"]["source"] == "run" and e["sampling"]["temperature"] == 1.0 for e in ext)
        assert all(e["sampling"]["max_tokens"] == 12 for e in ext)
        # every completion is in the sequence, as sampled, where the extension says
        for e in ext:
            p, c = e["prompt_token_ids"], e["completion_token_ids"]
            assert seq.tokens[: len(p)].tolist() == p
            assert seq.tokens[len(p) : len(p) + len(c)].tolist() == c
            assert seq.loss_mask[len(p) : len(p) + len(c)].tolist() == [1] * len(c)
        # later calls reused the session's KV cache: only the new messages were appended
        assert rs[1].usage.prompt_tokens_details.cached_tokens >= rs[0].usage.prompt_tokens
        assert rs[2].usage.prompt_tokens_details.cached_tokens >= rs[1].usage.prompt_tokens
        # the trained log-probs are those of a full forward pass over the sequence
        ref = full_pass_logprobs(params, cfg, seq.tokens.tolist())
        mask = seq.loss_mask.astype(bool)
        assert mask.sum() == sum(len(e["completion_token_ids"]) for e in ext)
        np.testing.assert_allclose(seq.logprobs[mask], ref[mask], atol=1e-5)
        np.testing.assert_allclose(np.concatenate([e["completion_logprobs"] for e in ext]), ref[mask], atol=1e-5)


def test_a_session_samples_the_same_whatever_shares_its_rounds_and_whether_its_cache_was_kept(served):
    gateway, server = served
    texts = ["hello 0", "go on", "and again"]
    gateway.open_session("alone", key_id=0)
    alone = asyncio.run(three_turns(server, "alone", texts))
    gateway.close_session("alone", discard=True)
    # the same key id in a crowd of other sessions, with its cache dropped between calls
    gateway.open_session("crowd-0", key_id=0)
    for i in range(1, 4):
        gateway.open_session(f"crowd-{i}", key_id=10 + i)

    async def main():
        other = [three_turns(server, f"crowd-{i}", [f"x{i}", "y", "z"]) for i in range(1, 4)]
        return await asyncio.gather(three_turns(server, "crowd-0", texts), *other)

    crowd = asyncio.run(main())[0]
    for i in range(4):
        gateway.close_session(f"crowd-{i}", discard=True)
    for a, c in zip(alone, crowd, strict=True):
        ea, ec = a.model_extra["jaxagent"], c.model_extra["jaxagent"]
        assert ea["completion_token_ids"] == ec["completion_token_ids"]
        np.testing.assert_allclose(ea["completion_logprobs"], ec["completion_logprobs"], atol=1e-5)


def test_streaming_carries_the_reply_usage_and_extension(served):
    gateway, server = served

    async def main():
        c = client(server)
        try:
            whole = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=False
            )
            stream = await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [ch async for ch in stream]
        finally:
            await c.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    ext = finish[0].model_extra["jaxagent"]
    assert tok_text(ext["completion_token_ids"]) == text
    assert chunks[-1].usage.completion_tokens == len(ext["completion_token_ids"])
    assert whole.usage.completion_tokens == len(whole.model_extra["jaxagent"]["completion_token_ids"])


def tok_text(ids):
    """The reply text of byte-tokenizer ids: specials dropped, the bytes decoded."""
    return bytes(t for t in ids if t < 256).decode("utf-8", "replace")


def test_an_idle_kept_alive_connection_outlives_the_clients_own_expiry(served):
    """The server keeps an idle connection open longer than httpx (the `openai` client's
    transport) does, 5 s: a client never sends a call on a connection the server is
    closing. One connection, a request, 6 s idle, another request on it."""
    import http.client

    gateway, server = served
    assert server.keep_alive_s > 5.0
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Authorization": f"Bearer {server.api_key}"}
    try:
        conn.request("GET", "/v1/models", headers=headers)
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(6.0)
        conn.request("GET", "/v1/models", headers=headers)  # raises if the server closed the socket
        again = conn.getresponse()
        assert again.status == 200 and json.loads(again.read())["data"][0]["id"] == "tiny"
        assert conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()


def test_refusals_are_openai_errors_naming_what_is_wrong(served):
    gateway, server = served

    async def main():
        out = {}
        bad = client(server, key="a-wrong-key-of-some-length")
        try:
            await bad.models.list()
        except openai.AuthenticationError as e:
            out["key"] = e
        await bad.close()
        c = client(server)
        try:
            assert [m.id for m in (await c.models.list()).data] == ["tiny"]
            for name, kwargs in {
                "empty": {"messages": []},
                "temperature": {"messages": [{"role": "user", "content": "x"}], "temperature": 9},
                "context": {"messages": [{"role": "user", "content": "x" * (MAX_LEN + 10)}]},
                "unsupported": {"messages": [{"role": "user", "content": "x"}], "extra_body": {"audio": {}}},
            }.items():
                try:
                    await c.chat.completions.create(model="m", **kwargs)
                except openai.APIStatusError as e:
                    out[name] = e
            try:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 70000}])
            except openai.APIStatusError as e:
                out["size"] = e
        finally:
            await c.close()
        nosession = client(server, "no-such-session")
        try:
            await nosession.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as e:
            out["session"] = e
        await nosession.close()
        return out

    out = asyncio.run(main())
    assert out["key"].status_code == 401 and out["key"].body["code"] == "invalid_api_key"
    assert "a-wrong-key" not in str(out["key"].body)
    assert out["empty"].status_code == 400 and out["empty"].body["param"] == "messages"
    assert out["temperature"].status_code == 400 and out["temperature"].body["param"] == "temperature"
    assert out["context"].status_code == 400 and out["context"].body["code"] == "context_length_exceeded"
    assert out["unsupported"].status_code == 400 and out["unsupported"].body["param"] == "audio"
    assert out["size"].status_code == 413
    assert out["session"].status_code == 404 and "no-such-session" in out["session"].body["message"]


# ---------------------------------------------------------------- scripted replies
class ScriptedEngine(Engine):
    """The real engine (queue, rows, rounds, threads) whose decode returns scripted token
    ids: what a model that writes tool calls would sample."""

    def __init__(self, sampler, replies, **kw):
        super().__init__(sampler, **kw)
        self.replies = list(replies)
        self.prompts = []

    def _round(self, jobs, rows):
        out = []
        for job in jobs:
            self.prompts.append(job.prompt)
            ids = self.replies.pop(0)
            out.append((tuple(ids), tuple(-0.5 for _ in ids), "stop_token", 0))
        return out


def test_tool_calls_round_trip_and_sampled_tokens_are_never_retokenised(model):
    tok, cfg, params = model
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    # the first reply holds a special token mid-text: its text ("hi" + "x") re-tokenises
    # without it, so only the recorded ids reproduce what was sampled
    drift = b("hi") + [IM_START] + b("x") + [IM_END]
    replies = [b(call_text) + [IM_END], drift, b("5") + [IM_END]]
    replies_given = [list(r) for r in replies]
    engine = ScriptedEngine(Sampler(params, cfg, max_len=2048), replies_given, slots=2, stop_token_ids=[IM_END, EOS])
    gateway = Gateway(engine, tok, model_name="tiny", run_sampling=RunSampling(SamplingConfig(), max_tokens=8))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "a + b",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
            },
        }
    ]
    with GatewayServer(gateway) as server:
        gateway.open_session("tools", key_id=0)

        async def program():
            c = client(server, "tools")
            messages = [{"role": "user", "content": "2+3?"}]
            r1 = await c.chat.completions.create(model="m", messages=messages, tools=tools)
            call = r1.choices[0].message.tool_calls[0]
            messages += [r1.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "5"}]
            r2 = await c.chat.completions.create(model="m", messages=messages, tools=tools)
            messages += [{"role": "assistant", "content": r2.choices[0].message.content}]
            messages += [{"role": "user", "content": "so?"}]
            r3 = await c.chat.completions.create(model="m", messages=messages, tools=tools)
            await c.close()
            return r1, r2, r3

        r1, r2, r3 = asyncio.run(program())
        gateway.close_session("tools")
    engine.close()
    assert r1.choices[0].finish_reason == "tool_calls"
    call = r1.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert r1.choices[0].message.content is None
    assert r2.choices[0].message.content == "hix"
    (seq,) = dict(gateway.store.drain())["tools"]
    # the whole session is one sequence holding every sampled reply exactly
    tokens = seq.tokens.tolist()
    p3 = list(engine.prompts[2])
    assert tokens[: len(p3)] == p3
    for prompt, reply in zip(engine.prompts, replies, strict=True):  # each call extends the last
        at = len(prompt)
        assert tokens[:at] == list(prompt) and tokens[at : at + len(reply)] == reply
        assert seq.loss_mask[at : at + len(reply)].tolist() == [1] * len(reply)
    # the tool result went in as the template's tool turn, after the sampled call
    tool_turn = [IM_START] + b("tool\n5") + [IM_END]
    assert any(tokens[i : i + len(tool_turn)] == tool_turn for i in range(len(tokens)))
    assert seq.loss_mask.sum() == sum(len(r) for r in replies)


def test_a_malformed_tool_call_is_plain_content(model):
    tok, cfg, params = model
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>'
    engine = ScriptedEngine(
        Sampler(params, cfg, max_len=2048), [b(broken) + [IM_END]], slots=1, stop_token_ids=[IM_END, EOS]
    )
    gateway = Gateway(engine, tok, model_name="tiny", run_sampling=RunSampling(SamplingConfig(), max_tokens=8))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with GatewayServer(gateway) as server:

        async def program():
            c = client(server)
            try:
                return await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "2+3?"}], tools=tools
                )
            finally:
                await c.close()

        r = asyncio.run(program())
    engine.close()
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == broken and not r.choices[0].message.tool_calls


@pytest.mark.slow  # ~12 s; MCPTools and the example program have their own tests (test_mcp_env.py)
def test_the_mcp_example_program_uses_the_servers_tools_through_the_gateway(model):
    """`examples/agents/mcp_agent.py` as written, against the gateway: the policy's tool call
    runs on the MCP test server, and its result reaches the next prompt."""
    pytest.importorskip("mcp")
    from examples.agents.mcp_agent import rollout

    tok, cfg, params = model
    call = '<tool_call>{"name": "add", "arguments": {"a": 1234, "b": 4321}}</tool_call>'
    replies = [b(call) + [IM_END], b("<answer>5555</answer>") + [IM_END]]
    engine = ScriptedEngine(Sampler(params, cfg, max_len=4096), replies, slots=1, stop_token_ids=[IM_END, EOS])
    gateway = Gateway(engine, tok, model_name="tiny", run_sampling=RunSampling(SamplingConfig(), max_tokens=64))
    server_script = str(Path(__file__).parent / "mcp_server_fixture.py")
    task = {"prompt": "What is 1234 + 4321?", "answer": "5555", "mcp_server": ["python", server_script]}
    with GatewayServer(gateway) as server:
        gateway.open_session("mcp", key_id=0)

        async def main():
            c = client(server, "mcp")
            try:
                return await rollout(c, task)
            finally:
                await c.close()

        reward = asyncio.run(main())
        gateway.close_session("mcp")
    engine.close()
    assert reward == 1.0
    first, second = engine.prompts
    assert b'"name": "add"' in bytes(t for t in first if t < 256)  # the server's tools were offered
    tool_turn = [IM_START] + b("tool\n5555") + [IM_END]
    assert any(list(second[i : i + len(tool_turn)]) == tool_turn for i in range(len(second)))
    (seq,) = dict(gateway.store.drain())["mcp"]
    assert seq.num_turns == 2
