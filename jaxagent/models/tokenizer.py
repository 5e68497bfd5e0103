"""Tokenizers through transformers, with the model's chat template.

`load_tokenizer(path)`:
  * an HF directory: `transformers.AutoTokenizer` (`tokenizer.json` or a sentencepiece
    `tokenizer.model`), local files only; except that a directory whose
    `tokenizer_config.json` declares the generic fast class (`TokenizersBackend` or
    `PreTrainedTokenizerFast`, as `jaxagent export` writes) is loaded as exactly its
    `tokenizer.json`: transformers' AutoTokenizer maps some model types (qwen2 among
    them) to a class that replaces the file's normaliser and pre-tokenizer with its own,
    which re-splits the text of a tokenizer trained with other pieces;
  * a `.gguf` file (or a packaged model name): a byte-level BPE
    `PreTrainedTokenizerFast` rebuilt from the GGUF metadata (`tokenizer.ggml.tokens`,
    `merges`, `token_type`, special ids, `pre` and `tokenizer.chat_template`).
"""

from __future__ import annotations

import os

from jaxagent.models.config import UnsupportedArchitectureError

# llama.cpp's `tokenizer.ggml.pre` names -> the split regex before byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_GGUF_PRETOKENIZERS = ("default", "gpt2", "smollm", "starcoder", "llama-bpe", "qwen2")

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer for a model directory, a `.gguf` file or a packaged model name."""
    from jaxagent.models.hf import resolve_model_path

    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        return gguf_tokenizer(p)
    import transformers

    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{p} has no tokenizer.json, tokenizer.model or vocab.json")
    if (p / "tokenizer.json").exists() and declared_tokenizer_class(p) in GENERIC_FAST_CLASSES:
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)


#: the tokenizer classes that mean "exactly the pipeline of tokenizer.json"
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declared_tokenizer_class(path) -> str | None:
    """The `tokenizer_class` a directory's `tokenizer_config.json` declares (None without one)."""
    import json
    from pathlib import Path

    f = Path(path) / "tokenizer_config.json"
    if not f.exists():
        return None
    try:
        value = json.loads(f.read_text()).get("tokenizer_class")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{f} is not a JSON object: {e}") from None
    return value if isinstance(value, str) else None


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if regex is None:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {list(SUPPORTED_GGUF_PRETOKENIZERS)}"
        )
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level])


def gguf_tokenizer(path: str | os.PathLike):
    """`PreTrainedTokenizerFast` from a GGUF file's `tokenizer.*` metadata."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    from jaxagent.models.gguf import open_gguf

    reader = open_gguf(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitectureError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: ['gpt2'] (byte-level BPE)"
        )
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def tok_str(key):
        i = field(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = tok_str("tokenizer.ggml.bos_token_id")
    if field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=tok_str("tokenizer.ggml.eos_token_id"),
        unk_token=tok_str("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_str("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
