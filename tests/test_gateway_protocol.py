"""The gateway's wire format (`jaxagent.gateway.protocol`): requests are validated into a
`ChatRequest` or refused with a 4xx that names the field; responses and stream chunks
have OpenAI's shapes (checked against hand-written dicts and the `openai` package's own
pydantic types), and the real `openai` client talks to them through an in-process
transport (no server, no network)."""

import json
import math

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxagent.gateway import protocol as P
from jaxagent.gateway import responses as R
from jaxagent.gateway.protocol import (
    ChatRequest,
    FunctionChoice,
    Limits,
    Message,
    RequestError,
    Tool,
    ToolCall,
    error_body,
    parse_request,
)
from jaxagent.gateway.responses import (
    SSE_DONE,
    AssistantMessage,
    Sampling,
    TokenLogprob,
    Usage,
    completion_response,
    sse,
    stream_chunks,
)

LIMITS = Limits()
USER = {"role": "user", "content": "hi"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def body(**over):
    return {"model": "tiny", "messages": [USER], **over}


def refused(request, status, param, code=None, *, limits=LIMITS, models=None) -> RequestError:
    """The request (dict or bytes) is refused with this status and param, the message names it."""
    raw = request if isinstance(request, bytes) else json.dumps(request).encode()
    with pytest.raises(RequestError) as info:
        parse_request(raw, limits=limits, models=models)
    err = info.value
    assert (err.status, err.param) == (status, param), (err.status, err.param, err.message)
    if param is not None:
        assert err.message.startswith(f"{param}: "), err.message
    if code is not None:
        assert err.code == code, err.code
    assert error_body(err) == {"error": {"message": err.message, "type": err.type, "param": param, "code": err.code}}
    assert err.type == P.error_type(status)
    return err


# ---------------------------------------------------------------- accepted requests
def test_a_full_request_parses_into_its_fields():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None, "annotations": []},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = parse_request(
        json.dumps(
            body(
                messages=messages,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                temperature=0.7,
                top_p=0.9,
                max_completion_tokens=64,
                stop=["\n\n", "END"],
                seed=7,
                logprobs=True,
                top_logprobs=3,
                stream=True,
                stream_options={"include_usage": True},
                n=1,
                user="u-1",
                parallel_tool_calls=False,
                metadata={"run": "a"},
                frequency_penalty=0,
                response_format={"type": "text"},
            )
        ).encode(),
        limits=LIMITS,
        models=["tiny", "other"],
    )
    assert req == ChatRequest(
        model="tiny",
        messages=(
            Message("system", "Be brief."),
            Message("user", "Weather\nin Paris?"),
            Message("assistant", None, (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
            Message("tool", "sunny", tool_call_id="call_1"),
        ),
        tools=(Tool("get_weather", "The weather of a city", WEATHER["function"]["parameters"]),),
        tool_choice=FunctionChoice("get_weather"),
        parallel_tool_calls=False,
        temperature=0.7,
        top_p=0.9,
        max_tokens=64,
        stop=("\n\n", "END"),
        seed=7,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        include_usage=True,
        user="u-1",
    )


def test_defaults_nulls_and_dict_bodies():
    nulls = dict.fromkeys(
        ["temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "top_logprobs", "tools", "tool_choice"]
    )
    nulls |= {"stream": None, "stream_options": None, "n": None, "presence_penalty": None, "logit_bias": None}
    for request in (body(), body(**nulls), json.dumps(body()).encode()):
        req = parse_request(request, limits=LIMITS, models=None)
        assert req == ChatRequest(model="tiny", messages=(Message("user", "hi"),)), req
    assert parse_request(body(model="anything"), limits=LIMITS, models=None).model == "anything"
    with_tools = parse_request(body(tools=[WEATHER]), limits=LIMITS, models=None)
    assert with_tools.tool_choice == "auto" and with_tools.tools[0].name == "get_weather"
    assert parse_request(body(stop="###"), limits=LIMITS, models=None).stop == ("###",)
    both = parse_request(body(max_tokens=5, max_completion_tokens=5), limits=LIMITS, models=None)
    assert both.max_tokens == 5
    neutral = {"n": 1, "logit_bias": {}, "store": False, "modalities": ["text"], "presence_penalty": 0.0}
    assert parse_request(body(**neutral), limits=LIMITS, models=None).model == "tiny"


# ---------------------------------------------------------------- refused requests
def test_a_body_that_is_not_a_json_object_is_refused():
    assert "not valid JSON" in refused(b'{"model": "tiny", ', 400, None, "invalid_json").message
    assert "UTF-8" in refused(b'{"model": "\xff"}', 400, None, "invalid_json").message
    assert "NaN" in refused(b'{"model": "tiny", "temperature": NaN}', 400, None, "invalid_json").message
    assert "JSON object" in refused(b"[1, 2]", 400, None, "invalid_json").message
    with pytest.raises(RequestError, match="not JSON data"):
        parse_request({"model": "tiny", "messages": [USER], "seed": {1, 2}}, limits=LIMITS, models=None)
    with pytest.raises(TypeError, match="bytes or a dict"):
        parse_request("{}", limits=LIMITS, models=None)  # type: ignore[arg-type]


def test_limits_on_size_messages_and_tokens():
    small = Limits(max_request_bytes=200, max_messages=2, max_tokens=100)
    big = body(messages=[{"role": "user", "content": "x" * 300}])
    err = refused(big, 413, None, "request_too_large", limits=small)
    assert "over the limit of 200" in err.message and err.type == "invalid_request_error"
    with pytest.raises(RequestError) as info:
        parse_request(big, limits=small, models=None)
    assert info.value.status == 413
    refused(body(messages=[USER] * 3), 400, "messages", "too_many_messages", limits=small)
    assert "limit of 100" in refused(body(max_tokens=101), 400, "max_tokens", limits=small).message
    refused(body(max_completion_tokens=101), 400, "max_completion_tokens", limits=small)
    assert parse_request(body(max_tokens=100), limits=small, models=None).max_tokens == 100


@pytest.mark.parametrize(
    "field, value",
    [("max_request_bytes", 0), ("max_messages", -1), ("max_tokens", True), ("max_sessions", 1.5)],
)
def test_limits_are_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"Limits.{field} must be a positive integer"):
        Limits(**{field: value})
    assert Limits() == Limits(4 * 1024 * 1024, 512, 4096, 256)


def test_unknown_and_unsupported_parameters_are_refused():
    assert "unrecognized" in refused(body(temprature=0.5), 400, "temprature", "unknown_parameter").message
    long_key = "k" * 300
    err = refused(body(**{long_key: 1}), 400, "k" * 37 + "...", "unknown_parameter")
    assert long_key not in err.message
    for key, value in [
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"50256": -100}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("functions", [WEATHER["function"]]),
        ("frequency_penalty", 0.5),
        ("store", True),
        ("reasoning_effort", "high"),
    ]:
        assert "not supported" in refused(body(**{key: value}), 400, key, "unsupported_parameter").message
    refused(body(n=2), 400, "n", "unsupported_value")
    refused(body(n="1"), 400, "n", "invalid_type")


def test_model_is_required_and_must_be_served():
    refused({"messages": [USER]}, 400, "model", "missing_required_parameter")
    refused(body(model=5), 400, "model", "invalid_type")
    err = refused(body(model="gpt-9"), 404, "model", "model_not_found", models=["tiny"])
    assert err.type == "not_found_error" and "'gpt-9'" in err.message and "tiny" in err.message


@pytest.mark.parametrize(
    "messages, param, code",
    [
        (None, "messages", "missing_required_parameter"),
        ([], "messages", "empty_array"),
        ("hi", "messages", "invalid_type"),
        (["hi"], "messages[0]", "invalid_type"),
        ([{"content": "hi"}], "messages[0].role", "invalid_value"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role", "invalid_value"),
        ([{"role": "function", "name": "f", "content": "x"}], "messages[0].role", "unsupported_value"),
        ([{"role": "user"}], "messages[0].content", "missing_content"),
        ([{"role": "system", "content": None}], "messages[0].content", "missing_content"),
        ([USER, {"role": "user", "content": 5}], "messages[1].content", "invalid_type"),
        ([{"role": "user", "content": []}], "messages[0].content", "invalid_value"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]}],
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 3}]}],
            "messages[0].content[1].text",
            "invalid_type",
        ),
        ([{"role": "user", "content": ["a"]}], "messages[0].content[0]", "invalid_type"),
        ([USER, {"role": "assistant", "content": None}], "messages[1].content", "missing_content"),
        ([USER, {"role": "assistant", "content": "x", "refusal": "no"}], "messages[1].refusal", "unsupported_value"),
        (
            [USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
            "messages[1].function_call",
            "unsupported_value",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}],
            "messages[1].tool_calls[0].id",
            "invalid_type",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}],
            "messages[1].tool_calls[0].type",
            "unsupported_value",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}],
            "messages[1].tool_calls[0].function.arguments",
            "invalid_type",
        ),
        ([USER, {"role": "assistant", "tool_calls": {}}], "messages[1].tool_calls", "invalid_type"),
        ([USER, {"role": "user", "content": "x", "name": 3}], "messages[1].name", "invalid_type"),
        ([USER, {"role": "tool", "content": "sunny"}], "messages[1].tool_call_id", "invalid_type"),
        (
            [USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "messages[1].tool_call_id",
            "unknown_tool_call_id",
        ),
        (  # the call comes after its result
            [
                USER,
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "tool_calls": [CALL]},
            ],
            "messages[1].tool_call_id",
            "unknown_tool_call_id",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}],
            "messages[2].content",
            "missing_content",
        ),
    ],
)
def test_bad_messages_are_refused_naming_the_field(messages, param, code):
    refused(body(messages=messages), 400, param, code)


