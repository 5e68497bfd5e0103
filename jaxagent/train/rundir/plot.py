"""Learning curves of a run: `<run_dir>/metrics.jsonl` -> one PNG (`jaxagent plot RUN_DIR`).

    path = plot_run("runs/countdown")            # runs/countdown/learning_curves.png

One panel per group of metrics present in the file, against `iteration` (PANELS):
reward (`reward_mean`, with a +-`reward_std` band), success rate, KL (`kl`,
`approx_kl`), entropy, loss (`loss`, `pg_loss`, `value_loss`), the learning diagnostics
(flat groups, anchor repeats, invalid and no-op actions, failed episodes, clip
fraction), the input dependence of the responses (template collapse) and tokens/s. Evaluation
results (keys `eval_*`, in the same lines or in lines of their own with an
`iteration`) are drawn on the panel of the metric they evaluate (`eval_success_rate`
on the success panel) as markers, and any other `eval_*` keys on an extra "eval"
panel. When `<run_dir>/summary.json` has `success_before_rl` / `success_after_rl`,
they are drawn on the success panel as horizontal reference lines.

Errors (`RunDataError`, a `ValueError`, or `FileNotFoundError`) name the file and, for
a malformed line, its line number.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import TypeGuard

from jaxagent.dataclass_yaml import flatten
from jaxagent.train.rundir import RunFileError, read_config, read_json, read_text

#: (title, metric keys) of each panel, in drawing order
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean",)),
    ("success rate", ("success_rate",)),
    ("KL", ("kl", "approx_kl")),
    ("entropy", ("entropy",)),
    ("loss", ("loss", "pg_loss", "value_loss")),
    # the learning diagnostics (fractions): what the batch can teach, malformed and no-op actions
    (
        "diagnostics",
        (
            "flat_groups_frac",
            "anchor_repeat_frac",
            "invalid_action_frac",
            "noop_action_frac",
            "failed_frac",
            "clipfrac",
        ),
    ),
    # template collapse: do the responses still tell which task they answer?
    ("input dependence", ("input_dependence", "within_input_similarity", "cross_input_similarity")),
    ("tokens/s", ("tokens_per_s",)),
)
SUMMARY_KEYS = ("success_before_rl", "success_after_rl")
DEFAULT_NAME = "learning_curves.png"
COLUMNS = 2


class RunDataError(RunFileError):
    """metrics.jsonl or summary.json cannot be read as a run's metrics."""


@dataclasses.dataclass
class Panel:
    """One subplot: its title, the series drawn as lines, the eval series drawn as
    markers, and reference lines (label -> y)."""

    title: str
    lines: dict[str, tuple[list[float], list[float]]] = dataclasses.field(default_factory=dict)
    evals: dict[str, tuple[list[float], list[float]]] = dataclasses.field(default_factory=dict)
    references: dict[str, float] = dataclasses.field(default_factory=dict)
    band: tuple[list[float], list[float], list[float]] | None = None  # x, low, high


def _is_number(v) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path, *, live: bool = False) -> list[dict]:
    """The JSON objects of a metrics.jsonl (blank lines skipped); errors name the line.

    `live`: the file of a run that may be running (`jaxagent view`): a missing or empty
    file is no records, and a last line without its newline (being appended) is left out.
    Otherwise a last line without its newline that is not valid JSON is a torn append (a
    run killed while writing it; a resume rewrites the file) and is left out too. Any
    other line that is not a JSON object, or a byte that is not UTF-8, is damage: an error
    naming the line (`RunDataError`, a `RunFileError`)."""
    path = Path(path)
    if not path.is_file():
        if live:
            return []
        raise FileNotFoundError(f"{path}: no such file (a run writes metrics.jsonl after its first iteration)")
    records = []
    try:
        lines = read_text(path).split("\n")  # the last item: what follows the last newline
    except RunFileError as err:
        raise RunDataError(str(err)) from None
    for number, line in enumerate(lines, start=1):
        complete = number < len(lines)
        if not line.strip() or (live and not complete):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            if not complete:  # the last line, torn: never a complete record
                continue
            raise RunDataError(f"{path}, line {number}: not valid JSON at column {err.colno} ({err.msg})") from None
        if not isinstance(rec, dict):
            raise RunDataError(f"{path}, line {number}: expected a JSON object, got {type(rec).__name__}")
        records.append(rec)
    if not records and not live:
        raise RunDataError(f"{path} is empty: no iteration has been logged yet")
    return records


