"""Warm start (`jaxagent.train.warmstart`) and the trainer's SFT phase and held-out evaluation.

The layout check compares a demonstration's tokens with an independent rendering: the
tokenizer's own chat template applied to the whole conversation at once.
"""

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import envs
from envs.intake.demonstrations import BALANCE_DRAWS, Conclusions, balanced
from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.models.tokenizer_training import train_bpe_tokenizer
from jaxagent.rollout.chat import ChatFormat
from jaxagent.train import warmstart as ws
from jaxagent.train.config import TrainerConfig
from jaxagent.train.evaluate import evaluate_run
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
LAKE = {"size": 3, "hole_prob": 0.2}


def test_noise_free_expert_always_succeeds_and_noise_is_reproducible():
    clean = ws.collect_demonstrations("frozenlake", LAKE, range(40), max_turns=20)
    assert all(d.success and d.done and d.noisy_actions == 0 for d in clean)
    noisy = ws.collect_demonstrations("frozenlake", LAKE, range(40), noise=0.5, max_turns=20)
    again = ws.collect_demonstrations("frozenlake", LAKE, range(40), noise=0.5, max_turns=20)
    assert [d.actions for d in noisy] == [d.actions for d in again]
    # replayed here: an action that is not the expert's move in its state was a noisy one
    # (a noisy draw may also pick the expert's move), so each count is bounded by the replay
    env, off_total = envs.make("frozenlake", **LAKE), 0
    for d in noisy:
        env.reset(d.seed)
        off = 0
        for a in d.actions:
            off += a != env.expert_action()
            env.step(a)
        assert off <= d.noisy_actions <= len(d.actions), (d.seed, off, d.noisy_actions)
        off_total += off
    assert off_total > 0
    assert sum(d.success for d in noisy) < len(noisy)  # imperfect: some noisy episodes fail
    # every action is one of the env's moves
    moves = set(envs.make("frozenlake").random_actions)
    assert all(a in moves for d in noisy for a in d.actions)
    # the recorded success is the env's own verdict: replaying the actions gives the same
    for d in noisy[:10]:
        env = envs.make("frozenlake", **LAKE)
        env.reset(seed=d.seed)
        info = {}
        for a in d.actions:
            *_, info = env.step(a)
        assert bool(info.get("success", False)) == d.success


def test_noise_needs_an_action_vocabulary_and_an_expert():
    with pytest.raises(ValueError, match="random_actions"):
        ws.collect_demonstrations("countdown", {}, [0], noise=0.3, max_turns=2)
    with pytest.raises(ValueError, match="expert noise"):
        ws.collect_demonstrations("frozenlake", LAKE, [0], noise=1.5, max_turns=2)


def test_bpe_tokenizer_round_trips_and_learns_the_moves():
    demos = ws.collect_demonstrations("frozenlake", LAKE, range(64), noise=0.3, max_turns=8)
    tok = train_bpe_tokenizer(ws.demonstration_texts(demos), 400)
    assert len(tok) <= 400
    for text in ["You move right.\nS F H\n", "<action>up</action>", "héllo wörld 🙂\t\n  x", ""]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # a move the corpus is full of is one token; specials stay single tokens
    assert len(tok.encode("<action>right</action>", add_special_tokens=False)) == 1
    assert len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False)) <= 3
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["x"], 100)


def test_demonstration_tokens_match_the_chat_template_of_the_whole_conversation():
    demos = ws.collect_demonstrations("frozenlake", LAKE, range(5), noise=0.3, max_turns=6)
    tok = train_bpe_tokenizer(ws.demonstration_texts(demos), 400)
    chat = ChatFormat(tok)
    for d in demos:
        tokens, mask = ws.demonstration_tokens(chat, d, 4096)
        messages = [{"role": "system", "content": d.system_prompt}]
        for obs, act in zip(d.observations, d.actions, strict=False):  # the last observation follows the last action
            messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": act}]
        whole = tok.apply_chat_template(messages, tokenize=False)
        # the template closes the last assistant turn with "<|im_end|>\n"; the episode ends
        # with the policy's end-of-turn token
        assert tok.decode(tokens) == whole.removesuffix("\n")
        # the loss is on the actions and their end-of-turn tokens, nothing else
        taught = tok.decode([t for t, m in zip(tokens, mask, strict=True) if m])
        assert taught == "".join(a + "<|im_end|>" for a in d.actions)


