"""The jitted update: exact micro-batch accumulation, optimizer, skip rule, LoRA, critic, SFT.

References are written here from the formulas (docs/explanations/formulas.md), independently of
`jaxagent.algos` and `jaxagent.train`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_testlib import host

from jaxagent import models as M
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig
from jaxagent.train.update import accumulated_grads, make_update_step, sft_step, train_step
from jaxagent.train.update.batch import SFTBatch, UpdateBatch, last_turn_mask
from jaxagent.train.update.losses import critic_values
from jaxagent.train.update.state import init_train_state, learning_rate_schedule

CFG = M.DecoderConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    model_type="llama",
)
B, T = 8, 12


def make_params(seed=0):
    return M.init_params(jax.random.key(seed), CFG, std=0.2)


def make_batch(seed=0, B=B, T=T, critic=False):
    """Ragged masks (observation gaps), one fully masked row, logp near the policy's."""
    r = np.random.RandomState(seed)
    tokens = r.randint(0, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = (r.rand(B, T) < 0.6).astype(np.float32)
    mask[:, 0] = 0.0
    mask[2:4] = 0.0  # rows with no policy token (a whole micro-batch of 2 rows)
    mask[5, 1:] = 1.0
    old = (-4.2 + 0.3 * r.randn(B, T)).astype(np.float32)
    fields = dict(
        tokens=tokens,
        loss_mask=mask,
        advantages=r.randn(B, T).astype(np.float32),
        old_logp=old,
        ref_logp=(old + 0.2 * r.randn(B, T)).astype(np.float32),
        rollout_logp=(old + 0.3 * r.randn(B, T)).astype(np.float32),
        attention_mask=np.ones((B, T), np.int32),
    )
    fields["attention_mask"][7, -3:] = 0  # right padding
    fields["loss_mask"][7, -3:] = 0.0
    if critic:
        fields["returns"] = r.randn(B, T).astype(np.float32)
        fields["old_values"] = (0.1 * r.randn(B, T)).astype(np.float32)
    return UpdateBatch(**{k: jnp.asarray(v) for k, v in fields.items()})


def assert_tree_equal(a, b):
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    assert jax.tree.structure(host(a)) == jax.tree.structure(host(b))
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ inline reference
def reference_loss(params, batch, mode, lc: LossConfig):
    """PPO (dual clip) + k3 KL - entropy, with truncated IS, on the *full* batch,
    written from FORMULAS.md."""
    logp, ent = M.token_logprobs(params, CFG, batch.tokens, attention_mask_BxT=batch.attention_mask)
    m = batch.loss_mask
    A = jnp.where(m > 0, batch.advantages, 0.0)
    w = jnp.minimum(jnp.exp(batch.old_logp - batch.rollout_logp), lc.tis_cap) if lc.tis_cap else 1.0
    d = jnp.clip(logp - batch.old_logp, -20, 20)
    ratio = jnp.exp(d)
    l1 = -A * ratio
    l2 = -A * jnp.clip(ratio, 1 - 0.2, 1 + 0.2)
    c1 = jnp.maximum(l1, l2)
    pg = jnp.where(A < 0, jnp.minimum(-A * 3.0, c1), c1) * w
    k = jnp.clip(-(logp - batch.ref_logp), -20, 20)
    kl = jnp.clip(jnp.exp(k) - k - 1, -10, 10)

    n_i = jnp.sum(m, axis=1)
    rows = jnp.sum(n_i > 0)

    def agg(L):
        L = jnp.where(m > 0, L, 0.0)
        if mode == "token-mean":
            return jnp.sum(L) / jnp.sum(m)
        if mode == "seq-mean-token-mean":
            return jnp.sum(jnp.where(n_i > 0, jnp.sum(L, 1) / jnp.maximum(n_i, 1), 0.0)) / rows
        if mode == "seq-mean-token-sum-norm":
            return jnp.sum(L) / (rows * L.shape[1])
        raise AssertionError(mode)

    return agg(pg) + lc.kl_coef * agg(kl) - lc.entropy_coef * agg(ent)


reference_value_and_grad = jax.jit(jax.value_and_grad(reference_loss), static_argnums=(2, 3))


# one aggregation mode by default (suite budget, ~13 s each); the kernels' micro-batch
# accumulation is checked for every mode in test_algos_losses
@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
        pytest.param("seq-mean-token-sum-norm", marks=pytest.mark.slow),
    ],
)
def test_micro_batch_accumulation_equals_full_batch_gradient(mode):
    lc = LossConfig(agg_mode=mode, kl_coef=0.3, entropy_coef=0.05, tis_cap=1.5)
    params = make_params()
    batch = make_batch()
    state = init_train_state(jax.random.key(0), params, CFG, StepConfig(loss=lc))
    ref_loss, ref = reference_value_and_grad(params, batch, mode, lc)
    cfg = StepConfig(loss=lc, num_micro_batches=4)
    grads, sums = jax.jit(accumulated_grads, static_argnums=2)(state, batch, cfg)
    np.testing.assert_allclose(sums["policy_loss"], ref_loss, rtol=2e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads.policy), jax.tree.leaves(ref), strict=True):
        scale = float(np.max(np.abs(r))) + 1e-12
        np.testing.assert_allclose(
            np.asarray(g) / scale, np.asarray(r) / scale, atol=2e-5, err_msg=f"{mode} {jax.tree_util.keystr(path)}"
        )