def read_summary(run_dir) -> dict[str, float]:
    """`success_before_rl` / `success_after_rl` of `<run_dir>/summary.json` ({} if absent)."""
    data = _summary(Path(run_dir) / "summary.json")
    return {k: float(data[k]) for k in SUMMARY_KEYS if _is_number(data.get(k))}


def _summary(path: Path) -> dict:
    """The object in a run's summary.json ({} if absent); `RunDataError` naming the file,
    line and column when it is damaged."""
    if not path.is_file():
        return {}
    try:
        data = read_json(path)
    except RunFileError as err:
        raise RunDataError(str(err)) from None
    if not isinstance(data, dict):
        raise RunDataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for n, rec in enumerate(records, start=1):
        v = rec.get(key)
        if _is_number(v):
            x = rec.get("iteration")
            xs.append(float(x) if _is_number(x) else float(n))
            ys.append(float(v))
    return xs, ys


def build_panels(records: list[dict], summary: dict[str, float] | None = None) -> list[Panel]:
    """The panels `plot_run` draws for these metrics records (only those with data)."""
    keys = {k for rec in records for k, v in rec.items() if _is_number(v)}
    summary = summary or {}
    panels, claimed = [], set()
    for title, metric_keys in PANELS:
        panel = Panel(title)
        for key in metric_keys:
            if key in keys:
                panel.lines[key] = _series(records, key)
            if f"eval_{key}" in keys:
                panel.evals[f"eval_{key}"] = _series(records, f"eval_{key}")
                claimed.add(f"eval_{key}")
        if title == "reward" and "reward_mean" in panel.lines and "reward_std" in keys:
            xs, lo, hi = [], [], []
            for rec_n, rec in enumerate(records, start=1):
                m, s = rec.get("reward_mean"), rec.get("reward_std")
                if _is_number(m) and _is_number(s):
                    x = rec.get("iteration")
                    xs.append(float(x) if _is_number(x) else float(rec_n))
                    lo.append(m - s)
                    hi.append(m + s)
            panel.band = (xs, lo, hi)
        if title == "success rate":
            panel.references = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
        if panel.lines or panel.evals or panel.references:
            panels.append(panel)
    other_evals = sorted(k for k in keys if k.startswith("eval_") and k not in claimed)
    if other_evals:
        panels.append(Panel("eval", evals={k: _series(records, k) for k in other_evals}))
    return panels


def grid_shape(n_panels: int) -> tuple[int, int]:
    """(rows, columns) of the figure for `n_panels` panels."""
    cols = min(COLUMNS, max(n_panels, 1))
    return math.ceil(max(n_panels, 1) / cols), cols


