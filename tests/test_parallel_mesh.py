"""Sharded training on the 8 virtual CPU devices: meshes, the logical-axis rules, the
sharded update (equal to the single-device one, compiled once) and the memory estimate.

Tolerance of sharded vs single-device results: rtol 1e-5, atol 1e-6. The two compute
the same float32 sums in a different order (per-shard partial sums, then a cross-device
reduction), so results agree to float32 rounding (~1e-7 relative per operation, a few
hundred operations deep), not bitwise. AdamW's first steps are close to `lr * sign(g)`,
which would turn a rounding-level difference in a near-zero gradient into a full
`2 lr` difference, so the optimizer uses `eps = 1e-3` (the update is then Lipschitz in
`g` and the comparison tests the sharded reductions, not sign noise).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_testlib import host

from jaxagent import models as M
from jaxagent import parallel as par
from jaxagent.train import memory as train_memory
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.update import make_update_step, sft_step, train_step
from jaxagent.train.update.batch import SFTBatch, UpdateBatch
from jaxagent.train.update.losses import critic_values
from jaxagent.train.update.state import init_train_state

# vocab 66: divisible by tensor=2 but not by tensor=4, so the 1x2x4 mesh exercises the
# replicated fallback inside a real step (embedding rows / lm_head columns unsplit).
CFG = M.DecoderConfig(
    vocab_size=66,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    model_type="llama",
)
B, T = 16, 10
STEP = StepConfig(
    loss=LossConfig(kl_coef=0.1, entropy_coef=0.01),
    optim=OptimizerConfig(lr=1e-3, eps=1e-3, weight_decay=0.01),
    num_micro_batches=2,
)
RTOL, ATOL = 1e-5, 1e-6
N_STEPS = 3


def make_params(seed=0):
    return M.init_params(jax.random.key(seed), CFG, std=0.2)


def make_batch(seed, critic=False, B=B):
    r = np.random.RandomState(seed)
    old = (-4.2 + 0.3 * r.randn(B, T)).astype(np.float32)
    mask = (r.rand(B, T) < 0.6).astype(np.float32)
    mask[:, 0] = 0.0
    mask[3] = 0.0  # a row with no policy token
    f = dict(
        tokens=r.randint(0, CFG.vocab_size, (B, T)).astype(np.int32),
        loss_mask=mask,
        advantages=r.randn(B, T).astype(np.float32),
        old_logp=old,
        ref_logp=(old + 0.2 * r.randn(B, T)).astype(np.float32),
        attention_mask=np.ones((B, T), np.int32),
    )
    f["attention_mask"][5, -3:] = 0
    f["loss_mask"][5, -3:] = 0.0
    if critic:
        f["returns"] = r.randn(B, T).astype(np.float32)
        f["old_values"] = (0.1 * r.randn(B, T)).astype(np.float32)
    return UpdateBatch(**{k: jnp.asarray(v) for k, v in f.items()})


def need_8():
    if len(jax.devices()) != 8:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")


class CompileCounter:
    """Counts XLA compilations of functions whose name contains `name` (jax.monitoring)."""

    def __init__(self, name):
        self.name, self.count = name, 0

    def __call__(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and self.name in kw.get("fun_name", ""):
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def run_single_device(state, batches, step_fn, cfg):
    metrics = []
    for b in batches:
        state, m = step_fn(state, b, cfg)
        metrics.append(host(m))
    return host(state), metrics


def assert_close(got_state, got_metrics, want_state, want_metrics):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(host(got_state)), jax.tree.leaves(want_state), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))
    for i, (g, w) in enumerate(zip(got_metrics, want_metrics, strict=True)):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=RTOL, atol=ATOL, err_msg=f"step {i} {k}")


@pytest.fixture(scope="module")
def reference():
    """The single-device `train_step` over N_STEPS batches (one compilation, shared)."""
    state = init_train_state(jax.random.key(0), make_params(), CFG, STEP)
    batches = [make_batch(10 + i) for i in range(N_STEPS)]
    return batches, run_single_device(state, batches, train_step, STEP)


# ----------------------------------------------------------------------------- the sharded step
MESHES = [
    pytest.param((2, 2, 2), id="2x2x2"),
    pytest.param((1, 2, 4), id="1x2x4", marks=pytest.mark.slow),
    pytest.param((8, 1, 1), id="8x1x1", marks=pytest.mark.slow),
    pytest.param((2, 4, 1), id="2x4x1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_step_equals_single_device_keeps_rule_layout_and_compiles_once(shape, reference):
    need_8()
    batches, (want_state, want_metrics) = reference
    mesh = par.make_mesh(par.MeshConfig(*shape))
    state = par.shard_train_state(init_train_state(jax.random.key(0), make_params(), CFG, STEP), mesh)
    want_specs = par.train_state_specs(state, mesh)
    step = make_update_step(STEP, state, mesh)
    metrics = []
    with CompileCounter("_train_step") as compiles:
        for b in batches:
            state, m = step(state, par.shard_batch(b, mesh))
            metrics.append(host(m))
    assert compiles.count == 1, f"{compiles.count} compilations over {N_STEPS} calls"
    assert_close(state, metrics, want_state, want_metrics)

    # the layout after the steps is exactly the rules' (checked against the table by hand)
    got_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    assert got_specs == want_specs
    data, fsdp, tensor = shape
    F = "fsdp" if fsdp > 1 else None
    Tn = "tensor" if tensor > 1 else None
    vocab = Tn if CFG.vocab_size % tensor == 0 else None  # 66 rows: replicated on tensor=4
    p = got_specs.params
    assert p["embed"]["embedding"] == P(vocab, F)
    assert p["lm_head"]["kernel"] == P(F, vocab)
    assert p["layers"]["q_proj"]["kernel"] == P(None, F, Tn)
    assert p["layers"]["k_proj"]["kernel"] == P(None, F, Tn)
    assert p["layers"]["down_proj"]["kernel"] == P(None, Tn, F)
    assert p["layers"]["input_norm"]["scale"] == P(None, F)
    assert p["final_norm"]["scale"] == P(F)
    # AdamW moments: the params' specs leaf for leaf; counts replicated
    is_adam = lambda x: hasattr(x, "mu") and hasattr(x, "nu")  # noqa: E731
    adam = [x for x in jax.tree.leaves(got_specs.opt_state, is_leaf=is_adam) if is_adam(x)]
    assert len(adam) == 1
    assert adam[0].mu == p and adam[0].nu == p and adam[0].count == P()
    assert got_specs.step == got_specs.skipped == got_specs.rng == P()
    assert all(m.sharding.is_fully_replicated for m in jax.tree.leaves(m))


@pytest.mark.slow
def test_sharded_sft_step_equals_single_device():
    need_8()
    cfg = StepConfig(optim=OptimizerConfig(lr=1e-2, eps=1e-3), num_micro_batches=2)
    batches = [make_batch(30 + i) for i in range(2)]
    batches = [SFTBatch(tokens=b.tokens, loss_mask=b.loss_mask, attention_mask=b.attention_mask) for b in batches]
    want = run_single_device(init_train_state(jax.random.key(0), make_params(), CFG, cfg), batches, sft_step, cfg)
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    state = par.shard_train_state(init_train_state(jax.random.key(0), make_params(), CFG, cfg), mesh)
    step = make_update_step(cfg, state, mesh, kind="sft")
    metrics = []
    for b in batches:
        state, m = step(state, par.shard_batch(b, mesh))
        metrics.append(host(m))
    assert_close(state, metrics, *want)


@pytest.mark.slow
def test_sharded_ppo_step_with_critic_equals_single_device():
    need_8()
    cfg = StepConfig(
        optim=OptimizerConfig(lr=1e-3, eps=1e-3), critic_optim=OptimizerConfig(lr=3e-3, eps=1e-3), num_micro_batches=2
    )
    base = make_params()
    critic = M.value_params_from_policy(jax.random.key(1), base, CFG)
    batches = []
    for i in range(2):
        b = make_batch(40 + i, critic=True)
        batches.append(b.replace(old_values=critic_values(critic, CFG, b), ref_logp=None))

    def fresh():
        return init_train_state(
            jax.random.key(0),
            make_params(),
            CFG,
            cfg,
            critic_params=M.value_params_from_policy(jax.random.key(1), make_params(), CFG),
            critic_config=CFG,
        )

    want = run_single_device(fresh(), batches, train_step, cfg)
    mesh = par.make_mesh(par.MeshConfig(1, 2, 4))
    state = par.shard_train_state(fresh(), mesh)
    assert state.critic_params["value_head"]["kernel"].sharding.spec == P("fsdp")
    step = make_update_step(cfg, state, mesh)
    metrics = []
    for b in batches:
        state, m = step(state, par.shard_batch(b, mesh))
        metrics.append(host(m))
    assert "value_loss" in metrics[0]
    assert_close(state, metrics, *want)


def test_sharded_step_rejects_a_state_not_on_the_rules_layout():
    need_8()
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    state = init_train_state(jax.random.key(0), make_params(), CFG, STEP)
    with pytest.raises(ValueError, match=r"shard_train_state.*|params"):
        make_update_step(STEP, state, mesh)
    other = par.make_mesh(par.MeshConfig(2, 4, 1))
    with pytest.raises(ValueError, match="laid out"):
        make_update_step(STEP, par.shard_train_state(state, other), mesh)


# ----------------------------------------------------------------------------- mesh and rules
def test_mesh_config_validates_and_names_the_field():
    with pytest.raises(ValueError, match="MeshConfig.fsdp"):
        par.MeshConfig(fsdp=0)
    with pytest.raises(ValueError, match="MeshConfig.tensor"):
        par.MeshConfig(tensor=2.0)
    with pytest.raises(ValueError, match="MeshConfig.data"):
        par.MeshConfig(data=True)
    with pytest.raises(ValueError, match="at most one"):
        par.MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match=r"data=2 \* fsdp=2 \* tensor=1 = 4 devices, but 8 are available"):
        par.MeshConfig(2, 2, 1).resolve(8)
    with pytest.raises(ValueError, match="does not divide"):
        par.MeshConfig(data=-1, tensor=3).resolve(8)
    assert par.MeshConfig(data=-1, tensor=2).resolve(8) == par.MeshConfig(4, 1, 2)
    need_8()
    with pytest.raises(ValueError, match="but 8 are available"):
        par.make_mesh(par.MeshConfig(2, 2, 1))
    mesh = par.make_mesh(par.MeshConfig(fsdp=-1))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    sub = par.make_mesh(par.MeshConfig(2, 1, 2), devices=jax.devices()[:4])
    assert sub.devices.size == 4


def test_logical_to_spec_rules_fallback_and_errors():
    sizes = {"data": 2, "fsdp": 2, "tensor": 4}
    assert par.logical_to_spec((None, "embed", "heads"), (2, 32, 32), sizes) == P(None, "fsdp", "tensor")
    # 6 is not divisible by tensor=4: replicated on that dimension, not an error
    assert par.logical_to_spec(("vocab", "embed"), (6, 32), sizes) == P(None, "fsdp")
    assert par.logical_to_spec(("embed",), (3,), sizes) == P(None)
    # batch over (data, fsdp); the longest dividing prefix when the product does not divide
    assert par.logical_to_spec(("batch", "seq"), (8, 5), sizes) == P(("data", "fsdp"), None)
    assert par.logical_to_spec(("batch", "seq"), (6, 5), sizes) == P("data", None)
    # size-1 axes are left out; a mesh axis is used once per array
    assert par.logical_to_spec(("embed", "mlp"), (4, 4), {"data": 8, "fsdp": 1, "tensor": 1}) == P(None, None)
    rules = (("a", "fsdp"), ("b", "fsdp"))
    assert par.logical_to_spec(("a", "b"), (4, 4), sizes, rules) == P("fsdp", None)
    with pytest.raises(ValueError, match="'embd' has no rule"):
        par.logical_to_spec(("embd",), (4,), sizes)
    with pytest.raises(ValueError, match="no axis 'model'"):
        par.logical_to_spec(("x",), (4,), sizes, (("x", "model"),))
    with pytest.raises(ValueError, match="rank-2"):
        par.logical_to_spec(("embed",), (4, 4), sizes)


def test_activation_constraint_gives_the_fsdp_layout():
    """The residual stream ("batch", "seq", "embed") under the same rules: rows over
    (data, fsdp), "embed" whole (fsdp is taken by the rows)."""
    need_8()
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    constrain = par.activation_constraint(mesh)
    out = jax.jit(lambda x: constrain(x * 2.0, M.ACTIVATION_AXES["hidden"]))(jnp.ones((8, 4, 32)))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, None)), 3)
    assert out.addressable_shards[0].data.shape == (2, 4, 32)


def test_every_parameter_name_has_a_rule():
    """LoRA adapters and the value head included: the rules cover param_axes' names."""
    params, _ = M.add_lora(jax.random.key(1), make_params(), CFG, M.LoraConfig(rank=2))
    params = M.value_params_from_policy(jax.random.key(2), params, CFG)
    specs = par.param_specs(params, {"data": 2, "fsdp": 2, "tensor": 2})
    assert specs["layers"]["q_proj"]["lora_a"] == P(None, "fsdp", None)
    assert specs["layers"]["q_proj"]["lora_b"] == P(None, None, "tensor")
    assert specs["value_head"]["bias"] == P()