def reference_loss_kl_masked(params, batch, mode, lc: LossConfig, klm):
    """`reference_loss` with the KL term on the tokens of `klm` (within the loss mask)
    alone, its token and row counts taken over those tokens."""
    base = reference_loss(params, batch, mode, dataclasses.replace(lc, kl_coef=0.0, kl_turns="all"))
    logp, _ = M.token_logprobs(params, CFG, batch.tokens, attention_mask_BxT=batch.attention_mask)
    m = batch.loss_mask * klm
    k = jnp.clip(-(logp - batch.ref_logp), -20, 20)
    kl = jnp.where(m > 0, jnp.clip(jnp.exp(k) - k - 1, -10, 10), 0.0)
    n_i = jnp.sum(m, axis=1)
    if mode == "token-mean":
        agg = jnp.sum(kl) / jnp.sum(m)
    else:  # seq-mean-token-mean
        agg = jnp.sum(jnp.where(n_i > 0, jnp.sum(kl, 1) / jnp.maximum(n_i, 1), 0.0)) / jnp.sum(n_i > 0)
    return base + lc.kl_coef * agg


@pytest.mark.parametrize("mode", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_the_kl_term_on_the_last_turn_alone_accumulates_exactly(mode):
    """`kl_turns="last"`: the KL covers each row's last policy turn (`last_turn_mask`),
    averaged over those tokens and rows, and micro-batches still add up to it."""
    lc = LossConfig(agg_mode=mode, kl_coef=0.3, entropy_coef=0.05, kl_turns="last")
    params = make_params()
    batch = make_batch(4)
    # turn ids: policy tokens in runs of 3 per turn, -1 elsewhere
    mask = np.asarray(batch.loss_mask)
    tid = np.where(mask > 0, np.arange(T)[None, :] // 3, -1).astype(np.int32)
    klm = np.zeros((B, T), np.float32)
    for b in range(B):  # the last turn, written out: the largest turn id among the row's policy tokens
        if (tid[b] >= 0).any():
            klm[b, tid[b] == tid[b].max()] = 1.0
    got_mask = last_turn_mask(tid, mask)
    np.testing.assert_array_equal(got_mask, klm)
    assert 0 < klm.sum() < mask.sum()
    batch = dataclasses.replace(batch, kl_mask=jnp.asarray(got_mask))
    state = init_train_state(jax.random.key(0), params, CFG, StepConfig(loss=lc))
    ref_loss, ref = jax.value_and_grad(reference_loss_kl_masked)(params, batch, mode, lc, jnp.asarray(klm))
    grads, sums = jax.jit(accumulated_grads, static_argnums=2)(state, batch, StepConfig(loss=lc, num_micro_batches=4))
    np.testing.assert_allclose(sums["policy_loss"], ref_loss, rtol=2e-5)
    full = reference_loss(params, batch, mode, lc)  # the KL on every token differs
    assert abs(float(full) - float(ref_loss)) > 1e-4
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads.policy), jax.tree.leaves(ref), strict=True):
        scale = float(np.max(np.abs(r))) + 1e-12
        np.testing.assert_allclose(
            np.asarray(g) / scale, np.asarray(r) / scale, atol=2e-5, err_msg=f"{mode} {jax.tree_util.keystr(path)}"
        )
    # the step requires the mask it was configured for, and names a bad choice
    with pytest.raises(ValueError, match="kl_mask is required"):
        accumulated_grads(state, dataclasses.replace(batch, kl_mask=None), StepConfig(loss=lc))
    with pytest.raises(ValueError, match="kl_turns must be one of"):
        LossConfig(kl_coef=0.1, kl_turns="first")
    with pytest.raises(ValueError, match="set kl_coef > 0"):
        LossConfig(kl_turns="last")


