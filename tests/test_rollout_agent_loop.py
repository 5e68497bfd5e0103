"""The agent loop against the real EnvPool and independent references.

Token-exactness is checked from the outside: every policy token of the trajectory is
what a plain full forward pass over the trajectory's own prefix picks (greedy) and
its stored log-prob is that forward pass's log-prob, so the context the sampler saw is
exactly the sequence the trainer will see; observation tokens equal the tokenization of
the ChatML text written out here by hand around what a separately replayed env says;
the loss mask is 1 exactly on policy tokens; rewards, anchors and ends match the replay.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from jaxagent import models as M
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

TOK = byte_chat_tokenizer()
CFG = tiny_config(vocab_size=len(TOK))
EOT = TOK.convert_tokens_to_ids("<|im_end|>")
CTX = 1024


def random_params():
    return M.init_params(jax.random.key(0), CFG, std=0.3)


def eager_stop_params():
    """Logits are hidden dims 0..5 for `<|im_end|>` and the bytes of "lurdx": greedy ends a
    turn by the end-of-turn token about one time in six per token, so turns end both
    ways (end-of-turn and the length limit)."""
    p = M.init_params(jax.random.key(3), CFG, std=0.3)
    head = np.zeros((CFG.hidden_size, CFG.vocab_size), np.float32)
    for dim, tok in enumerate([EOT] + [ord(c) for c in "lurdx"]):
        head[dim, tok] = 1.0
    p["lm_head"]["kernel"] = jnp.asarray(head)
    return p


_forward = jax.jit(lambda params, toks: M.forward(params, CFG, toks))


def full_logp(params, tokens):
    """log_softmax of a full forward pass over one whole trajectory row, float64 [T, V].

    Right-padded to CTX (one compilation; causal attention ignores what follows)."""
    row = np.zeros((1, CTX), np.int32)
    row[0, : len(tokens)] = tokens
    lg = np.asarray(_forward(params, jnp.asarray(row))[0, : len(tokens)], np.float64)
    lg = lg - lg.max(-1, keepdims=True)
    return lg - np.log(np.exp(lg).sum(-1, keepdims=True))


def chatml_observation(obs, after_eot):
    text = f"<|im_end|>\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"
    return text[len("<|im_end|>") :] if after_eot else text


def replay(name, seed, actions):
    """Independent replay of one episode in-process: observations, rewards, ends, state keys."""
    env = envs.make(name)
    obs, _ = env.reset(seed)
    out = {"obs": [obs], "rewards": [], "keys": [env.state_key()], "ends": [], "system": env.system_prompt}
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out["obs"].append(obs)
        out["rewards"].append(r)
        out["ends"].append((term, trunc))
        out["keys"].append(env.state_key())
    return out


def check_token_exact(traj, eps, params, sampling):
    tokens, loss = np.asarray(traj.tokens), np.asarray(traj.loss_mask)
    logp, tid = np.asarray(traj.rollout_logp), np.asarray(traj.turn_ids)
    n_eot = n_len = 0
    for b, ep in enumerate(eps):
        n = int(traj.lengths[b])
        assert n == len(ep.tokens) and tokens[b, :n].tolist() == ep.tokens
        assert np.all(tokens[b, n:] == 0) and np.all(loss[b, n:] == 0)
        # prompt = the chat template rendered once, tokenized
        rep = replay("frozenlake", ep.seed, ep.actions)
        prompt = TOK.encode(
            TOK.apply_chat_template(
                [{"role": "system", "content": rep["system"]}, {"role": "user", "content": rep["obs"][0]}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        assert tokens[b, : len(prompt)].tolist() == prompt
        # walk the segments: policy tokens are the model's, observations are the env's text
        pos, turn = len(prompt), 0
        ref_logp = full_logp(params, tokens[b, :n])
        kinds = [k for k, _ in ep.segments]
        assert kinds[0] == "prompt" and all(k == "policy" for k in kinds[1::2])
        assert all(k == "observation" for k in kinds[2::2])
        for kind, seg in ep.segments[1:]:
            if kind == "policy":
                span = slice(pos, pos + len(seg))
                assert np.all(loss[b, span] == 1) and np.all(tid[b, span] == turn)
                for t in range(span.start, span.stop):
                    if sampling.greedy:
                        assert tokens[b, t] == int(np.argmax(ref_logp[t - 1]))
                        np.testing.assert_allclose(logp[b, t], ref_logp[t - 1, tokens[b, t]], atol=2e-4)
                    else:  # plain temperature: log-prob of the scaled distribution
                        z = ref_logp[t - 1] / sampling.temperature  # = logits / T up to a constant
                        z = z - z.max()
                        np.testing.assert_allclose(logp[b, t], z[tokens[b, t]] - np.log(np.exp(z).sum()), atol=2e-4)
                assert TOK.decode(seg, skip_special_tokens=True) == ep.actions[turn]
                last_eot = len(seg) > 0 and seg[-1] == EOT
                n_eot += last_eot
                n_len += not last_eot
                turn += 1
            else:
                expected = TOK.encode(chatml_observation(rep["obs"][turn], last_eot), add_special_tokens=False)
                assert seg == expected
                assert np.all(loss[b, pos : pos + len(seg)] == 0) and np.all(tid[b, pos : pos + len(seg)] == -1)
            pos += len(seg)
        assert pos == n
        assert int(loss[b].sum()) == sum(len(s) for k, s in ep.segments if k == "policy")
        # rewards at each turn's last policy token, returns, ends
        k = int(traj.num_turns[b])
        np.testing.assert_allclose(np.asarray(traj.turn_rewards[b, :k]), rep["rewards"][:k])
        for j in range(k):
            last = np.nonzero(tid[b] == j)[0]
            if last.size:
                assert traj.rewards[b, last[-1]] == pytest.approx(rep["rewards"][j])
        assert float(np.asarray(traj.rewards[b]).sum()) == pytest.approx(sum(rep["rewards"][:k]), abs=1e-6)
        assert float(traj.episode_return[b]) == pytest.approx(sum(rep["rewards"][:k]), abs=1e-6)
        if ep.end_reason == "terminated":
            assert rep["ends"][-1][0] and bool(traj.done[b])
    return n_eot, n_len


@pytest.mark.parametrize("params_fn", [random_params, eager_stop_params])
def test_frozenlake_rollout_is_token_exact(params_fn):
    params = params_fn()
    cfg = AgentLoopConfig(max_turns=3, max_tokens_per_turn=6, max_context=CTX, sampling=SamplingConfig(0.0))
    loop = AgentLoop(params, CFG, TOK, cfg)
    seeds = [3, 4, 3, 5, 6]
    with envs.EnvPool(["frozenlake"] * 5, num_workers=1) as pool:
        traj, eps = loop.run(pool, seeds, group_ids=[0, 1, 0, 2, 3])
    n_eot, n_len = check_token_exact(traj, eps, params, cfg.sampling)
    if params_fn is eager_stop_params:
        assert n_eot > 0 and n_len > 0  # both continuation paths were exercised
    assert np.asarray(traj.group_ids).tolist() == [0, 1, 0, 2, 3]
    # episodes 0 and 2 share a seed and (greedy) play identically: equal anchors per turn
    np.testing.assert_array_equal(np.asarray(traj.anchor_ids[0]), np.asarray(traj.anchor_ids[2]))
    assert np.all(np.asarray(traj.num_turns) <= 3)
    # anchor ids: equal iff the replayed env state keys are equal
    keys, ids = [], []
    for b, ep in enumerate(eps):
        rep = replay("frozenlake", ep.seed, ep.actions)
        for j in range(int(traj.num_turns[b])):
            keys.append(rep["keys"][j])
            ids.append(int(traj.anchor_ids[b, j]))
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (keys[i] == keys[j]) == (ids[i] == ids[j])


def test_temperature_rollout_logprobs_match_the_trained_on_sequence():
    params = random_params()
    cfg = AgentLoopConfig(max_turns=2, max_tokens_per_turn=5, max_context=CTX, sampling=SamplingConfig(0.8), seed=5)
    loop = AgentLoop(params, CFG, TOK, cfg)
    with envs.EnvPool(["frozenlake"] * 2, num_workers=1) as pool:
        traj, eps = loop.run(pool, [1, 2])
    check_token_exact(traj, eps, params, cfg.sampling)


def test_env_failure_ends_only_that_episode():
    params = random_params()
    cfg = AgentLoopConfig(max_turns=6, max_tokens_per_turn=4, max_context=CTX, sampling=SamplingConfig(1.0))
    loop = AgentLoop(params, CFG, TOK, cfg)
    faulty = functools.partial(envs.make, "testing/faulty", fault="raise", at_step=2, fault_seeds={2}, horizon=3)
    with envs.EnvPool([faulty] * 4, num_workers=1) as pool:
        traj, eps = loop.run(pool, [0, 1, 2, 3])
    assert [ep.end_reason for ep in eps] == ["terminated", "terminated", "env_failed", "terminated"]
    np.testing.assert_array_equal(np.asarray(traj.failed), [False, False, True, False])
    np.testing.assert_array_equal(np.asarray(traj.done), [True, True, False, True])
    np.testing.assert_array_equal(np.asarray(traj.num_turns), [3, 3, 2, 3])
    assert "injected fault" in eps[2].failure


def test_context_limit_truncates_with_the_reason():
    env = envs.make("testing/faulty")
    obs, _ = env.reset(0)
    prompt = TOK.encode(
        TOK.apply_chat_template(
            [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": obs}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    for room, policy_tokens in ((6, 4), (2, 2)):  # observation does not fit / action cut by the limit
        cfg = AgentLoopConfig(
            max_turns=4, max_tokens_per_turn=4, max_context=len(prompt) + room, sampling=SamplingConfig(1.0)
        )
        with envs.EnvPool(["testing/faulty"] * 2, num_workers=1) as pool:
            traj, eps = AgentLoop(random_params(), CFG, TOK, cfg).run(pool, [0, 0])
        assert [e.end_reason for e in eps] == ["context_full"] * 2 and bool(np.all(traj.truncated))
        assert np.asarray(traj.num_turns).tolist() == [1, 1]
        assert np.asarray(traj.lengths).tolist() == [len(prompt) + policy_tokens] * 2
        assert int(np.asarray(traj.loss_mask).sum()) == 2 * policy_tokens
        if room == 2:
            assert eps[0].actions == []  # a cut action is never sent to the env


@pytest.mark.slow  # ~18 s on idle cores (suite budget; test_rollout_sampler's bounded-compilation test stays)
def test_max_turns_and_bounded_compilations():
    """Repeated rollouts compile nothing new: decode once, append per length bucket; the
    batch shrinks (one select per smaller bucket) as episodes end."""
    params = random_params()
    cfg = AgentLoopConfig(max_turns=2, max_tokens_per_turn=4, max_context=CTX, sampling=SamplingConfig(1.0))
    loop = AgentLoop(params, CFG, TOK, cfg)
    with envs.EnvPool(["testing/faulty"] * 3, num_workers=1) as pool:
        for _ in range(2):
            traj, eps = loop.run(pool, [7, 8, 9])
    assert [e.end_reason for e in eps] == ["max_turns"] * 3 and bool(np.all(traj.truncated))
    assert np.asarray(traj.num_turns).tolist() == [2, 2, 2]
    counts = dict(loop.sampler.trace_counts)
    assert counts["decode"] == 1 and counts["append"] <= 2 and counts.get("select", 0) == 0
    # finished episodes leave the batch: 5 episodes whose horizons differ
    loop5 = AgentLoop(params, CFG, TOK, AgentLoopConfig(max_turns=6, max_tokens_per_turn=4, max_context=CTX))
    fns = [functools.partial(envs.make, "testing/faulty", horizon=h) for h in (1, 1, 1, 2, 6)]
    with envs.EnvPool(fns, num_workers=1) as pool:
        for _ in range(2):
            traj, eps = loop5.run(pool, [0, 1, 2, 3, 4])
    assert np.asarray(traj.num_turns).tolist() == [1, 1, 1, 2, 6]
    counts = dict(loop5.sampler.trace_counts)
    # batch buckets 5 -> 2 -> 1: one decode per batch size, one select per smaller bucket
    assert counts["decode"] == 3 and counts["select"] == 2 and counts["append"] <= 6


def test_env_reset_failure_and_bad_config():
    faulty = functools.partial(envs.make, "testing/faulty", fault="raise_on_reset", fault_seeds={1})
    loop = AgentLoop(random_params(), CFG, TOK, AgentLoopConfig(max_turns=1, max_tokens_per_turn=3, max_context=256))
    with envs.EnvPool([faulty] * 2, num_workers=1) as pool:
        traj, eps = loop.run(pool, [0, 1])
    assert eps[1].end_reason == "env_failed" and int(traj.lengths[1]) == 0 and bool(traj.failed[1])
    assert eps[0].end_reason == "max_turns" and int(traj.num_turns[0]) == 1
    with pytest.raises(ValueError, match="max_turns"):
        AgentLoopConfig(max_turns=0)
    with pytest.raises(ValueError, match="seeds"):
        with envs.EnvPool(["testing/null"] * 2, num_workers=1) as pool:
            loop.run(pool, [0])


@pytest.mark.slow  # ~14 s on idle cores (suite budget)
def test_run_arguments_seed_sampling_and_row_offset():
    """`run(seed=, sampling=, row_offset=)` override the config per call: a slice of a
    batch played with its row offset samples what those rows sampled in the whole batch,
    and `sampling` replaces the config's without touching it."""
    params = random_params()
    cfg = AgentLoopConfig(
        max_turns=2, max_tokens_per_turn=6, max_context=CTX, sampling=SamplingConfig(temperature=1.0), seed=3
    )
    loop = AgentLoop(params, CFG, TOK, cfg)
    seeds = [5, 6, 7, 8]
    with envs.EnvPool(["frozenlake"] * 4, num_workers=0) as pool:
        whole, _ = loop.run(pool, seeds, seed=11)
        again, _ = loop.run(pool, seeds, seed=11)
        other, _ = loop.run(pool, seeds)  # the config's seed 3
        greedy, _ = loop.run(pool, seeds, sampling=SamplingConfig(temperature=0.0))
    with envs.EnvPool(["frozenlake"] * 2, num_workers=0) as pool:
        tail, _ = loop.run(pool, seeds[2:], seed=11, row_offset=2)
        head, _ = loop.run(pool, seeds[2:], seed=11)
    tok = lambda t: np.asarray(t.tokens)  # noqa: E731
    assert np.asarray(whole.loss_mask).sum() > 0  # the policy did sample tokens
    np.testing.assert_array_equal(tok(whole), tok(again))
    assert not np.array_equal(tok(whole), tok(other))
    np.testing.assert_array_equal(tok(tail), tok(whole)[2:])  # rows 2, 3 of the whole batch
    assert not np.array_equal(tok(head), tok(whole)[2:])  # without the offset: rows 0, 1's keys
    assert loop.config == cfg  # nothing was mutated
    # greedy through the argument = a loop configured greedy
    greedy_loop = AgentLoop(params, CFG, TOK, dataclasses.replace(cfg, sampling=SamplingConfig(temperature=0.0)))
    with envs.EnvPool(["frozenlake"] * 4, num_workers=0) as pool:
        want, _ = greedy_loop.run(pool, seeds)
    np.testing.assert_array_equal(tok(greedy), tok(want))
    with pytest.raises(ValueError, match="row_offset"):
        loop.run(pool, seeds, row_offset=-1)