def test_lora_optimizer_state_follows_the_adapters():
    need_8()
    params, cfg_l = M.add_lora(jax.random.key(1), make_params(), CFG, M.LoraConfig(rank=2))
    state = init_train_state(jax.random.key(0), params, cfg_l, STEP)
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    specs = par.train_state_specs(state, mesh)
    # every adapter moment has its adapter's spec; the frozen leaves have no moments
    param_spec = {
        jax.tree_util.keystr(path): sp
        for path, sp in jax.tree_util.tree_leaves_with_path(specs.params, is_leaf=lambda x: isinstance(x, P))
    }
    checked = 0
    for path, sp in jax.tree_util.tree_leaves_with_path(specs.opt_state, is_leaf=lambda x: isinstance(x, P)):
        key = jax.tree_util.keystr(path)
        if ".mu" in key or ".nu" in key:
            own = key[key.index("['layers']") :]
            assert "lora_" in own and sp == param_spec[own], key
            checked += 1
    assert checked == 2 * 2 * 4  # mu and nu of lora_a and lora_b on q, k, v, o
    assert specs.params["layers"]["o_proj"]["lora_a"] == P(None, "tensor", None)
    sharded = par.shard_train_state(state, mesh)
    assert jax.tree.map(lambda x: x.sharding.spec, sharded) == specs