def test_train_step_matches_reference_adamw_update():
    """Params after one step (4 micro-batches) = a NumPy AdamW step on the full-batch
    gradient: warm-up lr(0) = lr/W, clipping, decoupled decay on kernels only."""
    lc = LossConfig(kl_coef=0.1)
    opt = OptimizerConfig(lr=1e-2, warmup_steps=4, weight_decay=0.1, max_grad_norm=0.5, eps=1e-3)
    params = make_params()
    batch = make_batch(1)
    state = init_train_state(jax.random.key(0), params, CFG, StepConfig(loss=lc, optim=opt, num_micro_batches=4))
    before = host(params)
    g = host(reference_value_and_grad(params, batch, "token-mean", lc)[1])
    new_state, metrics = train_step(state, batch, StepConfig(loss=lc, optim=opt, num_micro_batches=4))
    norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in jax.tree.leaves(g)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-4)
    scale = min(1.0, 0.5 / norm)
    lr = 1e-2 / 4

    def expected(path, p, gr):
        gr = gr.astype(np.float64) * scale
        mhat, vhat = gr, gr**2  # bias-corrected first moments after one step
        upd = mhat / (np.sqrt(vhat) + 1e-3)
        if jax.tree_util.keystr(path).endswith("['kernel']") or "embedding" in jax.tree_util.keystr(path):
            upd = upd + 0.1 * p
        return p - lr * upd

    want = jax.tree_util.tree_map_with_path(expected, before, g)
    for got, w in zip(jax.tree.leaves(host(new_state.params)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1 and int(new_state.skipped) == 0
    np.testing.assert_allclose(float(metrics["lr"]), lr, rtol=1e-6)
    assert float(metrics["skipped"]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_other_losses_accumulate_exactly(policy_loss):
    lc = LossConfig(policy_loss=policy_loss, entropy_coef=0.01)
    state = init_train_state(jax.random.key(0), make_params(), CFG, StepConfig(loss=lc))
    batch = make_batch(2)
    f = jax.jit(accumulated_grads, static_argnums=2)
    g1, s1 = f(state, batch, StepConfig(loss=lc, num_micro_batches=1))
    g4, s4 = f(state, batch, StepConfig(loss=lc, num_micro_batches=4))
    np.testing.assert_allclose(s1["policy_loss"], s4["policy_loss"], rtol=1e-5, atol=1e-8)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.max(np.abs(a)) + 1e-12))


def test_nonfinite_batch_is_skipped_and_state_bitwise_unchanged():
    cfg = StepConfig(loss=LossConfig(kl_coef=0.1), optim=OptimizerConfig(lr=1e-3), num_micro_batches=2)
    state = init_train_state(jax.random.key(3), make_params(), CFG, cfg)
    good = make_batch(3)
    state, m = train_step(state, good, cfg)  # a real optimizer state first
    assert float(m["skipped"]) == 0.0
    before = host(state)
    adv = np.array(good.advantages)
    adv[0, np.nonzero(np.asarray(good.loss_mask[0]))[0][0]] = np.nan  # NaN on a policy token
    bad = good.replace(advantages=jnp.asarray(adv))
    state, m = train_step(state, bad, cfg)
    assert float(m["skipped"]) == 1.0 and not np.isfinite(float(m["loss"]))
    after = host(state)
    assert int(after.skipped) == 1 and int(after.step) == 1
    assert_tree_equal(after.replace(skipped=before.skipped), before)
    # NaN where the loss mask is 0 never reaches the loss: not skipped
    adv = np.array(good.advantages)
    adv[2, :] = np.inf
    state, m = train_step(state, good.replace(advantages=jnp.asarray(adv)), cfg)
    assert float(m["skipped"]) == 0.0 and int(state.step) == 2
    # a batch without any policy token: loss 0, nothing applied (no momentum/decay drift)
    before = host(state)
    state, m = train_step(state, good.replace(loss_mask=jnp.zeros_like(good.loss_mask)), cfg)
    assert float(m["skipped"]) == 1.0 and float(m["loss"]) == 0.0 and float(m["num_tokens"]) == 0.0
    assert_tree_equal(host(state).replace(skipped=before.skipped), before)


def test_train_step_compiles_once():
    cfg = StepConfig(
        loss=LossConfig(entropy_coef=0.02),
        optim=OptimizerConfig(lr=3e-3, schedule="cosine", total_steps=10, warmup_steps=1),
    )
    state = init_train_state(jax.random.key(0), make_params(), CFG, cfg)
    n0 = train_step._cache_size()
    lrs = []
    for i in range(4):
        state, m = train_step(state, make_batch(10 + i), cfg)
        lrs.append(m["lr"])
        if i == 0:
            assert train_step._cache_size() == n0 + 1
    assert train_step._cache_size() == n0 + 1
    sched = learning_rate_schedule(cfg.optim)
    np.testing.assert_allclose([float(x) for x in lrs], [float(sched(s)) for s in range(4)], rtol=1e-6)
    assert int(state.step) == 4


def test_learning_rate_schedules_follow_the_formula():
    lr, W, S, r = 2e-3, 3, 13, 0.1
    for kind in ("constant", "linear", "cosine"):
        sched = learning_rate_schedule(
            OptimizerConfig(lr=lr, warmup_steps=W, schedule=kind, total_steps=S, final_lr_ratio=r)
        )
        for s in range(16):
            warm = min(1.0, (s + 1) / W)
            p = min(max((s - W) / (S - W), 0.0), 1.0)
            decay = {
                "constant": 1.0,
                "linear": 1 - (1 - r) * p,
                "cosine": r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p)),
            }[kind]
            np.testing.assert_allclose(float(sched(s)), lr * warm * decay, rtol=1e-5, err_msg=f"{kind} {s}")