def test_invalid_and_noop_actions_are_counted_per_episode_and_in_evaluation():
    """Counts from the loop equal a fresh replay's count of the env's `invalid_action`
    and `noop` infos; the held-out summary's fractions are those counts over turns."""
    from jaxagent.train.evaluate import evaluate_policy

    kw = dict(height=6, width=6, num_boxes=1, max_steps=8)
    cfg = AgentLoopConfig(max_turns=8, max_tokens_per_turn=3, max_context=CTX, sampling=SamplingConfig(0.1))
    loop = AgentLoop(eager_stop_params(), CFG, TOK, cfg)
    with envs.EnvPool([functools.partial(envs.make, "sokoban", **kw)] * 8, num_workers=1) as pool:
        _, eps = loop.run(pool, list(range(8)), seed=5)
        summary = evaluate_policy(
            loop, pool, eager_stop_params(), episodes=8, first_seed=0, temperature=0.1, sampling_seed=5, details=True
        )
    totals = {"invalid_action": 0, "noop": 0, "turns": 0}
    for ep in eps:
        env = envs.make("sokoban", **kw)
        env.reset(ep.seed)
        infos = [env.step(a)[4] for a in ep.actions]
        assert ep.invalid_actions == sum("invalid_action" in i for i in infos)
        assert ep.noop_actions == sum(bool(i.get("noop")) for i in infos)
        totals["invalid_action"] += ep.invalid_actions
        totals["noop"] += ep.noop_actions
        totals["turns"] += len(ep.actions)
    assert totals["invalid_action"] > 0 and totals["noop"] > 0  # both kinds occurred
    # the evaluation played the same seeds with the same sampling seed: the same episodes
    assert summary["invalid_action_frac"] == totals["invalid_action"] / totals["turns"]
    assert summary["noop_action_frac"] == totals["noop"] / totals["turns"]
    # the per-episode details carry each episode's actions as played
    assert [(e["seed"], e["actions"]) for e in summary["per_episode"]] == [(ep.seed, list(ep.actions)) for ep in eps]


