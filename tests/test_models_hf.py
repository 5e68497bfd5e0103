"""Decoder parity with Hugging Face transformers (PyTorch CPU) and checkpoint I/O.

References are HF models with random weights; nothing here compares the code under
test with itself.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from jaxagent import models as M  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "smollm2"]
V = 256


def tiny_hf_config(family: str):
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if family == "llama":  # Llama 3.1-style rope scaling, untied
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if family == "smollm2":  # Llama architecture, tied embeddings, rope theta 1e5
        return transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True
        )
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":  # head_dim decoupled from hidden / heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    raise ValueError(family)


def randomize_(hf_model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (HF model, saved dir)."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        m = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(fam)).eval()
        randomize_(m, i)
        d = tmp_path_factory.mktemp(f"hf_{fam}")
        m.save_pretrained(str(d))
        out[fam] = (m, d)
    return out


@pytest.fixture(scope="module")
def jax_models(hf_models):
    return {fam: M.load_pretrained(d) for fam, (_, d) in hf_models.items()}


def hf_logits(hf_model, tokens, mask=None, positions=None):
    kw = {}
    if mask is not None:
        kw["attention_mask"] = torch.tensor(np.asarray(mask), dtype=torch.long)
    if positions is not None:
        kw["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long), **kw).logits.float().numpy()


def left_padded_batch(seed=0, B=4, T=16):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, V, (B, T))
    lengths = np.array([T, T - 5, T - 11, 3])[:B]
    mask = (np.arange(T)[None, :] >= (T - lengths)[:, None]).astype(np.int64)
    tokens = np.where(mask > 0, tokens, 0)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


_forward = jax.jit(M.forward, static_argnums=1, static_argnames=("remat",))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_left_padded(family, hf_models, jax_models):
    hf, _ = hf_models[family]
    model = jax_models[family]
    tokens, mask, positions = left_padded_batch()
    ref = hf_logits(hf, tokens, mask, positions)
    out = np.asarray(
        _forward(model.params, model.config, jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask))
    )
    assert out.shape == ref.shape == (4, 16, V)
    real = mask.astype(bool)
    assert np.max(np.abs(out[real] - ref[real])) <= 1e-4
    assert np.all(np.isfinite(out))


def test_logits_match_hf_right_padded_and_call(hf_models, jax_models):
    hf, _ = hf_models["qwen2"]
    tokens, mask, _ = left_padded_batch(seed=1)
    mask = mask[:, ::-1].copy()
    tokens = tokens[:, ::-1].copy()
    ref = hf_logits(hf, tokens, mask)  # right padding: HF default positions 0..T-1 agree with ours
    out = np.asarray(jax_models["qwen2"](jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.max(np.abs(out[real] - ref[real])) <= 1e-4


def test_packed_segments_match_separate_sequences(hf_models, jax_models):
    hf, _ = hf_models["qwen3"]
    model = jax_models["qwen3"]
    rng = np.random.RandomState(2)
    a, b = rng.randint(0, V, 6), rng.randint(0, V, 5)
    tokens = np.concatenate([a, b, np.zeros(3, int)])[None]
    seg = np.array([[1] * 6 + [2] * 5 + [0] * 3])
    mask = (seg > 0).astype(np.int32)
    out = np.asarray(
        _forward(
            model.params,
            model.config,
            jnp.asarray(tokens, jnp.int32),
            attention_mask_BxT=jnp.asarray(mask),
            segment_ids_BxT=jnp.asarray(seg),
        )
    )
    ref_a = hf_logits(hf, a[None])[0]
    ref_b = hf_logits(hf, b[None])[0]
    assert np.max(np.abs(out[0, :6] - ref_a)) <= 1e-4
    assert np.max(np.abs(out[0, 6:11] - ref_b)) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kv_cache_prefill_append_decode_equals_full_forward(family, hf_models, jax_models):
    """Left-padded prefill, a right-padded appended chunk, then one-token decodes; each
    row's outputs equal HF's forward over that row's real tokens."""
    hf, _ = hf_models[family]
    model = jax_models[family]
    rng = np.random.RandomState(3)
    tokens, mask, _ = left_padded_batch(seed=3, B=3, T=8)
    chunk = rng.randint(0, V, (3, 4))
    chunk_mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    decode = rng.randint(0, V, (3, 5))

    cache = model.init_cache(batch=3, max_len=24)
    extend = jax.jit(lambda m, t, c, mk: m.extend(t, c, attention_mask_BxT=mk))
    outs, masks = [], []
    for t, mk in [(tokens, mask), (chunk, chunk_mask)] + [
        (decode[:, i : i + 1], np.ones((3, 1), int)) for i in range(5)
    ]:
        logits, cache = extend(model, jnp.asarray(t, jnp.int32), cache, jnp.asarray(mk, jnp.int32))
        outs.append(np.asarray(logits))
        masks.append(mk)
    all_tokens = np.concatenate([tokens, chunk, decode], 1)
    all_mask = np.concatenate(masks, 1).astype(bool)
    all_out = np.concatenate(outs, 1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), all_mask.sum(1))
    for b in range(3):
        real = all_tokens[b][all_mask[b]]
        ref = hf_logits(hf, real[None])[0]
        assert np.max(np.abs(all_out[b][all_mask[b]] - ref)) <= 1e-4