@pytest.mark.parametrize(
    "over, param, code",
    [
        ({"tools": WEATHER}, "tools", "invalid_type"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "unsupported_value"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_type"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", None),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name", None),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "duplicate_tool_name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
            "invalid_type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
            "invalid_type",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice", "invalid_type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "invalid_value",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
            "tool_choice.type",
            "unsupported_value",
        ),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": -0.1}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": True}, "temperature", "invalid_type"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
        ({"max_completion_tokens": "9"}, "max_completion_tokens", "invalid_type"),
        ({"max_tokens": 10, "max_completion_tokens": 20}, "max_completion_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": 7}, "stop", "invalid_type"),
        ({"stop": ["a", 3]}, "stop[1]", "invalid_type"),
        ({"stop": [""]}, "stop[0]", "invalid_value"),
        ({"stop": ""}, "stop", "invalid_value"),
        ({"seed": "7"}, "seed", "invalid_type"),
        ({"seed": 2**64}, "seed", "invalid_value"),
        ({"logprobs": "yes"}, "logprobs", "invalid_type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"stream": "true"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown_parameter"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
        ({"stream": True, "stream_options": []}, "stream_options", "invalid_type"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
        ({"user": 5}, "user", "invalid_type"),
        ({"metadata": "x"}, "metadata", "invalid_type"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(over, param, code):
    refused(body(**over), 400, param, code)


def test_too_many_tools_are_refused():
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(P.MAX_TOOLS + 1)]
    refused(body(tools=tools), 400, "tools")


def test_errors_never_echo_content_and_cap_what_they_show():
    secret = "sk-live-" + "9" * 40
    err = refused(body(messages=[{"role": "user", "content": secret}], temperature=9), 400, "temperature")
    assert secret not in err.message and "9" in err.message
    err = refused(body(messages=[{"role": "user", "content": secret}, {"role": secret}]), 400, "messages[1].role")
    assert secret not in err.message and secret[:37] + "..." in err.message
    err = refused(body(temperature="x" * 500), 400, "temperature")
    assert "x" * 38 not in err.message and len(err.message) < 120
    assert len(RequestError(400, "m" * 5000).message) == 1000


def test_error_types_and_ready_made_errors():
    assert [P.error_type(s) for s in (400, 401, 403, 404, 413, 418, 429, 500, 503)] == [
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "invalid_request_error",
        "invalid_request_error",
        "rate_limit_error",
        "server_error",
        "server_error",
    ]
    auth = P.authentication_error()
    assert (auth.status, auth.type, auth.code, auth.param) == (401, "authentication_error", "invalid_api_key", None)
    busy = P.session_limit_error(256)
    assert (busy.status, busy.type, busy.code) == (
        429,
        "rate_limit_error",
        "too_many_sessions",
    ) and "256" in busy.message
    long = P.context_length_error(4000, 512, 4096)
    assert error_body(long) == {
        "error": {
            "message": "messages: the prompt is 4000 tokens and max_tokens asks for 512 more, over the model's "
            "context of 4096 tokens; shorten the messages or lower max_tokens",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert RequestError(400, "x", type="custom_error").type == "custom_error"
    with pytest.raises(ValueError, match="HTTP error status"):
        RequestError(200, "fine")


# ---------------------------------------------------------------- responses
SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=None, max_tokens=64, seed=3, stop=["\n\n"], source="run")
EXT = R.jaxagent_extension(
    prompt_token_ids=[1, 2, 3],
    completion_token_ids=[4, 5],
    policy_version=7,
    sampling=SAMPLING,
    completion_logprobs=[-0.5, -0.25],
)
EXT_DICT = {
    "prompt_token_ids": [1, 2, 3],
    "completion_token_ids": [4, 5],
    "policy_version": 7,
    "sampling": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "max_tokens": 64,
        "seed": 3,
        "stop": ["\n\n"],
        "greedy": False,
        "source": "run",
    },
    "completion_logprobs": [-0.5, -0.25],
}
CALLS = (ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", "{}"))


def test_the_extension_holds_the_tokens_the_version_and_the_sampling_used():
    assert EXT == EXT_DICT
    with pytest.raises(ValueError, match="2 completion log-probs for 3 completion tokens"):
        R.jaxagent_extension(
            prompt_token_ids=[],
            completion_token_ids=[1, 2, 3],
            policy_version=0,
            sampling=SAMPLING,
            completion_logprobs=[0.0, 0.0],
        )
    with pytest.raises(ValueError, match="source"):
        Sampling(1.0, 1.0, None, 8, None, source="client")  # type: ignore[arg-type]


def test_a_text_completion_has_openai_shape():
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    logprobs = [TokenLogprob.from_bytes(b"Hi", -0.5, [(b"Hi", -0.5), (b"Yo", -1.5)]), TokenLogprob("!", -math.inf)]
    out = completion_response("chatcmpl-1", "tiny", 1700000000, AssistantMessage("Hi!"), "stop", usage, logprobs, EXT)
    assert out == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!", "refusal": None},
                "logprobs": {
                    "content": [
                        {
                            "token": "Hi",
                            "logprob": -0.5,
                            "bytes": [72, 105],
                            "top_logprobs": [
                                {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
                            ],
                        },
                        {"token": "!", "logprob": -9999.0, "bytes": None, "top_logprobs": []},
                    ],
                    "refusal": None,
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
        "jaxagent": EXT_DICT,
    }
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(out)))
    assert parsed.choices[0].message.content == "Hi!" and parsed.usage.prompt_tokens_details.cached_tokens == 1
    assert parsed.choices[0].logprobs.content[1].logprob == -9999.0
    assert parsed.model_extra["jaxagent"]["completion_token_ids"] == [4, 5]


def test_a_tool_call_completion_has_openai_shape():
    message = AssistantMessage(None, CALLS)
    assert R.finish_reason_of(message, "stop") == "tool_calls" and R.finish_reason_of(message, "length") == "tool_calls"
    assert R.finish_reason_of(AssistantMessage("x"), "length") == "length"
    out = completion_response("chatcmpl-2", "tiny", 5, message, "tool_calls", Usage(10, 4))
    assert out == {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "created": 5,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
    }
    parsed = ChatCompletion.model_validate(out)
    assert [c.function.name for c in parsed.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    with pytest.raises(ValueError, match="finish_reason"):
        completion_response("x", "tiny", 0, message, "content_filter", Usage(1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="content may be None only"):
        AssistantMessage(None)
    with pytest.raises(ValueError, match="cached_tokens"):
        Usage(2, 1, cached_tokens=3)
    with pytest.raises(ValueError, match="Usage.completion_tokens"):
        Usage(2, -1)


def test_token_text_of_partial_characters():
    assert R.token_text("é".encode()) == "é"
    tok = TokenLogprob.from_bytes(b"\xe2\x82", -0.1)
    assert tok.to_dict() == {"token": "bytes:\\xe2\\x82", "logprob": -0.1, "bytes": [226, 130], "top_logprobs": []}


def test_stream_chunks_have_openai_shape_and_add_up_to_the_completion():
    message = AssistantMessage("Let me check.", CALLS)
    usage = Usage(10, 6)
    chunks = stream_chunks("c-1", "tiny", 9, message, "tool_calls", usage, include_usage=True, extension=EXT)
    head = {"id": "c-1", "object": "chat.completion.chunk", "created": 9, "model": "tiny"}

    def choice(delta, finish=None):
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            "usage": None,
        }

    assert chunks == [
        choice({"role": "assistant", "content": ""}),
        choice({"content": "Let me check."}),
        choice({"tool_calls": [{"index": 0, **CALLS[0].to_dict()}]}),
        choice({"tool_calls": [{"index": 1, **CALLS[1].to_dict()}]}),
        {**choice({}, "tool_calls"), "jaxagent": EXT_DICT},
        {**head, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16}},
    ]
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    final = state.get_final_completion()
    whole = ChatCompletion.model_validate(completion_response("c-1", "tiny", 9, message, "tool_calls", usage))
    assert final.choices[0].message.content == whole.choices[0].message.content == "Let me check."
    got = [(c.id, c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert got == [(c.id, c.name, c.arguments) for c in CALLS]
    assert final.choices[0].finish_reason == "tool_calls" and final.usage == whole.usage


def test_a_stream_without_usage_and_with_logprobs():
    lp = [TokenLogprob("Hi", -0.1)]
    plain = stream_chunks("c", "m", 1, AssistantMessage("Hi"), "stop", Usage(1, 1), logprobs=lp)
    assert len(plain) == 3 and all("usage" not in c for c in plain)
    assert plain[1]["choices"][0]["logprobs"] == {"content": [lp[0].to_dict()], "refusal": None}
    assert plain[2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    calls_only = stream_chunks("c", "m", 1, AssistantMessage(None, CALLS[:1]), "tool_calls", Usage(1, 1), logprobs=lp)
    assert calls_only[-1]["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
    for c in plain + calls_only:
        ChatCompletionChunk.model_validate(c)
    assert R.chunk("c", "m", 1, R.content_delta("x"))["choices"][0]["delta"] == {"content": "x"}


def test_server_sent_events():
    assert sse({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert sse("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(sse({"text": "two\nlines"})[len(b"data: ") :]) == {"text": "two\nlines"}
    with pytest.raises(ValueError, match="one line"):
        sse("two\nlines")
    with pytest.raises(ValueError):
        sse({"x": math.nan})


def test_the_models_list():
    out = R.models_response(["tiny", "tiny-lora"], 1700000000)
    assert out == {
        "object": "list",
        "data": [
            {"id": "tiny", "object": "model", "created": 1700000000, "owned_by": "jaxagent"},
            {"id": "tiny-lora", "object": "model", "created": 1700000000, "owned_by": "jaxagent"},
        ],
    }
    assert [Model.model_validate(m).id for m in out["data"]] == ["tiny", "tiny-lora"]


# ---------------------------------------------------------------- the real client, in process
class FakeGateway:
    """An in-process stand-in for the server: parses with `parse_request` and answers a
    tool call first, then text, in the protocol's shapes (what the real server will do)."""

    def __init__(self):
        self.requests: list[ChatRequest] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer key-1":
            err = P.authentication_error()
            return httpx.Response(err.status, json=error_body(err))
        try:
            req = parse_request(request.content, limits=LIMITS, models=["tiny"])
        except RequestError as err:
            return httpx.Response(err.status, json=error_body(err))
        self.requests.append(req)
        if req.tools and req.messages[-1].role != "tool":
            message, finish = AssistantMessage(None, CALLS[:1]), "tool_calls"
        else:
            message, finish = AssistantMessage("It is sunny."), "stop"
        cid, usage = f"chatcmpl-{len(self.requests)}", Usage(12, 5)
        if not req.stream:
            return httpx.Response(200, json=completion_response(cid, req.model, 1, message, finish, usage, None, EXT))
        chunks = stream_chunks(cid, req.model, 1, message, finish, usage, include_usage=req.include_usage)
        events = b"".join(sse(c) for c in chunks) + SSE_DONE
        return httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})


@pytest.fixture
def gateway():
    fake = FakeGateway()
    client = openai.OpenAI(
        api_key="key-1",
        base_url="http://gateway.test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(fake)),
    )
    yield fake, client
    client.close()


def test_the_openai_client_runs_a_tool_loop(gateway):
    fake, client = gateway
    messages: list = [{"role": "system", "content": "Help."}, {"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], temperature=0.5)
    call = first.choices[0].message.tool_calls[0]
    assert (first.choices[0].finish_reason, call.id, call.function.name) == ("tool_calls", "call_a", "get_weather")
    assert first.model_extra["jaxagent"]["policy_version"] == 7
    messages.append(first.choices[0].message)  # the client's own pydantic object, as programs do
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny." and second.usage.total_tokens == 17
    sent = fake.requests[1]
    assert [m.role for m in sent.messages] == ["system", "user", "assistant", "tool"]
    assert sent.messages[2].tool_calls == (CALLS[0],) and sent.messages[3].tool_call_id == "call_a"
    assert fake.requests[0].temperature == 0.5 and sent.temperature is None


def test_the_openai_client_streams(gateway):
    fake, client = gateway
    stream = client.chat.completions.create(
        model="tiny", messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny."
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    with client.chat.completions.stream(model="tiny", messages=[USER], tools=[WEATHER]) as events:
        final = events.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert fake.requests[-1].stream


def test_the_openai_client_sees_errors_that_name_the_field(gateway):
    _, client = gateway
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[USER], temperature=3)
    assert (info.value.status_code, info.value.param, info.value.code) == (400, "temperature", "invalid_value")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[USER], n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[USER], extra_body={"logit_bias": {"5": 3}})
    assert (info.value.param, info.value.code) == ("logit_bias", "unsupported_parameter")
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[USER])
    assert info.value.param == "model" and info.value.type == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").chat.completions.create(model="tiny", messages=[USER])
