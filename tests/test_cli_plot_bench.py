"""`jaxagent plot` (jaxagent.train.rundir.plot) and `jaxagent bench` (jaxagent.bench), as a user calls them."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxagent import bench
from jaxagent.cli import main
from jaxagent.train.rundir.plot import RunDataError, build_panels, grid_shape, plot_run, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def write_run(run_dir: Path, records, summary=None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def full_record(i):
    return {
        "iteration": i,
        "step": i,
        "reward_mean": 0.1 * i,
        "reward_std": 0.05,
        "success_rate": 0.1 * i,
        "kl": 1e-3 * i,
        "approx_kl": 2e-3,
        "entropy": 3.0 - 0.1 * i,
        "loss": 0.5,
        "pg_loss": 0.4,
        "tokens_per_s": 1000.0 + i,
        "time_rollout_s": 1.0,
    }


def png_info(path):
    with Image.open(path) as im:
        return im.size, dict(im.text)


# ----------------------------------------------------------------------------- plot_run
def test_plot_run_draws_one_panel_per_metric_group(tmp_path):
    run = write_run(tmp_path / "run", [full_record(i) for i in range(1, 6)])
    path = plot_run(run)
    assert path == run / "learning_curves.png" and path.stat().st_size > 10_000
    (w, h), text = png_info(path)
    assert text["Description"] == "panels: reward, success rate, KL, entropy, loss, tokens/s"
    assert grid_shape(6) == (3, 2) and (w, h) == (1100, 960)  # 5.5 x 3.2 inches per panel, 100 dpi

    small = write_run(tmp_path / "small", [{"iteration": i, "reward_mean": 0.5} for i in (1, 2)])
    out = plot_run(small, tmp_path / "sub" / "curves.png")
    (w, h), text = png_info(out)
    assert out == tmp_path / "sub" / "curves.png" and text["Description"] == "panels: reward"
    assert (w, h) == (550, 320)


def test_eval_lines_and_summary_references_are_drawn(tmp_path):
    records = [
        full_record(1),
        full_record(2),
        {"iteration": 2, "eval_success_rate": 0.6, "eval_reward_mean": 0.7, "eval_turns": 3.0},
        full_record(3),
    ]
    summary = {"success_before_rl": 0.2, "success_after_rl": 0.65, "note": "x"}
    run = write_run(tmp_path / "run", records, summary)
    panels = {
        p.title: p
        for p in build_panels(read_metrics(run / "metrics.jsonl"), {"success_before_rl": 0.2, "success_after_rl": 0.65})
    }
    assert panels["success rate"].evals == {"eval_success_rate": ([2.0], [0.6])}
    assert panels["success rate"].lines["success_rate"][0] == [1.0, 2.0, 3.0]
    assert panels["success rate"].references == {"success_before_rl": 0.2, "success_after_rl": 0.65}
    assert panels["reward"].evals == {"eval_reward_mean": ([2.0], [0.7])}
    # the +-reward_std band of the training records (the eval record has neither)
    xs, lo, hi = panels["reward"].band
    assert xs == [1.0, 2.0, 3.0]
    assert lo == pytest.approx([0.1 * i - 0.05 for i in (1, 2, 3)]) and hi == pytest.approx(
        [0.1 * i + 0.05 for i in (1, 2, 3)]
    )
    assert panels["eval"].evals == {"eval_turns": ([2.0], [3.0])}
    _, text = png_info(plot_run(run))
    assert text["Description"] == "panels: reward, success rate, KL, entropy, loss, tokens/s, eval"


def test_learning_diagnostics_have_their_panel(tmp_path):
    diag = {
        "flat_groups_frac": 0.25,
        "anchor_repeat_frac": 0.9,
        "invalid_action_frac": 0.02,
        "noop_action_frac": 0.4,
        "failed_frac": 0.0,
    }
    records = [{**full_record(i), **{k: v * i for k, v in diag.items()}} for i in (1, 2)]
    panels = {p.title: p for p in build_panels(records)}
    got = panels["diagnostics"].lines
    assert set(got) == set(diag)
    assert got["noop_action_frac"] == ([1.0, 2.0], [0.4, 0.8])
    _, text = png_info(plot_run(write_run(tmp_path / "run", records)))
    assert text["Description"] == "panels: reward, success rate, KL, entropy, loss, diagnostics, tokens/s"
    # the template-collapse signal has a panel of its own
    records = [{**r, "input_dependence": 0.1 * i, "cross_input_similarity": 0.5} for i, r in enumerate(records)]
    panels = {p.title: p for p in build_panels(records)}
    assert panels["input dependence"].lines["input_dependence"] == ([1.0, 2.0], [0.0, 0.1])
    assert set(panels["input dependence"].lines) == {"input_dependence", "cross_input_similarity"}


def test_summary_alone_gives_the_success_panel(tmp_path):
    run = write_run(tmp_path / "run", [{"iteration": 1, "entropy": 2.0}], {"success_before_rl": 0.1})
    _, text = png_info(plot_run(run))
    assert text["Description"] == "panels: success rate, entropy"


@pytest.mark.parametrize(
    "setup, error, match",
    [
        (lambda d: None, FileNotFoundError, "no such run directory"),
        (lambda d: d.mkdir(), FileNotFoundError, "metrics.jsonl: no such file"),
        (lambda d: write_run(d, []), RunDataError, "is empty"),
        (
            lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"iteration": 1}\n\n{"iteration": 2, \n')),
            RunDataError,
            "line 3: not valid JSON",
        ),
        (
            lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"iteration": 1}\n[1, 2]\n')),
            RunDataError,
            "line 2: expected a JSON object, got list",
        ),
        (lambda d: write_run(d, [{"iteration": 1, "note": "x"}]), RunDataError, "none of the plotted metrics"),
        (
            lambda d: write_run(d, [{"reward_mean": 1.0}], summary=None) and (d / "summary.json").write_text("{"),
            RunDataError,
            "summary.json: not valid JSON",
        ),
    ],
)
def test_bad_run_dirs_are_clear_errors(tmp_path, setup, error, match):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(error, match=match):
        plot_run(run)


# ----------------------------------------------------------------------------- CLI plot
def test_cli_plot_exit_codes(tmp_path, capsys):
    run = write_run(tmp_path / "run", [full_record(1), full_record(2)])
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "learning_curves.png")
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    # the same figure as plot_run's: six panels of 5.5 x 3.2 inches at 100 dpi
    size, text = png_info(tmp_path / "c.png")
    assert size == (1100, 960) and text["Description"] == "panels: reward, success rate, KL, entropy, loss, tokens/s"
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "jaxagent plot: error:" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("not json\n")
    assert main(["plot", str(run)]) == 2
    assert "line 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plot"])
    assert exc.value.code == 2


# ----------------------------------------------------------------------------- bench
def _bench_args(**kw):
    ns = dict(workload="update", repeats=None, quick=False, out=None, systems=None)
    ns.update(kw)
    return argparse.Namespace(**ns)


def test_bench_command_line_and_missing_benchmarks(tmp_path, monkeypatch, capsys):
    assert bench.benchmarks_dir() == ROOT / "benchmarks"
    cmd = bench.command(_bench_args(repeats=7, quick=True, out="x.jsonl", systems="jax,tunix"))
    assert cmd[:2] == [sys.executable, str(ROOT / "benchmarks" / "w2_model_step.py")]
    assert cmd[2:] == ["--systems", "jax,tunix", "--repeats", "7", "--quick", "--out", str(Path("x.jsonl").resolve())]
    # every workload is a script of the repository; --systems only where systems are compared
    for workload, script in bench.WORKLOADS.items():
        assert (ROOT / "benchmarks" / script).is_file(), script
        cmd = bench.command(_bench_args(workload=workload, quick=True))
        assert cmd[1] == str(ROOT / "benchmarks" / script) and "--quick" in cmd
        assert ("--systems" in cmd) == (bench.SYSTEMS.get(workload) is not None), workload
    assert main(["bench", "envpool", "--systems", "jax"]) == 2
    assert "compares no systems" in capsys.readouterr().err
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: tmp_path / "nowhere")
    assert main(["bench", "update"]) == 2
    err = capsys.readouterr().err
    assert "w2_model_step.py not found" in err and "checkout" in err
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])


def test_bench_envpool_quick_smoke(tmp_path):
    out = tmp_path / "w5.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxagent", "bench", "envpool", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == rows


@pytest.mark.slow
def test_bench_update_quick_smoke(tmp_path):
    out = tmp_path / "w2.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxagent", "bench", "update", "--quick", "--systems", "jax", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")] == rows
    steps = [r for r in rows if r["kind"] == "policy_update"]
    assert [r["system"] for r in steps] == ["jax"]
    # the throughput is the batch's tokens over the median of the timed steps
    s = steps[0]
    assert len(s["step_s"]) >= 1 and min(s["step_s"]) > 0
    assert s["median_step_s"] == pytest.approx(float(np.median(s["step_s"])), rel=1e-12)
    assert s["tokens_per_s"] == pytest.approx(s["batch"] * s["seq"] / s["median_step_s"], rel=1e-12)
    assert steps[0]["batch"] == 2 and not [r for r in rows if r["kind"] == "ratio"]


def write_seed_run(run_dir: Path, seed: int, lr: float, train_success, eval_at, summary, logging=None):
    """A run dir as the trainer writes it: config.yaml, metrics.jsonl, summary.json."""
    import yaml

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "env": {"group_size": 4},
                "optim": {"lr": lr},
                "seed": seed,
                "run_dir": str(run_dir),
                "logging": logging or {},
            }
        )
    )
    lines = []
    for i, s in enumerate(train_success, start=1):
        rec = {"iteration": i, "tasks_seen": 2 * i, "success_rate": s}
        if i in eval_at:
            rec.update(eval_success_rate=eval_at[i][0], eval_greedy_success_rate=eval_at[i][1])
        lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_plot_several_runs_groups_seeds_of_a_recipe(tmp_path):
    from jaxagent.train.rundir.plot import _mean_band, read_run

    before_after = {
        "success_before_rl": 0.1,
        "success_after_rl": 0.5,
        "success_before_rl_greedy": 0.0,
        "success_after_rl_greedy": 0.4,
    }
    a = tmp_path / "a"
    write_seed_run(a, 0, 1e-3, [0.1, 0.2, 0.3], {2: (0.3, 0.2)}, before_after)
    b = tmp_path / "b"
    # b logged differently (its episode store off): still a seed of a's recipe
    write_seed_run(
        b,
        1,
        1e-3,
        [0.3, 0.4, 0.5],
        {2: (0.5, 0.4)},
        {**before_after, "success_after_rl": 0.7},
        logging={"episodes_per_iteration": 0},
    )
    c = tmp_path / "c"
    write_seed_run(c, 0, 3e-4, [0.0, 0.0, 0.1], {}, before_after)
    run = read_run(a)
    assert run.episodes == [8.0, 16.0, 24.0]  # tasks seen x group size
    assert run.held_out["sampled"] == [(0.0, 0.1), (16.0, 0.3), (24.0, 0.5)]
    assert run.held_out["greedy"] == [(0.0, 0.0), (16.0, 0.2), (24.0, 0.4)]
    xs, mean, lo, hi = _mean_band([read_run(a).held_out["sampled"], read_run(b).held_out["sampled"]])
    assert xs == [0.0, 16.0, 24.0] and lo == [0.1, 0.3, 0.5] and hi == [0.1, 0.5, 0.7]
    assert mean == pytest.approx([0.1, 0.4, 0.6])
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), str(c), "--out", str(out)]) == 0
    desc = Image.open(out).info["Description"]
    # a and b differ only by seed: one recipe of 2 seeds; c is another recipe (its lr)
    assert desc == "recipes: optim.lr=0.001 (2 seeds); optim.lr=0.0003 (1 seed)"
    assert main(["plot", str(a), str(tmp_path / "missing")]) == 2


def test_seeds_are_one_recipe_whatever_defaults_their_configs_spell_out(tmp_path):
    """A run whose config.yaml spells out a default the other's omits (written by a newer
    version, or resumed by one) is a seed of the same recipe; seeds evaluated at different
    iterations are averaged at the points they share only."""
    import yaml

    from jaxagent.train.rundir.plot import _mean_band, read_run

    before_after = {
        "success_before_rl": 0.1,
        "success_after_rl": 0.5,
        "success_before_rl_greedy": 0.0,
        "success_after_rl_greedy": 0.4,
    }
    a, b = tmp_path / "a", tmp_path / "b"
    write_seed_run(a, 0, 1e-3, [0.1, 0.2, 0.3], {2: (0.3, 0.2)}, before_after)
    write_seed_run(b, 1, 1e-3, [0.3, 0.4, 0.5], {1: (0.9, 0.9)}, {**before_after, "success_after_rl": 0.7})
    cfg = yaml.safe_load((b / "config.yaml").read_text())
    cfg["update"] = {"trim_chunks": False, "trim_padding": 0}  # the defaults, spelled out
    cfg["optim"]["warmup_steps"] = 0.0  # an int default written as a float
    (b / "config.yaml").write_text(yaml.safe_dump(cfg))
    xs, mean, lo, hi = _mean_band([read_run(a).held_out["sampled"], read_run(b).held_out["sampled"]])
    assert xs == [0.0, 24.0] and mean == pytest.approx([0.1, 0.6]) and lo == [0.1, 0.5] and hi == [0.1, 0.7]
    assert _mean_band([[(0.0, 1.0)], [(8.0, 1.0)]])[0] == []  # nothing shared: nothing to draw
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert Image.open(out).info["Description"] == "recipes: grpo (2 seeds)"
    cfg["update"]["trim_padding"] = 64  # not a default: another recipe
    (b / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert Image.open(out).info["Description"] == (
        "recipes: update.trim_padding=0 (1 seed); update.trim_padding=64 (1 seed)"
    )


def test_a_torn_last_line_is_left_out(tmp_path):
    """A run killed while appending its metrics line leaves the line without its newline
    (the resume rewrites the file): plot reads the complete lines; a garbled line with its
    newline is still an error naming it."""
    run = write_run(tmp_path / "run", [full_record(1), full_record(2)])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 3, "reward_me')
    assert [r["iteration"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert main(["plot", str(run)]) == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write("\n")
    with pytest.raises(RunDataError, match="line 3: not valid JSON"):
        read_metrics(run / "metrics.jsonl")


def test_seeds_that_played_different_numbers_of_tasks_are_matched_by_iteration(tmp_path):
    """Dynamic sampling refills groups, so seeds reach an iteration after different numbers
    of tasks: their evaluations at the same iterations are one point of the band, drawn at
    the seeds' mean episode count."""
    from jaxagent.train.rundir.plot import _mean_band, read_run

    summary = {"success_before_rl": 0.1, "success_after_rl": 0.5}
    a, b = tmp_path / "a", tmp_path / "b"
    write_seed_run(a, 0, 1e-3, [0.1, 0.2, 0.3], {2: (0.3, 0.2)}, summary)
    write_seed_run(b, 1, 1e-3, [0.3, 0.4, 0.5], {2: (0.5, 0.4)}, {**summary, "success_after_rl": 0.7})
    lines = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:  # b played one more task each iteration (2 refills)
        rec["tasks_seen"] = 3 * rec["iteration"]
    (b / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    ra, rb = read_run(a), read_run(b)
    assert ra.held_iterations["sampled"] == rb.held_iterations["sampled"] == [0, 2, 4]
    series = [ra.held_out["sampled"], rb.held_out["sampled"]]
    # by episodes, 24 would pair a's final evaluation with b's at iteration 2
    assert _mean_band(series)[0] == [0.0, 24.0]
    xs, mean, lo, hi = _mean_band(series, [ra.held_iterations["sampled"], rb.held_iterations["sampled"]])
    assert xs == [0.0, (16.0 + 24.0) / 2, (24.0 + 36.0) / 2]
    assert mean == pytest.approx([0.1, 0.4, 0.6]) and lo == [0.1, 0.3, 0.5] and hi == [0.1, 0.5, 0.7]
