"""The accelerator check: one command to run the day a device is lent (issue 50).

    jaxagent bench device --out benchmarks/results/device_check.jsonl
    python benchmarks/device_check.py [--small] [--budget SECONDS] [--out FILE] [--parts LIST]

Made to finish inside 8 minutes on one GPU (`--budget`, default 480 s). Four parts, each
in subprocesses of its own, so that a crash, a hang or an out-of-memory costs that part
and not the check, and so that no process holds the accelerator's memory while another
part runs (this process never imports JAX):

device  The device and the versions, from a probe process: `jax.devices()`, the device
        kind, `memory_stats()` (`bytes_limit`: what the allocator may use), one small
        kernel run, the platform the later parts are given (`JAX_PLATFORMS`: cuda, rocm,
        tpu or cpu); Python, jax, jaxlib, the JAX plugins (jax-cuda*-plugin / -pjrt,
        libtpu), the NVIDIA wheels (CUDA runtime, cuDNN, cuBLAS, NCCL) and `nvidia-smi`'s
        driver and CUDA version where there are any; the OS, the host and the git commit
        (`JAXAGENT_GIT_COMMIT` where the copy has no .git). Without `--small`, a device
        that is only a CPU fails this part (`--allow-cpu` accepts it).
tests   The accelerator-relevant tests (`TESTS`), one pytest process with `JAX_PLATFORMS`
        set to the device's platform and the slow-marked cases included: the sampler's
        layer scan against its unrolled layers, the chunked log-probs, parity with
        Hugging Face transformers, the train step, mixed precision, the memory estimate
        against the compiled programs and the real allocator, every shipped config
        compiled within its estimate, the accelerator exports, the matmul precision.
        Counts and failures come from pytest's JUnit XML (`--junitxml`); a run stopped at
        its time share keeps the counts of its verbose output so far.
w6      W6 (`benchmarks/w6_gpu.py --parts calib,update,decode`, its budget inside this
        part's share): a large matmul's FLOP/s (in the update's dtype) and a large device
        copy's bytes/s measured in that process, the update's MFU and the decode's
        bandwidth against those measured peaks (datasheet figures only where the device
        kind is known, labelled `nominal`). Its raw lines are kept beside `--out`
        (`<out>_w6.jsonl`).
recipe  Iterations of a training recipe through `jaxagent train` (`--recipe-config`,
        default configs/tiny_countdown_grpo.yaml; on the device 2 iterations of 16 tasks x
        8 episodes in bf16 compute with float32 master weights; `--small`: one iteration
        of the config as shipped), no warm start or evaluation; its metrics.jsonl.

Time: each part gets its share of the budget (`SHARES`) plus whatever the parts before it
left unused, the later parts keeping theirs. A subprocess still running when its part's
time is up is stopped (SIGINT, then SIGKILL of its process group `GRACE_S` later) and the
part is recorded with status "timeout"; a part with under `MIN_PART_S` left is "skipped".

Output: JSON lines, one per part in this order (device, tests, w6, recipe) and a summary,
printed and appended to `--out`. Every line has `check` ("device"), `kind` (the part, or
"summary"), `status` ("ok", "failed", "timeout", "skipped"), `error` (null when ok),
`wall_s`, `timeout_s`, `small` and `date_utc`, then the part's fields. The subprocesses'
output goes to `--log` (default: `--out` with `.log`). Exit status 0 when every part is
ok, else 1 (2 for bad arguments).

`--small` is the same end to end on a CPU in a minute or two: a handful of tests, W6's
tiny model, one iteration of the tiny recipe (the test `tests/test_bench_device.py`).

Where the project is not installed (a lent device's image: its own Python with a CUDA
JAX, nothing installable), run this script with that Python from the repository's root;
the parts get the repository on PYTHONPATH. Through this workplace's device tool:
run(command="JAXAGENT_GIT_COMMIT=<sha> python3 benchmarks/device_check.py
--out $OUT/device_check.jsonl", timeout_s=560); its three files (the lines, W6's lines,
the log) come back.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _jsonl import emit  # noqa: E402

PARTS = ("device", "tests", "w6", "recipe")
#: each part's share of the budget (normalised over the parts run)
SHARES = {"device": 0.06, "tests": 0.38, "w6": 0.38, "recipe": 0.18}
FULL_BUDGET_S = 480.0
SMALL_BUDGET_S = 300.0
GRACE_S = 10.0  # from SIGINT to SIGKILL of a part's process group
MIN_PART_S = 5.0  # a part with less time left is skipped

#: the accelerator-relevant tests: group -> (file, -k expression within that file or None)
TESTS = {  # run in this order: a run stopped at its time share has done the first ones
    "sampler": (
        "tests/test_rollout_sampler.py",
        "unrolled_layers_equal_the_layer_scan or greedy_matches_full_forward or temperature_logprobs "
        "or continuation_equals or append_in_pieces or prefill_shares",
    ),
    "logprobs": ("tests/test_models_logprobs.py", None),
    "precision": ("tests/test_matmul_precision.py", None),
    "train_step": ("tests/test_train_step.py", "not sharded"),
    "mixed_precision": ("tests/test_train_mixed_precision.py", None),
    "memory": ("tests/test_train_memory.py", "not cpu_check"),
    "hf_parity": (
        "tests/test_models_hf.py",
        "logits_match or packed_segments or kv_cache_prefill or bfloat16_params or gradients_match",
    ),
    "compiled": ("tests/test_train_compiled.py", "every_shipped_config"),
    "export": ("tests/test_export_accelerators.py", "not on_the_cpu"),
}
#: --small: a handful of quick ones (seconds each on CPU; the allocator's is skipped there)
SMALL_TESTS = {
    "sampler": ("tests/test_rollout_sampler.py", "append_in_pieces"),
    "logprobs": ("tests/test_models_logprobs.py", "never_materialises"),
    "memory": ("tests/test_train_memory.py", "allocators_peak"),
    "precision": ("tests/test_matmul_precision.py", "auto_is_highest or lowered_program"),
}
RECIPE_CONFIG = "configs/tiny_countdown_grpo.yaml"
#: the default recipe's overrides on a device (bf16 compute, float32 masters; a GPU-sized batch)
RECIPE_DEVICE_OVERRIDES = ("model.compute_dtype=bfloat16", "env.tasks_per_iteration=16", "env.group_size=8")


# ============================================================================ running parts
class PartError(Exception):
    """A part that failed, with the fields it measured before failing."""

    def __init__(self, message: str, fields: dict | None = None):
        super().__init__(message)
        self.fields = fields or {}


class PartTimeout(PartError):
    """A part's subprocess outlived the part's time and was stopped."""

    def __init__(self, message: str, stdout: str = "", stderr: str = "", fields: dict | None = None):
        super().__init__(message, fields)
        self.stdout, self.stderr = stdout, stderr


@dataclasses.dataclass
class Completed:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:] if text else ""


def run_subprocess(
    cmd: list,
    timeout: float,
    *,
    env: dict | None = None,
    cwd: Path = ROOT,
    grace: float = GRACE_S,
    log: Path | None = None,
    workdir: Path | None = None,
) -> Completed:
    """Run `cmd` in a process group of its own, stdout and stderr to files; after
    `timeout - grace` seconds SIGINT the group (pytest then still writes its report), after
    `timeout` SIGKILL it and raise `PartTimeout` with the output so far."""
    grace = min(grace, max(timeout, 0.0) / 4)
    tmp = Path(tempfile.mkdtemp(prefix="dc_", dir=workdir))
    out_path, err_path = tmp / "stdout", tmp / "stderr"
    t = time.monotonic()
    timed_out = False
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=fo,
            stderr=fe,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            try:
                proc.wait(timeout=max(timeout - grace, 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
                _signal_group(proc, signal.SIGINT)
                try:
                    proc.wait(timeout=max(grace, 0.01))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None or timed_out:
                _signal_group(proc, signal.SIGKILL)  # the whole group: workers a part started too
            proc.wait()
    seconds = time.monotonic() - t
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if log is not None:
        with open(log, "a") as f:
            f.write(
                f"==== {shlex.join(str(c) for c in cmd)}  (exit {proc.returncode}, {seconds:.1f} s"
                f"{', stopped: time up' if timed_out else ''})\n---- stdout\n{stdout}\n---- stderr\n{stderr}\n"
            )
    if timed_out:
        raise PartTimeout(
            f"stopped after {seconds:.0f} s (its time share of {timeout:.0f} s ran out): "
            f"{shlex.join(str(c) for c in cmd[:4])} ...",
            stdout,
            stderr,
        )
    return Completed(list(cmd), proc.returncode, stdout, stderr, seconds)


def _signal_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclasses.dataclass
class PartContext:
    """What a part function gets: the check (arguments, environment) and its own deadline."""

    check: Check
    name: str
    deadline: float
    workdir: Path

    @property
    def args(self):
        return self.check.args

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, **extra) -> dict:
        return self.check.env(self.name, **extra)

    def run(self, cmd: list, env: dict | None = None) -> Completed:
        return run_subprocess(
            cmd, self.left(), env=env if env is not None else self.env(), log=self.check.log_path, workdir=self.workdir
        )


PartFn = Callable[[PartContext], dict]


class Check:
    """Runs the parts in order, each within its time, and writes their JSON lines."""

    def __init__(
        self,
        args,
        parts: list[tuple[str, PartFn]] | None = None,
        t0: float | None = None,
        min_part_s: float = MIN_PART_S,
    ):
        self.args, self.min_part_s = args, min_part_s
        self.parts = parts if parts is not None else [(p, PART_FUNCS[p]) for p in args.parts]
        self.t0 = time.monotonic() if t0 is None else t0
        self.deadline = self.t0 + args.budget
        self.jax_platforms = args.platform
        self.records: dict[str, dict] = {}
        self.log_path = Path(args.log) if args.log else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def shares(self) -> dict[str, float]:
        raw = {n: SHARES.get(n, 0.25) for n, _ in self.parts}
        total = sum(raw.values()) or 1.0
        return {n: v / total for n, v in raw.items()}

    def env(self, part: str, **extra) -> dict:
        """The environment of a part's subprocesses: the repository importable, unbuffered
        output, `JAX_PLATFORMS` the device's platform (once the device part found it)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        if self.jax_platforms:
            env["JAX_PLATFORMS"] = self.jax_platforms
        on_cpu = env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu"
        if on_cpu and self.args.small and "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
            # tiny programs on CPU: LLVM's optimisation is most of their compile time
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
        if part in ("device", "tests"):
            # no preallocated pool: the probe is a glance, the tests run children of their own
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if part == "w6":
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # as benchmarks/run_w6_gpu.sh
        env.update(extra)
        return env

    def common(self) -> dict:
        return {
            "check": "device",
            "small": bool(self.args.small),
            "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }

    def emit(self, rec: dict) -> None:
        emit(rec, self.args.out)

    def say(self, msg: str) -> None:
        print(f"[device-check +{time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def run_part(self, name: str, fn: PartFn, timeout: float, workdir: Path) -> dict:
        start = time.monotonic()
        fields: dict = {}
        if timeout < self.min_part_s:
            status, error = (
                "skipped",
                (f"time budget: {max(timeout, 0):.1f} s left for this part (under {self.min_part_s:.1f} s)"),
            )
        else:
            self.say(f"{name}: start ({timeout:.0f} s)")
            part_dir = workdir / name
            part_dir.mkdir(parents=True, exist_ok=True)
            try:
                fields = fn(PartContext(self, name, start + timeout, part_dir)) or {}
                status, error = "ok", None
            except PartTimeout as e:
                status, error, fields = "timeout", str(e), e.fields
                if not fields:
                    fields = {"stderr_tail": _tail(e.stderr)}
            except PartError as e:
                status, error, fields = "failed", str(e), e.fields
            except Exception as e:  # noqa: BLE001  (a part's failure must not stop the check)
                status, error = "failed", f"{type(e).__name__}: {e}"
                fields = {"traceback": traceback.format_exc()[-3000:]}
        wall = time.monotonic() - start
        rec = {
            **self.common(),
            "kind": name,
            "status": status,
            "error": error,
            "wall_s": round(wall, 2),
            "timeout_s": round(max(timeout, 0.0), 1),
        }
        rec.update({k: v for k, v in fields.items() if k not in rec})
        self.say(f"{name}: {status} in {wall:.1f} s" + (f": {error[:300]}" if error else ""))
        return rec

    def run(self) -> int:
        shares = self.shares()
        with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
            for i, (name, fn) in enumerate(self.parts):
                reserved = sum(shares[n] for n, _ in self.parts[i + 1 :]) * self.args.budget
                timeout = self.deadline - time.monotonic() - reserved
                rec = self.run_part(name, fn, timeout, Path(tmp))
                self.records[name] = rec
                self.emit(rec)
        statuses = {n: r["status"] for n, r in self.records.items()}
        bad = [n for n, s in statuses.items() if s != "ok"]
        summary = {
            **self.common(),
            "kind": "summary",
            "status": "ok" if not bad else "failed",
            "error": f"not ok: {', '.join(f'{n} ({statuses[n]})' for n in bad)}" if bad else None,
            "wall_s": round(time.monotonic() - self.t0, 2),
            "timeout_s": float(self.args.budget),
            "parts": statuses,
            "failed_parts": bad,
            **self.headline(),
        }
        self.emit(summary)
        self.say(f"done in {summary['wall_s']:.0f} s: {statuses}")
        return 1 if bad else 0

    def headline(self) -> dict:
        """The few figures a reader wants first, from the parts' records (null where absent)."""
        g = lambda part, key: self.records.get(part, {}).get(key)  # noqa: E731
        return {
            "device_kind": g("device", "device_kind"),
            "jax_platforms": self.jax_platforms,
            "jax": g("device", "jax"),
            "tests_passed": g("tests", "passed"),
            "tests_failed": g("tests", "failed"),
            "tests_errors": g("tests", "errors"),
            "matmul_peak_tflops": g("w6", "matmul_peak_tflops"),
            "copy_gbps": g("w6", "copy_gbps"),
            "update_mfu": g("w6", "update_mfu"),
            "decode_fraction_of_measured_copy": g("w6", "decode_fraction_of_measured_copy"),
            "recipe_iterations": len(g("recipe", "iterations") or []) or None,
            "recipe_last_iteration_s": g("recipe", "last_iteration_s"),
        }


# ============================================================================ part: device
def git_info() -> dict:
    """The commit of this checkout (`git rev-parse HEAD`), whether tracked files differ from it,
    else `JAXAGENT_GIT_COMMIT` (a copy of the tree without .git, as on a lent device)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        if head.returncode == 0 and head.stdout.strip():
            st = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=20,
            )
            return {
                "git_commit": head.stdout.strip(),
                "git_dirty": bool(st.stdout.strip()) if st.returncode == 0 else None,
                "git_source": "git",
            }
    except (OSError, subprocess.SubprocessError):
        pass
    commit = os.environ.get("JAXAGENT_GIT_COMMIT")
    return {"git_commit": commit, "git_dirty": None, "git_source": "JAXAGENT_GIT_COMMIT" if commit else None}


def _packages() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            out[name] = dist.version
    return out


def _nvidia_smi() -> dict | None:
    try:
        proc = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return {"error": _tail(proc.stderr or proc.stdout, 500)}
    drv = re.search(r"Driver Version:\s*([\w.]+)", proc.stdout)
    cuda = re.search(r"CUDA Version:\s*([\w.]+)", proc.stdout)
    return {"driver_version": drv.group(1) if drv else None, "cuda_version": cuda.group(1) if cuda else None}


def probe() -> dict:
    """The device record, in the process that imports JAX (`device_check.py --probe`)."""
    t = time.perf_counter()
    import jax
    import jax.numpy as jnp

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    devices = jax.devices()
    dev = devices[0]
    init_s = time.perf_counter() - t
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001  (backends without stats raise or return None)
        stats = None
    stats = {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))} if stats else None
    t = time.perf_counter()
    n = 512
    total = float(jax.jit(lambda a: (a @ a).sum())(jnp.ones((n, n), jnp.float32)))
    kernel_s = time.perf_counter() - t
    try:
        platform_version = str(dev.client.platform_version)
    except Exception:  # noqa: BLE001
        platform_version = None
    plat = dev.platform
    jax_platforms = ("rocm" if "rocm" in (platform_version or "").lower() else "cuda") if plat == "gpu" else plat
    pkgs = _packages()
    plugins = {k: v for k, v in sorted(pkgs.items()) if k.startswith(("jax-", "libtpu"))}
    cuda_pkgs = {
        k: v
        for k, v in sorted(pkgs.items())
        if k.startswith(("nvidia-cudnn", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-nccl", "nvidia-cuda-nvcc"))
    }
    libs = {k: pkgs.get(k) for k in ("numpy", "flax", "optax", "orbax-checkpoint", "pytest", "torch", "transformers")}
    try:
        env_info = jax.print_environment_info(return_string=True)
    except Exception as e:  # noqa: BLE001
        env_info = f"{type(e).__name__}: {e}"
    return {
        "platform": plat,
        "jax_platforms": jax_platforms,
        "device_kind": dev.device_kind,
        "devices": [str(d) for d in devices],
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "platform_version": platform_version,
        "memory_stats": stats,
        "bytes_limit": (stats or {}).get("bytes_limit"),
        "kernel_ok": total == float(n) ** 3,
        "import_s": round(import_s, 3),
        "backend_init_s": round(init_s, 3),
        "first_kernel_s": round(kernel_s, 3),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "jax": jax.__version__,
        "jaxlib": pkgs.get("jaxlib"),
        "jax_plugins": plugins,
        "cuda_packages": cuda_pkgs,
        "nvidia_smi": _nvidia_smi() if plat == "gpu" else None,
        "libraries": libs,
        "os": platform.platform(),
        "machine": platform.machine(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "jax_environment_info": env_info,
        "env": {
            k: os.environ.get(k)
            for k in (
                "JAX_PLATFORMS",
                "XLA_FLAGS",
                "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "XLA_PYTHON_CLIENT_PREALLOCATE",
                "CUDA_VISIBLE_DEVICES",
            )
        },
    }


def part_device(ctx: PartContext) -> dict:
    r = ctx.run([sys.executable, str(Path(__file__).resolve()), "--probe"])
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise PartError(f"the probe exited {r.returncode}: {_tail(r.stderr, 1500)}", git_info())
    info = {**json.loads(lines[-1]), **git_info()}
    if ctx.check.jax_platforms is None:
        ctx.check.jax_platforms = info["jax_platforms"]
    info["jax_platforms_used"] = ctx.check.jax_platforms
    if not info["kernel_ok"]:
        raise PartError("a 512 x 512 matmul of ones gave the wrong sum on this device", info)
    if info["platform"] == "cpu" and not ctx.args.small and not ctx.args.allow_cpu:
        raise PartError(
            "JAX sees no accelerator here (platform cpu; check the jax plugin for this device, "
            "see jax_environment_info): the rest runs on the CPU; --small is the CPU check, "
            "--allow-cpu accepts a CPU",
            info,
        )
    return info


# ============================================================================ part: tests
def test_command(selection: dict, junit: Path, *, include_slow: bool, extra: list | None = None) -> list:
    """pytest on the selection's files, one -k expression (each file's own, joined by the
    file's name), verbose (a stopped run's progress), JUnit XML to `junit`."""
    files, terms = [], []
    for file, k in selection.values():
        if file not in files:
            files.append(file)
        stem = Path(file).stem
        terms.append(f"({stem} and ({k}))" if k else stem)
    return [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-k",
        " or ".join(terms),
        "-m",
        "slow or not slow" if include_slow else "not slow",
        "-v",
        "-rfE",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *(extra or []),
    ]


def _group_of(selection: dict) -> dict[str, str]:
    return {Path(file).stem: group for group, (file, _) in selection.items()}


def _empty_counts() -> dict:
    return {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}


def parse_junit(path: Path, selection: dict) -> dict:
    """Counts (all and per group), failures and the slowest tests of a pytest JUnit XML."""
    groups = _group_of(selection)
    counts, by_group, failures, times = _empty_counts(), {}, [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        module = classname.split(".")[-1] if classname else ""
        if module and module not in groups:  # a class inside a module: classname ends with it
            module = next((m for m in classname.split(".") if m in groups), module)
        test = f"{module}::{name}"
        seconds = float(case.get("time") or 0.0)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                failures.append(
                    {
                        "test": test,
                        "kind": child.tag,
                        "message": (child.get("message") or "")[:500],
                        "detail": _tail(child.text or "", 1500),
                        "time_s": seconds,
                    }
                )
                break
            if child.tag == "skipped":
                outcome = "skipped"
                break
        g = by_group.setdefault(groups.get(module, module), _empty_counts())
        for c in (counts, g):
            c["tests"] += 1
            c[outcome] += 1
        times.append((seconds, test))
    times.sort(reverse=True)
    return {
        **counts,
        "by_group": by_group,
        "failures": failures,
        "tests_time_s": round(sum(s for s, _ in times), 2),
        "slowest": [{"test": t, "time_s": round(s, 2)} for s, t in times[:10]],
    }


#: a `-v` progress line: "tests/test_x.py::test_y[param id, spaces allowed] PASSED   [ 10%]"
_VERBOSE = re.compile(r"^(\S+\.py::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?= |$)", re.M)


def parse_verbose(stdout: str, selection: dict) -> dict:
    """Counts from pytest's `-v` lines (a run stopped before writing its report)."""
    groups = _group_of(selection)
    counts, by_group, failures = _empty_counts(), {}, []
    key = {
        "PASSED": "passed",
        "XPASS": "passed",
        "FAILED": "failed",
        "ERROR": "errors",
        "SKIPPED": "skipped",
        "XFAIL": "skipped",
    }
    for nodeid, word in _VERBOSE.findall(stdout):
        module = Path(nodeid.split("::")[0]).stem
        g = by_group.setdefault(groups.get(module, module), _empty_counts())
        for c in (counts, g):
            c["tests"] += 1
            c[key[word]] += 1
        if word in ("FAILED", "ERROR"):
            failures.append({"test": nodeid, "kind": "failure" if word == "FAILED" else "error"})
    return {**counts, "by_group": by_group, "failures": failures}


def part_tests(ctx: PartContext) -> dict:
    selection = SMALL_TESTS if ctx.args.small else TESTS
    junit = ctx.workdir / "junit.xml"
    cmd = test_command(selection, junit, include_slow=not ctx.args.small, extra=shlex.split(ctx.args.pytest_args))
    env = ctx.env()
    fields = {
        "jax_platforms": env.get("JAX_PLATFORMS"),
        "selection": {g: {"file": f, "k": k} for g, (f, k) in selection.items()},
        "command": shlex.join(str(c) for c in cmd[1:]),
    }
    try:
        r = ctx.run(cmd, env=env)
    except PartTimeout as e:
        got = parse_junit(junit, selection) if junit.is_file() else parse_verbose(e.stdout, selection)
        e.fields = {
            **fields,
            **got,
            "counts_from": "junit" if junit.is_file() else "verbose output",
            "stdout_tail": _tail(e.stdout, 1500),
        }
        raise
    if not junit.is_file():
        raise PartError(
            f"pytest exited {r.returncode} without a report: {_tail(r.stderr or r.stdout, 1500)}",
            {**fields, "pytest_exit": r.returncode},
        )
    got = {**fields, **parse_junit(junit, selection), "counts_from": "junit", "pytest_exit": r.returncode}
    if r.returncode != 0 or got["failed"] or got["errors"] or not got["tests"]:
        what = f"{got['failed']} failed, {got['errors']} errors of {got['tests']}"
        raise PartError(
            f"pytest exited {r.returncode}: {what}"
            + (f" ({got['failures'][0]['test']}: {got['failures'][0]['message'][:200]})" if got["failures"] else ""),
            got,
        )
    return got


# ============================================================================ part: w6
def w6_command(ctx: PartContext, out: Path) -> tuple[list, float]:
    """W6's command line: its budget and watchdog end it before this part's time does."""
    left = ctx.left()
    grace_w6 = max(2.0, min(20.0, 0.08 * left))
    budget = max(1.0, left - min(GRACE_S, left / 4) - grace_w6 - 5.0)
    cmd = [
        sys.executable,
        str(HERE / "w6_gpu.py"),
        "--parts",
        "calib,update,decode",
        "--budget-s",
        f"{budget:.0f}",
        "--grace-s",
        f"{grace_w6:.0f}",
        "--out",
        str(out),
    ]
    if ctx.args.small:
        cmd += ["--small", "--steps", "2", "--decode-repeats", "1"]
    else:
        cmd += ["--steps", "3", "--decode-repeats", "2", "--calib-reps", "3"]
    return cmd + shlex.split(ctx.args.w6_args), budget


def summarize_w6(recs: list[dict]) -> dict:
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r.get("kind"), []).append(r)
    first = lambda kind: (by.get(kind) or [None])[0]  # noqa: E731
    calib, up, dec, summ, env = first("calib"), first("policy_update"), first("decode"), first("summary"), first("env")
    keep = lambda r, keys: None if r is None else {k: r.get(k) for k in keys}  # noqa: E731
    return {
        "w6_records": len(recs),
        "w6_parts": None if summ is None else summ.get("parts"),
        "w6_aborted": first("aborted") is not None,
        "w6_errors": [
            r.get("error", "")[:500] for r in by.get("part_failed", []) + by.get("update_attempt_failed", [])
        ],
        "backend": None if env is None else env.get("backend"),
        "matmul_dtype": None if calib is None else calib.get("matmul_dtype"),
        "matmul_peak_tflops": None if calib is None else calib.get("measured_peak_tflops"),
        "copy_gbps": None if calib is None else calib.get("copy_gbps"),
        "read_gbps": None if calib is None else calib.get("read_gbps"),
        "matmuls": [keep(r, ("n", "dtype", "best_tflops", "median_tflops")) for r in by.get("matmul_peak", [])],
        "update": keep(
            up,
            (
                "batch",
                "seq",
                "remat",
                "num_micro_batches",
                "compile_s",
                "median_step_s",
                "tokens_per_s",
                "model_flops",
                "achieved_tflops",
                "measured_peak_tflops",
                "mfu",
                "mfu_vs_nominal",
                "temp_bytes",
                "peak_bytes_in_use",
                "device_memory_limit",
            ),
        ),
        "update_mfu": None if up is None else up.get("mfu"),
        "decode": keep(
            dec,
            (
                "decode_batch",
                "prompt_len",
                "new_tokens",
                "decode_tokens_per_s",
                "decode_step_s",
                "prefill_tokens_per_s",
                "bytes_per_step",
                "achieved_hbm_gbps",
                "measured_copy_gbps",
                "fraction_of_measured_copy",
                "measured_read_gbps",
                "fraction_of_measured_read",
                "fraction_of_nominal_hbm",
            ),
        ),
        "decode_fraction_of_measured_copy": None if dec is None else dec.get("fraction_of_measured_copy"),
        "nominal": None
        if calib is None
        else {k: calib.get(k) for k in ("nominal_bf16_tflops", "nominal_hbm_gbps", "nominal_source")},
    }


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def part_w6(ctx: PartContext) -> dict:
    out = ctx.workdir / "w6.jsonl"
    cmd, budget = w6_command(ctx, out)
    fields = {"command": shlex.join(str(c) for c in cmd[1:]), "w6_budget_s": budget}
    keep = Path(ctx.args.out).with_name(Path(ctx.args.out).stem + "_w6.jsonl") if ctx.args.out else None

    def results() -> dict:
        recs = _read_jsonl(out)
        if keep is not None and recs:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with open(keep, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)
        return {**fields, **summarize_w6(recs), "w6_jsonl": str(keep) if keep is not None and recs else None}

    try:
        r = ctx.run(cmd, env=ctx.env())
    except PartTimeout as e:
        e.fields = {**results(), "stderr_tail": _tail(e.stderr, 1500)}
        raise
    got = results()
    parts = got["w6_parts"] or {}
    bad = {p: parts.get(p, "missing") for p in ("calib", "update", "decode") if parts.get(p) != "ok"}
    if r.returncode != 0 or bad:
        raise PartError(
            f"W6 exited {r.returncode}; parts not ok: {bad or parts}"
            + (
                f"; {got['w6_errors'][0][:300]}"
                if got["w6_errors"]
                else f"; {_tail(r.stderr, 500)}"
                if r.returncode
                else ""
            ),
            got,
        )
    return got


