"""The in-memory byte-level ChatML tokenizers: `jaxagent.models.byte_tokenizer`,
re-exported here (`byte_chat_tokenizer`, `chatml_tokenizer`, `CHATML_TEMPLATE`,
`SPECIAL_TOKENS`)."""

from jaxagent.models.byte_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, byte_chat_tokenizer, chatml_tokenizer

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "byte_chat_tokenizer", "chatml_tokenizer"]