def test_batch_sharding_and_errors():
    need_8()
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    b = par.shard_batch(make_batch(1), mesh)
    assert b.tokens.sharding.spec == P(("data", "fsdp"), None)
    assert b.tokens.addressable_shards[0].data.shape == (B // 4, T)
    assert b.ref_logp.sharding == NamedSharding(mesh, P(("data", "fsdp"), None))
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 4 batch shards"):
        par.shard_batch(make_batch(1, B=6), mesh)


# ----------------------------------------------------------------------------- memory
def test_memory_estimate_params_and_optimizer_are_the_exact_shard_sizes():
    """params / opt_state / grads of the estimate vs the bytes each device really holds
    after `shard_train_state` (device 0's shards, summed)."""
    need_8()
    for shape in ((2, 2, 2), (1, 2, 4), (8, 1, 1)):
        mesh_cfg = par.MeshConfig(*shape)
        mesh = par.make_mesh(mesh_cfg)
        state = par.shard_train_state(init_train_state(jax.random.key(0), make_params(), CFG, STEP), mesh)

        def on_device0(tree, mesh=mesh):
            d0 = mesh.devices.flat[0]
            return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == d0)

        est = train_memory.estimate_memory(CFG, STEP, mesh_cfg, batch_size=B, seq_len=T)
        assert est["params"] == on_device0(state.params), shape
        assert est["opt_state"] == on_device0(state.opt_state), shape
        # float32 gradients like the params, twice with micro-batches (accumulator + one micro-batch)
        assert est["grads"] == 2 * on_device0(state.params), shape
        assert est["kv_cache"] == 0
        assert est["total"] == sum(est[k] for k in ("params", "opt_state", "grads", "activations", "kv_cache"))
    total = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(make_params()))
    one = train_memory.estimate_memory(CFG, STEP, par.MeshConfig(), batch_size=B, seq_len=T)
    assert one["params"] == total
    assert (
        train_memory.estimate_memory(CFG, STEP, {"data": 1, "fsdp": 2, "tensor": 1}, batch_size=B, seq_len=T)["params"]
        == total // 2
    )


