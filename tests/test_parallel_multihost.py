"""Multi-host training simulated on one machine: 2 local processes x 4 CPU devices,
connected by `jax.distributed` (gloo collectives on CPU), each feeding only its half of
the global batch, give the same params, AdamW moments and metrics as 1 process x 8
devices on the same global batches and mesh shape (to float32 rounding: rtol 1e-5,
atol 1e-6; the cross-process all-reduce sums in its own order).

Also the single-process behaviour of `jaxagent.parallel.distributed` (no subprocess).
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from multiprocess_testlib import run_process_group

from jaxagent import parallel as par

WORKER = Path(__file__).with_name("parallel_worker.py")
TIMEOUT_S = 240


def _launch(out: Path, num_processes: int, devices: int, mode: str = "train") -> dict:
    """Runs the worker as `num_processes` processes (`run_process_group`)."""
    run_process_group(
        WORKER, num_processes, lambda pid, port: (out, num_processes, pid, port, devices, mode), out, TIMEOUT_S
    )
    with np.load(out / "result.npz") as f:
        result = {k: f[k] for k in f.files}
    result["rows"] = [np.load(out / f"rows_{pid}.npy") for pid in range(num_processes)]
    return result


def test_two_processes_build_one_global_batch_and_reduce_across(tmp_path):
    """Fast smoke (no model): each process gives its own rows; a jitted reduction over
    the global array crosses the processes; every row arrives where it belongs."""
    res = _launch(tmp_path, num_processes=2, devices=4, mode="smoke")
    a, b = res["rows"]
    assert len(a) == len(b) == 8 and sorted([*a, *b]) == list(range(16))
    full = np.arange(16 * 10, dtype=np.float32).reshape(16, 10)
    np.testing.assert_array_equal(res["x"], full)
    np.testing.assert_array_equal(res["row_sums"], full.sum(axis=1))
    assert float(res["total"]) == float(full.sum())


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    multi = _launch(tmp_path / "multi", num_processes=2, devices=4)
    single = _launch(tmp_path / "single", num_processes=1, devices=8)
    # each process fed a different half of the rows, and together all of them
    a, b = multi.pop("rows")
    assert len(a) == len(b) == 8 and sorted([*a, *b]) == list(range(16))
    np.testing.assert_array_equal(single.pop("rows")[0], np.arange(16))
    assert str(multi["spec/q_proj"]) == str(single["spec/q_proj"]) == "P(None, 'fsdp', 'tensor')"
    assert set(multi) == set(single)
    for k in single:
        if k.startswith(("param/", "mu/", "metric/")):
            np.testing.assert_allclose(multi[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert float(single["metric/2/step"]) == 3.0 and float(single["metric/0/skipped"]) == 0.0


@pytest.mark.slow  # two processes each compile a sampler on 4 devices and one on 1 (~25 s on 2 idle cores)
def test_each_process_samples_on_all_its_own_devices(tmp_path):
    """2 processes x 4 devices on a 2 x 2 x 2 mesh: `Placement.sampler_params` gives each
    process the params on a mesh of its 4 devices (weights split over tensor as in
    training, whole over fsdp), not on its first device, without a trip through the host;
    the sampler takes that mesh and samples what an unsharded sampler samples. On a mesh
    whose tensor axis spans the processes each gets the weights whole on its 4 devices."""
    run_process_group(WORKER, 2, lambda pid, port: (tmp_path, 2, pid, port, 4, "sampler"), tmp_path, TIMEOUT_S)
    found = [json.loads((tmp_path / f"sampler_{pid}.json").read_text()) for pid in range(2)]
    assert found[0]["local_devices"] != found[1]["local_devices"]
    for r in found:
        assert r["sampler_devices"] == r["local_devices"] and len(r["local_devices"]) == 4, r
        assert r["sampler_mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and r["sampler_is_placement_mesh"], r
        assert r["q_spec"] == "P(None, None, 'tensor')" and r["fully_addressable"], r
        assert r["values_equal"] and r["copy_is_fresh"] and r["same_samples"] == [True, True], r
        assert r["cache_spec"] == "P(None, 'fsdp', 'tensor', None, None)", r  # rows over its fsdp devices
        assert r["wide_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1} and r["wide_values_equal"], r
        assert r["wide_q_spec"] == "P(None, None, None)", r


# ----------------------------------------------------------------------------- one process
def test_initialize_is_a_noop_for_one_process(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXAGENT_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    assert par.initialize() is False
    assert par.initialize(num_processes=1) is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert par.initialize() is False
    assert par.is_primary()
    par.barrier("alone")  # no-op


def test_initialize_errors_name_what_is_missing(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXAGENT_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match=r"missing process_id \(JAX_PROCESS_ID\)"):
        par.initialize("127.0.0.1:1234", 2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer"):
        par.initialize()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"process_id \(JAX_PROCESS_ID\) must be an int in \[0, 2\)"):
        par.initialize()


def test_global_batch_and_rows_in_one_process():
    if len(jax.devices()) != 8:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")
    mesh = par.make_mesh(par.MeshConfig(2, 2, 2))
    np.testing.assert_array_equal(par.process_rows(mesh, 16), np.arange(16))
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    g = par.global_batch({"x": x, "none": None}, mesh, 16)
    assert g["none"] is None
    assert g["x"].sharding.spec == jax.P(("data", "fsdp"), None)
    np.testing.assert_array_equal(par.to_host(g)["x"], x)
    with pytest.raises(ValueError, match="must provide 16 rows"):
        par.global_batch({"x": x[:8]}, mesh, 16)
