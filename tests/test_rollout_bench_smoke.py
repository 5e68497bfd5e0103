"""End-to-end smoke runs of the W1, W3 and W12 benchmarks, as a user calls them (slow)."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, tmp_path, *extra):
    out = tmp_path / f"{script}.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def rate_of(rate, tokens, median_s):
    """Whether `rate` is `round(tokens / m, 1)` for an `m` that rounds to `median_s` (4 decimals)."""
    lo = tokens / (median_s + 5e-5) - 0.05
    hi = tokens / (median_s - 5e-5) + 0.05 if median_s > 5e-5 else math.inf
    return lo <= rate <= hi


@pytest.mark.slow
def test_w1_generate_quick(tmp_path):
    out = [r for r in run("w1_generate", tmp_path) if "skipped" not in r]
    versus = [r for r in out if r["system"] == "jaxagent_vs_ceiling"]
    rows = [r for r in out if r["system"] != "jaxagent_vs_ceiling"]
    systems = {r["system"] for r in rows}
    assert {"jaxagent", "ceiling"} <= systems
    if importlib.util.find_spec("torch"):
        assert "hf" in systems
    if importlib.util.find_spec("tunix"):
        assert "tunix" in systems
    assert {r["mode"] for r in rows} == {"greedy", "temperature_1.0"}
    # each rate is the batch's new tokens over the median call
    assert all(rate_of(r["tokens_per_s"], r["batch"] * r["new_tokens"], r["median_s"]) for r in rows), rows
    # same weights and prompts: every system's greedy tokens equal jaxagent's (the ceiling samples none)
    assert all(
        r["greedy_agree_with_jaxagent"] == 1.0 for r in rows if r["mode"] == "greedy" and r["system"] != "ceiling"
    )
    # jaxagent against the matmul-only ceiling, one line per mode, from the same run's rates
    assert sorted(r["mode"] for r in versus) == ["greedy", "temperature_1.0"], versus
    rate = {(r["system"], r["mode"]): r["tokens_per_s"] for r in rows}
    for r in versus:
        assert r["jaxagent_tokens_per_s"] == rate[("jaxagent", r["mode"])]
        assert r["ceiling_tokens_per_s"] == rate[("ceiling", r["mode"])]
        assert 0 < r["fraction"] < 1.5, r
        assert r["fraction"] == pytest.approx(r["jaxagent_tokens_per_s"] / r["ceiling_tokens_per_s"], abs=1e-3)


@pytest.mark.slow
def test_w3_multiturn_quick(tmp_path):
    rows = run("w3_multiturn", tmp_path)
    variants = {(r["system"], r["variant"]) for r in rows}
    assert variants == {("jaxagent", "live"), ("jaxagent", "reencode")}
    # continuing the live cache gives exactly the tokens of re-encoding the history
    assert all(r["greedy_agree_live_vs_reencode"] == 1.0 for r in rows if r["mode"] == "greedy")
    live = [r for r in rows if r["variant"] == "live"]
    assert all("ratio_vs_jaxagent_reencode" in r for r in live)
    # each rate is the episodes' policy tokens over the median rollout
    assert all(
        rate_of(r["tokens_per_s"], r["episodes"] * r["turns"] * r["tokens_per_turn"], r["rollout_s"]) for r in rows
    ), rows


@pytest.mark.slow
def test_w12_shared_prompt_quick(tmp_path):
    rows = run("w12_shared_prompt", tmp_path)
    assert {(r["variant"], r["mode"]) for r in rows} == {
        (v, m) for v in ("per_row", "shared") for m in ("greedy", "temperature_1.0")
    }
    # sharing the prompt does not change what is decoded
    assert all(r["greedy_tokens_agree"] for r in rows if r["mode"] == "greedy")
    assert all(
        rate_of(r["tokens_per_s"], r["groups"] * r["group_size"] * r["turns"] * r["tokens_per_turn"], r["rollout_s"])
        for r in rows
    ), rows
