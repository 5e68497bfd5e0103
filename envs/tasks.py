"""Question/answer tasks with a verifier, as single-turn or multi-turn envs.

A task source is a sequence of :class:`Task` (question, reference answer) with a
``score(response_answer, task) -> float`` in [0, 1]. Sources:

- :class:`JsonlTasks`: a JSON Lines file, one object per line with a question field
  and an answer field (names configurable; defaults ``question`` and ``answer``). The
  answer may be a full GSM8K-style solution ending in ``#### <answer>``. Scored with
  :func:`envs.verify.answers_match` (exact, numbers compared as fractions).
- :class:`ReasoningGymTasks`: a reasoning-gym procedural dataset, scored by the
  dataset's own ``score_answer`` (extra ``envs-reasoning``).
- :class:`TfdsTasks`: a TensorFlow Datasets split read through ``tfds.data_source``
  (random access, no TensorFlow needed; extra ``envs-tfds``).
- :class:`ListTasks`: tasks given in memory.

:class:`QAEnv` serves a source as an env: ``reset(seed)`` poses task ``seed % len``;
the response's final answer is extracted (see :mod:`envs.verify`) and scored. With
``max_attempts > 1`` a wrong answer is answered with feedback and another try
(retry-with-feedback); the reward is the score of the last answer given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.core import InvalidAction, TextEnv, require
from envs.verify import answers_match, extract_answer, reference_answer


@dataclass(frozen=True)
class Task:
    """One question with its reference answer (and anything else the source keeps)."""

    question: str
    answer: str
    id: str = ""
    metadata: dict = field(default_factory=dict)


class TaskSource:
    """A random-access sequence of tasks with a scorer. Subclasses set ``name`` and
    implement ``__len__`` and ``__getitem__``; sources load lazily so they pickle
    cheaply into pool workers."""

    name = "tasks"

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Task:
        raise NotImplementedError

    def score(self, answer: str, task: Task) -> float:
        """Score of an extracted final answer against the task, in [0, 1]."""
        return 1.0 if answers_match(answer, task.answer) else 0.0

    def expert_answer(self, task: Task) -> str | None:
        """The reference final answer, as an expert would state it (None: there is none)."""
        return reference_answer(task.answer)


class ListTasks(TaskSource):
    """Tasks from a list of :class:`Task` or ``(question, answer)`` pairs."""

    def __init__(self, tasks: Sequence, name: str = "list"):
        out = []
        for i, t in enumerate(tasks):
            if isinstance(t, Task):
                out.append(t)
            elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
                out.append(Task(t[0], t[1], id=str(i)))
            else:
                raise TypeError(f"tasks[{i}] must be a Task or a (question, answer) pair of str, got {t!r}")
        if not out:
            raise ValueError("tasks is empty")
        self.tasks, self.name = out, name

    def __len__(self):
        return len(self.tasks)

    def __getitem__(self, index):
        return self.tasks[index]


class JsonlTasks(TaskSource):
    """Tasks from a JSON Lines file (see the module docstring).

    Args:
      path: the ``.jsonl`` file; blank lines are skipped.
      question_key, answer_key: field names of the question and the answer.
      id_key: optional field holding a task id (default: the line number).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        question_key: str = "question",
        answer_key: str = "answer",
        id_key: str | None = None,
    ):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"task file {self.path!r} does not exist")
        self.question_key, self.answer_key, self.id_key = question_key, answer_key, id_key
        self.name = f"jsonl:{os.path.basename(self.path)}"
        self._tasks: list[Task] | None = None

    def _load(self) -> list[Task]:
        if self._tasks is not None:
            return self._tasks
        # the JSONL reader the gateway's `agent.tasks` shares: standard library only, and the
        # one module of `jaxagent` this package imports (here, not when `envs` is imported)
        from jaxagent.specs import read_jsonl_tasks

        tasks = []
        for lineno, row in read_jsonl_tasks(self.path, "qa/jsonl"):
            where = f"{self.path}, line {lineno}"
            for key in (self.question_key, self.answer_key):
                if key not in row:
                    raise ValueError(f"{where}: missing field {key!r} (fields: {sorted(row)})")
            q, a = row[self.question_key], row[self.answer_key]
            if not isinstance(q, str):
                raise ValueError(f"{where}: field {self.question_key!r} must be a string")
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                a = json.dumps(a)
            if not isinstance(a, str):
                raise ValueError(f"{where}: field {self.answer_key!r} must be a string or a number")
            tid = str(row.get(self.id_key, lineno)) if self.id_key else str(lineno)
            meta = {k: v for k, v in row.items() if k not in (self.question_key, self.answer_key)}
            tasks.append(Task(q, a, id=tid, metadata=meta))
        self._tasks = tasks
        return tasks

    def __len__(self):
        return len(self._load())

    def __getitem__(self, index):
        return self._load()[index]

    def __getstate__(self):
        return {**self.__dict__, "_tasks": None}


