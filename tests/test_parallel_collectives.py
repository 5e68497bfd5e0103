"""What the sharded programs send between devices, read off their compiled HLO on the 8
virtual CPU devices (`hlo_testlib`):

- the sampler's decode loop, on the accelerators' path (the layer scan), all-gathers no
  weight inside the loop on fsdp=8, data=8 and 2 x 2 x 2: the sampler lays its weights
  out by its own rules (`ROLLOUT_AXIS_RULES`: whole over data and fsdp), once per update;
- XLA's "involuntary full rematerialization" (a sharding conflict that makes the
  partitioner replicate a whole array and slice it again: it was the embedding lookup,
  the table split over fsdp and its rows over data x fsdp) is gone from the sampler's
  append and decode and from the train step on 2 x 2 x 2;
- under fsdp the train step reduces each weight's gradient to the device's shard:
  all-reduce + dynamic-slice of the shard right after XLA's partitioner, the pattern
  XLA's GPU and TPU compilers rewrite into one reduce-scatter (`ReduceScatterCreator`);
  XLA:CPU has no such pass, so a CPU program shows no reduce-scatter and this is what can
  be checked here;
- the sampler of one process of a multi-process run is laid out on a mesh of all that
  process's devices (`local_mesh`, `to_local`; simulated in one process here; the real
  two-process run is `test_parallel_multihost.py`'s slow test).
"""

import hlo_testlib as H
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent import CODE_PATHS_ENV, parallel
from jaxagent import models as M
from jaxagent.rollout import Sampler

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

CFG = H.decoder_test_config()
SHAPES = {"fsdp8": (1, 8, 1), "data8": (8, 1, 1), "2x2x2": (2, 2, 2)}


def mesh_of(shape):
    return parallel.make_mesh(parallel.MeshConfig(*shape), jax.devices()[:8])


@pytest.fixture(scope="module")
def decode_programs():
    """Per mesh shape: the sampler's decode (layer scan, as on GPU / TPU) compiled, and what
    XLA logged meanwhile; on 2 x 2 x 2 also its append (a prefill)."""
    params = M.init_params(jax.random.key(0), CFG)
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CODE_PATHS_ENV, "gpu")
        for name, shape in SHAPES.items():
            sampler = Sampler(params, CFG, max_len=32, window_segments=1, mesh=mesh_of(shape))
            assert not sampler.unroll_layers  # the accelerators' decode
            text, err, _ = H.compile_text(H.decode_lowered(sampler))
            out[name] = {"text": text, "stderr": err}
            if name == "2x2x2":
                out[name]["append_stderr"] = H.compile_text(H.append_lowered(sampler))[1]
    return out


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_decode_loop_all_gathers_no_weight(decode_programs, name):
    found = H.loop_collectives(decode_programs[name]["text"])
    weight = H.smallest_weight_matrix(CFG)
    big = [c.line for c in found if c.op == "all-gather" and c.largest_result >= weight]
    assert not big, f"{len(big)} weight-sized all-gathers in the decode loop on {name}:\n" + "\n".join(big)
    # what does cross devices per token is activation-sized: per collective kind, at most
    # two blocks of the 8 rows' hidden states or logits per layer
    per_token = H.per_loop_iteration(decode_programs[name]["text"])
    rows_bytes = 8 * max(CFG.hidden_size, CFG.vocab_size) * 4
    assert all(row["bytes"] <= 2 * CFG.num_layers * rows_bytes for row in per_token.values()), per_token


@pytest.mark.slow  # a positive control of the check above (~4 s of compiling): `make test-slow`
def test_the_detector_sees_the_training_layouts_weight_gathers():
    """The check above fails where it should: the sampler on the update's rules (weights
    split over fsdp, as before the sampler had rules of its own) all-gathers every weight
    matrix of the layer scan in the decode loop."""
    params = M.init_params(jax.random.key(0), CFG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CODE_PATHS_ENV, "gpu")
        sampler = Sampler(
            params, CFG, max_len=32, window_segments=1, mesh=mesh_of(SHAPES["fsdp8"]), rules=parallel.LOGICAL_AXIS_RULES
        )
        text = H.compile_text(H.decode_lowered(sampler))[0]
    weight = H.smallest_weight_matrix(CFG)
    big = [c for c in H.loop_collectives(text) if c.op == "all-gather" and c.largest_result >= weight]
    # q, k, v, o, gate, up, down of each layer of the scan
    assert sum(c.times for c in big) >= 7 * CFG.num_layers


