"""The sampler and the agent loop sharded on a device mesh (one process, 8 CPU devices):
"batch over data, heads over tensor". The sharded runs must give the unsharded runs'
tokens (greedy and temperature) and log-probs, and the state must really be sharded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import envs
from jaxagent import models as M
from jaxagent import parallel
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout import AgentLoop, AgentLoopConfig, Sampler, SamplingConfig

TOK = byte_chat_tokenizer()
EOT = TOK.convert_tokens_to_ids("<|im_end|>")

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def mesh_of(data, fsdp, tensor):
    return parallel.make_mesh(parallel.MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:8])


def lists_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol)


def test_sampler_sharded_matches_unsharded():
    cfg = tiny_config(vocab_size=97, num_kv_heads=4)  # 4 heads / 4 kv heads: split over tensor=4
    params = M.init_params(jax.random.key(0), cfg, std=0.3)
    mesh = mesh_of(2, 1, 4)
    ref = Sampler(params, cfg, max_len=48, window_segments=1)
    shd = Sampler(params, cfg, max_len=48, window_segments=1, mesh=mesh)
    # params are placed by the sampler's rules (q_proj: heads over tensor)
    want = parallel.param_shardings(shd.params, mesh, parallel.ROLLOUT_AXIS_RULES)
    for x, s in zip(jax.tree.leaves(shd.params), jax.tree.leaves(want), strict=True):
        assert x.sharding.spec == s.spec
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14], [5], [6, 7], [8, 8, 8, 8]]

    def run(s, sampling):
        st, g = s.generate(prompts, max_new_tokens=6, sampling=sampling, seed=3)
        out = [Sampler.to_lists(g)]
        spec = (lambda x: x.sharding.spec) if s.mesh is not None else (lambda x: None)
        specs = [tuple(map(spec, (st.cache.k, st.cache.lengths, st.next_logits_BxV, st.keys_B, g.tokens_BxN)))]
        if sampling.greedy:  # (fewer compilations) the continuation with temperature only
            return out, specs
        st = s.select_rows(st, [6, 0, 3])  # 3 rows: not divisible by data=2 -> replicated rows
        specs.append(spec(st.cache.k))
        st = s.append(st, [[20, 21], None, [22, 23, 24]])  # continuation on a live cache
        st, g = s.decode(st, max_new_tokens=5, sampling=sampling, max_new=[5, 3, 5])
        out.append(Sampler.to_lists(g))
        specs.append(spec(st.cache.k))
        return out, specs

    for sampling in (SamplingConfig(0.0), SamplingConfig(0.9, top_k=20)):
        out_ref, _ = run(ref, sampling)
        out_shd, specs = run(shd, sampling)
        for (t0, l0, r0), (t1, l1, r1) in zip(out_ref, out_shd, strict=True):
            assert t0 == t1 and r0 == r1
            lists_close(l0, l1)
        assert specs[0] == (P(None, "data", "tensor"), P("data"), P("data"), P("data"), P("data"))
    assert specs[1] == specs[2] == P(None, None, "tensor")  # 3 rows: replicated, kv heads split


def eager_stop_params(cfg):
    """Greedy turns end both by the end-of-turn token and by the length limit (as in
    test_rollout_agent_loop): the lm_head reads hidden dims 0..5 only."""
    p = M.init_params(jax.random.key(3), cfg, std=0.3)
    head = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
    for dim, tok in enumerate([EOT] + [ord(c) for c in "lurdx"]):
        head[dim, tok] = 1.0
    p["lm_head"]["kernel"] = jnp.asarray(head)
    return p


FAULTY = [functools.partial(envs.make, "testing/faulty", horizon=h) for h in (2, 3, 2, 3)]


@pytest.mark.parametrize(
    "sampling,env_fns,ctx",
    [
        pytest.param(SamplingConfig(0.0), ["frozenlake"] * 4, 1024, id="greedy"),
        # ~18 s on idle cores (suite budget): `make test-slow`
        pytest.param(SamplingConfig(0.8), FAULTY, 256, id="temp-shrink", marks=pytest.mark.slow),
    ],
)
def test_agent_loop_sharded_matches_unsharded(sampling, env_fns, ctx):
    cfg = tiny_config(vocab_size=len(TOK))  # 4 heads / 2 kv heads: kv heads split over tensor=2
    params = eager_stop_params(cfg)
    mesh = mesh_of(2, 2, 2)
    lcfg = AgentLoopConfig(max_turns=3, max_tokens_per_turn=6, max_context=ctx, sampling=sampling, seed=5)
    ref = AgentLoop(params, cfg, TOK, lcfg)
    shd = AgentLoop(params, cfg, TOK, lcfg, mesh=mesh)
    specs = []
    decode = shd.sampler.decode

    def spy(state, **kw):
        specs.append((state.batch_size, state.cache.k.sharding.spec))
        return decode(state, **kw)

    shd.sampler.decode = spy
    seeds = [3, 4, 5, 6]
    with envs.EnvPool(env_fns, num_workers=1) as pool:
        t_ref, e_ref = ref.run(pool, seeds)
        t_shd, e_shd = shd.run(pool, seeds)
    np.testing.assert_array_equal(np.asarray(t_ref.tokens), np.asarray(t_shd.tokens))
    np.testing.assert_array_equal(np.asarray(t_ref.loss_mask), np.asarray(t_shd.loss_mask))
    np.testing.assert_allclose(np.asarray(t_ref.rollout_logp), np.asarray(t_shd.rollout_logp), atol=1e-5)
    assert [e.actions for e in e_ref] == [e.actions for e in e_shd]
    assert [e.end_reason for e in e_ref] == [e.end_reason for e in e_shd]
    assert np.asarray(t_shd.num_turns).max() == 3  # continuation turns were played
    # rows over (data, fsdp) while 4 rows are live; the shrunk bucket of 2 rows over data
    # only (the longest dividing prefix); the kv heads stay over tensor
    want = {4: P(None, ("data", "fsdp"), "tensor"), 2: P(None, "data", "tensor")}
    assert all(spec == want[b] for b, spec in specs)
    batches = [b for b, _ in specs]
    assert batches == ([4, 4, 4] if env_fns is not FAULTY else [4, 4, 2])
    # new params are placed on the mesh like the first ones, by the sampler's rules: whole
    # over data and fsdp (q_proj: P(None, None, "tensor")), not the update's fsdp split
    shd.set_params(jax.tree.map(lambda x: x + 0, params))
    rollout = parallel.param_shardings(params, mesh, parallel.ROLLOUT_AXIS_RULES)
    for x, s in zip(jax.tree.leaves(shd.params), jax.tree.leaves(rollout), strict=True):
        assert x.sharding == s
    assert shd.params["layers"]["q_proj"]["kernel"].sharding.spec == P(None, None, "tensor")


def test_unsharded_sampler_is_untouched():
    cfg = tiny_config(vocab_size=97)
    s = Sampler(M.init_params(jax.random.key(0), cfg), cfg, max_len=32)
    assert s.mesh is None
    st = s.init_state(2)
    assert not isinstance(st.cache.k.sharding, jax.sharding.NamedSharding) or st.cache.k.sharding.spec == P()


# fsdp=8 is slow (its own compilations, ~8 s): 2x2x2 already splits every axis
@pytest.mark.parametrize("shape", [(2, 2, 2), pytest.param((1, 8, 1), marks=pytest.mark.slow)], ids=["2x2x2", "fsdp8"])
def test_the_layer_scan_decode_on_a_mesh_matches_the_unsharded_sampler(shape):
    """The decode path accelerators take (`unroll_layers=False`, the layer scan) on a
    mesh, against the unsharded sampler's CPU path (unrolled): the same tokens and
    log-probs, greedy and sampled."""
    cfg = tiny_config(vocab_size=97, num_kv_heads=2)
    params = M.init_params(jax.random.key(0), cfg, std=0.3)
    ref = Sampler(params, cfg, max_len=40, window_segments=2)
    scan = Sampler(params, cfg, max_len=40, window_segments=2, mesh=mesh_of(*shape), unroll_layers=False)
    assert ref.unroll_layers and not scan.unroll_layers
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14], [5], [6, 7], [8, 8, 8, 8]]
    for sampling in (SamplingConfig(0.0), SamplingConfig(0.9, top_k=20)):
        (t0, l0, r0), (t1, l1, r1) = (
            Sampler.to_lists(s.generate(prompts, max_new_tokens=6, sampling=sampling, seed=3)[1]) for s in (ref, scan)
        )
        assert t0 == t1 and r0 == r1
        lists_close(l0, l1)