class ReasoningGymTasks(TaskSource):
    """A reasoning-gym dataset: ``reasoning_gym.create_dataset(dataset, seed, size, **config)``.

    Items are generated on access; the score is the dataset's own ``score_answer``.
    """

    def __init__(self, dataset: str, seed: int = 0, size: int = 10_000, **config):
        rg = require("reasoning_gym", f"reasoning_gym/{dataset}", "reasoning-gym", "envs-reasoning")
        from reasoning_gym.factory import DATASETS  # type: ignore[import-untyped]

        if dataset not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; known: {', '.join(sorted(DATASETS))}")
        self.dataset, self.seed, self.size, self.config = dataset, seed, size, config
        self.name = f"reasoning_gym/{dataset}"
        self._ds = None
        del rg

    def _data(self):
        if self._ds is None:
            import reasoning_gym  # type: ignore[import-untyped]

            try:
                self._ds = reasoning_gym.create_dataset(self.dataset, seed=self.seed, size=self.size, **self.config)
            except Exception as e:
                raise ValueError(
                    f"reasoning-gym dataset {self.dataset!r} (seed={self.seed}, size={self.size}, "
                    f"config={self.config}) cannot be created: {type(e).__name__}: {e}"
                ) from e
        return self._ds

    def __len__(self):
        return len(self._data())

    def __getitem__(self, index):
        entry = self._data()[index]
        answer = "" if entry["answer"] is None else str(entry["answer"])
        return Task(entry["question"], answer, id=f"{self.dataset}:{index}", metadata={"entry": entry})

    def score(self, answer, task):
        return float(self._data().score_answer(answer, task.metadata["entry"]))

    def expert_answer(self, task):
        # Some datasets (graph_color, rush_hour, ...) accept many answers and give none.
        answer = task.metadata["entry"]["answer"]
        return None if answer is None else str(answer)

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}


class TfdsTasks(TaskSource):
    """A TensorFlow Datasets split read with ``tfds.data_source`` (array_record files).

    Args:
      name: the TFDS dataset name (``"gsm8k"``, or your own builder's name).
      split: the split, e.g. ``"train"`` or ``"test[:100]"``.
      data_dir: where the prepared dataset lives (TFDS's default when None).
      question_key, answer_key: feature names; bytes are decoded as UTF-8.
    """

    def __init__(
        self,
        name: str,
        split: str = "train",
        data_dir: str | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
    ):
        require("tensorflow_datasets", f"TfdsTasks({name!r})", "tensorflow-datasets", "envs-tfds")
        self.tfds_name, self.split, self.data_dir = name, split, data_dir
        self.question_key, self.answer_key = question_key, answer_key
        self.name = f"tfds:{name}/{split}"
        self._source = None

    def _data(self):
        if self._source is None:
            import tensorflow_datasets as tfds  # type: ignore[import-untyped]

            try:
                self._source = tfds.data_source(
                    self.tfds_name, split=self.split, data_dir=self.data_dir, download=False
                )
            except Exception as e:
                raise ValueError(
                    f"cannot open TFDS dataset {self.tfds_name!r} split {self.split!r} in "
                    f"data_dir {self.data_dir!r}: {e}"
                ) from e
        return self._source

    def __len__(self):
        return len(self._data())

    def __getitem__(self, index):
        row = self._data()[index]
        for key in (self.question_key, self.answer_key):
            if key not in row:
                raise ValueError(f"TFDS dataset {self.tfds_name!r} has no feature {key!r} (features: {sorted(row)})")
        q, a = _text(row[self.question_key]), _text(row[self.answer_key])
        return Task(q, a, id=f"{self.tfds_name}:{index}")

    def __getstate__(self):
        return {**self.__dict__, "_source": None}


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "item"):
        value = value.item()
        if isinstance(value, bytes):
            return value.decode("utf-8")
    return str(value)