def test_memory_estimate_scales_as_documented():
    big = M.DecoderConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        model_type="qwen2",
    )
    one = par.MeshConfig()
    kw = dict(batch_size=64, seq_len=2048)
    base = train_memory.estimate_memory(big, StepConfig(), one, **kw)
    remat = train_memory.estimate_memory(big, StepConfig(remat=True), one, **kw)
    assert remat["activations"] < base["activations"] / 5
    micro = train_memory.estimate_memory(big, StepConfig(num_micro_batches=4), one, **kw)
    assert micro["activations"] < base["activations"] / 3.5
    assert micro["grads"] == 2 * base["grads"]
    data8 = train_memory.estimate_memory(big, StepConfig(), {"data": 8, "fsdp": 1, "tensor": 1}, **kw)
    assert data8["params"] == base["params"] and data8["activations"] < base["activations"] / 7
    lora = train_memory.estimate_memory(big.replace(lora=M.LoraConfig(rank=8)), StepConfig(), one, **kw)
    assert lora["opt_state"] < base["opt_state"] / 50 and lora["grads"] < base["grads"] / 50
    kv = train_memory.estimate_memory(
        big, StepConfig(), one, sample_batch=32, sample_len=4096, kv_dtype="bfloat16", **kw
    )
    assert kv["kv_cache"] == 2 * 24 * 32 * 2 * 4096 * 64 * 2
    ppo = train_memory.estimate_memory(big, StepConfig(), one, critic=True, **kw)
    assert ppo["params"] > 1.9 * base["params"] - 2 * 896 * 151936 * 4  # trunk twice, one lm_head
    with pytest.raises(ValueError, match="sample_len"):
        train_memory.estimate_memory(big, StepConfig(), one, sample_batch=4, **kw)
    with pytest.raises(ValueError, match="batch_size"):
        train_memory.estimate_memory(big, StepConfig(), one, batch_size=0, seq_len=8)


def test_check_fits_names_the_components():
    est = train_memory.estimate_memory(
        CFG, STEP, par.MeshConfig(), batch_size=B, seq_len=T, sample_batch=4, sample_len=64
    )
    train_memory.check_fits(est, 10 * est["total"])
    with pytest.raises(train_memory.DoesNotFitError) as err:
        train_memory.check_fits(est, est["total"])  # 90% of it is usable: does not fit
    assert isinstance(err.value, MemoryError)
    for name in ("params", "opt_state", "grads", "activations", "kv_cache", "remat", "fsdp"):
        assert name in str(err.value)
    line = train_memory.format_memory(est, 2**30)
    assert line.startswith("memory per device: params") and "kv_cache" in line and "of 1.00 GiB" in line
    assert train_memory.device_memory_bytes(default=123) == 123  # CPU devices do not report a limit
    with pytest.raises(ValueError, match="usable_fraction"):
        train_memory.check_fits(est, 1, usable_fraction=0)
