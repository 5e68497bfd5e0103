"""End-to-end smoke run of the W8 benchmark (a whole GRPO iteration), as a user calls it.

One `--quick` run serves both tests: jaxagent and Tunix together when Tunix is
installed (the systems alternate inside one run), jaxagent alone otherwise.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~40 s on 2 cores (jaxagent and, if installed, Tunix)

ROOT = Path(__file__).resolve().parents[1]
HAVE_TUNIX = importlib.util.find_spec("tunix") is not None


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("w8") / "out.jsonl"
    systems = "jaxagent,tunix" if HAVE_TUNIX else "jaxagent"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "w8_iteration.py"),
            "--quick",
            "--systems",
            systems,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # what went to --out is what was printed
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == lines
    return lines


def _iteration(rows, system):
    found = [r for r in rows if r.get("kind") == "iteration" and r["system"] == system]
    assert len(found) == 1, rows
    return found[0]


def _check_iteration(r):
    assert r["workload"] == "W8" and r["quick"] is True
    tokens = r["batch"] * (r["prompt_len"] + r["new_tokens"])
    assert r["batch"] == r["prompts"] * r["samples_per_prompt"]
    assert r["tokens_per_s"] > 0 and r["median_iteration_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(tokens / r["median_iteration_s"], rel=1e-3)
    assert len(r["iteration_s"]) == r["warmup"] + r["repeats"] and all(t > 0 for t in r["iteration_s"])
    # no early stop: every completion has the full length; at temperature 1 the two samples differ
    assert r["completion_tokens_min"] == r["completion_tokens_max"] == r["new_tokens"]
    assert r["groups_with_distinct_samples"] == 1.0


def test_w8_quick_jaxagent(rows):
    r = _iteration(rows, "jaxagent")
    _check_iteration(r)
    phases = r["phase_median_s"]
    for k in ("rollout", "logprobs", "advantages", "update"):
        assert phases[k] > 0, phases
    assert (
        phases["rollout"] + phases["logprobs"] + phases["advantages"] + phases["update"]
        <= r["median_iteration_s"] * 1.5
    ), phases
    assert r["skipped_updates"] == 0
    # the trainer's log-probs of what was sampled are the sampler's
    assert r["rollout_logp_gap"] < 1e-3


def test_w8_quick_tunix(rows):
    if not HAVE_TUNIX:
        pytest.skip("Tunix (google-tunix) is not installed: `make bench` installs it")
    r = _iteration(rows, "tunix")
    _check_iteration(r)
    assert r["rollout_median_s"] > 0
    assert r["iterations_run"] == r["warmup"] + r["repeats"] + 1  # its loop runs one untimed extra
    check = [x for x in rows if x.get("kind") == "check"]
    assert len(check) == 1
    assert check[0]["max_abs_logp_diff_tunix_actor"] < 1e-3 and check[0]["max_abs_logp_diff_tunix_reference"] < 1e-3
    ratio = [x for x in rows if x.get("kind") == "ratio"]
    assert len(ratio) == 1 and ratio[0]["jaxagent_over_tunix_tokens_per_s"] > 0
    assert len(ratio[0]["pairwise_ratios"]) == r["repeats"] and ratio[0]["pairwise_ratio_median"] > 0
    jr = _iteration(rows, "jaxagent")
    assert ratio[0]["jaxagent_over_tunix_tokens_per_s"] == pytest.approx(
        jr["tokens_per_s"] / r["tokens_per_s"], rel=1e-2
    )
