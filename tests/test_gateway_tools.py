"""Tool calls through the model's own chat template (`jaxagent.gateway.tools`): OpenAI
messages into template messages, Hermes / Qwen2.5 `<tool_call>` blocks parsed back (a
malformed one is plain content, never an error), the tool policy, and the built-in
`TOOL_CHATML_TEMPLATE` of the byte-level tokenizers (ChatFormat accepts it, and a rendered
call parses back to the same call)."""

import json
import re

import pytest

from jaxagent.gateway.protocol import FunctionChoice, Message, RequestError, Tool, ToolCall
from jaxagent.gateway.tools import (
    TOOL_CHATML_TEMPLATE,
    CallIds,
    apply_tool_choice,
    parse_reply,
    parse_tool_calls,
    streamable_prefix,
    template_kwargs,
    to_template_messages,
)
from jaxagent.models.byte_tokenizer import CHATML_TEMPLATE, byte_chat_tokenizer
from jaxagent.rollout.chat import ChatFormat

WEATHER = Tool(
    "get_weather",
    "The weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time")
TOOLS = (WEATHER, TIME)

#: a Qwen2.5-style tool template, written for this test: tools listed in the system turn,
#: calls as <tool_call> JSON blocks, results as <tool_response> blocks inside a user turn
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}You are a helpful assistant.{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nFunction signatures are inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{- '\\n</tools>\\n\\nCall one with <tool_call></tool_call> around ' }}"
    '{{- \'{"name": ..., "arguments": ...}<|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer(template=TOOL_CHATML_TEMPLATE):
    tok = byte_chat_tokenizer()
    tok.chat_template = template
    return tok


TOK = tokenizer()


def render(messages, tools=(), tok=TOK, generation=False):
    return tok.apply_chat_template(
        to_template_messages(messages), tokenize=False, add_generation_prompt=generation, **template_kwargs(tools)
    )


def assistant_turns(text: str) -> list[str]:
    """The bodies of the rendered assistant turns (what the policy writes after the generation prompt)."""
    return re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, flags=re.S)


def call(i, name, arguments):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [call(1, "get_weather", {"city": "Zürich"}), call(2, "get_time", {})],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


# ---------------------------------------------------------------- parsing completions
def test_one_call_with_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ids=CallIds(0))
    assert content == "Let me check."
    assert calls == [ToolCall(CallIds(0)(), "get_weather", '{"city": "Zürich"}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_several_calls_and_text_between_them():
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
        '<tool_call>{"name":"get_time"}</tool_call>\n  and <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        " done\n"
    )
    ids = CallIds(5)
    content, calls = parse_tool_calls(text, ids=ids)
    expected_ids = CallIds(5)
    assert content == "and\ndone"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        (expected_ids(), "get_weather", {"city": "Paris", "days": [1, 2]}),
        (expected_ids(), "get_time", {}),
        (expected_ids(), "get_time", {}),
    ]
    assert calls[0].arguments == '{"city": "Paris", "days": [1, 2]}'  # what a template's tojson writes
    only_calls, _ = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', ids=CallIds(0))
    assert only_calls is None


def test_ids_are_deterministic_per_seed_and_random_without_one():
    a, b = CallIds(1), CallIds(1)
    assert [a() for _ in range(3)] == [b() for _ in range(3)]
    assert CallIds(1)() != CallIds(2)()
    assert CallIds()() != CallIds()() and re.fullmatch(r"call_[0-9a-f]{24}", CallIds()())
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_text_without_tags_is_content_verbatim():
    for text in ("", "  plain answer \n", "a < b and c > d", "<tool>"):
        assert parse_tool_calls(text, ids=CallIds(0)) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as JSON text
        '<tool_call>{"name": "f", "arguments": {}, "id": "x"}</tool_call>',  # another key
        '<tool_call>["f", {}]</tool_call>',  # not an object
        "<tool_call></tool_call>",  # empty
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        'I will call it: <tool_call>\n{"name": "f", "arguments": {}}',  # unclosed
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> then <tool_call>{"name": "g"',  # second unclosed
        'stray {"name": "f"}</tool_call>',  # close without open
        '<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call></tool_call>',  # nested
    ],
)
def test_a_malformed_call_makes_the_whole_reply_plain_content(text):
    ids = CallIds(0)
    assert parse_tool_calls(text, ids=ids) == (text, [])
    assert ids() == CallIds(0)(), "a failed parse draws no id"


