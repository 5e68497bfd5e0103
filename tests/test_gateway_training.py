"""Training agent programs through the gateway: `ProgramLoop` (the trainer's rollout of
`agent.program`), a two-iteration run from the CLI, and SIGTERM during a gateway run.

The programs are plain `openai` client code (`tests/gateway_programs.py`). References:
the trained log-probs against a full forward pass over each episode's tokens
(`token_logprobs`, not the sampler's cache); tokens against what the gateway returned to
the program (the `jaxagent` extension it read).
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gateway_programs
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxagent import models as M
from jaxagent.gateway.loop import ProgramLoop, ProgramSettings, TaskPool
from jaxagent.gateway.program import TaskSource, load_program
from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.models.logprobs import token_logprobs
from jaxagent.rollout.agent_loop import AgentLoopConfig
from jaxagent.rollout.sampling import SamplingConfig
from jaxagent.train.config.algo import AlgoSection
from jaxagent.train.placement import policy_logprobs
from jaxagent.train.update.advantages import compute_advantages

TESTS = str(Path(__file__).parent)
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def policy():
    tok = byte_chat_tokenizer()
    tok.chat_template = TOOL_CHATML_TEMPLATE
    cfg = tiny_config(vocab_size=len(tok))
    return tok, cfg, M.init_params(jax.random.key(1), cfg, std=0.3)


@pytest.fixture(scope="module")
def shared_loop(policy):
    """One loop (one sampler: its kernels compile once) whose program and limits each test sets."""
    tok, cfg, params = policy
    lc = AgentLoopConfig(max_turns=3, max_tokens_per_turn=6, max_context=320, sampling=SamplingConfig())
    settings = ProgramSettings(load_program("gateway_programs:chat_rollout", [TESTS]), 8, 60.0, 1)
    with ProgramLoop(params, cfg, tok, lc, settings) as loop:
        yield loop


def make_loop(loop, program, *, timeout_s=60.0, max_turns=3):
    loop.settings = dataclasses.replace(loop.settings, program=load_program(program, [TESTS]), timeout_s=timeout_s)
    loop.config = dataclasses.replace(loop.config, max_turns=max_turns)
    loop.gateway.max_calls = max_turns
    return contextlib.nullcontext(loop)


def test_program_episodes_train_exactly_the_sampled_tokens(policy, shared_loop):
    tok, cfg, params = policy
    pool = TaskPool(TaskSource("gateway_programs:task", [TESTS]), 6)
    with make_loop(shared_loop, "gateway_programs:chat_rollout") as loop:
        traj, eps = loop.run(pool, [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], seed=5)
        again, eps2 = loop.run(pool, [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], seed=5)
    assert not any(ep.failed for ep in eps)
    tokens, mask = np.asarray(traj.tokens), np.asarray(traj.loss_mask)
    logp = np.asarray(traj.rollout_logp)
    ref, _ = token_logprobs(params, cfg, jnp.asarray(tokens))
    ref = np.asarray(ref)
    for i, ep in enumerate(eps):
        assert len(ep.rewards) == 2 and ep.rewards[0] == 0.0  # two calls: two turns, the reward on the last
        assert ep.rewards[1] == float(pool.task(ep.seed)["letter"] in ep.actions[0])
        assert "reply_chars" in ep.info and ep.info["gateway_sequences"] == 1
        on = mask[i].astype(bool)
        assert on.sum() == sum(len(t) for k, t in ep.segments if k == "policy")
        np.testing.assert_allclose(logp[i][on], ref[i][on], atol=1e-5)
    # the same seed and sampling seed: the same episodes, whatever ran beside them
    np.testing.assert_array_equal(np.asarray(again.tokens), tokens)
    # one sampling key per row: the rows of one task sample different episodes
    assert len({tuple(tokens[i][mask[i] > 0]) for i in range(3)}) > 1


def test_a_history_rewrite_trains_every_sequence_in_its_own_context_with_one_advantage(policy, shared_loop):
    """A session whose third call starts over (two sequences: calls 1-2, call 3) is one
    row packing both: every completion the program got is trained, each at the sampled
    log-probs of its own context. References: the sampler's log-probs against a forward
    pass over each sequence alone (`token_logprobs` of the cut tokens); the trainer's
    log-prob pass over the packed row (with `segment_ids`) against the same."""
    tok, cfg, params = policy
    pool = TaskPool(TaskSource("gateway_programs:task", [TESTS]), 4)
    gateway_programs.COMPLETIONS.clear()
    with make_loop(shared_loop, "gateway_programs:rewriting_rollout") as loop:
        traj, eps = loop.run(pool, [0, 0, 1, 1], [0, 0, 1, 1], seed=3)
    assert not any(ep.failed for ep in eps)
    tokens, mask = np.asarray(traj.tokens), np.asarray(traj.loss_mask)
    seg, logp, tid = np.asarray(traj.segment_ids), np.asarray(traj.rollout_logp), np.asarray(traj.turn_ids)

    def logprobs(**segments):  # the trainer's log-prob pass over the rows as packed
        return np.asarray(
            policy_logprobs(
                params,
                cfg,
                tokens_BxT=traj.tokens,
                attention_mask_BxT=traj.attention_mask,
                temperature=1.0,
                seq_chunk=64,
                vocab_chunk=512,
                **segments,
            )
        )

    packed, unpacked = logprobs(segment_ids_BxT=traj.segment_ids), logprobs()
    got = {letter: sorted(map(str, runs)) for letter, runs in gateway_programs.COMPLETIONS.items()}
    for i, ep in enumerate(eps):
        assert ep.info["gateway_sequences"] == 2 and ep.info["gateway_untrained_calls"] == 0
        n = int(np.asarray(traj.lengths)[i])
        assert seg[i, :n].tolist() == [1] * seg[i, :n].tolist().count(1) + [2] * seg[i, :n].tolist().count(2)
        assert (seg[i, n:] == 0).all() and 0 < (seg[i, :n] == 2).sum() < n
        # the trained tokens: the three completions the program was given, turn by turn
        on = mask[i] > 0
        calls = [tokens[i][on & (tid[i] == k)].tolist() for k in range(3)]
        assert str(calls) in got[pool.task(ep.seed)["letter"]]
        assert tid[i][on & (seg[i] == 2)].tolist() == [2] * int((on & (seg[i] == 2)).sum())
        for s in (1, 2):  # each sequence alone, from position 0
            part = seg[i] == s
            ref, _ = token_logprobs(params, cfg, jnp.asarray(tokens[i][part][None]))
            ref = np.asarray(ref)[0]
            np.testing.assert_allclose(logp[i][part & on], ref[on[part]], atol=1e-5)
            np.testing.assert_allclose(packed[i][part & on], ref[on[part]], atol=1e-5)
        # without the segments the second sequence would be read in the first's context
        assert np.abs(unpacked[i][(seg[i] == 2) & on] - logp[i][(seg[i] == 2) & on]).max() > 1e-3
        assert ep.rewards == [0.0, 0.0, float(pool.task(ep.seed)["letter"] in ep.actions[0])]
    # one advantage over both sequences of a session (GRPO: one per episode)
    adv, _ = compute_advantages(AlgoSection(advantage="grpo"), traj, jnp.asarray(mask))
    adv = np.asarray(adv)
    for i in range(len(eps)):
        assert np.unique(adv[i][mask[i] > 0]).size == 1


def test_a_misbehaving_program_costs_its_own_episode_with_its_failure_kind(shared_loop):
    pool = TaskPool(TaskSource("gateway_programs:numbered_task", [TESTS]), 4)
    with make_loop(shared_loop, "gateway_programs:misbehaving_rollout", timeout_s=300.0) as loop:
        traj, eps = loop.run(pool, [0, 2, 3, 4])
    kinds = [ep.failure_kind if ep.failed else None for ep in eps]
    assert kinds == ["raised", "no_calls", "invalid_result", None]
    assert "the agent's own bug" in eps[0].failure and "RuntimeError" in eps[0].failure_traceback
    assert "not a number" in eps[2].failure
    assert np.asarray(traj.failed).tolist() == [True, True, True, False]
    # a program that hangs is cut at its timeout, beside one that plays
    pool = TaskPool(TaskSource("gateway_programs:numbered_task", [TESTS]), 1)
    t0 = time.perf_counter()
    with make_loop(shared_loop, "gateway_programs:misbehaving_rollout", timeout_s=2.0) as loop:
        _, eps = loop.run(pool, [1])
    assert eps[0].failed and eps[0].failure_kind == "timeout"
    assert time.perf_counter() - t0 < 30


def in_processes(loop, program, n=2, timeout_s=60.0):
    loop.settings = dataclasses.replace(
        loop.settings, program=None, spec=program, imports=(TESTS,), processes=n, timeout_s=timeout_s
    )
    return loop


def test_programs_in_processes_of_their_own_train_the_same_tokens_and_outlive_crashes(policy, shared_loop, monkeypatch):
    """`agent.processes`: sessions played by worker processes give the episodes the
    trainer's own threads give (same seeds and sampling keys: same tokens, log-probs
    within 1e-5); a program
    that exits the interpreter costs the sessions of its process ("crashed", with its
    last output), one that blocks its event loop those of its process ("timeout", the
    process killed); the run goes on and the next batch gets fresh processes."""
    from jaxagent.gateway import processes as P

    tok, cfg, params = policy
    saved = shared_loop.settings
    pool = TaskPool(TaskSource("gateway_programs:numbered_task", [TESTS]), 4)
    try:
        with make_loop(shared_loop, "gateway_programs:chat_rollout") as loop:
            here, _ = loop.run(pool, [5, 6, 7, 9], seed=2)
            in_processes(loop, "gateway_programs:chat_rollout")
            there, eps = loop.run(pool, [5, 6, 7, 9], seed=2)
            assert loop._processes is not None and loop._processes.started == 2
            assert not any(ep.failed for ep in eps)
            np.testing.assert_array_equal(np.asarray(there.tokens), np.asarray(here.tokens))
            # the same tokens; their log-probs to float rounding (a round's rows may be
            # batched in other shapes, which XLA sums in another order)
            np.testing.assert_allclose(np.asarray(there.rollout_logp), np.asarray(here.rollout_logp), atol=1e-5)
            # seed 0 exits its process (worker 0: rows 0 and 2); worker 1's sessions play
            in_processes(loop, "gateway_programs:crashing_rollout")
            _, eps = loop.run(pool, [0, 1, 2, 3])
            kinds = [ep.failure_kind if ep.failed else None for ep in eps]
            assert kinds == ["crashed", None, "crashed", None], kinds
            assert "exited (code 3)" in eps[0].failure and "about to exit the interpreter" in eps[0].failure
            # seed 0 blocks its process's event loop: killed past its time, the other worker plays
            monkeypatch.setattr(P, "GRACE_S", 1.0)
            in_processes(loop, "gateway_programs:blocking_rollout", timeout_s=10.0)
            t0 = time.perf_counter()
            _, eps = loop.run(pool, [0, 1, 2, 3])
            assert time.perf_counter() - t0 < 60
            kinds = [ep.failure_kind if ep.failed else None for ep in eps]
            assert kinds == ["timeout", None, "timeout", None], [ep.failure for ep in eps]
            assert "blocks its event loop" in eps[0].failure
            # and the next batch plays on fresh processes
            in_processes(loop, "gateway_programs:chat_rollout")
            _, eps = loop.run(pool, [1, 2, 3, 4])
            assert not any(ep.failed for ep in eps) and loop._processes.started == 4
    finally:
        if shared_loop._processes is not None:
            shared_loop._processes.close()
            shared_loop._processes = None
        shared_loop.settings = saved


def test_calls_past_max_turns_are_refused_and_end_the_episode_truncated(shared_loop):
    pool = TaskPool(TaskSource("gateway_programs:task", [TESTS]), 2)
    with make_loop(shared_loop, "gateway_programs:chat_rollout", max_turns=1) as loop:
        _, eps = loop.run(pool, [0, 1])
    for ep in eps:
        assert not ep.failed and ep.truncated and ep.end_reason == "max_turns"
        assert len(ep.rewards) == 1 and ep.rewards == [0.0]


@pytest.mark.slow  # ~20 s; the staleness rule's own arithmetic is one comparison in ProgramLoop._episode
def test_an_episode_sampled_by_an_older_policy_than_max_staleness_allows_is_dropped(policy, shared_loop):
    """The policy changes between a session's two calls (as an update can land during an
    off-policy rollout): its calls carry both versions, and with max_staleness 0 the
    episode is failed as stale; with 1 it is kept."""
    tok, cfg, params = policy
    pool = TaskPool(TaskSource("gateway_programs:task", [TESTS]), 2)
    got = {}
    for staleness in (0, 1):
        stages = {"first": threading.Semaphore(0), "go": threading.Event()}
        gateway_programs.STAGES.update(stages)

        def update_between_the_calls(stages=stages):
            for _ in range(2):
                assert stages["first"].acquire(timeout=120)
            shared_loop.set_params(params)
            stages["go"].set()

        with make_loop(shared_loop, "gateway_programs:staged_two_calls") as loop:
            loop.settings = dataclasses.replace(loop.settings, max_staleness=staleness)
            updater = threading.Thread(target=update_between_the_calls)
            updater.start()
            _, got[staleness] = loop.run(pool, [0, 1])
            updater.join()
    assert [ep.failure_kind for ep in got[0]] == ["stale", "stale"]
    assert "max_staleness=0" in got[0][0].failure
    assert not any(ep.failed for ep in got[1])


def run_cli(args, run_dir, **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-m", "jaxagent", "train", "--config", "configs/tiny_gateway_chat.yaml", f"run_dir={run_dir}"]
        + args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_a_gateway_run_trains_from_the_cli(tmp_path):
    proc = run_cli([], tmp_path / "run")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [1, 2]
    assert all(m["failed_frac"] == 0.0 and m["turns_mean"] == 2.0 for m in lines)
    assert (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.slow  # ~25 s: a one-iteration run to serve; the server itself is tested in test_gateway_server.py
def test_jaxagent_serve_answers_the_openai_client_for_a_run(tmp_path):
    proc = run_cli(["iterations=1"], tmp_path / "run")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    serve_the_run(tmp_path / "run", "run@1")


def serve_the_run(run_dir, model_id):
    """`jaxagent serve` answers the `openai` client for the run's checkpoint, and stops on SIGTERM."""
    key = "k" * 8 + os.urandom(8).hex()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TEST_GATEWAY_KEY": key}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxagent", "serve", str(run_dir), "--port", "0", "--api-key-env", "TEST_GATEWAY_KEY"]
        + ["--max-context", "256", "--max-tokens", "8"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("jaxagent serve: http://"):
                url = line.split()[2]
                break
        assert url is not None and url.startswith("http://127.0.0.1:")
        good = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in good.models.list().data] == [model_id]
        r = good.chat.completions.create(
            model="run", messages=[{"role": "user", "content": "Say the letter a."}], temperature=0, max_tokens=4
        )
        ext = r.model_extra["jaxagent"]
        assert ext["sampling"]["source"] == "request" and ext["sampling"]["greedy"] is True
        assert ext["policy_version"] == 0 and 1 <= r.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="x" * 20, max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest[-2000:]
    assert key not in rest  # the key is never printed when it comes from the environment


def test_sigterm_during_a_gateway_run_leaves_a_checkpoint_and_nothing_running(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["iterations=50"], run_dir)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "checkpoint" in out.lower(), out[-3000:]
    done = [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == done[-1]  # the last iteration it finished is saved
    # the gateway's threads went with the process: no child, nothing listening
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if f" {proc.pid} " in line]
