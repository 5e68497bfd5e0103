"""Damaged run directories fail closed (issue 49): `jaxagent view`, `plot`, `eval` and
`export` on a run whose metrics.jsonl, config.yaml, episode store file or saved "bpe"
tokenizer is truncated or garbled print ONE error line naming the file (and the line,
and the column where it makes sense) and exit with status 2, never a traceback. A torn
last line of metrics.jsonl (a run killed while appending it) is no error.

One real tiny run is trained per module; each case copies it, damages one file and runs
the command. The cases call `jaxagent.cli.main` in this process (an uncaught exception
fails the test, so none can end in a traceback there; a subprocess per case would cost
~3 s of imports each); `test_damage_through_the_entry_point` runs three of them as
`python -m jaxagent` subprocesses.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent.cli import main
from jaxagent.dataclass_yaml import load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 1-iteration run with everything the readers read: metrics.jsonl,
    config.yaml (and config.0.yaml), a checkpoint, a trained "bpe" tokenizer in
    tokenizer/ and an episode store file of 2 episodes (~10 s on 2 cores)."""
    run_dir = tmp_path_factory.mktemp("readers") / "run"
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "tiny_countdown_grpo.yaml",
        [
            f"run_dir={run_dir}",
            "iterations=1",
            "eval.episodes=0",
            "model.tokenizer=bpe",
            "model.tokenizer_vocab_size=300",
            "env.num_workers=0",
            "update.mini_batches=1",
            "logging.episodes_per_iteration=2",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.transcripts_every=0",
        ],
    )
    Trainer(cfg, log=lambda *_: None).run()
    for name in (
        "metrics.jsonl",
        "config.yaml",
        "config.0.yaml",
        "tokenizer/tokenizer.json",
        "tokenizer/chat_template.jinja",
        "episodes/iter_000001.jsonl",
        "checkpoints/1",
    ):
        assert (run_dir / name).exists(), name
    assert len((run_dir / "episodes" / "iter_000001.jsonl").read_text().splitlines()) == 2
    return run_dir