class QAEnv(TextEnv):
    """A task source as an env (see the module docstring).

    The expert answers with the source's reference answer; ``has_expert`` is False for
    a task that has none.

    Args:
      source: a :class:`TaskSource`.
      max_attempts: answers allowed; 1 is single-turn.
      instructions: the system prompt (a default asks for ``<answer>`` tags).
      invalid_penalty: reward for a response with no final answer in it.
    """

    def __init__(
        self, source: TaskSource, max_attempts: int = 1, instructions: str | None = None, invalid_penalty: float = -0.1
    ):
        if not isinstance(source, TaskSource):
            raise TypeError(f"source must be a TaskSource, got {type(source).__name__}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        super().__init__(max_steps=max_attempts, invalid_penalty=invalid_penalty)
        self.source, self.max_attempts = source, max_attempts
        self._instructions = instructions
        self.index = 0
        self.task: Task | None = None

    @property
    def system_prompt(self) -> str:
        if self._instructions is not None:
            return self._instructions
        retry = (
            f" If your answer is wrong you are told so and may try again, up to {self.max_attempts} answers in all."
            if self.max_attempts > 1
            else ""
        )
        return f"Answer the question. Think it through, then give your final answer.{retry} {self.action_format}"

    @property
    def action_format(self) -> str:
        return "Put the final answer inside answer tags, e.g. <answer>42</answer>."

    def _reset(self, seed: int):
        n = len(self.source)
        self.index = seed % n
        self.task = self.source[self.index]
        return self.task.question, {"task_id": self.task.id, "source": self.source.name}

    def _current(self) -> Task:
        """The task being played (``reset`` picks it)."""
        if self.task is None:
            raise RuntimeError("QAEnv: reset() the env first")
        return self.task

    def _step(self, action: str):
        answer = extract_answer(action)
        if answer is None or not answer.strip():
            raise InvalidAction("no final answer found")
        info: dict[str, object] = {"answer": answer}
        try:
            score = float(self.source.score(answer, self._current()))
        except Exception as e:  # a scorer that chokes on a malformed answer scores it 0
            score = 0.0
            info["score_error"] = f"{type(e).__name__}: {e}"
        correct = score >= 1.0
        last = self._steps >= self.max_attempts
        info.update(score=score, success=correct)
        if correct:
            return "Correct.", score, True, info
        if last:
            return "Incorrect.", score, True, info
        left = self.max_attempts - self._steps
        return (
            (f"Your answer {answer!r} is not correct. Try again ({left} attempt{'s' if left > 1 else ''} left)."),
            0.0,
            False,
            info,
        )

    def state_key(self):
        return ("qa", self.source.name, self.index, self._steps)

    @property
    def has_expert(self) -> bool:
        return self.task is None or self.source.expert_answer(self.task) is not None

    @has_expert.setter
    def has_expert(self, value: bool) -> None:
        # `Env.has_expert` is an attribute an env may set; here it follows the task
        raise AttributeError("QAEnv.has_expert follows the task's reference answer; it cannot be set")

    def expert_action(self) -> str:
        task = self._current()
        answer = self.source.expert_answer(task)
        if answer is None:
            raise NotImplementedError(f"task {task.id} of {self.source.name} has no reference answer")
        return f"<answer>{answer}</answer>"


def make_jsonl(path, question_key="question", answer_key="answer", id_key=None, **env_kwargs) -> QAEnv:
    """``envs.make("qa/jsonl", path=...)``."""
    return QAEnv(JsonlTasks(path, question_key, answer_key, id_key), **env_kwargs)


def make_tfds(name, split="train", data_dir=None, question_key="question", answer_key="answer", **env_kwargs) -> QAEnv:
    """``envs.make("qa/tfds", name=..., split=..., data_dir=...)``."""
    return QAEnv(TfdsTasks(name, split, data_dir, question_key, answer_key), **env_kwargs)


_QA_ENV_KEYS = ("max_attempts", "instructions", "invalid_penalty")


def make_reasoning_gym(dataset: str, **kwargs) -> QAEnv:
    """``envs.make("reasoning_gym/<dataset>", seed=0, size=100_000, max_attempts=1, **config)``:
    keyword arguments other than the QAEnv ones go to the dataset's config."""
    env_kwargs = {k: kwargs.pop(k) for k in _QA_ENV_KEYS if k in kwargs}
    return QAEnv(ReasoningGymTasks(dataset, **kwargs), **env_kwargs)