def plot_run(run_dir, out=None) -> Path:
    """Draw `<run_dir>/metrics.jsonl` to a PNG (default `<run_dir>/learning_curves.png`).

    Returns the PNG's path. Raises FileNotFoundError (no run dir, no metrics.jsonl) or
    RunDataError (empty file, malformed line, nothing numeric to plot).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    records = read_metrics(run_dir / "metrics.jsonl")
    panels = build_panels(records, read_summary(run_dir))
    if not panels:
        known = ", ".join(k for _, keys in PANELS for k in keys)
        raise RunDataError(f"{run_dir / 'metrics.jsonl'}: none of the plotted metrics ({known}, eval_*) is present")
    out = Path(out) if out is not None else run_dir / DEFAULT_NAME

    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: never a display
    import matplotlib.pyplot as plt

    rows, cols = grid_shape(len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.2 * rows), squeeze=False)
    try:
        for ax, panel in zip(axes.flat, panels, strict=False):
            if panel.band is not None:
                ax.fill_between(panel.band[0], panel.band[1], panel.band[2], alpha=0.2, label="± reward_std")
            for key, (xs, ys) in panel.lines.items():
                ax.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
            for key, (xs, ys) in panel.evals.items():
                ax.plot(xs, ys, label=key, linestyle="--", marker="o")
            for i, (key, y) in enumerate(panel.references.items()):
                ax.axhline(y, color=f"C{i + 5}", linestyle=":", label=f"{key} = {y:.3g}")
            if panel.title == "success rate":
                ax.set_ylim(-0.03, 1.03)  # a rate: the whole range, so runs compare at a glance
            ax.set_title(panel.title)
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(str(run_dir))
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, metadata={"Description": "panels: " + ", ".join(p.title for p in panels)})
    finally:
        plt.close(fig)
    return out


# ----------------------------------------------------------------------------- several runs
#: config keys that tell seeds of one recipe apart (not the recipe itself)
SEED_KEYS = ("seed", "run_dir")
COMPARE_NAME = "comparison.png"


@dataclasses.dataclass
class RunCurves:
    """One run's curves for `plot_runs`: x is episodes played (tasks seen x group size)."""

    run_dir: Path
    recipe: dict  # the config without SEED_KEYS
    episodes: list[float]  # per iteration
    train_success: list[float]
    held_out: dict[str, list[tuple[float, float]]]  # "sampled" / "greedy" -> [(episodes, success)]
    train_label: str = "success"  # what `train_success` holds
    iterations: list[int] = dataclasses.field(default_factory=list)  # per record of `episodes`
    #: "sampled" / "greedy" -> the iteration of each `held_out` point (0: before RL)
    held_iterations: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def read_run(run_dir, metric: str = "success_rate") -> RunCurves:
    """A run's curves: training success per iteration and held-out success (sampled and
    greedy) before RL, at every `eval.every` iterations, and after RL, against episodes.
    `metric`: the held-out evaluation's key to draw instead of `success_rate` (e.g.
    `return_mean`, or an env summary's `env_rubric_mean`); the training curve is then
    `train_<metric>` if the metrics have it, else the mean reward. A damaged config.yaml,
    metrics.jsonl or summary.json is a `RunFileError` naming the file and line."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: {run_dir} is not a training run directory")
    config = read_config(config_path)
    env = config.get("env")
    group = env.get("group_size", 1) if isinstance(env, dict) else 1
    if not _is_number(group) or group != int(group) or group < 1:
        raise RunFileError(f"{config_path}: env.group_size must be a positive int, got {group!r}")
    group = int(group)
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = _summary(run_dir / "summary.json")
    episodes: list[float] = []
    train: list[float] = []
    held: dict[str, list[tuple[float, float]]] = {"sampled": [], "greedy": []}
    iterations: list[int] = []
    held_iters: dict[str, list[int]] = {"sampled": [], "greedy": []}
    if metric == "success_rate":
        train_key = "success_rate"
    else:
        train_key = f"train_{metric}" if any(f"train_{metric}" in r for r in records) else "reward_mean"
    for n, rec in enumerate(records, start=1):
        x = float(rec["tasks_seen"] * group) if _is_number(rec.get("tasks_seen")) else float(n)
        it = int(rec["iteration"]) if _is_number(rec.get("iteration")) else n
        episodes.append(x)
        iterations.append(it)
        v = rec.get(train_key)
        train.append(float(v) if _is_number(v) else math.nan)
        for kind, key in (("sampled", f"eval_{metric}"), ("greedy", f"eval_greedy_{metric}")):
            if _is_number(rec.get(key)):
                held[kind].append((x, float(rec[key])))
                held_iters[kind].append(it)

    def held_out_value(when: str):  # summary.json's evaluation before / after RL
        if metric == "success_rate":
            return summary.get(f"success_{when}")
        ev = summary.get(f"eval_{when}")
        return ev.get(metric) if isinstance(ev, dict) else None

    for kind, suffix in (("sampled", ""), ("greedy", "_greedy")):
        before, after = held_out_value(f"before_rl{suffix}"), held_out_value(f"after_rl{suffix}")
        if _is_number(before):
            held[kind].insert(0, (0.0, float(before)))
            held_iters[kind].insert(0, 0)
        if _is_number(after) and episodes:
            held[kind].append((episodes[-1], float(after)))
            held_iters[kind].append(iterations[-1] + 1)  # after the last iteration's own evaluation
    # logging settings (trackers, the episode store ...) change no number of a run
    recipe = {k: v for k, v in config.items() if k not in SEED_KEYS and k != "logging"}
    label = {"success_rate": "success", "reward_mean": "reward"}.get(train_key, metric)
    return RunCurves(run_dir, recipe, episodes, train, held, label, iterations, held_iters)


def _recipe_labels(groups: list[list[RunCurves]]) -> list[str]:
    """A label per recipe: the dotted config keys in which the recipes differ."""

    def norm(v):  # a key absent, null or empty means the same default; 300 and 300.0 are one value
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = float(v)
        return json.dumps(None if v in ({}, []) else v, sort_keys=True)

    flats = [{k: v for k, v in _filled(g[0].recipe).items() if not k.startswith("logging.")} for g in groups]
    keys = sorted({k for f in flats for k in f if len({norm(x.get(k)) for x in flats}) > 1})
    labels = []
    for f, g in zip(flats, groups, strict=True):
        label = ", ".join(f"{k}={f.get(k)}" for k in keys) or str(f.get("algo.advantage", g[0].run_dir.name))
        labels.append(f"{label} ({len(g)} seed{'s' if len(g) > 1 else ''})")
    return labels


def _mean_band(series: list[list[tuple[float, float]]], keys: list[list[int]] | None = None):
    """(x, mean, low, high) over runs at the x values every run has: seeds evaluated at
    different iterations (a run resumed past its last evaluation) or of different lengths
    share only those, and a mean over some of the seeds would not be the recipe's. With
    `keys` (per series, the iteration of each point) the points are matched by key and
    drawn at their mean x: seeds whose dynamic sampling played different numbers of tasks
    evaluate at the same iterations but at different episode counts."""
    if keys is not None:
        by_key = [dict(zip(k, s, strict=True)) for k, s in zip(keys, series, strict=True)]
        shared = sorted(set.intersection(*(set(d) for d in by_key)))
        points = [[d[k] for d in by_key] for k in shared]
        ys = [[y for _, y in p] for p in points]
        xs_mean = [sum(x for x, _ in p) / len(p) for p in points]
        return xs_mean, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]
    common = set.intersection(*({x for x, _ in s} for s in series))
    xs = sorted(common)
    ys = [[dict(s)[x] for s in series] for x in xs]  # a repeated x: its last value
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


@functools.lru_cache(maxsize=1)
def _default_recipe() -> dict:
    """The trainer's default config as dotted keys, without SEED_KEYS (built once)."""
    from jaxagent.dataclass_yaml import to_dict
    from jaxagent.train.config import TrainerConfig

    return {k: v for k, v in flatten(to_dict(TrainerConfig())).items() if k.split(".")[0] not in SEED_KEYS}


