"""The triage-reading probe (`examples/intake_triage_reading.py`): its scores are the
log-probabilities of the three triage versions, checked against the model's full
logits (`decoder.forward`) read in float64 NumPy at the level's tokens."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxagent.models as M
from examples import intake_triage_reading as probe
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout.chat import ChatFormat
from jaxagent.train.warmstart import collect_demonstrations, demonstration_tokens

#: short interviews (byte tokens make a full one longer than the test needs)
SHORT = {"style": "weak", "questions": [2, 3], "risk_screen": 1.0, "risk_order": "shuffled"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = byte_chat_tokenizer()
    config = M.tiny_config(vocab_size=len(tok))
    model = M.Model(params=M.init_params(jax.random.key(3), config, std=0.3), config=config)
    return str(M.save_pretrained(model, tmp_path_factory.mktemp("m") / "export", tokenizer=tok)), model, tok


def test_cut_and_reference_read_the_triage_line():
    a = "<assessment>\nDifferential:\n1. x\nTriage: urgent\nManagement:\n- y\n</assessment>"
    assert probe.cut_after_triage(a, "emergent") == "<assessment>\nDifferential:\n1. x\nTriage: emergent"
    assert probe.reference_level(a) == "urgent"
    with pytest.raises(ValueError, match="no triage line"):
        probe.cut_after_triage("<assessment>\nDifferential:\n1. x\n</assessment>", "urgent")
    with pytest.raises(ValueError, match="not one of"):
        probe.reference_level("Differential:\nTriage: soon\n")


@pytest.mark.slow  # ~30 s: loads an exported model; the probe's summary stays in the default suite
def test_scores_are_the_log_probabilities_of_each_level(exported):
    path, model, tok = exported
    demos = collect_demonstrations(
        "intake",
        {"cases": "standard", "max_turns": 20},
        range(2_000_000, 2_000_002),
        max_turns=20,
        final_only=True,
        expert=SHORT,
    )
    got = probe.score(path, demos, 8192, batch=4)  # 6 rows in batches of 4: padding and a filled last batch
    assert got.shape == (2, 3)
    chat = ChatFormat(tok)
    for i, d in enumerate(demos):
        for j, level in enumerate(probe.LEVELS):
            # the version's layout (tested in test_train_warmstart), scored one at a time from the full logits
            version = dataclasses.replace(d, actions=d.actions[:-1] + [probe.cut_after_triage(d.actions[-1], level)])
            tokens, mask = demonstration_tokens(chat, version, 8192)
            taught = [k for k, m in enumerate(mask) if m]
            assert tok.decode([tokens[k] for k in taught[:-1]]) == version.actions[-1]  # the last is end of turn
            logits = np.asarray(model(np.array([tokens])), np.float64)[0]
            top = logits.max(-1, keepdims=True)
            logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
            want = sum(logits[k - 1, tokens[k]] - logz[k - 1] for k in taught[:-1])
            assert got[i, j] == pytest.approx(want, rel=1e-5, abs=1e-3)
    # the three versions share the head: their differences are the level's own tokens
    assert np.ptp(got, axis=1).max() > 0


def test_summary_counts_the_most_probable_level_against_the_reference():
    logp = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.2, 0.5, 0.3]]))
    s = probe.summarise(logp, ["routine", "urgent", "urgent"])
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["p_reference"] == pytest.approx((0.7 + 0.3 + 0.5) / 3)
    assert s["confusion"]["urgent"] == {"routine": 0, "urgent": 1, "emergent": 1}
    assert s["confusion"]["routine"]["routine"] == 1 and s["confusion"]["emergent"] == {
        "routine": 0,
        "urgent": 0,
        "emergent": 0,
    }


# slow (~15-20 s): the suite's time; the probe's scores are checked above in the default suite
@pytest.mark.slow
def test_the_command_writes_one_line_per_model(exported, tmp_path, capsys):
    path, *_ = exported
    out = tmp_path / "r.jsonl"
    assert (
        probe.main(
            [path, "--episodes", "2", "--max-context", "8192", "--clinician", json.dumps(SHORT), "--out", str(out)]
        )
        == 0
    )
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["cases"] == 2 and sum(sum(r.values()) for r in line["confusion"].values()) == 2
    assert "accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        probe.main([path, "--clinician", "[1]"])


# 35-54 s; the default suite is at its 15-minute limit (the probe's reading is covered by the other tests here)
@pytest.mark.slow
def test_notes_put_the_checklist_in_the_probed_interviews(exported, tmp_path, monkeypatch):
    import jaxagent.train.warmstart as ws

    path, *_ = exported
    seen = []

    def collect(name, kw, *args, **kwargs):
        demos = collect_demonstrations(name, kw, *args, **kwargs)
        seen.append((kw, demos))
        return demos

    monkeypatch.setattr(ws, "collect_demonstrations", collect)
    out = tmp_path / "r.jsonl"
    for flag in ([], ["--notes"], ["--notes", "--notes-order", "risk_first"]):
        assert (
            probe.main(
                [
                    path,
                    "--episodes",
                    "1",
                    "--max-context",
                    "8192",
                    "--clinician",
                    json.dumps(SHORT),
                    "--out",
                    str(out),
                    *flag,
                ]
            )
            == 0
        )
        assert json.loads(out.read_text())["notes"] is bool(flag)
    (plain_kw, plain), (notes_kw, noted), (first_kw, first) = seen
    assert not plain_kw["notes"] and notes_kw["notes"] and first_kw["notes_order"] == "risk_first"

    def text(demos):
        return json.dumps([dataclasses.asdict(d) for d in demos])

    assert "To ask: " not in text(plain) and "To ask: " in text(noted)
    assert "To ask: mood " in text(noted) and "To ask: suicide harm mood " in text(first)
    assert json.loads(out.read_text())["notes_order"] == "risk_first"
    with pytest.raises(SystemExit):  # the order of a checklist that is not shown
        probe.main([path, "--notes-order", "risk_first"])