def test_no_involuntary_rematerialization_on_2x2x2(decode_programs):
    # the capture sees XLA's warning: a lookup whose table is split over fsdp while its rows
    # are over data x fsdp (what the embedding lookup was)
    mesh = mesh_of(SHAPES["2x2x2"])
    table = jax.device_put(np.ones((CFG.vocab_size, CFG.hidden_size), np.float32), NamedSharding(mesh, P(None, "fsdp")))
    ids = jax.device_put(np.zeros((8, 4), np.int32), NamedSharding(mesh, P(("data", "fsdp"))))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    lookup = jax.jit(lambda t, i: jax.lax.with_sharding_constraint(t[i], rows))
    assert H.REMAT_WARNING in H.compile_text(lookup.lower(table, ids))[1]

    step_stderr = H.compile_text(H.train_step_lowered(mesh, CFG))[1]
    for what, err in (
        ("decode", decode_programs["2x2x2"]["stderr"]),
        ("append", decode_programs["2x2x2"]["append_stderr"]),
        ("train step", step_stderr),
    ):
        assert H.REMAT_WARNING not in err, f"the {what} on 2x2x2:\n{err[-3000:]}"


def test_fsdp_gradients_are_reduced_to_their_shards():
    """fsdp=8: every weight-sized all-reduce of the partitioned train step is sliced to the
    device's 1/8 right after (a reduce-scatter on GPU / TPU), none is used whole; the
    activations are smaller than any weight (2 rows x 8 tokens a device), so every one of
    them is a gradient."""
    mesh = mesh_of(SHAPES["fsdp8"])
    _, _, dumps = H.compile_text(H.train_step_lowered(mesh, CFG, rows=16, seq=8), "spmd-partitioning")
    partitioned = next(text for name, text in dumps.items() if "after_spmd-partitioning" in name)
    weight = H.smallest_weight_matrix(CFG)
    found = H.gradient_all_reduces(partitioned, weight)
    # the layers' 7 matrices (stacked: one all-reduce each in the backward scan), the
    # embedding's gradient (its lookup) and the lm_head's
    assert len(found) >= 9, found
    for name, users in found:
        assert users and all(u.op == "dynamic-slice" for u in users), (name, [u.op for u in users])
        full = max(n for _, n in H._arrays(H.instruction(partitioned, name).type))
        assert all(H.elements(u) * 8 == full for u in users), (name, [u.line for u in users])


def test_each_process_samples_on_a_mesh_of_all_its_devices():
    """Simulated in one process (devices 0-3 as process 0, 4-7 as process 1): on 2 x 2 x 2
    a process's sampler mesh is its 2 x 2 block of the run's mesh (weights split over
    tensor as in training, rows over its 2 fsdp devices); on tensor=8 (tensor spans the
    processes) all its 4 devices on the row axis with the weights whole. `to_local` keeps
    the values, and a `Sampler` given those params samples on that mesh."""
    process_of = lambda d: d.id // 4  # noqa: E731
    host = M.init_params(jax.random.key(0), CFG)
    for shape, local_shape, q_spec in (
        ((2, 2, 2), {"data": 1, "fsdp": 2, "tensor": 2}, P(None, None, "tensor")),
        ((1, 1, 8), {"data": 4, "fsdp": 1, "tensor": 1}, P(None, None, None)),
    ):
        mesh = mesh_of(shape)
        local = parallel.local_mesh(mesh, 1, process_of=process_of)
        assert dict(local.shape) == local_shape and sorted(d.id for d in local.devices.flat) == [4, 5, 6, 7]
        params = parallel.to_local(jax.device_put(host, parallel.param_shardings(host, mesh)), mesh, local)
        q = params["layers"]["q_proj"]["kernel"]
        assert q.sharding.mesh == local and q.sharding.spec == q_spec
        for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert Sampler(params, CFG, max_len=16).mesh is local
    # one device per process: no mesh (the sampler runs unsharded on it)
    assert parallel.local_mesh(mesh_of((8, 1, 1)), 3, process_of=lambda d: d.id) is None
    with pytest.raises(ValueError, match="process 9 has no device"):
        parallel.local_mesh(mesh_of((8, 1, 1)), 9)
