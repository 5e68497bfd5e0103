"""End-to-end smoke run of the W13 benchmark (agent programs through the gateway vs the
in-process agent loop), as a user calls it: `jaxagent bench gateway --quick`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~15 s on 2 cores: two compilations, the gateway's start

ROOT = Path(__file__).resolve().parents[1]


def test_w13_quick_compares_the_gateway_with_the_agent_loop_on_the_same_tokens(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxagent", "bench", "gateway", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == rows
    by = {r["system"]: r for r in rows}
    assert set(by) == {"agent_loop", "gateway", "gateway_processes"} and len(rows) == 3
    al, gw = by["agent_loop"], by["gateway"]
    for r in rows:
        assert r["workload"] == "W13" and r["quick"] is True and r["calls"] == r["episodes"] * r["turns"] == 16
        # the two rendered the same prompts and observations (and, same keys, sample alike but for rounding)
        assert r["same_prompts"] and r["same_observations"] and r["same_policy_turns"].endswith("/4")
        assert len(r["all_rollout_s"]) == r["repeats"] == 1 and r["rollout_s"] == r["all_rollout_s"][0]
        tokens = r["policy_tokens"][0]
        assert 0 < tokens <= r["calls"] * r["tokens_per_turn"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["rollout_s"], rel=1e-2)
    assert gw["ratio_vs_agent_loop"] == pytest.approx(gw["tokens_per_s"] / al["tokens_per_s"], rel=1e-2)
    assert gw["engine"]["calls"] == 16 and gw["engine"]["completion_tokens"] == gw["policy_tokens"][0]
    assert gw["gateway_sequences_max"] == 1  # every session's calls extended one sequence
    # the parts of a call's latency add up: client = http + ledger + queued + round
    parts = gw["http_ms"] + gw["ledger_ms"] + gw["queued_ms"] + gw["round_ms"]
    assert parts == pytest.approx(gw["client_ms"], abs=0.01)
    assert gw["overhead_ms_per_call"] == pytest.approx(gw["http_ms"] + gw["ledger_ms"], abs=0.002)
    assert 0 < gw["to_first_call_s"] < gw["rollout_s"] and len(gw["rounds_s"]) >= 4
    # the no-model floor: the same 16 calls with instant replies, timed by the script itself
    assert gw["no_model_rollout_s"] > 0
    assert gw["no_model_ms_per_call"] == pytest.approx(1000 * gw["no_model_rollout_s"] / 16, abs=0.01)
    # the programs in a worker process: the same calls and tokens (checked by the script)
    gp = by["gateway_processes"]
    assert gp["processes"] == 2 and gp["engine"]["calls"] == 16
    assert gp["same_policy_turns_as_threads"].endswith("/4")
    assert gp["ratio_vs_agent_loop"] == pytest.approx(gp["tokens_per_s"] / al["tokens_per_s"], rel=1e-2)
