"""`jaxagent view RUN_DIR [RUN_DIR ...] [--port P | --out DIR]`: a web page of runs.

    write_site(["runs/a", "runs/b"], "site/")      # static files; open site/index.html
    serve(["runs/a"], port=8765)                    # the same, rebuilt on every page load

The page (`index.html`, `viewer.js`, `viewer.css`, shipped in this package: no build
step, no CDN, nothing fetched from outside) shows

- learning curves of every run on shared axes against the iteration: training success
  and reward, held-out success sampled and greedy, and the monitors present in
  `metrics.jsonl` (entropy, approx_kl, clip fraction, flat groups, anchor repeats,
  invalid and no-op actions, failed episodes);
- two panes side by side, each with a run, one of its iterations, filters (failed,
  truncated, invalid actions, a return range) and the episode store's episodes of that
  iteration (`jaxagent.train.rundir.episodes`);
- an episode's conversation: the prompt, each turn's policy tokens coloured by a chosen
  signal (advantage, trainer log-prob, sampler log-prob, their ratio, entropy) with
  every value on hover, the turn's reward, the observations, and the env's final info.

The data are JavaScript files the page loads with `<script>` tags, so the static site
also works from `file://` (a browser refuses `fetch` there): `data/runs.js` (each run's
name, metrics, summary and a one-line digest of every stored episode) and
`data/run<k>/iter_<n>.js` (one iteration's stored episodes, loaded when chosen).
"""

from __future__ import annotations

import functools
import http.server
import json
import math
import shutil
import tempfile
import threading
from pathlib import Path

from jaxagent.train.rundir import read_json
from jaxagent.train.rundir.episodes import read_store
from jaxagent.train.rundir.plot import read_metrics

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = ("index.html", "viewer.js", "viewer.css")


class ViewError(ValueError):
    """A run directory the viewer cannot show."""


def _dumps(payload) -> str:
    """JSON (a JavaScript expression), with "</" escaped so that a page may inline it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False).replace("</", "<\\/")


def _finite(x):
    """`x` with every non-finite float as None (JSON has no NaN or Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def digest(rec: dict) -> dict:
    """The one-line summary of a stored episode that the episode list shows."""
    return {
        k: rec.get(k)
        for k in (
            "iteration",
            "index",
            "seed",
            "group_id",
            "return",
            "success",
            "failed",
            "truncated",
            "end_reason",
            "invalid_actions",
            "noop_actions",
            "why",
        )
    } | {"turns": len(rec.get("rewards", ()))}


def read_run(run_dir) -> tuple[dict, dict[int, list[dict]]]:
    """`(run, episodes by iteration)` of one run directory; errors name the file (a damaged
    metrics.jsonl, summary.json or episode store file: a `RunFileError` with the line)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ViewError(f"{run_dir}: no such run directory")
    metrics = read_metrics(run_dir / "metrics.jsonl", live=True)
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = read_json(run_dir / "summary.json")
        if not isinstance(summary, dict):
            raise ViewError(f"{run_dir / 'summary.json'}: expected a JSON object, got {type(summary).__name__}")
    stored = read_store(run_dir)
    if not metrics and not stored and not (run_dir / "config.yaml").is_file():
        raise ViewError(
            f"{run_dir}: neither metrics.jsonl nor an episode store (episodes/) to show; "
            "is it a training run's directory?"
        )
    by_iter: dict[int, list[dict]] = {}
    for rec in stored:
        by_iter.setdefault(int(rec["iteration"]), []).append(rec)
    # scalars, and one level of the evaluations' dicts as dotted keys
    # ("eval_after_rl_greedy.noop_action_frac")
    flat = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items() if not isinstance(vv, (dict, list))})
        elif not isinstance(v, list):
            flat[k] = v
    summary = _finite(flat)
    run = {
        "name": str(run_dir),
        "metrics": _finite(metrics),
        "summary": summary,
        "iterations": {str(i): [digest(r) for r in recs] for i, recs in sorted(by_iter.items())},
    }
    return run, by_iter


def write_site(run_dirs, out_dir, *, overwrite: bool = True) -> Path:
    """Writes the viewer of `run_dirs` to `out_dir` (module docstring); returns the
    path of its `index.html`."""
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ViewError("no run directory given")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ViewError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ViewError(f"{out}: not empty")
    loaded = [read_run(d) for d in run_dirs]  # every error before anything is written
    data = out / "data"
    if data.is_dir():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    for name in STATIC_FILES:
        shutil.copyfile(STATIC / name, out / name)
    runs = []
    for k, (run, by_iter) in enumerate(loaded):
        run["id"] = f"run{k}"
        runs.append(run)
        (data / run["id"]).mkdir()
        for i, recs in by_iter.items():
            (data / run["id"] / f"iter_{i}.js").write_text(
                f"JAXAGENT.loaded({_dumps(run['id'])}, {i}, {_dumps(recs)});\n", encoding="utf-8"
            )
    (data / "runs.js").write_text(f"JAXAGENT.setRuns({_dumps(runs)});\n", encoding="utf-8")
    return out / "index.html"


def serve(run_dirs, *, port: int = 8765, host: str = "127.0.0.1", ready=None) -> None:
    """Serves the viewer of `run_dirs` on `http://host:port/` until interrupted; the
    site is rebuilt from the run directories on every load of the page, so a running
    training run shows its newest iterations. `ready(url)` is called once listening."""
    site = Path(tempfile.mkdtemp(prefix="jaxagent-view-"))
    lock = threading.Lock()
    write_site(run_dirs, site)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            # every request under the lock: a page load's rebuild never races another's reads
            with lock:
                if self.path.split("?")[0] in ("/", "/index.html"):
                    try:
                        write_site(run_dirs, site)
                    except (ValueError, OSError) as err:
                        self.send_error(500, str(err))
                        return
                super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer((host, port), functools.partial(Handler, directory=str(site)))
    try:
        if ready is not None:
            ready(f"http://{host}:{httpd.server_address[1]}/")
        httpd.serve_forever()
    finally:
        httpd.server_close()
        shutil.rmtree(site, ignore_errors=True)
