"""What a training run shows while it runs: TensorBoard scalars, a progress line, transcripts.

    with RunLogger(run_dir, total_iterations=cfg.iterations) as run_log:
        while ...:
            metrics = ...                                 # Trainer._metrics(...)
            run_log.log_iteration(metrics, episodes)      # episodes: AgentLoop.run's list

Per `log_iteration(metrics, episodes)`:

- TensorBoard: every numeric metric (Python or NumPy reals, not bools; `iteration` is
  the step) as a scalar at global step `metrics["iteration"]`, in event files under
  `<run_dir>/tensorboard/`. Tags are grouped for TensorBoard's sections by `scalar_tag`:
  `time_*` -> `time/...`, `eval_*` -> `eval/...`, the rest -> `train/...`.
- Progress: one line on `stream` (`format_progress`: iteration i/N, reward, success,
  KL, entropy, tokens/s, ETA). On a terminal it is redrawn in place with `\\r`;
  elsewhere (a log file, CI) it is printed as a plain line per iteration.
- Transcripts: every `transcripts_every` iterations, `transcripts_per_iteration`
  sample episodes (`select_episodes`: one per task group first) are written as text
  (`format_transcript`) to `<run_dir>/transcripts/iter_000123.txt`.

Robustness: logging never stops training. A sink that raises (a full disk, a closed
stream, tensorboardX missing) is reported once with `warnings.warn` and the run goes
on; TensorBoard is then switched off for the run, the other sinks keep trying.
The sinks of scalars are trackers (`jaxagent.train.rundir.trackers`): TensorBoard (through
tensorboardX's public `FileWriter`), and optionally Weights & Biases and MLflow; a
tracker that raises is switched off for the run and reported once.

Resume: re-opening a run_dir keeps everything there. A new event file is added next
to the old ones (TensorBoard reads them all); when event files already exist, the new
one starts with a `SessionLog.START` at the first iteration logged, so TensorBoard
drops the old run's points from that iteration on (those a killed run logged after its
last checkpoint). A transcript file of an iteration that is played again is replaced.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

if TYPE_CHECKING:
    from jaxagent.train.rundir import DiskFullError

TRANSCRIPT_RULE = "=" * 78


# ----------------------------------------------------------------------------- formatting
def _is_number(value: Any) -> bool:
    """A real number (Python or NumPy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _fmt_num(value: Any, spec: str = ".3f") -> str:
    if not _is_number(value):
        return "-"
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _fmt_kl(value: float) -> str:
    """KL values are small: 3 significant digits, exponent notation below 1e-3."""
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4f}"


