"""The run config's `model:` section: the policy's architecture or checkpoint, its
tokenizer, dtypes and LoRA (`ModelSection`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from jaxagent.dataclass_yaml import Bound, Bounded
from jaxagent.models import LoraConfig

MODEL_TYPES = ("qwen2", "llama", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelSection(Bounded):
    """The policy: a checkpoint (`path`) or a small decoder trained from scratch.

    path: a Hugging Face directory, a `.gguf` file or a packaged model name
      (`jaxagent.models.load_pretrained`); None = from scratch with the fields below.
    tokenizer: "byte" (the in-memory byte-level ChatML tokenizer of
      `jaxagent.models.byte_tokenizer`), "bpe" (a byte-level BPE of `tokenizer_vocab_size`
      tokens trained on the env's text, `jaxagent.models.tokenizer_training.train_bpe_tokenizer`:
      the warm-start demonstrations, or noise-free expert episodes when there is no
      warm start; saved in `<run_dir>/tokenizer/` and reloaded from there on resume),
      a path for `load_tokenizer`, or None (= "byte" from scratch, the checkpoint's own
      tokenizer with `path`).
    tokenizer_vocab_size: vocabulary of the "bpe" tokenizer (bytes + specials + merges).
    tokenizer_pieces: what the "bpe" tokenizer's merges may not cross: "words" (a space
      or line break), "lines" (a line break only: a sentence the env's text repeats,
      such as a scripted question, can become one token) or "phrases" ("words", plus each
      line the text repeats at least 8 times as one token: questions and fixed lines are
      one token, varying text stays in words that recur). With "lines" and "phrases" the
      system prompt counts once per demonstration, so a fixed prompt becomes few tokens.
    hidden_size ... model_type: the from-scratch architecture (vocab = the tokenizer's).
    init_std: std of the from-scratch initialisation.
    dtype: "float32" or "bfloat16": the parameters' storage, so the dtype of the
      optimizer state and of the updates.
    compute_dtype: the dtype the forward passes run in (the update's, the log-prob
      passes', the critic's and the sampler's): null = `dtype`. `dtype: float32` with
      `compute_dtype: bfloat16` is mixed precision: float32 master weights and AdamW state,
      every pass in bfloat16 on a cast copy (gradients reach the float32 masters through
      the cast; log-probs, losses and the softmax stay float32), so small updates are
      not rounded away as they are with bfloat16 weights.
    remat: recompute activations in the backward pass instead of keeping them: False,
      True / "full" (keep each layer's input only), "dots" (keep the matmul outputs).
      Less memory for the update (see the memory estimate), the same gradients.
    lora: low-rank adapters `{rank, alpha, targets}` (`jaxagent.models.LoraConfig`) on the
      policy; only they are trained (optimizer state for the adapters only), and the KL
      reference shares the frozen base weights with the policy (a copy of the adapters
      alone). None = train every weight.
    matmul_precision: the precision of float32 matmuls (`jax_default_matmul_precision`):
      "auto" = "highest" where the run computes in float32 on a GPU or TPU (whose default
      passes run float32 matmuls in TF32 or bfloat16, so results would drift from the
      CPU's without a word) and JAX's default elsewhere; "default", "high" or "highest"
      choose it. bfloat16 compute (`compute_dtype`) is unaffected.
    attention: the attention implementation of training, the log-prob passes and the
      sampler's prefill (`jaxagent.models.attention`): "auto" (cuDNN's fused attention on
      a GPU in bfloat16, else the dense scores while one layer's take at most 256 MiB and
      the blocked, flash-style version beyond), "dense", "blocked" or "cudnn".
    """

    path: str | None = None
    tokenizer: str | None = None
    tokenizer_vocab_size: Annotated[int, Bound(ge=259)] = 512
    tokenizer_pieces: str = "words"
    hidden_size: Annotated[int, Bound(ge=1)] = 32
    intermediate_size: Annotated[int, Bound(ge=1)] = 64
    num_layers: Annotated[int, Bound(ge=1)] = 2
    num_heads: Annotated[int, Bound(ge=1)] = 4
    num_kv_heads: Annotated[int, Bound(ge=1)] = 2
    head_dim: Annotated[int, Bound(ge=1)] = 8
    qkv_bias: bool = True
    tie_word_embeddings: bool = False
    model_type: str = "qwen2"
    init_std: Annotated[float, Bound(gt=0)] = 0.02
    dtype: str = "float32"
    compute_dtype: str | None = None
    remat: bool | str = False
    lora: LoraConfig | None = None
    matmul_precision: str = "auto"
    attention: str = "auto"

    def __post_init__(self):
        from jaxagent.models.attention import IMPLEMENTATIONS

        super().__post_init__()
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}, got {self.attention!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {self.matmul_precision!r}"
            )
        if self.remat not in (False, True, "full", "dots"):
            raise ValueError(f"remat must be false, true, 'full' or 'dots', got {self.remat!r}")
        if self.tokenizer_pieces not in ("words", "lines", "phrases"):
            raise ValueError(f"tokenizer_pieces must be 'words', 'lines' or 'phrases', got {self.tokenizer_pieces!r}")
        if self.tokenizer == "bpe" and self.path is not None:
            raise ValueError(
                "tokenizer 'bpe' is for models trained from scratch; a checkpoint (path) brings its own tokenizer"
            )
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {list(MODEL_TYPES)}, got {self.model_type!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be null, 'float32' or 'bfloat16', got {self.compute_dtype!r}")

    def resolved_matmul_precision(self, platform: str) -> str | None:
        """The matmul precision a run sets on `platform` ("cpu", "gpu", "tpu"; None: JAX's
        default, left as it is): `matmul_precision` resolved (its docstring)."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        float32 = (self.compute_dtype or self.dtype) == "float32"
        return "highest" if float32 and platform != "cpu" else None


#: `ModelSection.matmul_precision`'s values
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")
