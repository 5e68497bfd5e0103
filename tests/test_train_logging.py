"""RunLogger: TensorBoard event files (read back record by record), the progress line,
transcripts of fake and real episodes, robustness to a broken sink, resume."""

import io
import struct
import warnings

import jax
import numpy as np
import pytest

import envs
from jaxagent import models as M
from jaxagent.models import tiny_config
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer
from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig
from jaxagent.rollout.episode import Episode
from jaxagent.train.rundir.runlog import (
    RunLogger,
    format_duration,
    format_progress,
    format_transcript,
    scalar_tag,
    select_episodes,
)


# ----------------------------------------------------------------------------- helpers
def read_events(path):
    """Every Event of a TFRecord event file, parsed with tensorboardX's protos: records are
    [u64 length][u32 crc][data][u32 crc] (the crcs are not checked here)."""
    from tensorboardX.proto import event_pb2

    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n]))
        pos += 12 + n + 4
    assert pos == len(data)
    return events


def scalars(run_dir):
    """{tag: {step: value}} over all event files of the run, in file order."""
    out = {}
    for f in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for ev in read_events(f):
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


def metrics(i, **kw):
    m = {
        "iteration": i,
        "step": i,
        "reward_mean": 0.5 + i,
        "success_rate": 0.25,
        "kl": 1e-4,
        "entropy": 2.0,
        "clipfrac": 0.1,
        "tokens_per_s": 1234.4,
        "time_rollout_s": 0.5,
        "failed_episodes": 0,
        "note": "text",
        "flag": True,
    }
    m.update(kw)
    return m


class TTY(io.StringIO):
    def isatty(self):
        return True


def fake_episode(index=0, seed=7, group=1, done=True, rewards=(0.0, 1.0)):
    ep = Episode(index=index, seed=seed, group_id=group)
    ep.system_prompt = "You play a number game."
    ep.observations = ["Reach 24 with 3 5 8.", "Not yet: 16.", "Correct!"][: len(rewards) + 1]
    ep.actions = ["3 + 5", "3 * 8"][: len(rewards)]
    ep.rewards = list(rewards)
    ep.finish_reasons = ["stop_token"] * len(rewards)
    ep.end(done=done, truncated=not done, reason="terminated" if done else "max_turns")
    return ep


# ----------------------------------------------------------------------------- TensorBoard
def test_tensorboard_event_file_holds_every_numeric_metric_at_the_iteration(tmp_path):
    with RunLogger(tmp_path, total_iterations=3, progress=False) as log:
        log.log_iteration(metrics(1))
        log.log_iteration(metrics(2, eval_success_rate=0.75))
    got = scalars(tmp_path)
    assert got["train/reward_mean"] == {1: 1.5, 2: 2.5}
    assert got["train/kl"][2] == pytest.approx(1e-4)
    assert got["train/tokens_per_s"][1] == pytest.approx(1234.4)
    assert got["time/time_rollout_s"] == {1: 0.5, 2: 0.5}
    assert got["eval/success_rate"] == {2: 0.75}
    assert got["train/failed_episodes"] == {1: 0.0, 2: 0.0}
    # strings, bools and the step itself are not scalars
    assert not any(t.endswith(("note", "flag", "/iteration")) for t in got)
    assert scalar_tag("eval_reward_mean") == "eval/reward_mean"


def test_numpy_scalars_are_logged_like_python_numbers(tmp_path):
    m = metrics(np.int64(2), entropy=np.float32(1.5), success_rate=np.float64(0.5), done=np.bool_(True))
    stream = io.StringIO()
    with RunLogger(tmp_path, total_iterations=2, stream=stream) as log:
        log.log_iteration(m, [fake_episode()])
    got = scalars(tmp_path)
    assert got["train/entropy"] == {2: 1.5} and got["train/success_rate"] == {2: 0.5} and "train/done" not in got
    assert "entropy 1.500" in stream.getvalue() and (tmp_path / "transcripts" / "iter_000002.txt").is_file()


def test_reopening_a_run_appends_and_purges_the_replayed_iterations(tmp_path):
    with RunLogger(tmp_path, total_iterations=4, progress=False) as log:
        for i in (1, 2, 3):
            log.log_iteration(metrics(i))
    first = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(first) == 1
    before = first[0].read_bytes()
    # a resumed run (checkpoint at iteration 2) plays iteration 3 again, then 4
    with RunLogger(tmp_path, total_iterations=4, progress=False) as log:
        log.log_iteration(metrics(3, reward_mean=9.0))
        log.log_iteration(metrics(4))
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2 and first[0].read_bytes() == before
    new = [f for f in files if f != first[0]][0]
    events = read_events(new)
    starts = [ev for ev in events if ev.HasField("session_log")]
    assert len(starts) == 1 and starts[0].step == 3 and starts[0].session_log.status == 1  # START
    assert scalars(tmp_path)["train/reward_mean"] == {1: 1.5, 2: 2.5, 3: 9.0, 4: 4.5}