def format_duration(seconds: float) -> str:
    """`45s`, `3m12s`, `2h05m`."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_progress(metrics: dict, total_iterations: int, eta_s: float | None = None, bar_width: int = 20) -> str:
    """One progress line: `iter 12/100 [##----] reward 0.532 | success 0.41 | kl 1.2e-04 | ...`.

    KL is `kl` (the KL to the reference policy) when the metrics have it, else
    `approx_kl` (old vs new policy); a metric that is missing shows as `-`.
    """
    i = metrics.get("iteration", 0)
    n = max(int(total_iterations), 1)
    frac = min(max(float(i) / n, 0.0), 1.0) if _is_number(i) else 0.0
    filled = int(round(frac * bar_width))
    parts = [
        f"iter {i}/{total_iterations} [{'#' * filled}{'-' * (bar_width - filled)}]",
        f"reward {_fmt_num(metrics.get('reward_mean'))}",
        f"success {_fmt_num(metrics.get('success_rate'), '.2f')}",
    ]
    for key in ("kl", "approx_kl"):
        v = metrics.get(key)
        if _is_number(v):
            parts.append(f"{key} {_fmt_kl(float(metrics[key]))}")
            break
    else:
        parts.append("kl -")
    parts.append(f"entropy {_fmt_num(metrics.get('entropy'))}")
    if _is_number(metrics.get("failed_frac")) and metrics["failed_frac"] > 0:
        parts.append(f"failed {metrics['failed_frac']:.0%}")
    parts.append(f"{_fmt_num(metrics.get('tokens_per_s'), '.0f')} tok/s")
    if _is_number(i) and i >= total_iterations:
        parts.append("done")
    else:
        parts.append(f"ETA {format_duration(eta_s) if eta_s is not None else '?'}")
    return " | ".join(parts)


def _indent(text: str, prefix: str = "    ") -> str:
    lines = str(text).splitlines() or [""]
    return "\n".join(prefix + line if line else prefix.rstrip() for line in lines)


def format_transcript(episode, tokenizer=None) -> str:
    """A readable record of one `jaxagent.rollout.Episode`.

    Task seed and group, the system prompt, then each turn k: the observation the policy
    answered (the user text) and its action (the assistant text) with turn k's reward
    and why the turn ended; then the env's last observation (its answer to the last
    action), the return and the success / done / truncated / failed flags with the end
    reason. A turn the context limit cut is not sent to the env and has no action text:
    with `tokenizer` its tokens are decoded from the episode's policy segment.
    """
    rewards = [float(r) for r in episode.rewards]
    head = (
        f"episode {episode.index} | task seed {episode.seed} | group {episode.group_id} | "
        f"{len(rewards)} turn{'s' if len(rewards) != 1 else ''}"
    )
    out = [head, "-" * len(head)]
    if episode.system_prompt:
        out += ["system:", _indent(episode.system_prompt)]
    policy_segments = [toks for kind, toks in episode.segments if kind == "policy"]
    for k, reward in enumerate(rewards):
        if k < len(episode.observations):
            out += [f"[turn {k}] observation (user):", _indent(episode.observations[k])]
        reason = episode.finish_reasons[k] if k < len(episode.finish_reasons) else ""
        tail = f", ended by {reason}" if reason else ""
        out.append(f"[turn {k}] action (assistant), reward {reward:+.4g}{tail}:")
        if k < len(episode.actions):
            out.append(_indent(episode.actions[k]))
        else:
            cut = "    (cut by the context limit; not sent to the env)"
            if tokenizer is not None and k < len(policy_segments):
                cut += "\n" + _indent(tokenizer.decode(policy_segments[k]))
            out.append(cut)
    if len(episode.observations) > len(rewards):  # the env's answer to the last action
        out += ["final observation:", _indent(episode.observations[len(rewards)])]
    flags = (
        f"return {sum(rewards):+.4g} | success {'yes' if episode.success else 'no'} | "
        f"done {bool(episode.done)} | truncated {bool(episode.truncated)} | failed {bool(episode.failed)}"
    )
    if episode.end_reason:
        flags += f" | end: {episode.end_reason}"
    out.append(flags)
    if episode.failure:
        out += ["failure:", _indent(episode.failure)]
    return "\n".join(out) + "\n"


def select_episodes(episodes: Sequence, n: int) -> list:
    """Up to `n` episodes for transcripts: the first of each task group in order, then
    the rest in order (so a handful of samples covers several tasks)."""
    firsts: list = []
    rest: list = []
    seen: set = set()
    for ep in episodes:
        (rest if ep.group_id in seen else firsts).append(ep)
        seen.add(ep.group_id)
    return (firsts + rest)[: max(n, 0)]


def scalar_tag(key: str) -> str:
    """TensorBoard tag of a metric key: `time_*` -> `time/`, `eval_*` -> `eval/`, else `train/`."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    if key.startswith("time_"):
        return "time/" + key
    return "train/" + key


def numeric_items(metrics: dict) -> Iterable[tuple[str, float]]:
    """The (key, value) pairs TensorBoard gets: real numbers (not bools), not `iteration`."""
    for key, value in metrics.items():
        if key == "iteration" or not _is_number(value):
            continue
        yield key, float(value)


