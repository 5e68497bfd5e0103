"""ChatFormat: segment-by-segment tokenization equals rendering the whole chat at once.

For templates that render history verbatim, prompt + action + observation segments
concatenated must be exactly the template's rendering of the full conversation; this is
checked on ChatML, a Llama-3-style template, and a template with no special
end-of-turn token.
"""

import pytest

from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout import ChatFormat, ChatTemplateError

LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def tokenizer(template, extra=()):
    from tokenizers import AddedToken

    tok = byte_chat_tokenizer()
    if extra:
        tok.add_special_tokens(
            {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in extra]}
        )
    tok.chat_template = template
    return tok


CASES = {
    "chatml": (tokenizer(byte_chat_tokenizer().chat_template), "<|im_end|>"),
    "llama3": (
        tokenizer(LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
        "<|eot_id|>",
    ),
    "plain": (tokenizer(PLAIN), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("ends_with_eot", [True, False])
def test_segments_concatenate_to_the_full_rendering(name, ends_with_eot):
    tok, eot = CASES[name]
    chat = ChatFormat(tok)
    assert chat.end_of_turn_text == eot
    if eot is not None:
        assert chat.stop_token_ids[0] == tok.convert_tokens_to_ids(eot)
    assert tok.eos_token_id in chat.stop_token_ids
    system, obs = "Play well.", ["You see a door.", "The door is open: <b>ok</b>.", "Done?"]
    actions = ["open door", "go north ü"]
    text = chat.prompt_text(system, obs[0])
    for k, act in enumerate(actions):
        # a turn ended by the end-of-turn token carries it as its last policy token
        text += act + (eot if (ends_with_eot and eot) else "")
        text += chat.observation_text(obs[k + 1], after_end_of_turn=bool(ends_with_eot and eot))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": obs[0]}]
    for k, act in enumerate(actions):
        msgs += [{"role": "assistant", "content": act}, {"role": "user", "content": obs[k + 1]}]
    assert text == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # tokens: each segment's own tokenization; the byte tokenizer makes it the text's bytes
    seg = chat.observation_tokens(obs[1], after_end_of_turn=False)
    assert seg == tok.encode(chat.observation_text(obs[1], False), add_special_tokens=False)
    assert chat.action_text(tok.encode(actions[1]) + list(chat.stop_token_ids[:1])) == actions[1]


def test_message_observations_and_errors():
    tok, _ = CASES["chatml"]
    chat = ChatFormat(tok, observation_role="tool")
    assert chat.observation_text("42", True) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    two = [{"role": "tool", "content": "42"}, {"role": "user", "content": "next?"}]
    assert chat.observation_text(two, False) == (
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>user\nnext?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(TypeError, match="observation"):
        chat.observation_text(42, False)
    bare = byte_chat_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat(bare)
