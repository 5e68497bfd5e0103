"""LoRA adapters and the value head, checked against NumPy / PyTorch references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxagent import models as M

CFG = M.DecoderConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
    model_type="qwen2",
)
LORA = M.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def lora_model():
    params = M.init_params(jax.random.key(0), CFG, std=0.1)
    lp, cfg = M.add_lora(jax.random.key(1), params, CFG, LORA)
    # give B non-zero values so the adapters change the output
    layers = {k: dict(v) for k, v in lp["layers"].items()}
    for i, t in enumerate(LORA.targets):
        layers[t]["lora_b"] = 0.1 * jax.random.normal(jax.random.key(10 + i), layers[t]["lora_b"].shape)
    return params, {**lp, "layers": layers}, cfg


def test_lora_shapes_axes_and_fresh_adapter_is_identity(lora_model):
    base, _, _ = lora_model
    lp, cfg = M.add_lora(jax.random.key(1), base, CFG, LORA)
    assert cfg.lora == LORA
    assert lp["layers"]["q_proj"]["lora_a"].shape == (2, 32, 4)
    assert lp["layers"]["q_proj"]["lora_b"].shape == (2, 4, 32)
    assert lp["layers"]["v_proj"]["lora_b"].shape == (2, 4, 16)
    assert lp["layers"]["down_proj"]["lora_a"].shape == (2, 64, 4)
    assert "lora_a" not in lp["layers"]["k_proj"]
    axes = M.param_axes(lp)
    assert axes["layers"]["down_proj"]["lora_a"] == (None, "mlp", None)
    assert axes["layers"]["q_proj"]["lora_b"] == (None, None, "heads")
    # fresh adapters: B = 0 (the model is unchanged), A ~ N(0, 1/in)
    for t in LORA.targets:
        assert not np.any(np.asarray(lp["layers"][t]["lora_b"]))
    a = np.asarray(lp["layers"]["down_proj"]["lora_a"])
    assert abs(a.std() * np.sqrt(64) - 1.0) < 0.15
    for name, p in base["layers"].items():  # base weights untouched
        for leaf, v in p.items():
            np.testing.assert_array_equal(np.asarray(lp["layers"][name][leaf]), np.asarray(v))
    f32 = M.add_lora(jax.random.key(1), M.cast_params(base, "bfloat16"), CFG, LORA, adapter_dtype="float32")[0]
    assert f32["layers"]["q_proj"]["lora_a"].dtype == jnp.float32
    assert f32["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def test_lora_projection_matches_numpy(lora_model):
    """One adapted projection: x W + b + (alpha/r) (x A) B, in float64 NumPy."""
    _, lp, cfg = lora_model
    from jaxagent.models.decoder import _proj

    p = jax.tree.map(lambda x: x[0], lp["layers"]["q_proj"])
    x = np.random.RandomState(0).randn(3, 32).astype(np.float32)
    out = np.asarray(_proj(p, jnp.asarray(x), cfg))
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    ref = x @ P["kernel"] + P["bias"] + (8.0 / 4) * (x @ P["lora_a"]) @ P["lora_b"]
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_merge_equals_unmerged_forward(lora_model):
    base, lp, cfg = lora_model
    merged, mcfg = M.merge_lora(lp, cfg)
    assert mcfg.lora is None and not M.has_lora(merged)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 128)
    out = np.asarray(M.forward(lp, cfg, tokens))
    assert np.max(np.abs(out - np.asarray(M.forward(base, CFG, tokens)))) > 1e-3  # adapters matter
    np.testing.assert_allclose(np.asarray(M.forward(merged, mcfg, tokens)), out, atol=1e-5)
    k = np.asarray(lp["layers"]["v_proj"]["kernel"], np.float64)
    a = np.asarray(lp["layers"]["v_proj"]["lora_a"], np.float64)
    b = np.asarray(lp["layers"]["v_proj"]["lora_b"], np.float64)
    np.testing.assert_allclose(np.asarray(merged["layers"]["v_proj"]["kernel"]), k + 2.0 * a @ b, atol=1e-6)


def test_only_adapters_train_and_optimizer_state_holds_only_them(lora_model):
    _, lp, cfg = lora_model
    tx = M.lora_optimizer(optax.adamw(1e-2), lp)
    state = tx.init(lp)
    adapter_size = sum(
        x.size for p, x in jax.tree_util.tree_flatten_with_path(lp)[0] if p[-1].key in ("lora_a", "lora_b")
    )
    state_size = sum(x.size for x in jax.tree.leaves(state) if hasattr(x, "size"))
    assert state_size == 2 * adapter_size + 1  # adam mu + nu for adapters, one step count
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 128)

    @jax.jit
    def loss(params):
        logp, _ = M.token_logprobs(params, cfg, tokens)
        return -jnp.sum(logp)

    @jax.jit
    def step(params, state):
        g = jax.grad(loss)(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    new, _ = step(lp, state)
    mask = M.trainable_mask(lp)
    changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), lp, new)
    for path, m in jax.tree_util.tree_flatten_with_path(mask)[0]:
        c = changed
        for k in path:
            c = c[k.key]
        assert c == m, path
    assert loss(new) < loss(lp)
    # split / combine: gradients w.r.t. the adapters alone
    adapters, frozen = M.split_lora(lp)
    g = jax.jit(jax.grad(lambda a: loss(M.combine_lora(a, frozen))))(adapters)
    assert {p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(g)[0]} == {"lora_a", "lora_b"}


def test_save_merges_lora(lora_model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, lp, cfg = lora_model
    M.save_pretrained(M.Model(params=lp, config=cfg), tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    tokens = np.random.RandomState(5).randint(0, 128, (2, 6))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(M.forward(lp, cfg, jnp.asarray(tokens))), ref, atol=1e-4)


def test_lora_config_validation():
    with pytest.raises(ValueError, match="targets has unknown"):
        M.LoraConfig(targets=("qkv",))
    with pytest.raises(ValueError, match="rank"):
        M.LoraConfig(rank=0)


def test_value_head_from_policy_matches_numpy(lora_model):
    base, _, _ = lora_model
    vp = M.value_params_from_policy(jax.random.key(6), base, CFG)
    assert "lm_head" not in vp and vp["value_head"]["kernel"].shape == (32,)
    assert vp["value_head"]["bias"].shape == ()
    assert M.param_axes(vp)["value_head"] == {"kernel": ("embed",), "bias": ()}
    # the trunk is the policy's: identical leaves
    assert all(
        np.array_equal(vp["layers"][k][n], base["layers"][k][n]) for k in base["layers"] for n in base["layers"][k]
    )
    tokens = jax.random.randint(jax.random.key(7), (3, 5), 0, 128)
    mask = jnp.asarray([[1] * 5, [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    values = np.asarray(M.value_forward(vp, CFG, tokens, attention_mask_BxT=mask))
    assert values.shape == (3, 5) and values.dtype == np.float32
    h = np.asarray(M.forward_hidden(base, CFG, tokens, attention_mask_BxT=mask), np.float64)
    ref = h @ np.asarray(vp["value_head"]["kernel"], np.float64) + float(vp["value_head"]["bias"])
    np.testing.assert_allclose(values, ref, atol=1e-5)
    fresh = M.init_value_params(jax.random.key(8), CFG)
    assert jax.tree.structure(fresh) == jax.tree.structure(vp)
    g = jax.grad(lambda p: jnp.sum(M.value_forward(p, CFG, tokens)))(fresh)
    # d/dw sum_bt (h_bt . w + b) = sum_bt h_bt, and d/db = the B x T = 15 positions
    h_fresh = np.asarray(M.forward_hidden(fresh, CFG, tokens), np.float64)
    np.testing.assert_allclose(
        np.asarray(g["value_head"]["kernel"], np.float64), h_fresh.sum((0, 1)), rtol=1e-5, atol=1e-5
    )
    assert float(g["value_head"]["bias"]) == 15.0 and np.abs(h_fresh.sum((0, 1))).max() > 1e-3
    with pytest.raises(ValueError, match="value_head"):
        M.value_forward(base, CFG, tokens)
