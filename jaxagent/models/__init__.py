"""Decoder models: Llama 3.x / SmolLM2 / Qwen2 / Qwen3, value head, LoRA, HF + GGUF I/O.

Pure functions over a params pytree (`decoder`, `logprobs`, `value`, `lora`), a
`Model` pytree that bundles params with their static config, and host-side loading
(`hf`, `gguf`, `tokenizer`), the in-memory ChatML tokenizers (`byte_tokenizer`) and
tokenizer training (`tokenizer_training`: a byte-level BPE trained on an env's text).
Logical axis names of every parameter: `param_axes(params)`.
"""

from jaxagent.models.byte_tokenizer import byte_chat_tokenizer, chatml_tokenizer
from jaxagent.models.config import (
    LORA_TARGETS,
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    LoraConfig,
    UnsupportedArchitectureError,
    tiny_config,
)
from jaxagent.models.decoder import (
    ACTIVATION_AXES,
    KVCache,
    cast_params,
    default_positions,
    forward,
    forward_cached,
    forward_hidden,
    init_cache,
    init_params,
    lm_head_kernel,
    logits_from_hidden,
    make_attention_mask,
    param_axes,
)
from jaxagent.models.hf import (
    PACKAGED_MODELS,
    CheckpointError,
    load_pretrained,
    packaged_model_path,
    save_pretrained,
)
from jaxagent.models.logprobs import (
    chunked_logprobs_and_entropy,
    plain_logprobs_and_entropy,
    token_logprobs,
)
from jaxagent.models.lora import (
    add_lora,
    combine_lora,
    has_lora,
    lora_optimizer,
    merge_lora,
    split_lora,
    trainable_labels,
    trainable_mask,
)
from jaxagent.models.model import Model
from jaxagent.models.tokenizer import load_tokenizer
from jaxagent.models.tokenizer_training import save_tokenizer, train_bpe_tokenizer
from jaxagent.models.value import init_value_params, value_forward, value_params_from_policy

__all__ = [
    "ACTIVATION_AXES",
    "KVCache",
    "LORA_TARGETS",
    "PACKAGED_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "DecoderConfig",
    "LoraConfig",
    "Model",
    "UnsupportedArchitectureError",
    "add_lora",
    "byte_chat_tokenizer",
    "cast_params",
    "chatml_tokenizer",
    "chunked_logprobs_and_entropy",
    "combine_lora",
    "default_positions",
    "forward",
    "forward_cached",
    "forward_hidden",
    "has_lora",
    "init_cache",
    "init_params",
    "init_value_params",
    "lm_head_kernel",
    "load_pretrained",
    "load_tokenizer",
    "logits_from_hidden",
    "lora_optimizer",
    "make_attention_mask",
    "merge_lora",
    "packaged_model_path",
    "param_axes",
    "plain_logprobs_and_entropy",
    "save_pretrained",
    "save_tokenizer",
    "split_lora",
    "tiny_config",
    "token_logprobs",
    "train_bpe_tokenizer",
    "trainable_labels",
    "trainable_mask",
    "value_forward",
    "value_params_from_policy",
]
