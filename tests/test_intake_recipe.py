"""The pieces of the intake recipe (`configs/intake.yaml`): the imperfect clinician of the
warm start, the tokenizer whose merges cross words, the env's score for a cut-off
interview, and the env's own summary in the trainer's evaluations and metrics."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from envs.intake.env import IntakeEnv
from envs.intake.policies import QUESTIONS, RISK_ORDER, WeakClinician, make_policy
from envs.intake.rubric import RubricConfig, score
from jaxagent.dataclass_yaml import load_config
from jaxagent.models.tokenizer_training import frequent_lines, train_bpe_tokenizer
from jaxagent.train import warmstart
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
RISK_QUESTIONS = {QUESTIONS[d][0] for d in RISK_ORDER}


def play(env, seed, policy):
    obs, _ = env.reset(seed=seed)
    actions = []
    while True:
        a = policy(obs, env)
        actions.append(a)
        obs, r, term, trunc, info = env.step(a)
        if term or trunc:
            return actions, r, info


def test_the_weak_clinician_is_imperfect_the_way_its_options_say():
    env = IntakeEnv("standard", max_turns=20)
    weak = WeakClinician()
    runs = [play(env, s, weak) for s in range(120)]
    # deterministic: the same case, the same interview
    assert play(env, 7, weak)[0] == runs[7][0]
    planned = []
    for s in range(120):
        env.reset(seed=s)
        planned.append("suicidal_ideation" in weak.plan(env.case.case_id)[0])
    assert 0.2 <= np.mean(planned) <= 0.4  # risk_screen 0.3
    asked = [any(a.endswith(q) for a in acts for q in RISK_QUESTIONS) for acts, _, _ in runs]
    # the risk questions come last, so the early conclusion cuts many of them
    assert 0 < sum(asked) < sum(planned) and not any(a and not p for a, p in zip(asked, planned, strict=True))
    n_questions = [len(acts) - 1 for acts, _, _ in runs]
    assert max(n_questions) <= 12 and min(n_questions) >= 1
    assert all(info["assessment"] is not None for _, _, info in runs)  # it always concludes
    orders = Counter(acts[0] for acts, _, _ in runs)
    assert len(orders) >= 10  # a random order, not the expert's
    mean = np.mean([r for _, r, _ in runs])
    expert = np.mean([play(env, s, make_policy("expert"))[1] for s in range(40)])
    assert expert > 0.95 and 0.3 < mean < 0.6
    # never screening risk: every risky case is under-triaged
    never = WeakClinician(risk_screen=0.0)
    assert not any(a in RISK_QUESTIONS for s in range(30) for a in play(env, s, never)[0])
    # the env's expert_action offers it
    env.reset(seed=3)
    assert env.expert_action(style="weak") == weak.act(env)
    with pytest.raises(ValueError, match="style must be"):
        env.expert_action(style="clumsy")
    with pytest.raises(ValueError, match="risk_screen must be a probability"):
        WeakClinician(risk_screen=1.5)
    with pytest.raises(ValueError, match="questions must be"):
        WeakClinician(questions=(8, 3))


def test_shuffled_risk_order_asks_the_planned_screening_and_follows_up_revealed_ideation():
    env = IntakeEnv("standard", max_turns=20)
    last, shuffled = WeakClinician(followup=1.0), WeakClinician(followup=1.0, risk_order="shuffled")
    asked = {"last": 0, "shuffled": 0}
    followed = 0
    for s in range(300):  # 4 screened cases with suicidal intent among them
        env.reset(seed=s)
        plan_last, plan_shuffled = last.plan(env.case.case_id), shuffled.plan(env.case.case_id)
        # the same domains kept and the same screening and follow-up draws; the risk domains placed elsewhere
        assert [d for d in plan_shuffled[0] if d not in RISK_ORDER] == [d for d in plan_last[0] if d not in RISK_ORDER]
        assert sorted(d for d in plan_shuffled[0] if d in RISK_ORDER) == sorted(
            d for d in plan_last[0] if d in RISK_ORDER
        )
        assert plan_shuffled[1] == plan_last[1]
        for name, policy in (("last", last), ("shuffled", shuffled)):
            acts, _, info = play(env, s, policy)
            asked[name] += any(a.endswith(QUESTIONS["suicidal_ideation"][0]) for a in acts)
            if (
                name == "shuffled"
                and "suicidal_ideation" not in info["missed_domains"]
                and "suicide_intent" in info["case"]["risks"]
                and plan_shuffled[1]
            ):
                followed += "suicide_intent" not in info["missed_domains"]
    assert asked["shuffled"] > asked["last"] > 0  # the early conclusion cuts fewer of them
    assert followed > 0
    with pytest.raises(ValueError, match="risk_order must be"):
        WeakClinician(risk_order="first")


def _listed(observation):
    """The checklist's domains from an observation's last line (`To ask: ...`), read
    with the labels written out here."""
    labels = {
        "mood": "mood",
        "anxiety": "anxiety",
        "panic": "panic",
        "trauma": "trauma",
        "mania": "mania",
        "psychosis": "psychosis",
        "substance": "substance",
        "attention": "attention",
        "sleep": "sleep",
        "appetite": "appetite",
        "medical": "medical",
        "medications": "medications",
        "family": "family",
        "work": "social",
        "suicide": "suicidal_ideation",
        "plan": "suicide_plan",
        "intent": "suicide_intent",
        "means": "suicide_means",
        "harm": "harm_others",
        "voices": "command_hallucinations",
        "withdrawal": "withdrawal",
    }
    line = observation.rstrip().splitlines()[-1]
    assert line.startswith("To ask: ") and line.endswith("."), line
    body = line[len("To ask: ") : -1]
    return [] if body == "nothing" else [labels[w] for w in body.split()]


def _asked_domain(action):
    hits = [d for d, (first, _) in QUESTIONS.items() if action.endswith(first)]
    assert len(hits) == 1, action
    return hits[0]


def test_the_weak_clinician_can_read_its_questions_off_the_notes():
    env = IntakeEnv("standard", max_turns=20, notes=True)
    first = WeakClinician(follow_notes=1.0, skip=0.0, risk_screen=1.0, followup=1.0, questions=(19, 19))
    anyone = WeakClinician(follow_notes=0.0, skip=0.0, risk_screen=1.0, followup=1.0, questions=(19, 19))
    not_first = 0
    screened = 0
    for s in range(40):
        for policy in (first, anyone):
            obs, _ = env.reset(seed=s)
            asked = []
            while True:
                a = policy(obs, env)
                if a.startswith("<assessment>"):
                    break
                dom = _asked_domain(a)
                # every question is a domain still on the notes that it has not asked (no retry, no repeat)
                todo = [d for d in _listed(obs) if d not in asked]
                assert dom in todo, (s, dom, todo)
                if policy is first:
                    assert dom == todo[0]
                else:
                    not_first += dom != todo[0]
                asked.append(dom)
                obs, _, term, trunc, _ = env.step(a)
                assert not (term or trunc)
            # it concludes when its budget is spent or nothing it planned is left
            assert len(asked) == 19 or not [d for d in _listed(obs) if d not in asked]
            screened += "suicidal_ideation" in asked
        assert play(env, s, anyone)[0] == play(env, s, anyone)[0]  # drawn from the case: deterministic
    assert not_first > 40  # the random pick is not the first item
    assert screened > 0
    # not planned, not asked: no risk screening reads no risk item off the notes
    never = WeakClinician(follow_notes=0.0, risk_screen=0.0, questions=(19, 19))
    for s in range(20):
        acts = play(env, s, never)[0]
        assert not any(a.endswith(q) for a in acts for q in RISK_QUESTIONS)
    # it reads the list whether or not the policy is shown it
    plain = IntakeEnv("standard", max_turns=20)
    assert play(plain, 5, first)[0] == play(env, 5, first)[0]
    assert env.expert_action(style="weak", follow_notes=0.5) == WeakClinician(follow_notes=0.5).act(env)
    for bad in (1.5, -0.1, True, "often"):
        with pytest.raises(ValueError, match="follow_notes must be null or a probability"):
            WeakClinician(follow_notes=bad)


def test_the_weak_clinician_reading_risk_first_notes_screens_first_only_when_it_planned_to():
    env = IntakeEnv("standard", max_turns=20, notes=True, notes_order="risk_first")
    screens = WeakClinician(follow_notes=1.0, risk_screen=1.0, questions=(6, 6))
    never = WeakClinician(follow_notes=1.0, risk_screen=0.0, questions=(6, 6))
    some = WeakClinician(follow_notes=1.0, risk_screen=0.3, questions=(6, 6))
    first_is_risk = 0
    for s in range(30):
        assert _asked_domain(play(env, s, screens)[0][0]) == "suicidal_ideation"
        acts = play(env, s, never)[0]
        assert not any(a.endswith(q) for a in acts for q in RISK_QUESTIONS)
        first_is_risk += _asked_domain(play(env, s, some)[0][0]) == "suicidal_ideation"
    assert 3 <= first_is_risk <= 18  # about 30% of the interviews
    # the same clinician on the expert's order: the budget ends the interview before the risk items
    late = IntakeEnv("standard", max_turns=20, notes=True)
    for s in range(10):
        assert not any(a.endswith(q) for a in play(late, s, screens)[0] for q in RISK_QUESTIONS)


def test_warm_start_expert_options_reach_the_env_and_bad_ones_are_named():
    demos = warmstart.collect_demonstrations(
        "intake", {"max_turns": 20}, range(10), max_turns=20, expert={"style": "weak", "risk_screen": 0.0}
    )
    assert all(not (set(d.actions) & RISK_QUESTIONS) for d in demos)
    with pytest.raises(ValueError, match="warm_start.expert .* does not fit env 'intake'"):
        warmstart.collect_demonstrations("intake", {}, range(1), max_turns=5, expert={"style": "weak", "bogus": 1})
    with pytest.raises(ValueError, match="warm_start.expert: expected a mapping"):
        load_config(TrainerConfig, None, ["warm_start.expert=3"])


def test_line_and_phrase_pieces_make_a_repeated_sentence_one_token_and_round_trip():
    sentence = "Have you had any thoughts of hurting or killing someone else?"
    texts = [sentence, 'Patient: "No, never."', "Triage: routine\nManagement:"] * 50 + ["odd words here"]
    lines = train_bpe_tokenizer(texts, 600, pieces="lines")
    words = train_bpe_tokenizer(texts, 600, pieces="words")
    assert len(lines.encode(sentence, add_special_tokens=False)) == 1
    assert len(words.encode(sentence, add_special_tokens=False)) == len(sentence.split())
    # a line break is never inside a token
    ids = lines.encode("Triage: routine\nManagement:", add_special_tokens=False)
    assert [lines.decode([i]) for i in ids] == ["Triage: routine", "\n", "Management:"]
    for text in texts + ["unseen text, with ünïcode\n\n and  spaces "]:
        assert lines.decode(lines.encode(text, add_special_tokens=False)) == text
    # "phrases": a line repeated 8 times is one token, other text stays in words
    varied = [f'Patient: "I lost my job {k} weeks ago."' for k in range(7)]
    phrases = train_bpe_tokenizer(texts + varied, 600, pieces="phrases")
    assert len(phrases) <= 600
    assert len(phrases.encode(sentence, add_special_tokens=False)) == 1
    assert len(phrases.encode(varied[0], add_special_tokens=False)) == len(varied[0].split())
    inside = "Doctor: " + sentence + " Thanks."  # a phrase inside other text is still its token
    ids = phrases.encode(inside, add_special_tokens=False)
    assert sentence in [phrases.decode([i]) for i in ids] and phrases.decode(ids) == inside
    assert frequent_lines(["ab\nabcd\nabcd"] * 4, 10) == ["abcd"]  # >= 8 times, >= 4 chars
    with pytest.raises(ValueError, match="pieces must be one of"):
        train_bpe_tokenizer(texts, 600, pieces="sentences")
    with pytest.raises(ValueError, match="tokenizer_pieces must be"):
        load_config(TrainerConfig, None, ["model.tokenizer_pieces=chars"])


def test_an_exported_phrase_tokenizer_loads_back_splitting_text_as_trained(tmp_path):
    """A run exported with its "phrases" tokenizer and read back as a model path
    (`load_tokenizer`, what `model.path=` uses) gives the same token ids: transformers'
    AutoTokenizer maps a qwen2 directory to a class with its own pre-tokenizer, which would
    re-split the text (the warm start then reads other tokens than it was trained on)."""
    import jax

    from jaxagent import models as M

    texts = ["Have you had any thoughts of hurting or killing someone else?", "Triage: routine"] * 40 + [
        f'Patient: "I sleep {k} hours, since March."' for k in range(7)
    ] * 5  # lines under 8 times: words
    tok = train_bpe_tokenizer(texts, 600, pieces="phrases")
    cfg = M.DecoderConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        qkv_bias=True,
    )
    out = M.save_pretrained(
        M.Model(params=M.init_params(jax.random.key(0), cfg), config=cfg), tmp_path / "hf", tokenizer=tok
    )
    back = M.load_tokenizer(out)
    for text in (
        texts[:2] + texts[-3:] + ["Doctor: Have you had any thoughts of hurting or killing someone else? ok\n\n x  y"]
    ):
        assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    msgs = [{"role": "system", "content": "Triage: routine"}, {"role": "user", "content": texts[-1]}]
    assert back.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    with pytest.raises(ValueError, match="tokenizer_config.json is not a JSON object"):
        (out / "tokenizer_config.json").write_text("[1, 2")
        M.load_tokenizer(out)


def test_a_cut_off_interview_scores_as_one_without_an_assessment():
    """`if_cut` on every question step is what the env gives when it runs out of turns."""
    a = IntakeEnv("adversarial", max_turns=4)
    b = IntakeEnv("adversarial", max_turns=4)
    a.reset(seed=0)
    b.reset(seed=0)
    _, r, _, _, info = a.step("How has your mood been lately?")
    assert r == 0.0 and "if_cut" in info
    b.step("How has your mood been lately?")
    b.step("Do you like the weather today?")
    b.step("Is there anything else?")
    # b runs out of turns after its 4th question with the same interview as a's cut... not
    # quite: compare with an env whose 2nd question is its last
    c = IntakeEnv("adversarial", max_turns=2)
    c.reset(seed=0)
    c.step("How has your mood been lately?")
    _, r_end, _, trunc, end_info = c.step("Do you like the weather today?")
    _, _, _, _, info_a2 = a.step("Do you like the weather today?")
    assert trunc and info_a2["if_cut"]["reward"] == pytest.approx(r_end)
    assert info_a2["if_cut"]["info"]["rubric"] == end_info["rubric"]
    assert info_a2["if_cut"]["info"]["cut_off"] is True
    assert r_end < 0  # the adversarial case needs more than routine care: under-triage cost


def test_the_loop_applies_the_cut_off_score_when_the_context_fills():
    import jax

    import envs
    from jaxagent import models
    from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
    from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

    tok = byte_chat_tokenizer()
    cfg = models.DecoderConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )
    params = models.init_params(jax.random.key(0), cfg)
    # a random model rarely stops: 60-token turns fill a context of prompt + ~150 tokens
    env = IntakeEnv("adversarial", max_turns=20)
    obs, info = env.reset(seed=0)
    from jaxagent.rollout.chat import ChatFormat

    prompt = len(ChatFormat(tok).prompt_tokens(env.system_prompt, obs))
    loop = AgentLoop(
        params,
        cfg,
        tok,
        AgentLoopConfig(
            max_turns=20, max_tokens_per_turn=60, max_context=prompt + 150, sampling=SamplingConfig(temperature=1.0)
        ),
    )
    with envs.EnvPool([lambda: IntakeEnv("adversarial", max_turns=20)] * 4, num_workers=0) as pool:
        _, eps = loop.run(pool, [0, 1, 2, 3], [0, 0, 1, 1], seed=0)
    cut = [ep for ep in eps if ep.end_reason == "context_full"]
    assert cut, [ep.end_reason for ep in eps]
    for ep in cut:
        # the reference: the same actions in a fresh env, then the env's own end of turns
        # actions, then the rubric of an interview with no assessment (rubric.score)
        ref = IntakeEnv("adversarial", max_turns=20)
        ref.reset(seed=ep.seed)
        rewards = [ref.step(a)[1] for a in ep.actions]
        no_assessment = score(ref.case, ref.interview, None, RubricConfig())["total"]
        assert ep.info.get("cut_off") is True and "rubric" in ep.info
        assert sum(ep.rewards) == pytest.approx(sum(rewards) + no_assessment, abs=1e-6), (ep.rewards, rewards)
        assert ep.rewards[-1] < 0  # the under-triage cost of an adversarial case


@pytest.mark.slow  # ~36 s: a whole intake run; the summary itself is tested on played episodes
def test_the_trainer_reports_the_env_summary(tmp_path):
    """Held-out evaluations and each iteration carry the env's own summary (intake: the
    rubric, its components and the triage rates), and so does the final line."""
    run = tmp_path / "run"
    lines = []
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "intake.yaml",
        [
            f"run_dir={run}",
            "iterations=2",
            "warm_start.episodes=16",
            "warm_start.epochs=1",
            "model.tokenizer_vocab_size=1024",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.head_dim=8",
            "env.group_size=2",
            "env.tasks_per_iteration=2",
            "env.kwargs.max_turns=4",
            "rollout.max_turns=4",
            "rollout.max_context=256",
            "eval.episodes=4",
            "eval.every=1",
            "update.epochs=1",
            "update.mini_batches=1",
            "env.num_workers=0",
            "logging.collapse_window=1",
            "logging.heldout_metric=train_env_heldout_rubric_mean",
            "logging.template_collapse_below=1.0",
        ],
    )
    Trainer(cfg, log=lines.append).run()
    final = json.loads(lines[-1])
    summary = json.loads((run / "summary.json").read_text())
    for when in ("before_rl", "after_rl", "before_rl_greedy", "after_rl_greedy"):
        env_summary = summary[f"eval_{when}"]["env_summary"]
        assert final[f"env_{when}"] == env_summary
        assert env_summary["scored_episodes"] == 4  # every episode scored, cut off or not
        assert summary[f"eval_{when}"]["env_rubric_mean"] == env_summary["rubric_mean"]
        assert set(env_summary["components"]) == {"history", "differential", "triage", "management", "communication"}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    m = metrics[0]  # evaluated every iteration but the last (after RL is the summary's)
    for key in (
        "train_env_rubric_mean",
        "train_env_under_triage_rate",
        "train_env_components_history",
        "eval_env_rubric_mean",
        "eval_greedy_env_rubric_mean",
    ):
        assert key in m, key
    # the monitors: a template-collapse threshold of 1.0 warns on every iteration (window 1);
    # the hacking warning needs 2 windows, so it may fire at the second iteration only
    below = np.cumsum([x["input_dependence"] < 1.0 for x in metrics]).tolist()
    assert [x["template_collapse_warnings"] for x in metrics] == below
    assert sum("warning: template collapse" in x for x in lines) == below[-1]
    assert metrics[0]["hacking_warnings"] == 0 and metrics[1]["hacking_warnings"] in (0, 1)
    assert -1.0 <= m["input_dependence"] <= 1.0 and 0 <= m["cross_input_similarity"] <= 1.0
    # the training rubric mean is the mean final reward of the scored episodes; with no
    # malformed action in the last turn it equals the mean return
    assert -2.0 < m["train_env_rubric_mean"] <= 1.0
    # the plot compares runs on the env's key
    from jaxagent.train.rundir.plot import RunDataError, plot_runs

    png = plot_runs([run], tmp_path / "rubric.png", metric="env_rubric_mean")
    assert png.stat().st_size > 1000
    with pytest.raises(RunDataError, match="no run .* has held-out evaluations of 'env_nonsense'"):
        plot_runs([run], tmp_path / "x.png", metric="env_nonsense")
