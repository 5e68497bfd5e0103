"""The accelerator check (`jaxagent bench device`, benchmarks/device_check.py): its
arguments, its part runner (a failing part and an overrunning one are recorded and the
check goes on), the pytest report parsing, the recipe's overrides, and a `--small` run
end to end on CPU, as a user calls it."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_testlib import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.py"


DC = load_benchmark("device_check.py", "device_check_under_test")
COMMON = {"check": str, "kind": str, "status": str, "wall_s": float, "timeout_s": float, "small": bool, "date_utc": str}


def _common_fields(rec):
    for key, typ in COMMON.items():
        assert isinstance(rec[key], typ), (rec["kind"], key, rec.get(key))
    assert rec["check"] == "device" and rec["status"] in ("ok", "failed", "timeout", "skipped")
    assert rec["wall_s"] >= 0 and rec["timeout_s"] >= 0
    assert (rec["error"] is None) == (rec["status"] == "ok"), rec
    assert rec["error"] is None or isinstance(rec["error"], str)


# ----------------------------------------------------------------------------- arguments
def test_arguments_defaults_and_errors(tmp_path):
    a = DC.parse_args([])
    assert a.budget == DC.FULL_BUDGET_S == 480 and a.parts == list(DC.PARTS) and not a.small and a.out is None
    assert a.log is None and a.platform is None and a.recipe_set == []
    s = DC.parse_args(["--quick", "--out", str(tmp_path / "r" / "dc.jsonl"), "--parts", "device, w6"])
    assert s.small and s.budget == DC.SMALL_BUDGET_S and s.parts == ["device", "w6"]
    assert s.log == str(tmp_path / "r" / "dc.log")
    assert DC.parse_args(["--small", "--budget", "90"]).budget == 90
    for bad in (
        ["--parts", "device,gpu"],
        ["--budget", "0"],
        ["--recipe-set", "iterations"],
        ["--recipe-iterations", "0"],
    ):
        with pytest.raises(SystemExit):
            DC.parse_args(bad)
    # every part has a share; the shares of the parts run add up to 1
    assert set(DC.SHARES) == set(DC.PARTS) and sum(DC.SHARES.values()) == pytest.approx(1.0)


def test_bench_device_passes_its_options_and_refuses_the_others(capsys):
    import argparse

    from jaxagent import bench
    from jaxagent.cli import main

    ns = argparse.Namespace(
        workload="device", repeats=None, quick=False, out="dc.jsonl", systems=None, small=True, budget=120.0
    )
    cmd = bench.command(ns)
    assert cmd[:2] == [sys.executable, str(ROOT / "benchmarks" / "device_check.py")]
    assert cmd[2:] == ["--small", "--budget", "120.0", "--out", str(Path("dc.jsonl").resolve())]
    assert main(["bench", "update", "--small"]) == 2
    assert "--small are for the device check" in capsys.readouterr().err
    assert main(["bench", "device", "--repeats", "3"]) == 2
    assert "no --repeats" in capsys.readouterr().err
    assert main(["bench", "device", "--budget", "-1"]) == 2


# ----------------------------------------------------------------------------- the part runner
_SLEEPER = (
    "import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "print(os.getpid(), flush=True); time.sleep(120)"
)


def test_a_failing_part_and_an_overrunning_one_are_recorded_and_the_check_goes_on(tmp_path, capsys):
    """Four trivial parts in a 2.5 s budget: one ok, one raising, one whose subprocess
    ignores SIGINT and outlives its share (killed: status timeout), one ok after it."""
    out = tmp_path / "dc.jsonl"
    seen = {}

    def sleeper(ctx):
        try:
            ctx.run([sys.executable, "-c", _SLEEPER])
        except DC.PartTimeout as e:
            seen["pid"] = int(e.stdout.split()[0])
            e.fields = {"child_pid": seen["pid"]}
            raise
        return {}

    def boom(ctx):
        raise RuntimeError("boom")

    parts = [
        ("device", lambda ctx: {"platform": "cpu", "left_s": ctx.left()}),
        ("tests", boom),
        ("w6", sleeper),
        ("recipe", lambda ctx: {"ran": True}),
    ]
    args = DC.parse_args(["--budget", "2.5", "--out", str(out)])
    t = time.monotonic()
    rc = DC.Check(args, parts, min_part_s=0.05).run()
    took = time.monotonic() - t
    assert rc == 1 and took < 2.5 + 1.0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows  # stdout = the file
    assert [r["kind"] for r in rows] == ["device", "tests", "w6", "recipe", "summary"]
    for r in rows:
        _common_fields(r)
    by = {r["kind"]: r for r in rows}
    assert by["device"]["status"] == "ok" and by["device"]["platform"] == "cpu"
    # the device part could use its share plus nothing more: the later parts keep theirs
    assert by["device"]["left_s"] == pytest.approx(2.5 * DC.SHARES["device"], abs=0.2)
    assert by["tests"]["status"] == "failed" and by["tests"]["error"] == "RuntimeError: boom"
    assert "boom" in by["tests"]["traceback"]
    w6 = by["w6"]
    assert w6["status"] == "timeout" and "stopped after" in w6["error"]
    # its time: its share and what device and tests left; stopped at that, not later
    assert w6["timeout_s"] == pytest.approx(
        2.5 * (1 - DC.SHARES["recipe"]) - by["device"]["wall_s"] - by["tests"]["wall_s"], abs=0.2
    )
    assert w6["wall_s"] < w6["timeout_s"] + 0.5
    with pytest.raises(ProcessLookupError):  # SIGINT ignored, so SIGKILLed
        os.kill(seen["pid"], 0)
    assert by["recipe"]["status"] == "ok" and by["recipe"]["ran"] is True
    s = by["summary"]
    assert s["status"] == "failed" and s["failed_parts"] == ["tests", "w6"]
    assert s["parts"] == {"device": "ok", "tests": "failed", "w6": "timeout", "recipe": "ok"}
    assert "tests (failed)" in s["error"] and s["timeout_s"] == 2.5


def test_a_part_without_time_left_is_skipped(tmp_path):
    args = DC.parse_args(["--budget", "1", "--out", str(tmp_path / "dc.jsonl")])
    rc = DC.Check(args, [("device", lambda ctx: {})]).run()  # 1 s is under MIN_PART_S
    rows = [json.loads(line) for line in (tmp_path / "dc.jsonl").read_text().splitlines()]
    assert rc == 1 and [r["status"] for r in rows] == ["skipped", "failed"]
    assert "time budget" in rows[0]["error"]


# ----------------------------------------------------------------------------- pytest's report
_FAKE_TESTS = """
import pytest

