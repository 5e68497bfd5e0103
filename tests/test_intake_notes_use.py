"""`examples/intake_notes_use.py`: the question turns read against the notes, on
interviews whose relation to the checklist is known by construction."""

import json

from envs.intake.env import IntakeEnv
from envs.intake.policies import WeakClinician
from examples import intake_notes_use as use


def pairs(policy, seeds, **env_kwargs):
    env = IntakeEnv("standard", max_turns=20, notes=True, **env_kwargs)
    out = []
    for s in seeds:
        obs, _ = env.reset(seed=s)
        while True:
            a = policy(obs, env)
            out.append((obs, a))
            obs, _, term, trunc, _ = env.step(a)
            if term or trunc:
                break
    return out


def test_a_clinician_reading_the_first_item_counts_as_such_and_a_random_order_does_not():
    first = use.count(pairs(WeakClinician(follow_notes=1.0, skip=0.0, risk_screen=1.0, followup=1.0), range(20)))
    # the list's first item unless that one was deflected (asked, still listed: it does not retry)
    assert first["questions"] > 100 and first["listed"] == first["questions"]
    assert first["first"] >= 0.9 * first["questions"]
    shuffled = use.count(pairs(WeakClinician(), range(20)))  # its own random order, no retries
    assert shuffled["questions"] > 80 and shuffled["listed"] == shuffled["questions"]
    assert shuffled["first"] < 0.4 * shuffled["questions"]
    # a repeated question is not on the list any more
    obs_after = pairs(WeakClinician(follow_notes=1.0, questions=(2, 2)), [3])
    repeat = [(obs_after[1][0], obs_after[0][1])]  # the first question again, after it was answered
    assert use.count(repeat) == {"questions": 1, "first": 0, "listed": 0}


def test_the_script_reads_stored_episodes(tmp_path, capsys):
    ep = {
        "segments": [
            {"kind": "prompt", "text": "... To ask: mood anxiety suicide harm.<|im_end|>"},
            {
                "kind": "policy",
                "text": "How has your mood been over the past few weeks? Have you been "
                "feeling down or hopeless?<|im_end|>",
            },
            {"kind": "observation", "text": "Patient: ... To ask: anxiety suicide harm.<|im_end|>"},
            {"kind": "policy", "text": "Have you had any thoughts of hurting or killing someone else?"},
            {"kind": "observation", "text": "Patient: ... To ask: anxiety suicide.<|im_end|>"},
            {"kind": "policy", "text": "<assessment> ... </assessment>"},
        ]
    }
    (tmp_path / "run" / "episodes").mkdir(parents=True)
    (tmp_path / "run" / "episodes" / "iter_000001.jsonl").write_text(json.dumps(ep) + "\n")
    assert use.main([str(tmp_path / "run")]) == 0
    assert "2 questions | first item 0.50 | on the list 1.00" in capsys.readouterr().out
    assert use.main([str(tmp_path / "run"), "--iterations", "2"]) == 2
    assert "no stored episodes" in capsys.readouterr().err