def test_bfloat16_params_close_to_hf_bfloat16(hf_models):
    hf, d = hf_models["qwen2"]
    model = M.load_pretrained(d, dtype="bfloat16")
    assert model.params["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    tokens, mask, positions = left_padded_batch()
    ref32 = hf_logits(hf, tokens, mask, positions)
    out = np.asarray(model(jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert out.dtype == np.float32
    # bf16 has 8 mantissa bits: logits of scale ~1 agree to a few 1e-2 with the fp32 reference.
    assert np.max(np.abs(out[real] - ref32[real])) < 0.1
    assert np.mean(np.argmax(out[real], -1) == np.argmax(ref32[real], -1)) > 0.9


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_match_torch_autograd(remat, hf_models, jax_models):
    hf, _ = hf_models["qwen2"]
    model = jax_models["qwen2"]
    tokens, mask, positions = left_padded_batch(seed=4, B=2, T=10)
    w = np.random.RandomState(5).randn(2, 10, V).astype(np.float32) * mask[:, :, None]

    def loss(params):
        logits = M.forward(
            params, model.config, jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask), remat=remat
        )
        return jnp.sum(logits * w)

    g = jax.jit(jax.grad(loss))(model.params)
    hf.zero_grad()
    out = hf(
        input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
    ).logits
    (out * torch.tensor(w)).sum().backward()
    ref_q = np.stack([hf.model.layers[i].self_attn.q_proj.weight.grad.numpy().T for i in range(2)])
    ref_qb = np.stack([hf.model.layers[i].self_attn.q_proj.bias.grad.numpy() for i in range(2)])
    ref_emb = hf.model.embed_tokens.weight.grad.numpy()
    hf.zero_grad()
    scale = max(1.0, float(np.abs(ref_q).max()))
    assert np.max(np.abs(np.asarray(g["layers"]["q_proj"]["kernel"]) - ref_q)) <= 1e-4 * scale
    assert np.max(np.abs(np.asarray(g["layers"]["q_proj"]["bias"]) - ref_qb)) <= 1e-4 * scale
    assert np.max(np.abs(np.asarray(g["embed"]["embedding"]) - ref_emb)) <= 1e-4 * max(1.0, np.abs(ref_emb).max())


def test_sharded_hf_checkpoint_loads(hf_models, tmp_path):
    hf, _ = hf_models["llama"]
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = M.load_pretrained(tmp_path)
    tokens, mask, positions = left_padded_batch(seed=6)
    ref = hf_logits(hf, tokens, mask, positions)
    out = np.asarray(model(jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask)))
    assert np.max(np.abs(out[mask > 0] - ref[mask > 0])) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_transformers_loads_same_logits(family, tmp_path):
    hf_cfg = tiny_hf_config(family)
    config = M.DecoderConfig.from_hf(
        hf_cfg.to_dict()
        | {
            "architectures": [
                {
                    "llama": "LlamaForCausalLM",
                    "smollm2": "LlamaForCausalLM",
                    "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM",
                }[family]
            ]
        }
    )
    params = M.init_params(jax.random.key(7), config, std=0.05)
    model = M.Model(params=params, config=config)
    out_dir = M.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=60_000 if family == "qwen2" else 10**9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir)).eval()
    tokens, mask, positions = left_padded_batch(seed=8)
    ref = hf_logits(hf, tokens, mask, positions)
    out = np.asarray(model(jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask)))
    assert np.max(np.abs(out[mask > 0] - ref[mask > 0])) <= 1e-4