# ------------------------------------------------------------------ damage: each returns what the error must say
def _line_of(path: Path, needle: str) -> int:
    """The 1-based number of the first line of `path` that contains `needle`."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def _insert(path: Path, line: int, column: int, data: bytes) -> None:
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1][: column - 1] + data + lines[line - 1][column - 1 :]
    path.write_bytes(b"\n".join(lines))


def metrics_garbled_middle(d: Path) -> list[str]:
    path = d / "metrics.jsonl"
    line = path.read_text().splitlines()[0]
    path.write_text(f"{line}\n{line[:40]}\n{line}\n")  # line 2 cut short, more lines after it
    return ["metrics.jsonl, line 2: not valid JSON at column"]


def metrics_garbage_bytes(d: Path) -> list[str]:
    path = d / "metrics.jsonl"
    line = path.read_text().splitlines()[0]
    path.write_text(f"{line}\n{line}\n{line}\n")
    _insert(path, 2, 7, b"\xff\xfe\x00")
    return ["metrics.jsonl, line 2, column 7: not UTF-8"]


def config_invalid_yaml(d: Path) -> list[str]:
    path = d / "config.yaml"
    k = _line_of(path, "hidden_size:")
    lines = path.read_text().splitlines(keepends=True)
    lines[k - 1] = lines[k - 1].replace("  ", "\t", 1)
    path.write_text("".join(lines))
    return [f"config.yaml, line {k}, column 1: not valid YAML"]


def config_garbage_bytes(d: Path) -> list[str]:
    path = d / "config.yaml"
    k = _line_of(path, "num_layers:")
    _insert(path, k, 3, b"\xc3\x28garbage")
    return [f"config.yaml, line {k}, column 3: not UTF-8"]


def config_truncated(d: Path) -> list[str]:
    path = d / "config.yaml"
    k = _line_of(path, "hidden_size:")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: k - 1]) + lines[k - 1][:10])  # cut mid-line: `  hidden_s`
    return [f"config.yaml, line {k}: truncated", "config.0.yaml"]


def episodes_truncated(d: Path) -> list[str]:
    path = d / "episodes" / "iter_000001.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(f"{first}\n{second[: len(second) // 2]}")
    return ["iter_000001.jsonl:2: not valid JSON", "truncated"]


def episodes_garbage_bytes(d: Path) -> list[str]:
    _insert(d / "episodes" / "iter_000001.jsonl", 2, 5, b"\xff")
    return ["iter_000001.jsonl, line 2, column 5: not UTF-8"]


def tokenizer_truncated(d: Path) -> list[str]:
    path = d / "tokenizer" / "tokenizer.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    try:
        json.loads(text[: len(text) // 2])
    except json.JSONDecodeError as err:
        return [f"tokenizer.json: not valid JSON at line {err.lineno}, column {err.colno}"]
    raise AssertionError("half a tokenizer.json parsed")


def tokenizer_garbage_bytes(d: Path) -> list[str]:
    _insert(d / "tokenizer" / "tokenizer.json", 3, 1, b"\x80\x81")
    return ["tokenizer.json, line 3, column 1: not UTF-8"]


def tokenizer_not_a_tokenizer(d: Path) -> list[str]:
    (d / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": 17}\n')  # JSON, not a tokenizer
    return ["tokenizer.json: not a tokenizer"]


def tokenizer_config_truncated(d: Path) -> list[str]:
    path = d / "tokenizer" / "tokenizer_config.json"
    path.write_text(path.read_text()[:40])
    return ["tokenizer_config.json: not valid JSON at line"]


def chat_template_truncated(d: Path) -> list[str]:
    path = d / "tokenizer" / "chat_template.jinja"
    text = path.read_text()
    path.write_text(text[: text.index("{{ m['content']") + 6])  # stops inside `{{ m[`
    return ["chat_template.jinja, line 2: not a valid chat template"]


def _command(name: str, d: Path) -> list[str]:
    return {
        "plot": ["plot", str(d)],
        "plot-compare": ["plot", str(d), "--metric", "return_mean"],  # also reads config.yaml
        "view": ["view", str(d), "--out", str(d.parent / "site")],
        "eval": ["eval", str(d), "--episodes", "1"],
        "export": ["export", str(d), str(d.parent / "exported")],
    }[name]


#: (command, damage): only where the command reads that file
CASES = [
    ("plot", metrics_garbled_middle),
    ("plot", metrics_garbage_bytes),
    ("plot-compare", config_invalid_yaml),
    ("plot-compare", config_garbage_bytes),
    ("plot-compare", config_truncated),
    ("view", metrics_garbled_middle),
    ("view", metrics_garbage_bytes),
    ("view", episodes_truncated),
    ("view", episodes_garbage_bytes),
    ("eval", config_invalid_yaml),
    ("eval", config_garbage_bytes),
    ("eval", config_truncated),
    ("eval", tokenizer_truncated),
    ("eval", tokenizer_garbage_bytes),
    ("eval", tokenizer_not_a_tokenizer),
    ("eval", tokenizer_config_truncated),
    ("eval", chat_template_truncated),
    ("export", config_invalid_yaml),
    ("export", config_truncated),
    ("export", tokenizer_truncated),
    ("export", tokenizer_garbage_bytes),
    ("export", chat_template_truncated),
]


def _damaged_copy(run: Path, tmp_path: Path, damage) -> tuple[Path, list[str]]:
    d = tmp_path / "run"
    shutil.copytree(run, d)
    return d, damage(d)


@pytest.mark.parametrize("command, damage", CASES, ids=[f"{c}-{f.__name__}" for c, f in CASES])
def test_a_damaged_file_is_one_error_line_and_status_2(run, tmp_path, capsys, command, damage):
    d, expected = _damaged_copy(run, tmp_path, damage)
    status = main(_command(command, d))
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # nothing logged before it, and a one-line message
    prefix = f"jaxagent {command.split('-')[0]}: error: {d}"
    assert lines[0].startswith(prefix), lines[0]  # names the damaged file by its path in the run
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert not (d.parent / "exported").exists() and not (d.parent / "site").exists()  # nothing written


def test_the_intact_run_reads_back(run, tmp_path):
    """The control: the same readers on the undamaged run raise nothing, so each case
    above fails for its damage; a config.yaml whose only change is its last newline, or
    edited by hand, is not taken for a truncated one."""
    from jaxagent.train.rundir import check_tokenizer_files, plot
    from jaxagent.train.rundir.episodes import read_store
    from jaxagent.train.runtools import run_config

    assert run_config(run).model.tokenizer == "bpe"
    check_tokenizer_files(run / "tokenizer")
    assert [r["iteration"] for r in read_store(run)] == [1, 1]
    assert plot.read_run(run, "return_mean").episodes == [8.0]  # 2 tasks x group 4
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert main(["view", str(run), "--out", str(tmp_path / "site")]) == 0
    d = tmp_path / "run"
    shutil.copytree(run, d)
    text = (d / "config.yaml").read_text()
    (d / "config.yaml").write_text(text.rstrip("\n"))
    assert run_config(d).seed == 0
    (d / "config.yaml").write_text(text.replace("\nseed: 0\n", "\nseed: 5\n").rstrip("\n"))  # edited
    assert run_config(d).seed == 5


def test_a_torn_last_metrics_line_is_no_error(run, tmp_path, capsys):
    """A run killed while appending a metrics line leaves it torn: plot and view leave it
    out and show the rest (exit 0); the same cut line in the middle is damage."""
    d = tmp_path / "run"
    shutil.copytree(run, d)
    path = d / "metrics.jsonl"
    path.write_text(path.read_text() + '{"iteration": 2, "reward_mean": 0.')
    assert main(["plot", str(d)]) == 0
    assert main(["view", str(d), "--out", str(tmp_path / "site")]) == 0
    runs = (tmp_path / "site" / "data" / "runs.js").read_text()
    assert '"iteration": 1' in runs and '"iteration": 2' not in runs
    capsys.readouterr()
    path.write_text(path.read_text() + "\n" + path.read_text().splitlines()[0] + "\n")
    assert main(["plot", str(d)]) == 2
    assert "metrics.jsonl, line 2: not valid JSON" in capsys.readouterr().err


def test_damage_through_the_entry_point(run, tmp_path):
    """`python -m jaxagent` end to end (its own process, stderr as a user sees it): one
    line, status 2, no traceback. Three commands at once (~6 s on 2 cores)."""
    cases = [("view", episodes_garbage_bytes), ("eval", tokenizer_truncated), ("plot-compare", config_truncated)]
    procs = []
    for k, (command, damage) in enumerate(cases):
        d, expected = _damaged_copy(run, tmp_path / str(k), damage)
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxagent", *_command(command, d)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append((command, d, expected, proc))
    for command, d, expected, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (command, out, err)
        assert "Traceback" not in out + err, err
        errors = [line for line in err.splitlines() if line.startswith("jaxagent ")]
        assert len(errors) == 1 and errors[0].startswith(f"jaxagent {command.split('-')[0]}: error: {d}"), err
        assert all(text in errors[0] for text in expected), (expected, errors[0])