# ============================================================================ part: recipe
def recipe_overrides(args, run_dir: Path) -> tuple[str, list[str]]:
    """The recipe's config and overrides: `--recipe-config` (default the tiny Countdown
    GRPO config; on a device with bf16 compute and a GPU-sized batch), no warm start or
    evaluation, `--recipe-iterations` (default 2; 1 with --small), then `--recipe-set`."""
    config = args.recipe_config or RECIPE_CONFIG
    iterations = args.recipe_iterations or (1 if args.small else 2)
    out = [
        f"run_dir={run_dir}",
        f"iterations={iterations}",
        "warm_start=null",
        "eval.episodes=0",
        "eval.every=0",
        "logging.tensorboard=false",
    ]
    if args.recipe_config is None and not args.small:
        out += list(RECIPE_DEVICE_OVERRIDES)
    return config, out + list(args.recipe_set)


_ITER_KEYS = (
    "iteration",
    "time_iteration_s",
    "time_rollout_s",
    "time_logprobs_s",
    "time_update_s",
    "tokens_per_s",
    "policy_tokens",
    "reward_mean",
    "loss",
    "grad_norm",
    "skipped_updates",
)


def part_recipe(ctx: PartContext) -> dict:
    run_dir = ctx.workdir / "run"
    config, overrides = recipe_overrides(ctx.args, run_dir)
    cmd = [sys.executable, "-m", "jaxagent", "train", "--config", config, *overrides]
    want = int(next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("iterations=")))

    def results(stdout: str = "", stderr: str = "") -> dict:
        its = [{k: m.get(k) for k in _ITER_KEYS} for m in _read_jsonl(run_dir / "metrics.jsonl")]
        mem = [x for x in (stdout + "\n" + stderr).splitlines() if "memory per device" in x]
        return {
            "config": config,
            "overrides": overrides[1:],
            "iterations_wanted": want,
            "iterations": its,
            "last_iteration_s": its[-1]["time_iteration_s"] if its else None,
            "memory_estimate": mem[-1].strip()[:500] if mem else None,
        }

    try:
        r = ctx.run(cmd)
    except PartTimeout as e:
        e.fields = {**results(e.stdout, e.stderr), "stderr_tail": _tail(e.stderr, 1500)}
        raise
    got = {**results(r.stdout, r.stderr), "exit": r.returncode}
    if r.returncode != 0:
        raise PartError(f"jaxagent train exited {r.returncode}: {_tail(r.stderr or r.stdout, 1500)}", got)
    its = got["iterations"]
    if len(its) != want:
        raise PartError(f"the run wrote {len(its)} of {want} iterations to metrics.jsonl", got)
    bad = [it["iteration"] for it in its if not (isinstance(it["loss"], (int, float)) and math.isfinite(it["loss"]))]
    if bad:
        raise PartError(f"non-finite loss in iterations {bad}", got)
    return got