def test_save_refuses_non_empty_dir_and_leaves_nothing_half_written(jax_models, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("hi")
    with pytest.raises(FileExistsError, match="not empty"):
        M.save_pretrained(jax_models["qwen2"], tmp_path / "x")
    assert sorted(os.listdir(tmp_path / "x")) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["x"]


def _copy_ckpt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = safetensors_numpy.load_file(str(src / "model.safetensors"))
    edit(tensors)
    safetensors_numpy.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_load_errors_name_missing_unexpected_misshaped(hf_models, tmp_path):
    _, src = hf_models["qwen2"]

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
        t["model.layers.0.self_attn.k_proj.bias"] = np.zeros(5, np.float32)

    _copy_ckpt(src, tmp_path / "bad", edit)
    with pytest.raises(M.CheckpointError) as e:
        M.load_pretrained(tmp_path / "bad")
    msg = str(e.value)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors ['model.layers.0.extra.weight in model.safetensors']" in msg
    assert "model.layers.0.self_attn.k_proj.bias in model.safetensors: (5,) (expected (32,))" in msg


def test_unsupported_architecture_lists_supported(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(M.UnsupportedArchitectureError) as e:
        M.load_pretrained(tmp_path)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"):
        assert name in str(e.value)
    with pytest.raises(FileNotFoundError, match="no model at"):
        M.load_pretrained(tmp_path / "nope")


def test_param_axes_cover_every_leaf_with_known_names(jax_models):
    for model in jax_models.values():
        axes = M.param_axes(model.params)
        pairs = jax.tree.leaves(
            jax.tree.map(lambda x, a: (x.ndim, a), model.params, axes, is_leaf=lambda a: isinstance(a, tuple)),
            is_leaf=lambda a: isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], int),
        )
        assert pairs
        for ndim, ax in pairs:
            assert len(ax) == ndim
            assert set(ax) <= {None, "batch", "seq", "embed", "heads", "mlp", "vocab"}


def test_sharded_forward_matches_hf(hf_models, jax_models):
    """Params sharded by their logical axes on a (data=4, tensor=2) mesh: HF's logits."""
    model = jax_models["qwen2"]
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = {"heads": "tensor", "mlp": "tensor", "vocab": None, "embed": None}

    def sharding(ax):
        return jax.NamedSharding(mesh, jax.P(*[rules.get(a) if a else None for a in ax]))

    shardings = jax.tree.map(sharding, M.param_axes(model.params), is_leaf=lambda a: isinstance(a, tuple))
    params = jax.device_put(model.params, shardings)
    assert params["layers"]["gate_proj"]["kernel"].sharding.spec == jax.P(None, None, "tensor")
    tokens, mask, positions = left_padded_batch(seed=9)
    ref = hf_logits(hf_models["qwen2"][0], tokens, mask, positions)
    with jax.set_mesh(mesh):
        out = jax.jit(M.forward, static_argnums=1)(
            params, model.config, jnp.asarray(tokens, jnp.int32), attention_mask_BxT=jnp.asarray(mask)
        )
    assert np.max(np.abs(np.asarray(out)[mask > 0] - ref[mask > 0])) <= 1e-4