def test_an_unknown_style_is_an_error():
    with pytest.raises(ValueError, match="unknown style 'xml'"):
        parse_tool_calls("x", style="xml")


def test_the_tool_choice_policy():
    text = 'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_tool_calls(text, ids=CallIds(0))
    assert apply_tool_choice(text, content, calls, "auto", TOOLS) == ("Sure.", calls)
    assert apply_tool_choice(text, content, calls, "required", TOOLS) == ("Sure.", calls)
    assert apply_tool_choice(text, content, calls, FunctionChoice("get_weather"), TOOLS) == ("Sure.", calls)
    assert apply_tool_choice(text, content, calls, FunctionChoice("get_time"), TOOLS) == (text, [])
    assert apply_tool_choice(text, content, calls, "none", TOOLS) == (text, [])
    assert apply_tool_choice(text, content, calls, "auto", (TIME,)) == (text, [])
    assert apply_tool_choice(text, content, calls, "auto", ()) == (text, [])
    assert apply_tool_choice("plain", "plain", [], "required", TOOLS) == ("plain", [])  # nothing is forced
    assert parse_reply(text, tools=TOOLS, tool_choice="auto", ids=CallIds(0)) == ("Sure.", calls)
    assert parse_reply(text, tools=(TIME,), tool_choice="auto", ids=CallIds(0)) == (text, [])


@pytest.mark.parametrize(
    "text, prefix",
    [
        ("Hello", "Hello"),
        ("Hello\n", "Hello"),
        ("Hello <tool", "Hello"),
        ("Hello <", "Hello"),
        ("a < b", "a < b"),
        ("a<b", "a<b"),
        ('Let me check.\n<tool_call>\n{"name"', "Let me check."),
        ("<tool_call>", ""),
    ],
)
def test_the_streamable_prefix(text, prefix):
    assert text[: streamable_prefix(text)] == prefix


def test_streamed_content_is_a_prefix_of_the_final_content():
    good = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    bad = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": "Oslo"}</tool_call>'
    unknown = 'Let me check.\n<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    for text in (good, bad, unknown, "Plain text \n"):
        content, _ = parse_reply(text, tools=TOOLS, tool_choice="auto", ids=CallIds(0))
        for end in range(len(text) + 1):
            assert content.startswith(text[: streamable_prefix(text[:end])]), (text, end)


# ---------------------------------------------------------------- into the template
def test_openai_messages_become_template_messages():
    raw = [
        {"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        *CHAT[1:],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call(3, "f", {}), "function": {"name": "f", "arguments": ""}}],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
        {"role": "assistant", "tool_calls": [{**call(4, "f", {}), "function": {"name": "f", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "call_4", "content": "?"},
        {"role": "user", "content": "thanks", "name": "ann"},
    ]

    def tc(i, name, arguments):
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}

    assert to_template_messages(raw) == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "Weather and time in Zürich?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [tc(1, "get_weather", {"city": "Zürich"}), tc(2, "get_time", {})],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2", "name": "get_time"},
        {"role": "assistant", "content": "", "tool_calls": [tc(3, "f", {})]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_3", "name": "f"},
        {"role": "assistant", "content": "", "tool_calls": [tc(4, "f", "[1]")]},
        {"role": "tool", "content": "?", "tool_call_id": "call_4", "name": "f"},
        {"role": "user", "content": "thanks", "name": "ann"},
    ]
    parsed = (Message("user", "hi"), Message("assistant", None, (ToolCall("c", "f", "{}"),)))
    assert to_template_messages(parsed) == to_template_messages([{"role": "user", "content": "hi"}, parsed[1]])
    with pytest.raises(RequestError) as info:
        to_template_messages([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "?"}])
    assert info.value.param == "messages[1].tool_call_id"


def test_template_kwargs():
    assert template_kwargs([]) == {}
    weather = {"name": "get_weather", "description": "The weather of a city", "parameters": WEATHER.parameters}
    expected = {
        "tools": [{"type": "function", "function": weather}, {"type": "function", "function": {"name": "get_time"}}]
    }
    assert template_kwargs(TOOLS) == expected
    assert template_kwargs([t.to_dict() for t in TOOLS]) == expected
    with pytest.raises(RequestError) as info:
        template_kwargs([{"type": "function", "function": {"name": "bad name"}}])
    assert info.value.param == "tools[0].function.name"


# ---------------------------------------------------------------- the built-in template
def test_without_tools_the_template_renders_what_chatml_renders():
    chatml = tokenizer(CHATML_TEMPLATE)
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}],
    ]
    for chat in chats:
        for generation in (False, True):
            assert render(chat, generation=generation) == render(chat, tok=chatml, generation=generation)