def test_demonstration_tokens_respect_the_context():
    demos = ws.collect_demonstrations("frozenlake", LAKE, [3], noise=1.0, max_turns=8)
    tok = train_bpe_tokenizer(ws.demonstration_texts(demos), 300)
    chat = ChatFormat(tok)
    full, full_mask = ws.demonstration_tokens(chat, demos[0], 4096)
    # the segments of the full layout (prompt, action, observation, action, ...) end where
    # its loss mask changes, and at its end
    bounds = [p for p in range(1, len(full)) if full_mask[p] != full_mask[p - 1]] + [len(full)]
    assert sum(full_mask[p - 1] for p in bounds) == len(demos[0].actions)
    for limit in range(bounds[0] + 1, len(full) + 1):
        cut, mask = ws.demonstration_tokens(chat, demos[0], limit)
        # whole segments only: each action that fits, an observation only while it leaves
        # room for a token of the next action
        keep = max(p for p in bounds if p <= limit and (full_mask[p - 1] == 1 or p < limit))
        assert cut == full[:keep] and mask == full_mask[:keep], limit
    cut, mask = ws.demonstration_tokens(chat, demos[0], len(full) - 5)
    assert len(cut) <= len(full) - 5 and full[: len(cut)] == cut and sum(mask) > 0
    with pytest.raises(ValueError, match="max_context"):
        ws.demonstration_tokens(chat, demos[0], 10)


TINY = [
    "model.tokenizer=bpe",
    "model.tokenizer_vocab_size=400",
    "env.name=frozenlake",
    "env.kwargs={size: 3, hole_prob: 0.2}",
    "env.group_size=4",
    "env.tasks_per_iteration=2",
    "rollout.max_turns=4",
    "rollout.max_tokens_per_turn=4",
    "rollout.max_context=384",
    "warm_start.episodes=32",
    "warm_start.expert_noise=0.3",
    "warm_start.epochs=6",
    "warm_start.batch_size=8",
    "warm_start.optim.lr=0.005",
    "eval.episodes=8",
    "iterations=2",
    "checkpoint_every=1",
    "update.mini_batches=1",
]


def tiny(run_dir, *more):
    return load_config(
        TrainerConfig, ROOT / "configs" / "tiny_countdown_grpo.yaml", [f"run_dir={run_dir}", *TINY, *more]
    )


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_warm_start_then_rl_reports_held_out_success_and_resumes(tmp_path):
    logs = []
    trainer = Trainer(tiny(tmp_path / "run"), log=logs.append)
    history = trainer.run()
    assert len(history) == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_before_rl"]["episodes"] == 8
    # each rate is a share of the 8 held-out episodes (before RL, whose checkpoint 0 is no
    # longer kept: a count of 8)
    before = summary["success_before_rl"]
    assert before == summary["eval_before_rl"]["success_rate"] and before * 8 == round(before * 8)
    # after RL: the share the env reported won, of the same evaluation replayed from the
    # last checkpoint (the one it ran with), which lists the episodes
    out = tmp_path / "eval.jsonl"
    evaluate_run(tmp_path / "run", out=out, log=lambda *_: None)
    episodes = [json.loads(x) for x in out.read_text().splitlines()][:-1]
    seed = tiny(tmp_path / "run").eval.seed
    assert [e["seed"] for e in episodes] == list(range(seed, seed + 8))
    won = sum(e["info"].get("success") is True for e in episodes)
    assert summary["success_after_rl"] == summary["eval_after_rl"]["success_rate"] == won / 8
    assert summary["eval_after_rl"]["return_mean"] == pytest.approx(
        math.fsum(e["return"] for e in episodes) / 8, rel=1e-12, abs=1e-12
    )
    # the SFT loss fell: the demonstrations were learned from
    sft = [json.loads(x) for x in (tmp_path / "run" / "warm_start.jsonl").read_text().splitlines()]
    assert sft[-1]["loss"] < 0.6 * sft[0]["loss"] and all(math.isfinite(x["loss"]) for x in sft)
    # the last log line is the JSON summary
    last = json.loads(logs[-1])
    assert last["success_before_rl"] == summary["success_before_rl"]
    assert last["success_after_rl"] == summary["success_after_rl"]
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    # the run logger wrote TensorBoard events and readable transcripts with per-turn rewards
    assert any((tmp_path / "run" / "tensorboard").iterdir())
    transcripts = sorted((tmp_path / "run" / "transcripts").glob("*.txt"))
    assert len(transcripts) == 2 and "reward" in transcripts[-1].read_text()
    # resuming a finished run does nothing and keeps the summary
    logs2 = []
    again = Trainer(tiny(tmp_path / "run"), resume=True, log=logs2.append)
    again.run()
    assert any("nothing to do" in x for x in logs2)
    assert again.summary["success_after_rl"] == summary["success_after_rl"]
    # extending the run resumes after the warm start (no second SFT) and re-evaluates
    logs3 = []
    more = Trainer(tiny(tmp_path / "run", "iterations=3"), resume=True, log=logs3.append)
    assert more.tokenizer.get_vocab() == trainer.tokenizer.get_vocab()
    more.run()
    assert not any(x.startswith("warm start") for x in logs3)
    assert [m["iteration"] for m in more.history] == [1, 2, 3]
    assert json.loads(logs3[-1])["iterations"] == 3