def test_lora_updates_only_adapters():
    lora = M.LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    params, cfg_l = M.add_lora(jax.random.key(7), make_params(), CFG, lora)
    cfg = StepConfig(optim=OptimizerConfig(lr=1e-2, weight_decay=0.1), num_micro_batches=2)
    state = init_train_state(jax.random.key(0), params, cfg_l, cfg)
    n_moments = len(jax.tree.leaves(state.opt_state))
    before = host(state.params)
    for i in range(2):
        state, m = train_step(state, make_batch(20 + i), cfg)
        assert float(m["skipped"]) == 0.0
    after = host(state.params)
    mask = M.trainable_mask(params)
    for (path, a), b, trainable in zip(
        jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(before), jax.tree.leaves(mask), strict=True
    ):
        if trainable:
            assert not np.array_equal(a, b), jax.tree_util.keystr(path)
        else:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    # moments exist for the 4 adapter leaves only (mu and nu), plus counters
    assert n_moments <= 2 * 4 + 3


def test_ppo_critic_loss_decreases_and_explained_variance_rises():
    base = make_params()
    critic = M.value_params_from_policy(jax.random.key(1), base, CFG)
    cfg = StepConfig(optim=OptimizerConfig(lr=1e-4), critic_optim=OptimizerConfig(lr=3e-3), num_micro_batches=2)
    state = init_train_state(jax.random.key(0), base, CFG, cfg, critic_params=critic, critic_config=CFG)
    batch = make_batch(4, critic=True)
    batch = batch.replace(old_values=critic_values(critic, CFG, batch))
    vl, ev = [], []
    for _ in range(12):
        state, m = train_step(state, batch, cfg)
        vl.append(float(m["value_loss"]))
        ev.append(float(m["explained_variance"]))
    assert vl[-1] < 0.6 * vl[0], vl
    assert ev[-1] > ev[0] + 0.2, ev
    assert int(state.step) == 12