PART_FUNCS: dict[str, PartFn] = {"device": part_device, "tests": part_tests, "w6": part_w6, "recipe": part_recipe}


# ============================================================================ main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="device_check.py",
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (python -m pydoc benchmarks/device_check.py) and "
        "docs/results/benchmarks.md for what each part runs.",
    )
    ap.add_argument(
        "--small",
        "--quick",
        dest="small",
        action="store_true",
        help="the CPU smoke run: a handful of tests, W6's tiny model, one tiny recipe iteration",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"the whole check's time (default {FULL_BUDGET_S:.0f}; {SMALL_BUDGET_S:.0f} with --small); "
        "each part gets a share and is stopped when it runs out",
    )
    ap.add_argument("--out", default=None, metavar="JSONL", help="also append the JSON lines to this file")
    ap.add_argument(
        "--log",
        default=None,
        metavar="FILE",
        help="the parts' subprocess output (default: --out with .log; none without --out)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)} (default all)")
    ap.add_argument(
        "--platform",
        default=None,
        metavar="NAME",
        help="JAX_PLATFORMS for the tests, W6 and the recipe (default: what the device part found)",
    )
    ap.add_argument("--allow-cpu", action="store_true", help="without --small, accept a device that is only a CPU")
    ap.add_argument("--pytest-args", default="", metavar="ARGS", help="extra pytest arguments for the tests part")
    ap.add_argument("--w6-args", default="", metavar="ARGS", help="extra benchmarks/w6_gpu.py arguments")
    ap.add_argument("--recipe-config", default=None, metavar="PATH", help=f"the recipe (default {RECIPE_CONFIG})")
    ap.add_argument(
        "--recipe-iterations",
        type=int,
        default=None,
        metavar="N",
        help="the recipe's iterations (default 2; 1 with --small)",
    )
    ap.add_argument(
        "--recipe-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override of the recipe's config (repeatable)",
    )
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the device part's child
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = SMALL_BUDGET_S if args.small else FULL_BUDGET_S
    if not args.budget > 0:
        ap.error("--budget must be positive")
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts:
        ap.error(f"--parts: unknown {bad}; choose from {','.join(PARTS)}")
    if args.recipe_iterations is not None and args.recipe_iterations < 1:
        ap.error("--recipe-iterations must be >= 1")
    if any("=" not in s for s in args.recipe_set):
        ap.error("--recipe-set takes KEY=VALUE")
    if args.out:
        args.out = str(Path(args.out).resolve())
        if args.log is None:
            args.log = str(Path(args.out).with_suffix(".log"))
    return args


def main(argv=None, parts: list[tuple[str, PartFn]] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(probe()), flush=True)
        return 0
    if threading.current_thread() is threading.main_thread():
        # stopped from outside (a tool's time limit): unwind, so the running part's process
        # group is killed too (its subprocesses run in sessions of their own)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return Check(args, parts).run()


if __name__ == "__main__":
    sys.exit(main())