def test_the_full_rendering_with_tools():
    text = render(CHAT, TOOLS, generation=True)
    tools_json = "\n".join(json.dumps(t.to_dict(), ensure_ascii=False) for t in TOOLS)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call functions to help with the request. "
        "Their signatures are inside <tools></tools>, one JSON object per line:\n<tools>\n"
        f"{tools_json}\n</tools>\n\nTo call a function, answer with one block per call, each holding the name of the "
        'function and its arguments as a JSON object:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<arguments-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather and time in Zürich?<|im_end|>\n"
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>tool\nnoon<|im_end|>\n<|im_start|>assistant\n"
    )
    no_system = render(CHAT[1:2], TOOLS)
    assert no_system.startswith("<|im_start|>system\n# Tools\n\n") and no_system.count("<|im_start|>system") == 1
    assert TOK.decode(TOK.encode(text, add_special_tokens=False)) == text  # byte-exact through the tokenizer


@pytest.mark.parametrize("content", ["Let me check.", None, ""])
def test_a_rendered_call_parses_back_to_the_same_calls(content):
    calls = [call(1, "get_weather", {"city": "Zürich", "when": ["today", 1.5, None]}), call(2, "get_time", {})]
    chat = [*CHAT[:2], {"role": "assistant", "content": content, "tool_calls": calls}]
    (body,) = assistant_turns(render(chat, TOOLS))
    got_content, got = parse_tool_calls(body, ids=CallIds(0))
    assert got_content == (content or None)
    assert [(c.name, json.loads(c.arguments)) for c in got] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]
    assert [c.arguments for c in got] == [
        json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False) for c in calls
    ]


def test_a_sampled_reply_rerenders_to_the_same_text():
    """A reply parsed from the policy's text and sent back by the client renders to the text
    the policy sampled (for replies in the template's own layout)."""
    sampled = (
        'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_reply(sampled, tools=TOOLS, tool_choice="auto", ids=CallIds(0))
    reply = {"role": "assistant", "content": content, "tool_calls": [c.to_dict() for c in calls]}
    assert assistant_turns(render([*CHAT[:2], reply], TOOLS)) == [sampled]


def test_chat_format_accepts_the_template():
    chat = ChatFormat(TOK)
    assert chat.end_of_turn_text == "<|im_end|>"
    assert chat.stop_token_ids == (TOK.convert_tokens_to_ids("<|im_end|>"), TOK.eos_token_id)
    tool_obs = ChatFormat(TOK, observation_role="tool")
    assert (
        tool_obs.observation_text("sunny", after_end_of_turn=True)
        == "\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    )
    # segment by segment equals the whole chat rendered at once
    text = chat.prompt_text("Be brief.", "Weather?") + "Let me check.<|im_end|>"
    text += tool_obs.observation_text("sunny", after_end_of_turn=True) + "Sunny.<|im_end|>"
    whole = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert text + "\n" == TOK.apply_chat_template(whole, tokenize=False)


def test_a_qwen_style_template():
    qwen = tokenizer(QWEN_STYLE)
    text = render(CHAT, TOOLS, tok=qwen, generation=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "get_weather"' in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>"
        in text
    )
    (body,) = assistant_turns(text)
    assert body.startswith("Let me check.\n<tool_call>\n")
    content, calls = parse_tool_calls(body, ids=CallIds(0))
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    # a sampled Qwen-style reply (the generation prompt ends with "\n") parses and re-renders the same
    sampled = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    content, calls = parse_reply(sampled, tools=TOOLS, tool_choice="auto", ids=CallIds(0))
    reply = {"role": "assistant", "content": content, "tool_calls": [c.to_dict() for c in calls]}
    assert assistant_turns(render([*CHAT[:2], reply], TOOLS, tok=qwen)) == [sampled]
