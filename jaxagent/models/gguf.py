"""GGUF files (llama.cpp's format) into the same `Model`, dequantised to float.

Reads tensors and metadata with the `gguf` package; quantised blocks (Q4_0, Q4_1,
Q8_0, K-quants ...) are dequantised with `gguf.quants.dequantize` to float32, then
cast to the requested dtype. A dequantised GGUF tensor is `[out, in]` like an HF
`Linear` weight.

RoPE layout: llama.cpp's HF->GGUF converter reorders the rows of the Q and K
projections of llama-architecture models (it stores rope as interleaved pairs,
HF as two halves). Within each head, HF row `r = s * hd/2 + i` (`s` in {0, 1},
`i < hd/2`) is stored at row `2 i + s`:

    gguf = hf.reshape(n, 2, hd/2, D).swapaxes(1, 2).reshape(n * hd, D)

so loading undoes it with `reshape(n, hd/2, 2, D).swapaxes(1, 2)` (`n` = heads for Q,
kv heads for K). Qwen2/Qwen3 GGUFs keep the HF order (no permutation).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxagent.models.config import DecoderConfig, UnsupportedArchitectureError
from jaxagent.models.hf import CheckpointError, check_tensor_shapes, params_from_hf_tensors
from jaxagent.models.model import Model

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name of a GGUF tensor name (None if it has no HF counterpart)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _BLOCK:
            return f"model.layers.{idx}.{_BLOCK[rest]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row reordering (see the module docstring)."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> DecoderConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedArchitectureError("GGUF rope scaling (rope_freqs / rope.scaling.*) is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    attn_bias = "blk.0.attn_output.bias" in names
    return DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2" or attn_bias,
        o_bias=attn_bias,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 32768)),
        model_type=arch,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def open_gguf(path):
    """`gguf.GGUFReader` of `path`; a file that is not GGUF (wrong magic), is cut short or
    garbled is a `CheckpointError` naming it."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"{path}: not a GGUF file (its first bytes are {magic!r}, a GGUF file starts with b'GGUF')"
        )
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - struct/numpy errors of a truncated or garbled file
        raise CheckpointError(
            f"{path}: cannot read GGUF file of {path.stat().st_size} bytes (truncated or "
            f"garbled?): {type(err).__name__}: {err}"
        ) from None


def load_gguf(path: str | os.PathLike, dtype="float32") -> Model:
    """A `Model` from a GGUF file; its tokenizer: `jaxagent.models.load_tokenizer(path)`."""
    from gguf.quants import dequantize

    path = Path(path)
    reader = open_gguf(path)
    config = gguf_config(reader)
    arch = config.model_type
    tensors: dict[str, np.ndarray] = {}
    unknown = []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope_rows(w, config.num_heads)
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        tensors[name] = w
    if unknown:
        raise UnsupportedArchitectureError(f"{path}: GGUF tensors this loader does not know: {sorted(unknown)}")
    check_tensor_shapes({k: v.shape for k, v in tensors.items()}, config, str(path))
    return Model(params=params_from_hf_tensors(tensors, config, dtype), config=config)