def _filled(recipe: dict) -> dict:
    """A run's recipe as dotted keys, each key its config omits set to the trainer's
    default (a run written before a field existed, or resumed after, is the same recipe)."""
    return {**_default_recipe(), **flatten(recipe)}


def plot_runs(run_dirs, out=None, metric: str = "success_rate") -> Path:
    """Several runs on one figure against episodes played: held-out success sampled and
    greedy, and training success (or, with `metric`, that held-out key: see `read_run`).
    Runs whose configs differ only in `seed` (and `run_dir`, and the `logging` section)
    are seeds of one recipe, drawn as their mean with a min-max band.
    Default output: `comparison.png` beside the first run directory."""
    runs = [read_run(d, metric) for d in run_dirs]
    if not runs:
        raise ValueError("plot_runs: no run directories given")
    if not any(r.held_out["sampled"] or r.held_out["greedy"] for r in runs):
        raise RunDataError(
            f"no run among {[str(r.run_dir) for r in runs]} has held-out evaluations of "
            f"{metric!r} (eval_{metric} in metrics.jsonl, or in summary.json's evaluations)"
        )
    groups: list[list[RunCurves]] = []
    for r in runs:
        for g in groups:
            if _filled(g[0].recipe) == _filled(r.recipe):
                g.append(r)
                break
        else:
            groups.append([r])
    labels = _recipe_labels(groups)
    out = Path(out) if out is not None else runs[0].run_dir.parent / COMPARE_NAME

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    name = "success" if metric == "success_rate" else metric
    train_name = " / ".join(sorted({r.train_label for r in runs}))
    titles = (f"held-out {name}, sampled", f"held-out {name}, greedy", f"training {train_name}")
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4.2 + 0.3 * len(groups)), squeeze=False)
    try:
        for gi, (group, label) in enumerate(zip(groups, labels, strict=True)):
            color = f"C{gi}"
            curves = [
                ([r.held_out["sampled"] for r in group], [r.held_iterations["sampled"] for r in group]),
                ([r.held_out["greedy"] for r in group], [r.held_iterations["greedy"] for r in group]),
                ([list(zip(r.episodes, r.train_success, strict=False)) for r in group], [r.iterations for r in group]),
            ]
            for ax, (series, keys) in zip(axes[0], curves, strict=True):
                if not all(series):
                    continue
                xs, mean, lo, hi = _mean_band(series, keys)  # matched by iteration
                if not xs:
                    continue
                ax.plot(xs, mean, color=color, marker="o" if len(xs) < 30 else None, label=label)
                if len(group) > 1:
                    ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
        for ax, title in zip(axes[0], titles, strict=True):
            ax.set_title(title)
            ax.set_xlabel("episodes")
            if metric == "success_rate":
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
        handles, names = axes[0][2].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=1, fontsize="small")
        fig.tight_layout(rect=(0, 0.06 * len(groups) + 0.02, 1, 1))
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, metadata={"Description": "recipes: " + "; ".join(labels)})
    finally:
        plt.close(fig)
    return out
