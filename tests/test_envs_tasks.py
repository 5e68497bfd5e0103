"""Dataset tasks: JSONL, reasoning-gym and TFDS sources served as single- or multi-turn envs."""

import functools
import json
import textwrap

import pytest
from envs_testlib import no_leftover_processes  # noqa: F401  (autouse fixture)

import envs
from envs import EnvPool, JsonlTasks, ListTasks, QAEnv


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [
        {"question": "What is 6 * 7?", "answer": "42"},
        {"question": "Half of 3?", "answer": "3/2", "level": 1},
        {"question": "Eggs?", "answer": "16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18"},
        {"question": "Capital of France?", "answer": "Paris"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_single_turn(jsonl):
    env = envs.make("qa/jsonl", path=str(jsonl))
    obs, info = env.reset(0)
    assert obs == "What is 6 * 7?" and info["task_id"] == "1"
    obs, r, term, trunc, info = env.step("6 times 7 is <answer>42</answer>")
    assert (r, term, info["success"]) == (1.0, True, True)
    env.reset(1)
    assert env.step("\\boxed{1.5}")[1] == 1.0
    env.reset(2)
    assert env.step("The answer is 18.")[1] == 1.0
    env.reset(6)  # seed 6 -> task 6 % 4 == 2
    assert env.step("<answer>17</answer>")[:3] == ("Incorrect.", 0.0, True)
    env.reset(3)
    assert env.step("<answer>paris</answer>")[1] == 1.0
    env.reset(3)
    obs, r, term, trunc, info = env.step("")
    assert r == -0.1 and "no final answer found" in obs


def test_jsonl_multi_turn_retry_with_feedback_and_expert(jsonl):
    env = envs.make("qa/jsonl", path=str(jsonl), max_attempts=3, invalid_penalty=-1.0)
    env.reset(0)
    obs, r, term, *_ = env.step("<answer>41</answer>")
    assert "'41' is not correct" in obs and "2 attempts left" in obs and r == 0.0 and not term
    obs, r, term, *_ = env.step(env.expert_action())
    assert r == 1.0 and term
    env.reset(2)
    assert env.expert_action() == "<answer>18</answer>"


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: missing field 'answer'"):
        len(JsonlTasks(bad))
    bad.write_text('{"question": "q", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        len(JsonlTasks(bad))
    bad.write_text("\n")
    with pytest.raises(ValueError, match=r"qa/jsonl: .*bad\.jsonl has no tasks"):
        len(JsonlTasks(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        JsonlTasks(tmp_path / "missing.jsonl")
    custom = tmp_path / "custom.jsonl"
    custom.write_text('{"problem": "1+1", "solution": 2, "uid": "a"}\n')
    src = JsonlTasks(custom, question_key="problem", answer_key="solution", id_key="uid")
    assert src[0].answer == "2" and src[0].id == "a"


def test_list_tasks_and_pool(jsonl):
    env = QAEnv(ListTasks([("1+1?", "2")]))
    env.reset(0)
    assert env.step("<answer>2</answer>")[1] == 1.0
    with pytest.raises(TypeError, match=r"tasks\[0\]"):
        ListTasks([3])
    fn = functools.partial(envs.make, "qa/jsonl", path=str(jsonl))
    with EnvPool([fn] * 4, num_workers=2) as pool:
        obs = pool.reset([0, 1, 2, 3])
        res = pool.step(pool.expert_actions())
    assert [o[0] for o in obs] == ["What is 6 * 7?", "Half of 3?", "Eggs?", "Capital of France?"]
    assert [r[1] for r in res] == [1.0] * 4


def test_reasoning_gym_tasks_scored_by_its_own_scorer():
    rg = pytest.importorskip("reasoning_gym")
    ref = rg.create_dataset("leg_counting", seed=0, size=10_000)
    env = envs.make("reasoning_gym/leg_counting", max_attempts=2)
    for seed in range(5):
        obs, info = env.reset(seed)
        entry = ref[seed]
        assert obs == entry["question"]
        obs, r, term, *_ = env.step("<answer>-1</answer>")
        assert r == ref.score_answer("-1", entry) == 0.0 and not term
        obs, r, term, *_ = env.step(f"The legs add up. <answer>{entry['answer']}</answer>")
        assert r == ref.score_answer(entry["answer"], entry) == 1.0 and term
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'"):
        envs.make("reasoning_gym/nope")
    env = envs.make("qa/reasoning_gym", dataset="basic_arithmetic", seed=3)
    obs, _ = env.reset(1)
    assert env.step(env.expert_action())[1] == 1.0


@pytest.mark.parametrize("dataset", ["chain_sum", "word_sorting", "maze", "number_sorting"])
def test_reasoning_gym_expert_answers_score_one(dataset):
    pytest.importorskip("reasoning_gym")
    env = envs.make(f"reasoning_gym/{dataset}")
    for seed in range(3):
        env.reset(seed)
        assert env.step(env.expert_action())[1] == 1.0


BUILDER = textwrap.dedent('''
    import tensorflow_datasets as tfds

    class Builder(tfds.core.GeneratorBasedBuilder):
        """Five addition questions, for the tests."""
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(5)}

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"question": f"What is {i} + {i}?", "answer": str(2 * i)}
''')


def test_tfds_tasks_from_a_builder_the_test_builds(tmp_path, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("array_record")
    pkg = tmp_path / "src" / "jaxagent_tiny_math"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "jaxagent_tiny_math_dataset_builder.py").write_text(BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    from jaxagent_tiny_math.jaxagent_tiny_math_dataset_builder import Builder

    data_dir = str(tmp_path / "data")
    Builder(data_dir=data_dir, file_format="array_record").download_and_prepare()
    assert len(tfds.data_source("jaxagent_tiny_math", split="train", data_dir=data_dir)) == 5

    env = envs.make("qa/tfds", name="jaxagent_tiny_math", split="train", data_dir=data_dir)
    questions = set()
    for seed in range(5):
        obs, _ = env.reset(seed)
        questions.add(obs)
        i = int(obs.split()[2])
        assert env.step(f"<answer>{2 * i}</answer>")[1] == 1.0
    assert questions == {f"What is {i} + {i}?" for i in range(5)}
    # In a worker process (which never imported the builder): read from data_dir.
    fn = functools.partial(envs.make, "qa/tfds", name="jaxagent_tiny_math", data_dir=data_dir)
    with EnvPool([fn], num_workers=1, reset_timeout=120) as pool:
        ((obs, info),) = pool.reset([2])
        assert not info.get("failed"), info
        ((o, r, *_),) = pool.step(pool.expert_actions())
    assert r == 1.0
    bad = envs.make("qa/tfds", name="jaxagent_no_such_dataset", data_dir=data_dir)
    with pytest.raises(ValueError, match="cannot open TFDS dataset 'jaxagent_no_such_dataset'"):
        bad.reset(0)


def test_a_scorer_that_raises_scores_zero_instead_of_escaping():
    class Picky(ListTasks):
        def score(self, answer, task):
            if not answer.isdigit():
                raise ValueError(f"cannot parse {answer!r}")
            return float(answer == task.answer)

    env = QAEnv(Picky([("1+1?", "2")]), max_attempts=2)
    env.reset(0)
    obs, r, term, trunc, info = env.step("<answer>two</answer>")
    assert r == 0.0 and not term and "cannot parse 'two'" in info["score_error"]
    assert env.step("<answer>2</answer>")[1] == 1.0


def test_reasoning_gym_datasets_without_reference_answers_have_no_expert():
    pytest.importorskip("reasoning_gym")
    env = envs.make("reasoning_gym/graph_color")
    env.reset(0)
    assert not env.has_expert
    with EnvPool([functools.partial(envs.make, "reasoning_gym/graph_color")], num_workers=0) as pool:
        pool.reset([0])
        assert pool.expert_actions() == [None]
    with pytest.raises(ValueError, match=r"reasoning-gym dataset 'composite' .* cannot be created"):
        envs.make("reasoning_gym/composite").reset(0)