def test_hf_dir_tokenizer_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "|"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", chat_template=template
    )
    fast.save_pretrained(str(tmp_path))
    loaded = M.load_tokenizer(tmp_path)
    text = loaded.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False)
    assert text == "user : hello world | "
    assert loaded(text)["input_ids"] == [5, 7, 3, 4, 8]
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        M.load_tokenizer(_empty_dir(tmp_path))


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_sentencepiece_dir_tokenizer_matches_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox jumps over the lazy dog {i} times" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=60,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (tmp_path / "tokenizer.vocab").unlink()
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
            }
        )
    )
    tok = M.load_tokenizer(tmp_path)
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model")).encode("the lazy dog 7")
    ids = [i for i in tok("the lazy dog 7")["input_ids"] if i != tok.bos_token_id]
    assert ids == ref
    assert tok.apply_chat_template([{"role": "user", "content": "the fox"}], tokenize=False) == "[user] the fox\n"


def test_damaged_model_files_are_named(hf_models, tmp_path):
    """A truncated or garbled safetensors file, a garbled config.json or index: the error
    names the file and what is wrong, never a bare library traceback."""
    import shutil

    _, src = hf_models["qwen2"]

    def copy(name):
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    d = copy("truncated")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # the data section cut in half
    with pytest.raises(M.CheckpointError, match=rf"{f}: cannot read"):
        M.load_pretrained(d)
    d = copy("header")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5])  # not even the header length
    with pytest.raises(M.CheckpointError, match=rf"{f}: cannot read safetensors file of 5 bytes \(truncated"):
        M.load_pretrained(d)
    d = copy("garbage")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(M.CheckpointError, match=r"model.safetensors: cannot read safetensors file of 64 bytes"):
        M.load_pretrained(d)
    d = copy("config")
    (d / "config.json").write_text('{"model_type": "qwen2", ')
    with pytest.raises(M.CheckpointError, match=r"config.json: not valid JSON"):
        M.load_pretrained(d)
    d = copy("index")
    (d / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(M.CheckpointError, match=r"model.safetensors.index.json: expected a JSON object"):
        M.load_pretrained(d)


def test_misshaped_tensor_names_its_file(hf_models, tmp_path):
    _, src = hf_models["qwen2"]
    _copy_ckpt(src, tmp_path / "bad", lambda t: t.__setitem__("model.norm.weight", np.zeros(3, np.float32)))
    with pytest.raises(M.CheckpointError, match=r"model.norm.weight in model.safetensors: \(3,\)"):
        M.load_pretrained(tmp_path / "bad")


def test_exported_directory_stops_generate_at_the_end_of_a_turn(tmp_path):
    """With the trainer's ChatML tokenizer, the exported directory names <|im_end|> as EOS
    (config.json and generation_config.json): transformers' `generate` stops there. The
    model is forced (a logits processor) to emit <|im_end|> as its 3rd new token."""
    from jaxagent.models.byte_tokenizer import byte_chat_tokenizer

    tok = byte_chat_tokenizer()
    config = M.tiny_config(vocab_size=len(tok))
    model = M.Model(params=M.init_params(jax.random.key(0), config, std=0.05), config=config)
    out = M.save_pretrained(model, tmp_path / "export", tokenizer=tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = transformers.GenerationConfig.from_pretrained(str(out))
    assert end in (gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.config.eos_token_id is not None

    class ForceEndAt(transformers.LogitsProcessor):
        def __init__(self, start, k):
            self.start, self.k = start, k

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - self.start == self.k - 1:
                scores[:] = -1e9
                scores[:, end] = 0.0
            else:
                scores[:, end] = -1e9  # never earlier
            return scores

    prompt = torch.tensor([tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")])
    out_ids = hf.generate(
        prompt,
        max_new_tokens=20,
        do_sample=False,
        logits_processor=transformers.LogitsProcessorList([ForceEndAt(prompt.shape[1], 3)]),
    )
    new = out_ids[0, prompt.shape[1] :].tolist()
    assert new[-1] == end and len(new) == 3, new  # stopped at the end of the turn, not after 20