def _record_prefills(sampler) -> list[int]:
    """The rows of each append to an empty state (a prefill) `sampler` makes from now on."""
    rows, append = [], sampler.append

    def recorded(state, tokens):
        if not np.any(np.asarray(state.cache.lengths)):
            rows.append(len(tokens))
        return append(state, tokens)

    sampler.append = recorded
    return rows


@pytest.mark.parametrize("pipeline_groups", [1, 2])
def test_a_groups_shared_prompt_is_prefilled_once_with_the_same_episodes(pipeline_groups):
    """Groups of 4 episodes of one task each (equal first prompts): the loop prefills each
    distinct prompt once (`share_prompts`, the default) and plays, sampled, the tokens
    and log-probs of the loop that prefills every row."""
    params = random_params()
    cfg = AgentLoopConfig(
        max_turns=3,
        max_tokens_per_turn=8,
        max_context=CTX,
        pipeline_groups=pipeline_groups,
        sampling=SamplingConfig(temperature=1.0),
        seed=3,
    )
    seeds = [5] * 4 + [9] * 4
    runs, rows_prefilled = {}, {}
    for share in (True, False):
        loop = AgentLoop(params, CFG, TOK, dataclasses.replace(cfg, share_prompts=share))
        rows_prefilled[share] = _record_prefills(loop.sampler)
        with envs.EnvPool(["frozenlake"] * 8, num_workers=0) as pool:
            runs[share] = loop.run(pool, seeds, group_ids=[0] * 4 + [1] * 4)[0]
    shared, alone = runs[True], runs[False]
    assert np.asarray(alone.loss_mask).sum() > 0
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(alone.tokens))
    np.testing.assert_allclose(np.asarray(shared.rollout_logp), np.asarray(alone.rollout_logp), atol=1e-5)
    # the prefills: each sub-batch's distinct prompts (one a group) against all of its rows
    per_group = 8 // pipeline_groups
    assert rows_prefilled[False] == [per_group] * pipeline_groups
    assert rows_prefilled[True] == [max(1, 2 // pipeline_groups)] * pipeline_groups, rows_prefilled