def test_sft_loss_decreases():
    cfg = StepConfig(optim=OptimizerConfig(lr=1e-2), num_micro_batches=2)
    state = init_train_state(jax.random.key(0), make_params(), CFG, cfg)
    b = make_batch(5)
    batch = SFTBatch(tokens=b.tokens, loss_mask=b.loss_mask, attention_mask=b.attention_mask)
    # reference for the first loss: masked token-mean negative log-likelihood
    logp, _ = M.token_logprobs(state.params, CFG, b.tokens, attention_mask_BxT=b.attention_mask)
    nll0 = float(-jnp.sum(jnp.where(b.loss_mask > 0, logp, 0.0)) / jnp.sum(b.loss_mask))
    losses = []
    for _ in range(8):
        state, m = sft_step(state, batch, cfg)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses[0], nll0, rtol=1e-5)
    assert losses[-1] < 0.7 * losses[0], losses


def test_config_and_batch_errors_name_the_field():
    state = init_train_state(jax.random.key(0), make_params(), CFG, StepConfig())
    batch = make_batch(6).replace(ref_logp=None)
    with pytest.raises(ValueError, match="ref_logp"):
        accumulated_grads(state, batch, StepConfig(loss=LossConfig(kl_coef=0.1)))
    with pytest.raises(ValueError, match="num_micro_batches"):
        accumulated_grads(state, make_batch(6), StepConfig(num_micro_batches=3))
    with pytest.raises(ValueError, match="advantages"):
        accumulated_grads(state, make_batch(6).replace(advantages=jnp.zeros((B, T + 1))), StepConfig())
    with pytest.raises(ValueError, match="nope"):
        LossConfig(policy_loss="nope")
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="kl_kind"):
        LossConfig(kl_kind="k9")
    assert dataclasses.replace(LossConfig(), kl_kind="k3+").kl_kind == "k3+"