def test_overlapping_seed_ranges_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="overlap"):
        tiny(tmp_path / "run", "eval.seed=1000010")
    with pytest.raises(ConfigError, match="overlap"):
        tiny(tmp_path / "run", "eval.seed=0")


def test_greedy_evaluation_is_deterministic(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run", "warm_start.episodes=0"), log=lambda *_: None)
    loop = trainer.episode_loop()
    with envs.EnvPool([lambda: envs.make("frozenlake", **LAKE)] * 8, num_workers=0) as pool:
        a = trainer.evaluate(loop, pool, episodes=10, temperature=0.0)
        b = trainer.evaluate(loop, pool, episodes=10, temperature=0.0)
    assert a["episodes"] == 10 and a["success_rate"] == b["success_rate"]
    assert a["return_mean"] == b["return_mean"]


def test_length_buckets_keep_every_row_once_and_group_similar_lengths():
    import jax
    import numpy as np

    rng = np.random.RandomState(3)
    lengths = rng.randint(20, 400, size=100)
    perm = rng.permutation(100)
    batches = [perm[j * 8 : (j + 1) * 8] for j in range(12)]  # 96 of 100 rows, as an epoch takes them
    got = ws.length_bucketed(batches, lengths, jax.random.key(0))
    assert sorted(len(b) for b in got) == [8] * 12
    assert sorted(np.concatenate(got).tolist()) == sorted(perm[:96].tolist())
    # the batches of one chunk of BUCKET_CHUNK split that chunk's rows at length order
    for c in range(0, 12, ws.BUCKET_CHUNK):
        chunk = np.concatenate(batches[c : c + ws.BUCKET_CHUNK])
        mine = [b for b in got if set(b.tolist()) <= set(chunk.tolist())]
        assert len(mine) == len(batches[c : c + ws.BUCKET_CHUNK])
        mine.sort(key=lambda b: lengths[b].min())
        for lo, hi in zip(mine, mine[1:], strict=False):  # each batch with the next
            assert lengths[lo].max() <= lengths[hi].min()
    # far less padding than padding every batch to the longest row
    padded = sum(ws.padded_length(int(lengths[b].max()), 416) * len(b) for b in got)
    assert padded < 0.75 * 96 * 416
    assert [ws.length_bucketed(batches, lengths, jax.random.key(0))[i].tolist() for i in range(12)] == [
        b.tolist() for b in got
    ]
    assert ws.padded_length(65, 416) == 128 and ws.padded_length(64, 416) == 64 and ws.padded_length(409, 416) == 416


def test_a_batch_trimmed_to_its_longest_row_has_the_same_sft_loss_and_gradient():
    """What `warm_start.length_buckets` relies on: columns past every row's end change
    neither the token-mean loss nor its gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxagent import models as M
    from jaxagent.train.config.step import StepConfig
    from jaxagent.train.update.batch import SFTBatch
    from jaxagent.train.update.losses import sft_loss_and_grads
    from jaxagent.train.update.state import init_train_state

    cfg = M.DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        model_type="qwen2",
    )
    state = init_train_state(jax.random.key(0), M.init_params(jax.random.key(1), cfg, std=0.2), cfg, StepConfig())
    rng = np.random.RandomState(0)
    rows = []
    for n in (9, 17, 23, 30):
        t = rng.randint(1, 64, n).tolist()
        m = (rng.rand(n) < 0.5).astype(int).tolist()
        rows.append((t, m))
    tokens, loss, attn = ws.pack_rows(rows, 64, 0)
    full = SFTBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(loss), attention_mask=jnp.asarray(attn))
    cut = SFTBatch(
        tokens=jnp.asarray(tokens[:, :32]),
        loss_mask=jnp.asarray(loss[:, :32]),
        attention_mask=jnp.asarray(attn[:, :32]),
    )
    # reference: masked token-mean NLL of each row on its own tokens only, float64
    row_logp = jax.jit(lambda p, x: M.token_logprobs(p, cfg, x)[0])
    logp = [np.asarray(row_logp(state.params, jnp.asarray([t]))[0], np.float64) for t, _ in rows]
    nll = -sum(float(np.sum(lp * np.asarray(m))) for lp, (_, m) in zip(logp, rows, strict=True)) / sum(
        sum(m) for _, m in rows
    )
    grads = jax.jit(sft_loss_and_grads, static_argnames=("config",))
    g_full, s_full = grads(state, full, config=StepConfig())
    g_cut, s_cut = grads(state, cut, config=StepConfig())
    np.testing.assert_allclose(float(s_full["loss"]), nll, rtol=2e-6)
    np.testing.assert_allclose(float(s_cut["loss"]), nll, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_cut), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_length_buckets_must_be_a_bool(tmp_path):
    with pytest.raises(ConfigError, match="length_buckets"):
        tiny(tmp_path / "run", "warm_start.length_buckets=3")


def test_conclusion_demonstrations_teach_only_their_final_action():
    demos = ws.collect_demonstrations("frozenlake", LAKE, range(6), noise=0.3, max_turns=6)
    final = ws.collect_demonstrations("frozenlake", LAKE, range(6), noise=0.3, max_turns=6, final_only=True)
    tok = train_bpe_tokenizer(ws.demonstration_texts(demos), 400)
    chat = ChatFormat(tok)
    for d, f in zip(demos, final, strict=True):
        assert f.final_only and not d.final_only and f.actions == d.actions
        tokens, mask = ws.demonstration_tokens(chat, d, 4096)
        f_tokens, f_mask = ws.demonstration_tokens(chat, f, 4096)
        # the same layout; the loss on the last action and its end-of-turn token only
        assert f_tokens == tokens
        taught = tok.decode([t for t, m in zip(f_tokens, f_mask, strict=True) if m])
        assert taught == d.actions[-1] + "<|im_end|>"
        last = chat.encode(d.actions[-1])
        assert f_mask[-1] == 1 and sum(f_mask) == len(last) + 1
        # skipping the final action's first tokens: they are not taught, its end-of-turn
        # token always is
        for skip in (1, 2, len(last) + 3):
            s_tokens, s_mask = ws.demonstration_tokens(chat, dataclasses.replace(f, skip_final=skip), 4096)
            assert s_tokens == tokens
            taught = [t for t, m in zip(s_tokens, s_mask, strict=True) if m]
            assert taught == (last + [chat.stop_token_ids[0]])[min(skip, len(last)) :]
        # acting demonstrations are unaffected
        assert ws.demonstration_tokens(chat, dataclasses.replace(d, skip_final=2), 4096) == (tokens, mask)
        # cut before the final action: nothing is taught
        _, cut_mask = ws.demonstration_tokens(chat, f, len(tokens) - 1)
        assert sum(cut_mask) == 0


@pytest.mark.slow  # ~21 s: the intake's demonstration source; warm_start.extra is tested in the default suite
def test_conclusion_demonstrations_join_the_warm_start(tmp_path):
    logs = []
    trainer = Trainer(tiny(tmp_path / "run", CONCLUSIONS + "seed: 1200000}"), log=logs.append)
    acting = [d for d in trainer.demonstrations if not d.final_only]
    final = [d for d in trainer.demonstrations if d.final_only]
    assert [d.seed for d in acting] == list(range(1_000_000, 1_000_032))
    assert [d.seed for d in final] == list(range(1_200_000, 1_200_008))
    _, _, summary = ws.sft_warm_start(
        trainer.config,
        trainer.state.params,
        trainer.model_config,
        trainer.tokenizer,
        trainer.demonstrations,
        trainer.placement,
        log=logs.append,
    )
    assert summary["demonstrations"] == 32
    assert summary["conclusion_demonstrations"] + summary["conclusions_dropped"] == 8
    # the demonstration success is the acting demonstrations' own
    assert summary["demonstration_success"] == pytest.approx(sum(d.success for d in acting) / 32)
    assert any("+ 8 conclusion demonstrations" in x for x in logs if isinstance(x, str))


def test_conclusion_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="overlap"):
        tiny(tmp_path / "run", CONCLUSIONS + "seed: 1000030}")
    with pytest.raises(ConfigError, match="expert must be a mapping"):
        tiny(tmp_path / "run", CONCLUSIONS + "expert: [1, 2]}")
    with pytest.raises(ConfigError, match="n must be an integer >= 1"):
        tiny(tmp_path / "run", "warm_start.extra={source: envs.intake.demonstrations:Conclusions, n: -1}")
    with pytest.raises(ConfigError, match="skip_tokens"):
        tiny(tmp_path / "run", CONCLUSIONS + "skip_tokens: -1}")
    # an option the source does not take, and sources that are not one
    with pytest.raises(ConfigError, match="unexpected keyword argument 'nn'"):
        tiny(tmp_path / "run", CONCLUSIONS + "nn: 3}")
    with pytest.raises(ConfigError, match="extra.source 'envs.nowhere:Conclusions': no module named 'envs.nowhere'"):
        tiny(tmp_path / "run", "warm_start.extra={source: 'envs.nowhere:Conclusions'}")
    with pytest.raises(ConfigError, match="module 'envs.intake.demonstrations' has no attribute 'Conclusion'"):
        tiny(tmp_path / "run", "warm_start.extra={source: 'envs.intake.demonstrations:Conclusion'}")
    with pytest.raises(ConfigError, match="has no seeds"):
        tiny(tmp_path / "run", "warm_start.extra={source: 'collections:OrderedDict'}")
    with pytest.raises(ConfigError, match="source: module:Class"):
        tiny(tmp_path / "run", "warm_start.extra={n: 8}")
    # the keys it replaced are refused, saying what to set
    with pytest.raises(
        ConfigError,
        match=r"warm_start.conclusions was replaced: set warm_start.extra: "
        r"\{source: envs.intake.demonstrations:Conclusions, n: \.\.\.\}",
    ):
        tiny(tmp_path / "run", "warm_start.conclusions=8")


#: the intake recipe's conclusion demonstrations (`envs.intake.demonstrations`), 8 of them; a test closes the braces
CONCLUSIONS = "warm_start.extra={source: envs.intake.demonstrations:Conclusions, n: 8, "


def player(name, kwargs, max_turns):
    """The trainer's expert player (`warmstart.expert_player`) for an env outside a run."""
    config = SimpleNamespace(
        env=SimpleNamespace(name=name, kwargs=kwargs),
        rollout=SimpleNamespace(max_turns=max_turns),
        warm_start=SimpleNamespace(expert={}),
    )
    return ws.expert_player(config)


WEAK_CONCLUSIONS = {
    "style": "weak",
    "questions": [5, 19],
    "risk_screen": 1.0,
    "followup": 1.0,
    "skip": 0.1,
    "risk_order": "shuffled",
}


def _triage_line(action: str) -> str | None:
    """The triage level an assessment names, read line by line (no regular expression)."""
    for line in action.splitlines():
        if line.startswith("Triage: "):
            return line[len("Triage: ") :].strip()
    return None


# slow (~15-25 s of intake episodes): the suite's time; the balancing is checked through the
# trainer on frozenlake below (test_the_trainer_balances_conclusions_when_asked)
@pytest.mark.slow
def test_balanced_conclusions_take_the_first_seeds_of_each_class():
    kw, start = {"cases": "standard", "max_turns": 20}, 1_100_000
    play = player("intake", kw, 20)
    got, counts = balanced(
        lambda a, n: play(range(a, a + n), expert=WEAK_CONCLUSIONS, final_only=True),
        start,
        30,
        r"Triage: (\w+)",
        BALANCE_DRAWS * 30,
    )
    # the source's own collection is the same one
    source = Conclusions(n=30, seed=start, balance=r"Triage: (\w+)", expert=WEAK_CONCLUSIONS)
    assert [d.seed for d in source.collect(play)] == [d.seed for d in got]
    # reference: every seed played plainly, classed by its triage line, the first 10 of each class kept
    plain = ws.collect_demonstrations(
        "intake",
        kw,
        range(start, start + counts["seeds_drawn"]),
        max_turns=20,
        final_only=True,
        expert=WEAK_CONCLUSIONS,
    )
    classes = sorted({_triage_line(d.actions[-1]) for d in plain[:30]} - {None})
    assert len(classes) == 3  # the first 30 seeds give all three levels (checked here, not assumed)
    want = []
    for c in classes:
        want += [d.seed for d in plain if _triage_line(d.actions[-1]) == c][:10]
    assert [d.seed for d in got] == sorted(want)
    assert {c: counts[c] for c in classes} == {c: 10 for c in classes}
    assert all(d.final_only for d in got)
    # the same demonstrations as the plain collection (seed for seed)
    by_seed = {d.seed: d for d in plain}
    assert all(d.actions == by_seed[d.seed].actions for d in got)
    # drawing stopped at the first chunk in which every class was full
    assert counts["seeds_drawn"] % 30 == 0
    last_needed = max(want)
    assert counts["seeds_drawn"] - 30 <= last_needed - start < counts["seeds_drawn"]


def test_balanced_conclusions_name_a_short_class_and_a_pattern_that_never_matches():
    play = player("intake", {"cases": "standard", "max_turns": 20}, 20)
    with pytest.raises(ValueError, match=r"class 'emergent' has \d+ of 10"):
        Conclusions(n=30, balance=r"Triage: (\w+)", expert=WEAK_CONCLUSIONS, max_draws=30).collect(play)
    with pytest.raises(ValueError, match="matches none"):
        Conclusions(n=6, balance=r"Verdict: (\w+)", expert=WEAK_CONCLUSIONS).collect(play)
    with pytest.raises(ValueError, match="one group"):
        Conclusions(n=6, balance=r"Triage: \w+")


def test_conclusion_balance_option_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="not a regular expression"):
        tiny(tmp_path / "run", CONCLUSIONS + "balance: 'Triage: (\\w+'}")
    with pytest.raises(ConfigError, match="exactly one group"):
        tiny(tmp_path / "run", CONCLUSIONS + "balance: '(a)(b)'}")
    with pytest.raises(ValueError, match="balance must be"):
        Conclusions(n=8, balance=3)
    # the balanced seed range is checked against the others at its longest (16 x n)
    tiny(tmp_path / "run", CONCLUSIONS + "seed: 999900}")
    with pytest.raises(ConfigError, match="overlap"):
        tiny(tmp_path / "run", CONCLUSIONS + "seed: 999900, balance: '(a)'}")


def test_the_trainer_balances_conclusions_when_asked(tmp_path):
    logs = []
    trainer = Trainer(
        tiny(tmp_path / "run", CONCLUSIONS + "seed: 1200000, balance: '<action>(\\w+)</action>'}"), log=logs.append
    )
    final = [d for d in trainer.demonstrations if d.final_only]
    # frozenlake's final action is a move: the classes are the moves of the first 8 seeds' last actions
    plain = ws.collect_demonstrations(
        "frozenlake", LAKE, range(1_200_000, 1_200_000 + 128), max_turns=4, final_only=True
    )

    def move(d):
        return d.actions[-1].removeprefix("<action>").removesuffix("</action>")

    classes = sorted({move(d) for d in plain[:8]})
    quota = 8 // len(classes)
    want = sorted(s for c in classes for s in [d.seed for d in plain if move(d) == c][:quota])
    assert [d.seed for d in final] == want
    assert any("balanced over" in x for x in logs if isinstance(x, str))