def test_tensorboard_itself_reads_the_scalars_and_drops_the_replayed_points(tmp_path):
    """TensorBoard's own event reader (the `tensorboard` extra) over a run and its resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path, total_iterations=4, progress=False) as log:
        for i in (1, 2, 3):
            log.log_iteration(metrics(i))
            # on disk as soon as the iteration is logged, before the writer closes
            acc = EventAccumulator(str(tmp_path / "tensorboard"))
            acc.Reload()
            assert [e.step for e in acc.Scalars("train/reward_mean")] == list(range(1, i + 1))
    with RunLogger(tmp_path, total_iterations=4, progress=False) as log:  # resumed from iteration 2
        log.log_iteration(metrics(3, reward_mean=9.0))
        log.log_iteration(metrics(4))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "train/reward_mean" in acc.Tags()["scalars"]
    got = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert got == [(1, 1.5), (2, 2.5), (3, 9.0), (4, 4.5)]


def test_a_failing_tensorboard_writer_warns_once_and_training_goes_on(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the event directory should be")
    stream = io.StringIO()
    eps = [fake_episode()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunLogger(tmp_path, total_iterations=3, stream=stream) as log:
            for i in (1, 2, 3):
                log.log_iteration(metrics(i), eps)
    tb = [w for w in caught if "tensorboard" in str(w.message)]
    assert len(tb) == 1 and issubclass(tb[0].category, RuntimeWarning)
    assert stream.getvalue().count("\n") == 3  # progress went on
    assert (tmp_path / "transcripts" / "iter_000003.txt").is_file()  # transcripts too


def test_a_broken_stream_warns_once(tmp_path):
    stream = io.StringIO()
    stream.close()
    with pytest.warns(RuntimeWarning, match="progress") as caught:
        with RunLogger(tmp_path, total_iterations=2, stream=stream, tensorboard=False) as log:
            log.log_iteration(metrics(1))
            log.log_iteration(metrics(2))
    assert len([w for w in caught if "progress" in str(w.message)]) == 1


# ----------------------------------------------------------------------------- progress
def test_progress_line_on_a_file_is_one_plain_line_per_iteration(tmp_path):
    stream = io.StringIO()
    with RunLogger(tmp_path, total_iterations=3, stream=stream, tensorboard=False) as log:
        log.log_iteration(metrics(1))
        log.log_iteration(metrics(2, kl=0.02))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in stream.getvalue()
    first = lines[0]
    for part in ("iter 1/3", "reward 1.500", "success 0.25", "kl 1.00e-04", "entropy 2.000", "1234 tok/s", "ETA "):
        assert part in first, (part, first)
    assert "kl 0.0200" in lines[1]


def test_progress_bar_on_a_terminal_redraws_in_place(tmp_path):
    stream = TTY()
    m = metrics(1)
    del m["kl"]
    m["approx_kl"] = 0.005
    with RunLogger(tmp_path, total_iterations=2, stream=stream, tensorboard=False) as log:
        log.phase("iteration 1: rollout (compiling)")
        assert "iter 0/2 | now: iteration 1: rollout (compiling)" in stream.getvalue()
        log.log_iteration(m)
        log.phase("iteration 2: update")
        log.log_iteration(metrics(2))
        # drawn in place (tqdm): carriage returns, no new line yet
        assert "\n" not in stream.getvalue() and stream.getvalue().count("\r") >= 4
        assert "ETA ?" in stream.getvalue()  # no ETA from the compiling iteration alone
        log.message("saved checkpoint 2")
        assert "saved checkpoint 2\n" in stream.getvalue()
    text = stream.getvalue()
    assert text.endswith("\n") and "approx_kl 0.0050" in text and "iter 2/2" in text and "done" in text
    # the live line ends as the last iteration's line
    assert text.rstrip("\n").split("\r")[-1].strip().startswith("iter 2/2")


def test_format_progress_and_eta():
    line = format_progress({"iteration": 5, "reward_mean": 0.1}, 10, eta_s=192)
    assert "iter 5/10 [##########----------]" in line and "ETA 3m12s" in line
    assert "success -" in line and "kl -" in line and "- tok/s" in line
    assert format_duration(45) == "45s" and format_duration(7500) == "2h05m"
    log = RunLogger.__new__(RunLogger)
    log.total_iterations, log._durations = 10, [30.0, 2.0, 4.0]  # the first (compilation) is left out
    assert log.eta_seconds(4) == pytest.approx(6 * 3.0)
    log._durations = [30.0]
    assert log.eta_seconds(1) is None


# ----------------------------------------------------------------------------- transcripts
def test_format_transcript_shows_turns_rewards_and_flags():
    text = format_transcript(fake_episode())
    for part in (
        "task seed 7",
        "group 1",
        "You play a number game.",
        "[turn 0] observation (user):",
        "Reach 24 with 3 5 8.",
        "[turn 0] action (assistant), reward +0",
        "3 + 5",
        "Not yet: 16.",
        "[turn 1] action (assistant), reward +1",
        "3 * 8",
        "final observation:",
        "Correct!",
        "return +1 | success yes | done True | truncated False | failed False | end: terminated",
    ):
        assert part in text, (part, text)
    assert text.index("3 + 5") < text.index("Not yet: 16.") < text.index("3 * 8") < text.index("Correct!")
    lost = fake_episode(done=False, rewards=(-0.5,))
    assert "return -0.5 | success no | done False | truncated True" in format_transcript(lost)


def test_a_cut_action_is_decoded_with_the_tokenizer():
    tok = byte_chat_tokenizer()
    ep = Episode(index=0, seed=1, group_id=0)
    ep.observations = ["go"]
    ep.add("prompt", [1, 2])
    ep.add("policy", tok.encode("left lef", add_special_tokens=False), [0.0] * 8, turn=0)
    ep.rewards, ep.finish_reasons = [0.0], ["cache_full"]
    ep.end(truncated=True, reason="context_full")
    text = format_transcript(ep, tokenizer=tok)
    assert "cut by the context limit" in text and "left lef" in text and "ended by cache_full" in text


def test_transcript_files_every_n_iterations_one_episode_per_group_first(tmp_path):
    eps = [fake_episode(0, seed=10, group=0), fake_episode(1, seed=10, group=0), fake_episode(2, seed=11, group=1)]
    assert [e.index for e in select_episodes(eps, 2)] == [0, 2]
    with RunLogger(
        tmp_path,
        total_iterations=4,
        progress=False,
        tensorboard=False,
        transcripts_every=2,
        transcripts_per_iteration=2,
    ) as log:
        for i in (1, 2, 3, 4):
            log.log_iteration(metrics(i), eps)
    files = sorted(p.name for p in (tmp_path / "transcripts").iterdir())
    assert files == ["iter_000002.txt", "iter_000004.txt"]
    text = (tmp_path / "transcripts" / "iter_000002.txt").read_text()
    assert text.startswith("iteration 2: 2 of 3 episodes")
    assert "task seed 10 | group 0" in text and "task seed 11 | group 1" in text and "episode 1 " not in text


@pytest.mark.slow  # compiles the sampler: ~6 s on a quiet 2-core machine, 20 s on a busy one
def test_transcripts_of_a_real_rollout_hold_its_turn_texts_and_rewards(tmp_path):
    tok = byte_chat_tokenizer()
    cfg = tiny_config(vocab_size=len(tok))
    params = M.init_params(jax.random.key(0), cfg, std=0.3)
    loop = AgentLoop(
        params,
        cfg,
        tok,
        AgentLoopConfig(max_turns=2, max_tokens_per_turn=4, max_context=512, sampling=SamplingConfig(1.0), seed=3),
    )
    with envs.EnvPool(["frozenlake"] * 2, num_workers=0) as pool:
        _, eps = loop.run(pool, [5, 6], group_ids=[0, 1])
    with RunLogger(tmp_path, total_iterations=1, progress=False, tensorboard=False) as log:
        log.log_iteration(metrics(1), eps)
    text = (tmp_path / "transcripts" / "iter_000001.txt").read_text()
    for ep in eps:
        assert f"task seed {ep.seed} | group {ep.group_id}" in text
        assert ep.observations[0].splitlines()[0] in text
        # strict=False: a turn the context limit cut has a reward but no action (`record_turn`)
        for k, (action, reward) in enumerate(zip(ep.actions, ep.rewards, strict=False)):
            assert f"[turn {k}] action (assistant), reward {reward:+.4g}" in text
            for line in action.splitlines():
                assert line.strip() in text