@pytest.mark.slow
def test_sharded_step_equals_unsharded_and_keeps_the_layout():
    """Params sharded over an 'fsdp' axis (a layout of its own, not the rules'), the
    batch's rows over 'data' x 'fsdp' (8 CPU devices): the same update as on one device,
    and the state keeps its shardings."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxagent import parallel as par

    cfg = StepConfig(
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.01), optim=OptimizerConfig(lr=1e-3, eps=1e-3), num_micro_batches=2
    )
    batch = make_batch(8)
    want, want_m = train_step(init_train_state(jax.random.key(0), make_params(), CFG, cfg), batch, cfg)
    mesh = par.make_mesh(par.MeshConfig(4, 2, 1))

    def place(x):
        spec = P(*([None] * (x.ndim - 1) + ["fsdp"])) if x.ndim >= 2 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = init_train_state(jax.random.key(0), make_params(), CFG, cfg)
    with pytest.raises(ValueError, match="different device sets"):
        make_update_step(cfg, state.replace(params=jax.tree.map(place, state.params)), mesh)
    state = jax.tree.map(place, state)
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
    step = make_update_step(cfg, state, mesh)
    got, got_m = step(state, batch)
    assert jax.tree.map(lambda x: x.sharding.spec, got.params) == specs
    for a, b in zip(jax.tree.leaves(host(got.params)), jax.tree.leaves(host(want.params)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for k in want_m:
        np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    got, _ = step(got, make_batch(9))  # the output layout is the input layout: no recompilation
    assert step._cache_size() == 1 and int(got.step) == 2


# ------------------------------------------------------------------ trimmed micro-batches
RAGGED = [5, 24, 9, 13, 3, 17, 20, 8]  # row lengths (right padding), T = 24


def make_ragged_batch(seed=0, lengths=RAGGED, T=24):
    """`make_batch` with right padding to `lengths`; the padding holds random tokens (a
    trimmed step must not depend on them)."""
    batch = make_batch(seed, B=len(lengths), T=T)
    am = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    return batch.replace(attention_mask=jnp.asarray(am), loss_mask=jnp.asarray(np.asarray(batch.loss_mask) * am))


def test_row_lengths_and_length_groups():
    from jaxagent.train.update.trimmed import length_groups, row_lengths

    batch = make_ragged_batch()
    np.testing.assert_array_equal(row_lengths(batch.loss_mask, batch.attention_mask), RAGGED)
    am = np.array(batch.attention_mask)
    am[4] = 0  # an empty row (no real or loss token)
    lm = np.array(batch.loss_mask)
    lm[4] = 0
    assert row_lengths(jnp.asarray(lm), jnp.asarray(am))[4] == 0
    assert list(row_lengths(batch.loss_mask)) == [24] * 8  # no attention mask: every token is real
    # sorted 3, 5 | 8, 9 | 13, 17 | 20, 24 (rows 4, 0 | 7, 2 | 3, 5 | 6, 1), rounded up to 4s
    groups = length_groups(RAGGED, 4, 4, 24)
    assert [sorted(r.tolist()) for r, _ in groups] == [[0, 4], [2, 7], [3, 5], [1, 6]]
    assert [L for _, L in groups] == [8, 12, 20, 24]
    assert [L for _, L in length_groups(RAGGED, 2, 8, 22)] == [16, 22]  # capped at max_len
    assert [L for _, L in length_groups([0, 0], 1, 8, 24)] == [8]  # at least one multiple
    with pytest.raises(ValueError, match="equal groups"):
        length_groups(RAGGED, 3, 4, 24)
    with pytest.raises(ValueError, match="multiple"):
        length_groups(RAGGED, 2, 0, 24)


# Dr.GRPO's T' (the padded length of the whole mini-batch) is where a micro-batch's own
# length would go wrong, so that mode runs by default
@pytest.mark.parametrize(
    "mode",
    [
        "seq-mean-token-sum-norm",
        pytest.param("token-mean", marks=pytest.mark.slow),
        pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
    ],
)
def test_trimmed_micro_batches_accumulate_the_full_batch_gradient(mode):
    """`TrimmedTrainStep`: micro-batches of rows grouped by length, each cut to its own
    length, add up to the gradient of the whole padded batch (the reference above, from
    the formulas), padding tokens and all."""
    from jaxagent.train.update.trimmed import TrimmedTrainStep

    lc = LossConfig(agg_mode=mode, kl_coef=0.3, entropy_coef=0.05, tis_cap=1.5)
    params = make_params()
    state = init_train_state(jax.random.key(0), params, CFG, StepConfig(loss=lc))
    step = TrimmedTrainStep(StepConfig(loss=lc, num_micro_batches=4), 4)
    # every micro-batch its own length; then the two longest of one length (one call, a scan)
    for lengths, want in ((RAGGED, [8, 12, 20, 24]), ([24, 24, 24, 24, 3, 5, 9, 13], [8, 16, 24, 24])):
        batch = make_ragged_batch(lengths=lengths)
        ref_loss, ref = reference_value_and_grad(params, batch, mode, lc)
        (grads, sums), _, _ = step.accumulate(state, batch)
        assert step.last_lengths == want
        np.testing.assert_allclose(sums["policy_loss"], ref_loss, rtol=2e-5)
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads.policy), jax.tree.leaves(ref), strict=True):
            scale = float(np.max(np.abs(r))) + 1e-12
            np.testing.assert_allclose(
                np.asarray(g) / scale,
                np.asarray(r) / scale,
                atol=2e-5,
                err_msg=f"{mode} {lengths} {jax.tree_util.keystr(path)}",
            )


# slow (~60-100 s): the suite's time; the trimmed gradient's exactness above stays in it
@pytest.mark.slow
def test_trimmed_step_updates_as_train_step_and_compiles_once_per_length():
    """The trimmed step lands on `train_step`'s params and metrics, with the KL term on the
    last turn and a critic; a second batch of the same lengths compiles nothing new; the
    skip rules hold."""
    from jaxagent.train.update.trimmed import TrimmedTrainStep

    lc = LossConfig(kl_coef=0.2, kl_turns="last", entropy_coef=0.01)
    cfg = StepConfig(loss=lc, optim=OptimizerConfig(lr=1e-2, max_grad_norm=0.5), num_micro_batches=2)
    params = make_params()
    critic = M.value_params_from_policy(jax.random.key(1), params, CFG)

    def full(seed):  # the fields the KL term on the last turn and the critic need
        b = make_ragged_batch(seed)
        return b.replace(
            kl_mask=jnp.asarray(
                last_turn_mask(np.where(np.asarray(b.loss_mask) > 0, np.arange(24) // 4, -1), b.loss_mask)
            ),
            returns=jnp.asarray(np.random.RandomState(seed).randn(8, 24).astype(np.float32)),
            old_values=jnp.zeros((8, 24), jnp.float32),
        )

    batch = full(5)

    def copy(tree):  # the steps donate the state's buffers
        return jax.tree.map(jnp.copy, tree)

    def new():
        return init_train_state(
            jax.random.key(0), copy(params), CFG, cfg, critic_params=copy(critic), critic_config=CFG
        )

    want_state, want = train_step(new(), batch, cfg)
    step = TrimmedTrainStep(cfg, 8)
    got_state, got = step(new(), batch)
    assert step.last_lengths == [16, 24]
    for a, b in zip(
        jax.tree.leaves(host(want_state.params)) + jax.tree.leaves(host(want_state.critic_params)),
        jax.tree.leaves(host(got_state.params)) + jax.tree.leaves(host(got_state.critic_params)),
        strict=True,
    ):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    for k in ("loss", "pg_loss", "kl_loss", "value_loss", "grad_norm", "critic_grad_norm", "entropy", "num_tokens"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-4, atol=1e-7, err_msg=k)
    assert int(got_state.step) == 1 and float(got["skipped"]) == 0.0
    n = step._add._cache_size()
    got_state, _ = step(got_state, full(6))  # the same lengths: no new compilation
    assert step._add._cache_size() == n and int(got_state.step) == 2
    # skip rules: a NaN on a policy token; advantages all 0 with nothing else to learn
    plain = StepConfig(loss=LossConfig(), num_micro_batches=2)
    pstep = TrimmedTrainStep(plain, 8)
    state = init_train_state(jax.random.key(0), copy(params), CFG, plain)
    before = host(state)
    state, m = pstep(state, batch.replace(advantages=jnp.zeros_like(batch.advantages)))
    assert float(m["skipped"]) == 1.0
    assert_tree_equal(host(state).replace(skipped=before.skipped), before)
    adv = np.array(batch.advantages)
    adv[1, np.nonzero(np.asarray(batch.loss_mask[1]))[0][-1]] = np.nan
    state, m = pstep(state, batch.replace(advantages=jnp.asarray(adv)))
    assert float(m["skipped"]) == 1.0 and int(state.skipped) == 2 and int(state.step) == 0
    with pytest.raises(ValueError, match="multiple"):
        TrimmedTrainStep(plain, 0)
    with pytest.raises(ValueError, match="kl_mask is required"):
        TrimmedTrainStep(cfg, 8)(new(), batch.replace(kl_mask=None))
