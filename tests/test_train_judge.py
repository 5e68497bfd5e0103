"""The `reward` section: a judge's score as the training reward, through the trainer,
against a local stub of an OpenAI-compatible server (scores, HTTP errors, a slow call)."""

import http.server
import json
import threading
from pathlib import Path

import pytest

from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-judge-secret-0123456789"


class Stub(http.server.BaseHTTPRequestHandler):
    """Every 3rd request fails with HTTP 400 (not retried); the others score 0.25."""

    calls: list = []
    lock = threading.Lock()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            Stub.calls.append({"auth": self.headers.get("Authorization"), "body": body})
            n = len(Stub.calls)
        if n % 3 == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"bad request")
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": "The agent moved.\nScore: 0.25"}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    Stub.calls = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def test_a_judge_scores_training_episodes_and_a_failing_call_costs_its_episode(tmp_path, server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    run = tmp_path / "run"
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "tiny_frozenlake_gigpo.yaml",
        [
            f"run_dir={run}",
            "iterations=1",
            "env.num_workers=0",
            "eval.episodes=4",
            "algo.advantage=grpo",
            f'reward.judge={{"type": "openai", "base_url": "{server}", "model": "stub", '
            f'"api_key_env": "JUDGE_KEY", "timeout_s": 10, "retries": 0}}',
        ],
    )
    lines = []
    Trainer(cfg, log=lines.append).run()
    batch = cfg.env.batch_size
    # one call per training episode; the held-out evaluations (before and after RL) use the env's reward
    assert len(Stub.calls) == batch
    assert all(c["auth"] == f"Bearer {KEY}" for c in Stub.calls)
    # the judge saw the conversation: the system prompt and the env's first observation
    prompt = Stub.calls[0]["body"]["messages"][0]["content"]
    assert "FrozenLake" in prompt or "frozen" in prompt.lower()
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    failed = batch // 3
    assert m["failed_judge_http_error"] == failed and m["failed_episodes"] == failed
    # the judge's score replaced each scored episode's last reward (the stored episodes)
    stored = [json.loads(x) for x in (run / "episodes" / "iter_000001.jsonl").read_text().splitlines()]
    scored = [e for e in stored if not e["failed"]]
    assert scored and len(stored) > len(scored)
    for e in scored:
        assert e["rewards"][-1] == pytest.approx(0.25) and e["info"]["judge"]["score"] == 0.25
        assert e["return"] == pytest.approx(sum(e["rewards"]))
    assert all(e["failure_kind"] == "judge_http_error" for e in stored if e["failed"])
    # the key is in no file of the run
    for f in run.rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f


def test_judge_config_errors_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    base = ROOT / "configs" / "tiny_frozenlake_gigpo.yaml"
    cfg = load_config(
        TrainerConfig,
        base,
        [
            f"run_dir={tmp_path / 'r'}",
            "env.num_workers=0",
            'reward.judge={"type": "openai", "base_url": "http://127.0.0.1:9", '
            '"model": "m", "api_key_env": "NO_SUCH_JUDGE_KEY"}',
        ],
    )
    with pytest.raises(ConfigError, match="reward.judge: .*NO_SUCH_JUDGE_KEY"):
        Trainer(cfg, log=lambda *_: None)
    keyed = load_config(
        TrainerConfig,
        base,
        [
            f"run_dir={tmp_path / 'k'}",
            "env.num_workers=0",
            f'reward.judge={{"type": "openai", "base_url": "http://127.0.0.1:9", "model": "m", "api_key": "{KEY}"}}',
        ],
    )
    with pytest.raises(ConfigError, match="does not take an API key") as err:
        Trainer(keyed, log=lambda *_: None)
    assert KEY not in str(err.value) and not (tmp_path / "k").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match="mode must be 'replace' or 'add'"):
        load_config(TrainerConfig, base, ["reward.mode=mean"])
    with pytest.raises(ConfigError, match="on_failure must be"):
        load_config(TrainerConfig, base, ["reward.on_failure=retry"])
    with pytest.raises(ConfigError, match="weight .* applies to mode 'add' only"):
        load_config(TrainerConfig, base, ["reward.weight=0.5"])
    with pytest.raises(ConfigError, match="reward.judge: .*type"):
        Trainer(
            load_config(
                TrainerConfig,
                base,
                [f"run_dir={tmp_path / 'r2'}", "env.num_workers=0", 'reward.judge={"type": "oracle"}'],
            ),
            log=lambda *_: None,
        )


def test_judge_reward_modes_on_episodes():
    """`JudgeReward` on hand-made episodes: replace, add, drop and keep-the-env's."""
    from jaxagent.rewards import CallableJudge, JudgeReward
    from jaxagent.rollout.episode import Episode

    def episodes():
        out = []
        for i in range(3):
            ep = Episode(index=i, seed=i, group_id=0)
            ep.system_prompt, ep.observations, ep.actions, ep.rewards = "sys", ["o0", "o1"], ["a0", "a1"], [0.0, 1.0]
            ep.info = {"k": i}
            out.append(ep)
        return out

    def fn(item):
        if item.info["k"] == 2:
            raise RuntimeError("judge down")
        assert [m["role"] for m in item.messages] == ["system", "user", "assistant", "user", "assistant"]
        return 0.5

    eps = episodes()
    JudgeReward(CallableJudge(fn), mode="replace")(eps)
    assert [ep.rewards for ep in eps[:2]] == [[0.0, 0.5], [0.0, 0.5]]
    assert eps[2].failed and eps[2].failure_kind == "judge_error" and eps[2].rewards == [0.0, 1.0]
    eps = episodes()
    JudgeReward(CallableJudge(fn), mode="add", weight=2.0, on_failure="env")(eps)
    assert [ep.rewards[-1] for ep in eps] == [2.0, 2.0, 1.0] and not eps[2].failed
    assert eps[2].info["judge"]["failure_kind"] == "judge_error" and eps[0].info["judge"]["score"] == 0.5
    with pytest.raises(ValueError, match="on_failure"):
        JudgeReward(CallableJudge(fn), on_failure="ignore")
