"""The in-memory byte-level ChatML tokenizers (no files, no downloads).

- `byte_chat_tokenizer()`: a byte-level BPE tokenizer without merges (256 byte tokens
  + `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) with a ChatML chat template, built in
  memory. Every text round-trips exactly, like a real byte-level BPE tokenizer.
- `chatml_tokenizer(tok)`: any `tokenizers.Tokenizer` with those special tokens and the
  ChatML template, as a transformers tokenizer (also used for the trained BPE of
  `jaxagent.models.tokenizer_training`).
"""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_chat_tokenizer():
    """A `transformers.PreTrainedTokenizerFast`: bytes 0..255 -> ids 0..255, specials 256..258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[i]: i for i in range(256)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return chatml_tokenizer(tok)


def chatml_tokenizer(tok):
    """A `tokenizers.Tokenizer` with the ChatML special tokens added, as a
    `transformers.PreTrainedTokenizerFast` with the ChatML chat template."""
    import transformers
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
