"""The episode store (`jaxagent.train.rundir.episodes`): which episodes are kept, its size
bound, and a real run's stored tokens and per-token signals against the episodes and
against a float64 NumPy pass over the policy's own parameters."""

import json
import types

import jax
import numpy as np
import pytest
from test_train_loop import VARIED, config

from jaxagent import models as M
from jaxagent.train.rundir.episodes import EpisodeStore, read_store, select_for_store


def fake(index, group, rewards, failed=False, truncated=False):
    return types.SimpleNamespace(index=index, group_id=group, rewards=rewards, failed=failed, truncated=truncated)


def test_selection_keeps_failed_truncated_and_the_extremes_first():
    eps = [
        fake(0, 0, [0.2]),
        fake(1, 0, [0.9]),
        fake(2, 1, [0.5], truncated=True),
        fake(3, 1, [0.0]),
        fake(4, 2, [0.1], failed=True),
        fake(5, 2, [0.3]),
        fake(6, 3, [0.4]),
    ]
    assert select_for_store(eps, 4) == [(1, "highest_return"), (3, "lowest_return"), (4, "failed"), (2, "truncated")]
    # then the first episode of each group not yet in (group 3), then the rest in order
    assert select_for_store(eps, 7)[4:] == [(6, "sample"), (0, "sample"), (5, "sample")]
    assert select_for_store(eps, 2) == [(1, "highest_return"), (3, "lowest_return")]
    # where most episodes are truncated, they get a quarter of the slots first, not all
    many = [fake(i, i // 2, [0.1 * i], truncated=i < 6) for i in range(8)]
    got = select_for_store(many, 4)
    assert got == [(7, "highest_return"), (0, "lowest_return"), (1, "truncated"), (2, "sample")]
    assert select_for_store(many, 8) == [
        (7, "highest_return"),
        (0, "lowest_return"),
        (1, "truncated"),
        (2, "truncated"),
        (4, "sample"),
        (3, "truncated"),
        (5, "truncated"),
        (6, "sample"),
    ]
    assert select_for_store(eps, 0) == [] and select_for_store([], 3) == []


class _Tok:
    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_the_store_is_bounded_and_atomic(tmp_path):
    ep = types.SimpleNamespace(
        index=0,
        seed=1,
        group_id=0,
        rewards=[1.0],
        success=True,
        done=True,
        truncated=False,
        failed=False,
        end_reason="terminated",
        failure="",
        failure_kind="",
        invalid_actions=0,
        noop_actions=0,
        info={"x": np.float32(1.5)},
        system_prompt=None,
        segments=[("prompt", [1, 2]), ("policy", [3, 4]), ("observation", [5])],
    )
    store = EpisodeStore(tmp_path, per_iteration=2, max_mb=1.0)
    assert store.write(1, [ep], _Tok())
    size = store.path(1).stat().st_size
    (rec,) = read_store(tmp_path)
    assert [s["text"] for s in rec["segments"]] == ["BC", "DE", "F"] and rec["segments"][1]["pieces"] == ["D", "E"]
    assert rec["info"] == {"x": 1.5} and rec["why"] == "highest_return"
    # rewriting an iteration replaces its file and does not count twice
    store.max_bytes = 4 * size + 10
    assert store.write(1, [ep], _Tok()) and store.write(1, [ep], _Tok())
    for i in (2, 3, 4):
        assert store.write(i, [ep], _Tok())
    assert sorted(store._stored()) == [1, 2, 3, 4] and store.stride == 1
    # the fifth would pass the bound: every other iteration goes, then only even ones are stored
    assert not store.write(5, [ep], _Tok())
    assert sorted(store._stored()) == [2, 4] and store.stride == 2
    assert store.write(6, [ep], _Tok()) and not store.write(7, [ep], _Tok()) and store.write(8, [ep], _Tok())
    assert sorted(store._stored()) == [2, 4, 6, 8]
    assert not store.write(10, [ep], _Tok()) and store.stride == 4  # 10 is not a multiple of 4
    assert sorted(store._stored()) == [4, 8] and store.used_bytes() <= store.max_bytes
    # a resumed run goes on with the stride on disk
    again = EpisodeStore(tmp_path, per_iteration=2, max_mb=1.0)
    assert again.stride == 4 and not again.write(14, [ep], _Tok()) and again.write(12, [ep], _Tok())
    # an iteration larger than the whole bound alone is not stored, and nothing is deleted
    tiny = EpisodeStore(tmp_path, per_iteration=2, max_mb=1.0)
    tiny.max_bytes = size - 1
    assert not tiny.write(16, [ep], _Tok()) and sorted(tiny._stored()) == [4, 8, 12]
    assert not list((tmp_path / "episodes").glob("*.tmp"))
    with pytest.raises(ValueError, match="per_iteration"):
        EpisodeStore(tmp_path, per_iteration=-1)
    with pytest.raises(ValueError, match="max_mb"):
        EpisodeStore(tmp_path, max_mb=0)
    store.path(4).write_text('{"a": 1}\n{"b": \n')
    with pytest.raises(ValueError, match=r"iter_000004.jsonl:2: not valid JSON"):
        read_store(tmp_path)


def _log_softmax64(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_a_real_run_stores_its_episodes_tokens_and_signals(stored_run):
    trainer = stored_run.trainer
    recs = read_store(stored_run.run_dir)
    assert len(recs) == 12 and [r["iteration"] for r in recs] == [1] * 6 + [2] * 6
    by_index = {ep.index: ep for ep in stored_run.last_episodes}
    rets = [sum(ep.rewards) for ep in stored_run.last_episodes]
    last = [r for r in recs if r["iteration"] == 2]
    whys = [r["why"] for r in last]
    assert "highest_return" in whys and "lowest_return" in whys
    assert max(r["return"] for r in last) == pytest.approx(max(rets))
    assert min(r["return"] for r in last) == pytest.approx(min(rets))
    # iteration 2's records against its episodes
    for rec in last:
        ep = by_index[rec["index"]]
        assert [t for s in rec["segments"] for t in s["tokens"]] == ep.tokens
        # each turn's text is the whole turn as sampled (special tokens shown); its action
        # is that without special tokens
        policy = [s for s in rec["segments"] if s["kind"] == "policy"]
        assert [s["turn"] for s in policy] == list(range(len(ep.actions)))
        for seg, action in zip(policy, ep.actions, strict=True):
            assert seg["text"] == trainer.tokenizer.decode(seg["tokens"])
            assert action == trainer.tokenizer.decode(seg["tokens"], skip_special_tokens=True)
        assert rec["rewards"] == ep.rewards and rec["seed"] == ep.seed
        pos = 0
        for seg in rec["segments"]:
            if seg["kind"] == "policy":
                assert seg["rollout_logp"] == pytest.approx(ep.logp[pos : pos + len(seg["tokens"])], abs=1e-6)
            pos += len(seg["tokens"])
    # iteration 1's signals against a float64 NumPy pass over the parameters it played with
    mc = trainer.model_config
    forward = jax.jit(lambda p, t: M.forward(p, mc, t))
    policy_tokens = 0
    for rec in recs[:6]:
        tokens = [t for s in rec["segments"] for t in s["tokens"]]
        logp_ref = _log_softmax64(np.asarray(forward(stored_run.params_before, np.asarray([tokens], np.int32)))[0])
        pos = 0
        for seg in rec["segments"]:
            n = len(seg["tokens"])
            if seg["kind"] == "policy":
                for j in range(n):
                    t = pos + j
                    ref = logp_ref[t - 1]
                    assert seg["logp"][j] == pytest.approx(ref[tokens[t]], abs=2e-4)
                    assert seg["entropy"][j] == pytest.approx(-(np.exp(ref) * ref).sum(), abs=2e-4)
                    assert seg["ratio"][j] == pytest.approx(np.exp(seg["logp"][j] - seg["rollout_logp"][j]), rel=1e-5)
                    assert seg["ratio"][j] == pytest.approx(1.0, abs=1e-3)  # on-policy: sampler = trainer
                    assert seg["rollout_logp"][j] == pytest.approx(ref[tokens[t]], abs=2e-4)
                    assert seg["loss_mask"][j] == 1.0
                # GRPO: one advantage per episode, on every one of its tokens
                assert len(set(seg["advantage"])) == 1
                policy_tokens += n
            pos += n
    assert policy_tokens > 0
    # the files are JSON lines a browser's JSON.parse reads (no NaN, no Infinity)
    for path in (stored_run.run_dir / "episodes").glob("iter_*.jsonl"):
        for line in path.read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_the_store_can_be_switched_off_and_changes_no_number_of_the_run(tmp_path, stored_run):
    from test_train_loop import learning_metrics

    from jaxagent.train.trainer import Trainer

    cfg = config(tmp_path / "run", *VARIED, "iterations=1", "logging.episodes_per_iteration=0")
    history = Trainer(cfg, log=lambda *_: None).run()
    assert not (tmp_path / "run" / "episodes").exists()
    # the same run with the store on (the shared fixture's first iteration): every metric equal, to the bit
    assert learning_metrics(history) == learning_metrics(stored_run.trainer.history[:1])


def test_a_store_that_cannot_write_is_switched_off_and_training_goes_on(tmp_path, monkeypatch):
    import warnings

    from jaxagent.train.trainer import Trainer

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EpisodeStore, "write", full_disk)
    trainer = Trainer(config(tmp_path / "run", *VARIED, "iterations=1"), log=lambda *_: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.run()
    assert len(history) == 1 and trainer._store is None
    msgs = [str(w.message) for w in caught if "episode store" in str(w.message)]
    assert len(msgs) == 1 and "No space left" in msgs[0] and "off for this run" in msgs[0]


def test_drop_after_removes_the_iterations_a_resume_plays_again(tmp_path):
    store = EpisodeStore(tmp_path)
    store.dir.mkdir(parents=True)
    for i in (1, 2, 3, 4):
        store.path(i).write_text("{}\n")
    store.drop_after(2)
    assert sorted(store._stored()) == [1, 2]