def test_ok():
    pass

@pytest.mark.parametrize("shape", [(1, 2), (3, 4)], ids=str)
def test_param(shape):
    assert shape[0] == 1, "three is not one"

def test_skip():
    pytest.skip("not here")

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_error(broken):
    pass
"""


def test_junit_and_verbose_output_give_the_same_counts(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_alpha.py").write_text(_FAKE_TESTS)
    (tmp_path / "tests" / "test_beta.py").write_text("def test_b():\n    pass\n")
    selection = {"alpha": ("tests/test_alpha.py", "not skip_me"), "beta": ("tests/test_beta.py", None)}
    junit = tmp_path / "junit.xml"
    cmd = DC.test_command(selection, junit, include_slow=False)
    assert cmd[cmd.index("-k") + 1] == "(test_alpha and (not skip_me)) or test_beta"
    env = {**os.environ, "PYTHONPATH": ""}
    r = DC.run_subprocess(cmd, 120, env=env, cwd=tmp_path, workdir=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    got = DC.parse_junit(junit, selection)
    assert {k: got[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 6,
        "passed": 3,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
    }
    assert got["by_group"]["beta"] == {"tests": 1, "passed": 1, "failed": 0, "errors": 0, "skipped": 0}
    assert got["by_group"]["alpha"]["tests"] == 5
    fails = {f["test"]: f for f in got["failures"]}
    assert set(fails) == {"test_alpha::test_param[(3, 4)]", "test_alpha::test_error"}
    assert "three is not one" in fails["test_alpha::test_param[(3, 4)]"]["message"]
    assert (
        fails["test_alpha::test_error"]["kind"] == "error"
        and "fixture broke" in fails["test_alpha::test_error"]["detail"]
    )
    assert len(got["slowest"]) == 6 and all(x["time_s"] >= 0 for x in got["slowest"])
    # a run stopped before its report: the same counts from its -v lines (ids with spaces too)
    verbose = DC.parse_verbose(r.stdout, selection)
    assert {k: verbose[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        k: got[k] for k in ("tests", "passed", "failed", "errors", "skipped")
    }
    assert verbose["by_group"] == got["by_group"]
    assert {f["test"] for f in verbose["failures"]} == {
        "tests/test_alpha.py::test_param[(3, 4)]",
        "tests/test_alpha.py::test_error",
    }


def test_the_default_selection_names_existing_files():
    for selection in (DC.TESTS, DC.SMALL_TESTS):
        for file, _ in selection.values():
            assert (ROOT / file).is_file(), file


# ----------------------------------------------------------------------------- the recipe, W6's records
def test_recipe_overrides_load_as_configs(tmp_path):
    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train.config import TrainerConfig

    device, over = DC.recipe_overrides(DC.parse_args([]), tmp_path / "run")
    cfg = load_config(TrainerConfig, ROOT / device, over)
    assert cfg.iterations == 2 and cfg.model.compute_dtype == "bfloat16" and cfg.model.dtype == "float32"
    assert cfg.env.tasks_per_iteration * cfg.env.group_size == 128 and cfg.warm_start.episodes == 0
    assert cfg.eval.episodes == 0 and cfg.run_dir == str(tmp_path / "run")
    small, over = DC.recipe_overrides(DC.parse_args(["--small", "--recipe-set", "optim.lr=0.01"]), tmp_path / "r")
    cfg = load_config(TrainerConfig, ROOT / small, over)
    assert cfg.iterations == 1 and cfg.model.compute_dtype is None and cfg.optim.lr == 0.01
    # another config: only the check's own overrides (its dtype and batch are the config's)
    _, over = DC.recipe_overrides(DC.parse_args(["--recipe-config", "configs/countdown_grpo.yaml"]), tmp_path / "r")
    assert not set(DC.RECIPE_DEVICE_OVERRIDES) & set(over)


def test_summarize_w6_reads_the_measured_peaks():
    recs = [
        {"kind": "env", "backend": "gpu"},
        {"kind": "matmul_peak", "n": 8192, "dtype": "bfloat16", "best_tflops": 700.0, "median_tflops": 650.0},
        {
            "kind": "calib",
            "measured_peak_tflops": 700.0,
            "matmul_dtype": "bfloat16",
            "copy_gbps": 4000.0,
            "read_gbps": 4200.0,
            "nominal_bf16_tflops": 989.0,
            "nominal_hbm_gbps": 4800.0,
            "nominal_source": "x",
        },
        {"kind": "update_attempt_failed", "error": "RESOURCE_EXHAUSTED: oom"},
        {"kind": "policy_update", "mfu": 0.4, "tokens_per_s": 1e5},
        {"kind": "decode", "fraction_of_measured_copy": 0.6, "achieved_hbm_gbps": 2400.0},
        {"kind": "summary", "parts": {"calib": "ok", "update": "ok", "decode": "ok"}},
    ]
    s = DC.summarize_w6(recs)
    assert s["matmul_peak_tflops"] == 700.0 and s["copy_gbps"] == 4000.0 and s["update_mfu"] == 0.4
    assert s["decode_fraction_of_measured_copy"] == 0.6 and s["decode"]["achieved_hbm_gbps"] == 2400.0
    assert s["w6_errors"] == ["RESOURCE_EXHAUSTED: oom"] and s["w6_records"] == 7 and not s["w6_aborted"]
    assert s["nominal"]["nominal_source"] == "x"
    empty = DC.summarize_w6([])
    assert empty["w6_parts"] is None and empty["update"] is None and empty["matmul_peak_tflops"] is None


# ----------------------------------------------------------------------------- end to end
def _positive(rec, *keys):
    for k in keys:
        v = rec[k]
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, (
            rec["kind"],
            k,
            v,
        )


@pytest.mark.slow  # ~55-100 s on the shared 2-core machine (4 subprocesses that each compile): the default
#                    suite is at its 15-minute limit; the cheap tests above cover the runner and the parsing
def test_small_check_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "dc.jsonl"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxagent", "bench", "device", "--small", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert proc.returncode == 0, (proc.stderr[-3000:], [(r["kind"], r["status"], r["error"]) for r in rows])
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == rows
    assert [r["kind"] for r in rows] == ["device", "tests", "w6", "recipe", "summary"]
    for r in rows:
        _common_fields(r)
        assert r["status"] == "ok" and r["small"] is True
        _positive(r, "wall_s", "timeout_s")
    by = {r["kind"]: r for r in rows}

    dev = by["device"]
    assert dev["platform"] == "cpu" and dev["jax_platforms"] == "cpu" and dev["device_kind"] == "cpu"
    assert dev["devices"] and all("cpu" in d.lower() for d in dev["devices"]) and dev["device_count"] >= 1
    assert dev["kernel_ok"] is True and dev["bytes_limit"] is None  # a CPU reports no allocator limit
    assert dev["jax"] and dev["jaxlib"] and dev["python"] == ".".join(map(str, sys.version_info[:3]))
    assert isinstance(dev["jax_plugins"], dict) and isinstance(dev["os"], str)
    assert dev["git_commit"] is None or len(dev["git_commit"]) == 40  # None: a copy without .git

    t = by["tests"]
    assert t["jax_platforms"] == "cpu" and t["counts_from"] == "junit" and t["failed"] == t["errors"] == 0
    assert t["tests"] == t["passed"] + t["skipped"] and t["passed"] >= 4
    assert set(t["by_group"]) == set(DC.SMALL_TESTS) and t["failures"] == []
    assert all(x["time_s"] >= 0 for x in t["slowest"])

    w6 = by["w6"]
    assert w6["w6_parts"] == {"calib": "ok", "update": "ok", "decode": "ok"} and w6["backend"] == "cpu"
    _positive(w6, "matmul_peak_tflops", "copy_gbps", "read_gbps", "update_mfu", "decode_fraction_of_measured_copy")
    _positive(w6["update"], "tokens_per_s", "median_step_s", "achieved_tflops", "mfu")
    assert w6["update"]["mfu"] == pytest.approx(w6["update"]["achieved_tflops"] / w6["matmul_peak_tflops"])
    _positive(w6["decode"], "decode_tokens_per_s", "achieved_hbm_gbps")
    assert w6["decode"]["measured_copy_gbps"] == w6["copy_gbps"]
    assert w6["nominal"] == {"nominal_bf16_tflops": None, "nominal_hbm_gbps": None, "nominal_source": None}
    kept = [json.loads(line) for line in Path(w6["w6_jsonl"]).read_text().splitlines()]
    assert kept[0]["kind"] == "env" and kept[-1]["kind"] == "summary" and len(kept) == w6["w6_records"]

    rc = by["recipe"]
    assert rc["config"] == DC.RECIPE_CONFIG and rc["iterations_wanted"] == 1 and len(rc["iterations"]) == 1
    _positive(rc["iterations"][0], "time_iteration_s", "time_update_s", "policy_tokens")
    assert math.isfinite(rc["iterations"][0]["loss"]) and "memory per device" in rc["memory_estimate"]

    s = by["summary"]
    assert s["parts"] == {p: "ok" for p in DC.PARTS} and s["failed_parts"] == [] and s["device_kind"] == "cpu"
    assert s["wall_s"] >= sum(by[p]["wall_s"] for p in DC.PARTS) and s["tests_passed"] == t["passed"]
    assert (tmp_path / "dc.log").is_file() and "w6_gpu.py" in (tmp_path / "dc.log").read_text()