# ----------------------------------------------------------------------------- the logger
class RunLogger:
    """TensorBoard scalars, a progress line and transcripts of a run (module docstring).

    Args:
      run_dir: the run's directory (created if missing; existing content is kept).
      total_iterations: the run's length, for the progress bar and the ETA.
      tensorboard: write event files under `<run_dir>/tensorboard/`.
      trackers: more trackers (`jaxagent.train.rundir.trackers`: W&B, MLflow) that get the
        same scalars.
      progress: draw the progress line on `stream`.
      stream: where the progress line goes (default stderr, so stdout stays clean).
      transcripts_every: write transcripts when `iteration % transcripts_every == 0`
        (0 = never).
      transcripts_per_iteration: how many episodes each transcript file shows.
    """

    def __init__(
        self,
        run_dir,
        *,
        total_iterations: int,
        tensorboard: bool = True,
        progress: bool = True,
        stream: TextIO | None = None,
        transcripts_every: int = 1,
        transcripts_per_iteration: int = 2,
        trackers: Sequence = (),
    ):
        if transcripts_every < 0 or transcripts_per_iteration < 0:
            raise ValueError("transcripts_every and transcripts_per_iteration must be >= 0")
        self.run_dir = Path(run_dir)
        self.total_iterations = int(total_iterations)
        self.progress = progress
        self.stream = sys.stderr if stream is None else stream
        self.transcripts_every = transcripts_every
        self.transcripts_per_iteration = transcripts_per_iteration
        self.transcripts_dir = self.run_dir / "transcripts"
        from jaxagent.train.rundir.trackers import TensorBoardTracker

        #: the scalar sinks still on (a tracker that raised is dropped)
        self.trackers = ([TensorBoardTracker(self.run_dir)] if tensorboard else []) + list(trackers)
        self._warned: set[str] = set()
        #: a transcript write that found no room (`rundir.DiskFullError`): the trainer stops
        #: at the end of the iteration instead of training on without its record
        self.disk_full: DiskFullError | None = None
        self._tty = is_terminal(self.stream)
        self._bar: Any = None  # the tqdm display on a terminal (made on the first draw)
        self._line = ""  # the last progress line drawn
        self._t_last = time.monotonic()
        self._durations: list[float] = []
        self._closed = False
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._warn("run_dir", err)

    # ------------------------------------------------------------------ API
    def log_iteration(self, metrics: dict, episodes: Sequence | None = None) -> None:
        """Log one iteration's metrics (and sample transcripts of its episodes)."""
        now = time.monotonic()
        self._durations.append(now - self._t_last)
        self._t_last = now
        iteration = metrics.get("iteration", len(self._durations))
        if isinstance(iteration, numbers.Integral):
            iteration = int(iteration)
        if self.trackers:
            items = [(scalar_tag(k), v) for k, v in numeric_items(metrics)]
            for tracker in list(self.trackers):
                self._guard(tracker.name, tracker.scalars, iteration, items, disable=tracker)
        if (
            episodes
            and self.transcripts_every
            and self.transcripts_per_iteration
            and isinstance(iteration, int)
            and iteration % self.transcripts_every == 0
        ):
            self._guard("transcripts", self._write_transcripts, iteration, metrics, episodes)
        if self.progress:
            self._guard("progress", self._draw, {**metrics, "iteration": iteration})

    def message(self, text: str) -> None:
        """Print a line of text without breaking the progress bar (it is redrawn below)."""

        def write():
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

        self._guard("progress", write)

    @property
    def iterations_logged(self) -> int:
        """Iterations logged by this logger (this process's session)."""
        return len(self._durations)

    def phase(self, text: str) -> None:
        """What the run is doing now (`rollout`, `update (compiling)`, `held-out evaluation
        64/256` ...), shown after the last progress line on a terminal; a log file gets
        only the per-iteration lines and messages."""
        if not (self.progress and self._tty):
            return

        def draw():
            head = self._line or f"iter 0/{self.total_iterations}"
            self._display(f"{head} | now: {text}")

        self._guard("progress", draw)

    def eta_seconds(self, iteration: int) -> float | None:
        """Remaining iterations x the mean of the last 10 iteration times of this session,
        leaving out its first (which compiles): None until a second iteration is done."""
        recent = self._durations[1:]
        if not recent:
            return None
        recent = recent[-10:]
        return max(self.total_iterations - iteration, 0) * sum(recent) / len(recent)

    def close(self, failed: bool = False) -> None:
        """Ends the progress line and closes the trackers; `failed` marks their runs failed
        (training stopped on an error)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._guard("progress", self._bar.close)
            self._bar = None
        for tracker in self.trackers:
            self._guard(tracker.name, tracker.close, failed)
        self.trackers = []

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None and not issubclass(exc_type, KeyboardInterrupt))

    # ------------------------------------------------------------------ sinks
    def _write_transcripts(self, iteration: int, metrics: dict, episodes: Sequence) -> None:
        chosen = select_episodes(episodes, self.transcripts_per_iteration)
        head = (
            f"iteration {iteration}: {len(chosen)} of {len(episodes)} episodes | "
            f"reward_mean {_fmt_num(metrics.get('reward_mean'))} | "
            f"success_rate {_fmt_num(metrics.get('success_rate'), '.2f')}\n"
        )
        body = "".join(f"\n{TRANSCRIPT_RULE}\n" + format_transcript(ep) for ep in chosen)
        self.transcripts_dir.mkdir(parents=True, exist_ok=True)
        path = self.transcripts_dir / f"iter_{iteration:06d}.txt"
        tmp = path.with_suffix(".txt.tmp")
        tmp.write_text(head + body, encoding="utf-8")
        tmp.replace(path)

    def _draw(self, metrics: dict) -> None:
        i = metrics["iteration"]
        line = format_progress(metrics, self.total_iterations, self.eta_seconds(i) if _is_number(i) else None)
        self._line = line
        if self._tty:
            self._display(line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _display(self, line: str) -> None:
        """The live line on a terminal, drawn in place by tqdm (which also keeps it below
        the messages `message` prints)."""
        if self._bar is None:
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs installed (types-tqdm is not a dependency)

            self._bar = tqdm(
                total=self.total_iterations, file=self.stream, bar_format="{desc}", leave=True, dynamic_ncols=True
            )
        self._bar.set_description_str(line, refresh=True)

    # ------------------------------------------------------------------ robustness
    def _guard(self, sink: str, fn, *args, disable=None) -> None:
        try:
            fn(*args)
        except OSError as err:
            from jaxagent.train.rundir import disk_full

            full = disk_full(err, self.transcripts_dir) if sink == "transcripts" else None
            if full is None:  # trackers (TensorBoard's events too) and the terminal: switched off
                self._guard_failed(sink, err, disable)
            else:
                self.disk_full = self.disk_full or full
        except Exception as err:  # logging must never stop training
            self._guard_failed(sink, err, disable)

    def _guard_failed(self, sink: str, err: BaseException, disable) -> None:
        """A sink that failed: warned about once; a tracker is switched off."""
        self._warn(sink, err, off=disable is not None)
        if disable is not None:
            if disable in self.trackers:
                self.trackers.remove(disable)
            try:
                disable.close(failed=True)
            except Exception:
                pass

    def _warn(self, sink: str, err: BaseException, off: bool = False) -> None:
        if sink in self._warned:
            return
        self._warned.add(sink)
        what = "switched off for this run" if off else "training continues"
        warnings.warn(
            f"RunLogger: {sink} logging failed ({type(err).__name__}: {err}); {what}", RuntimeWarning, stacklevel=3
        )


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (False for a stream that cannot tell, e.g. a closed one)."""
    try:
        return bool(stream.isatty())
    except Exception:
        return False
