"""Tokenizer training: a byte-level BPE trained on an env's text, and saving it.

`train_bpe_tokenizer(texts, vocab_size)`: a byte-level BPE (Hugging Face `tokenizers`
trainer) with the ChatML special tokens and chat template of
`jaxagent.models.byte_tokenizer.byte_chat_tokenizer`. Byte-level means every text
round-trips exactly (what token-in/token-out needs); merges learned on the env's text
make a typical FrozenLake turn several times shorter than bytes, which is what makes CPU
training of the demo fast. The texts are the env's (e.g.
`jaxagent.train.warmstart.demonstration_texts` of expert demonstrations).

`save_tokenizer(tokenizer, directory)`: `save_pretrained`, atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 512, pieces: str = "words"):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts` (see the module docstring).

    `pieces` is what a merge may never cross: "words" (whitespace-led words: a map cell or
    a move is always its own token) or "lines" (line breaks only: merges may join words,
    so a sentence the env's text repeats, such as a scripted question, can become one
    token). "phrases" is "words" plus every line the corpus repeats at least
    `PHRASE_MIN_COUNT` times as one token of its own (`frequent_lines`, at most half the
    vocabulary): scripted questions, assessment lines and fixed prompts are one token each,
    while text that varies (a patient's reply with the case's details) stays in words that
    recur across cases."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxagent.models.byte_tokenizer import SPECIAL_TOKENS, chatml_tokenizer

    if not isinstance(vocab_size, int) or vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be an int >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size!r}"
        )
    if pieces not in TOKENIZER_PIECES:
        raise ValueError(f"pieces must be one of {', '.join(TOKENIZER_PIECES)}, got {pieces!r}")
    if not texts:
        raise ValueError("train_bpe_tokenizer: no text to train on")
    phrases = frequent_lines(texts, (vocab_size - 256 - len(SPECIAL_TOKENS)) // 2) if pieces == "phrases" else []
    tok = Tokenizer(models.BPE(fuse_unk=False))
    # "words": pieces are whitespace-led words: merges never cross a space or line break,
    # so a map cell or a move is always its own token, while "<action>right</action>" can
    # become one. "lines": a piece is a line (or a run of line breaks)
    split = r"\n+|[^\n]+" if pieces == "lines" else r"\s*\S+|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(phrases),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    if phrases:  # matched before the word split: a repeated line is always one token
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in phrases])
    return chatml_tokenizer(tok)


def frequent_lines(texts: Sequence[str], limit: int, min_count: int | None = None) -> list[str]:
    """The lines (without their line break) that occur at least `min_count` times in
    `texts`, most frequent first (ties in text order), at most `limit` of them; lines of
    fewer than 4 characters are left to the BPE merges."""
    import collections

    min_count = PHRASE_MIN_COUNT if min_count is None else min_count
    counts = collections.Counter(line for t in texts for line in t.split("\n") if len(line.strip()) >= 4)
    ranked = sorted((line for line, c in counts.items() if c >= min_count), key=lambda line: (-counts[line], line))
    return ranked[:limit]


#: what a BPE merge may not cross (`train_bpe_tokenizer`'s `pieces`)
TOKENIZER_PIECES = ("words", "lines", "phrases")
#: "phrases": a line that occurs this often in the corpus becomes one token
PHRASE_MIN_COUNT = 8


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    """`tokenizer.save_pretrained` into a temporary sibling, then renamed (atomic)."""
    import shutil

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tokenizer.save_pretrained(str(tmp))
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory
