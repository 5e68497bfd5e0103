"""Demonstrations recorded through the gateway (`jaxagent.gateway.demonstrations`): the
agent program run unchanged against an expert, its episodes the warm start's token rows.

References: the env itself (the expert's episodes reach the goal: the env's reward), the
expert's own text tokenized by the tokenizer (each reply in the sequence), and the byte
tokenizer's ids written from bytes."""

import random
from pathlib import Path

import pytest

import envs
from examples.agents import frozenlake_agent as F
from jaxagent.dataclass_yaml import load_config
from jaxagent.gateway.demonstrations import record
from jaxagent.gateway.program import TaskSource
from jaxagent.gateway.tools import TOOL_CHATML_TEMPLATE
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout.chat import ChatFormat
from jaxagent.train.config import TrainerConfig
from jaxagent.train.warmstart import Demonstration, demonstration_tokens

IM_END = 258


@pytest.fixture(scope="module")
def tok():
    t = byte_chat_tokenizer()
    t.chat_template = TOOL_CHATML_TEMPLATE
    return t


def run(tok, seeds, noise=0.0):
    return record(
        F.rollout,
        TaskSource("examples.agents.frozenlake_agent:task"),
        seeds,
        tok,
        F.expert,
        max_context=8192,
        max_turns=8,
        max_tokens=128,
        noise=noise,
    )


def reachable(seed):
    """Whether the map of `seed` has a safe path (the env's own expert reaches the goal)."""
    env = envs.make("frozenlake", size=4, hole_prob=0.2)
    env.reset(seed=seed)
    for _ in range(16):
        _, r, term, trunc, _ = env.step(env.expert_action())
        if term or trunc:
            return r > 0
    return False


def test_the_program_against_its_expert_reaches_the_goal_and_records_the_experts_tokens(tok):
    seeds = list(range(100, 112))
    recs = run(tok, seeds)
    chat = ChatFormat(tok)
    for rec in recs:
        assert rec.outcome.failure_kind is None
        assert rec.outcome.reward == float(reachable(rec.seed))  # the env's reward, not the expert's claim
        seq = rec.sequence
        tokens, mask = seq.tokens.tolist(), seq.loss_mask.tolist()
        # every trained run of tokens is one expert reply, as the expert wrote it, closed by <|im_end|>
        runs, i = [], 0
        while i < len(mask):
            if mask[i]:
                j = i
                while j < len(mask) and mask[j]:
                    j += 1
                runs.append(tokens[i:j])
                i = j
            else:
                i += 1
        assert len(runs) == seq.num_turns >= 1
        calls = {
            d: chat.encode('<tool_call>{"name": "move", "arguments": {"direction": "' + d + '"}}</tool_call>')
            for d in F.DIRECTIONS
        }
        assert all(got[:-1] in calls.values() and got[-1] == IM_END for got in runs)
        # the map the env showed is in the sequence, as the program's first user message
        env = envs.make("frozenlake", size=4, hole_prob=0.2)
        obs, _ = env.reset(seed=rec.seed)
        assert F.board(obs) in rec.text


def test_a_noisy_expert_is_a_function_of_the_seed(tok):
    a = run(tok, [7, 8, 9], noise=0.5)
    b = run(tok, [7, 8, 9], noise=0.5)
    assert [r.sequence.tokens.tolist() for r in a] == [r.sequence.tokens.tolist() for r in b]
    quiet = run(tok, [7, 8, 9], noise=0.0)
    assert [r.sequence.texts for r in a] != [r.sequence.texts for r in quiet]


def walk(grid: str) -> tuple[bool, int]:
    """Follow the expert on a map until it reaches G or steps in H: (reached, moves)."""
    rows = [line.split(" ") for line in grid.splitlines()]
    for moves in range(1, 20):
        text = "\n".join(" ".join(r) for r in rows)
        reply = F.expert(f"<|im_start|>tool\n{text}<|im_end|>")
        d = reply.split('"direction": "')[1].split('"')[0]
        (r, c) = next((i, j) for i, row in enumerate(rows) for j, x in enumerate(row) if x == "P")
        dr, dc = F.DIRECTIONS[d]
        nr, nc = min(max(r + dr, 0), 3), min(max(c + dc, 0), 3)
        if rows[nr][nc] in "HG":
            return rows[nr][nc] == "G", moves
        rows[r][c], rows[nr][nc] = "F", "P"
    return False, moves


def test_the_expert_takes_a_shortest_safe_path():
    assert walk("P F F F\nF H H F\nF F F F\nF F F G") == (True, 6)
    assert walk("P H F F\nF H F F\nF F F F\nF F F G") == (True, 6)
    assert walk("P F F F\nH H H F\nF F F F\nF H H G") == (True, 6)
    # the last map of the conversation counts
    both = "P H F F\nF H F F\nF F F F\nF F F G<|im_end|>\n<|im_start|>tool\nS H F F\nF H F F\nF F F F\nF F P G"
    assert '"right"' in F.expert(both)
    # noise: a random move as often as asked
    rng = random.Random(0)
    moves = [F.expert("P F\nF G", noise=1.0, rng=rng) for _ in range(200)]
    assert len(set(moves)) == 4


def test_recorded_demonstrations_are_trained_as_recorded(tok):
    (rec,) = run(tok, [5])
    seq = rec.sequence
    demo = Demonstration(
        seed=5,
        system_prompt=None,
        observations=[],
        actions=list(seq.texts),
        rewards=[rec.outcome.reward],
        done=True,
        success=True,
        noisy_actions=0,
        tokens=seq.tokens.tolist(),
        loss_mask=seq.loss_mask.tolist(),
    )
    tokens, mask = demonstration_tokens(ChatFormat(tok), demo, 100000)
    assert tokens == seq.tokens.tolist() and mask == seq.loss_mask.tolist()
    cut_tokens, cut_mask = demonstration_tokens(ChatFormat(tok), demo, 50)
    assert cut_tokens == tokens[:50] and cut_mask == mask[:50]


def test_a_program_warm_start_needs_an_expert(tmp_path):
    with pytest.raises(ValueError, match="agent.expert"):
        load_config(
            TrainerConfig,
            "configs/gateway_frozenlake.yaml",
            ["agent.expert=null"],
        )
    cfg = load_config(TrainerConfig, "configs/gateway_frozenlake.yaml", ["agent.expert=null", "warm_start.episodes=0"])
    assert cfg.agent.expert is None


def test_a_demonstration_that_rewrote_its_history_trains_every_sequence_in_its_own_context(tmp_path):
    """An expert's episode whose program starts over (two sequences) is one SFT row
    packing both: every reply is taught, each in its own context. Reference: the SFT
    loss and gradients of the two sequences as two separate rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxagent import models as M
    from jaxagent.models import tiny_config
    from jaxagent.train.config.step import StepConfig
    from jaxagent.train.sources.program import program_demonstrations
    from jaxagent.train.update.batch import SFTBatch
    from jaxagent.train.update.losses import sft_loss_and_grads
    from jaxagent.train.update.state import init_train_state

    tests = str(Path(__file__).parent)
    cfg = load_config(
        TrainerConfig,
        None,
        [
            "agent.program=gateway_programs:rewriting_rollout",
            "agent.tasks=gateway_programs:task",
            "agent.expert=gateway_programs:letter_expert",
            f"agent.imports=[{tests}]",
            "agent.processes=0",
            "warm_start.episodes=1",
            "rollout.max_turns=3",
            "rollout.max_context=512",
            f"run_dir={tmp_path}",
        ],
    )
    t = byte_chat_tokenizer()
    t.chat_template = TOOL_CHATML_TEMPLATE
    (demo,) = program_demonstrations(cfg, t, log=lambda *_: None)
    seg = np.asarray(demo.segment_ids)
    n1 = int((seg == 1).sum())
    assert set(seg.tolist()) == {1, 2} and (seg[:n1] == 1).all() and len(seg) == len(demo.tokens)
    mask = np.asarray(demo.loss_mask)
    assert mask[:n1].sum() > 0 and mask[n1:].sum() > 0  # replies taught in both sequences
    assert len(demo.actions) == 3 and set(demo.actions) == {"b"}

    model = tiny_config(vocab_size=len(t))
    state = init_train_state(jax.random.key(0), M.init_params(jax.random.key(1), model, std=0.3), model, StepConfig())
    toks = np.asarray(demo.tokens, np.int32)
    n = len(toks)
    packed = SFTBatch(
        tokens=jnp.asarray(toks[None]),
        loss_mask=jnp.asarray(mask[None], jnp.float32),
        attention_mask=jnp.ones((1, n), jnp.int32),
        segment_ids=jnp.asarray(seg[None], jnp.int32),
    )
    rows = np.zeros((2, n), np.int32)
    rmask = np.zeros((2, n), np.float32)
    attn = np.zeros((2, n), np.int32)
    rows[0, :n1], rmask[0, :n1], attn[0, :n1] = toks[:n1], mask[:n1], 1
    rows[1, : n - n1], rmask[1, : n - n1], attn[1, : n - n1] = toks[n1:], mask[n1:], 1
    apart = SFTBatch(tokens=jnp.asarray(rows), loss_mask=jnp.asarray(rmask), attention_mask=jnp.asarray(attn))
    g_packed, s_packed = sft_loss_and_grads(state, packed, StepConfig())
    g_apart, s_apart = sft_loss_and_grads(state, apart, StepConfig())
    np.testing.assert_allclose(float(s_packed.loss), float(s_apart.loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_packed.policy), jax.tree.leaves(g_apart.policy), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # without the segments the second sequence would be read after the first
    joined = packed.replace(segment_ids=None)
    _, s_joined = sft_loss_and_grads(state, joined, StepConfig())
    assert abs(float(s_joined.loss) - float(s_apart.loss)) > 1e-4
