"""The gateway's engine (`jaxagent.gateway.engine.Engine`) and the sampler calls it adds
(`append_rows`, `copy_rows`, `truncate_rows`): a session samples the same tokens and
log-probs however its prompt reached the cache (kept from its earlier calls, cut back,
copied from a shared prefix, or prefilled alone in a fresh engine), which is the
reference here, together with a plain `Sampler.append` of the whole prompt."""

import jax
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.gateway.engine import Engine, EngineClosed
from jaxagent.models import tiny_config
from jaxagent.rollout.sampler import Sampler
from jaxagent.rollout.sampling import SamplingConfig

CFG = tiny_config(vocab_size=300)
PARAMS = M.init_params(jax.random.key(0), CFG, std=0.3)
SAMPLING = SamplingConfig(temperature=1.0)
STOP = [258]


@pytest.fixture(scope="module")
def sampler():
    return Sampler(PARAMS, CFG, max_len=160)


def solo(sampler, key_id, prompt, n=6):
    """What a fresh engine samples for one session: the reference."""
    with Engine(sampler, slots=1, stop_token_ids=STOP, seed=3) as e:
        e.open("s", key_id)
        return e.submit("s", prompt, max_new_tokens=n, sampling=SAMPLING).result()


def same(a, b):
    assert a.ids == b.ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_append_rows_and_copy_rows_match_a_whole_state_append(sampler):
    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 85)), list(range(5, 9))]
    ref = sampler.append(sampler.init_state(4, 0), prompts)
    got = sampler.append_rows(sampler.init_state(4, 0), [2, 0], [prompts[2], prompts[0]])
    lengths = np.asarray(got.cache.lengths)
    assert lengths.tolist() == [20, 0, 25, 0]
    for r in (0, 2):
        np.testing.assert_allclose(np.asarray(got.next_logits_BxV[r]), np.asarray(ref.next_logits_BxV[r]), atol=1e-5)
    keys_before = np.asarray(jax.random.key_data(got.keys_B))
    copied = sampler.copy_rows(got, [0, 0], [1, 3])
    assert np.asarray(copied.cache.lengths).tolist() == [20, 20, 25, 20]
    for r in (1, 3):
        np.testing.assert_array_equal(np.asarray(copied.next_logits_BxV[r]), np.asarray(copied.next_logits_BxV[0]))
        np.testing.assert_array_equal(
            np.asarray(copied.cache.k[:, r, :, :20]), np.asarray(copied.cache.k[:, 0, :, :20])
        )
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(copied.keys_B)), keys_before)  # keys stay
    cut = sampler.truncate_rows(copied, [2], [7])
    assert np.asarray(cut.cache.lengths).tolist() == [20, 20, 7, 20]
    with pytest.raises(ValueError, match="distinct"):
        sampler.copy_rows(cut, [0], [0])


def test_sessions_sample_the_same_however_their_prompt_reached_the_cache(sampler):
    base = list(range(10, 40))
    with Engine(sampler, slots=4, stop_token_ids=STOP, seed=3) as e:
        for sid, key in (("a", 0), ("b", 0), ("c", 1), ("d", 2)):
            e.open(sid, key)
        # a, b, c share a prompt: prefilled once, copied; d has its own
        futs = {s: e.submit(s, base if s != "d" else base[5:], max_new_tokens=6, sampling=SAMPLING) for s in "abcd"}
        first = {s: f.result() for s, f in futs.items()}
        assert e.stats["shared_prefill_tokens"] == 2 * (len(base) - 1)
        # a extends its sequence (its cache is kept); c rewrites its history (cut back)
        ext = base + list(first["a"].ids) + [7, 8, 9]
        rew = base[:12] + [99, 98, 97]
        second = {"a": e.submit("a", ext, max_new_tokens=6, sampling=SAMPLING)}
        second["c"] = e.submit("c", rew, max_new_tokens=6, sampling=SAMPLING)
        second = {s: f.result() for s, f in second.items()}
    same(first["a"], first["b"])  # one key, one prompt: one sample
    same(first["a"], solo(sampler, 0, base))
    same(first["c"], solo(sampler, 1, base))
    same(first["d"], solo(sampler, 2, base[5:]))
    assert second["a"].reused >= len(base) + len(first["a"].ids) - 1
    same(second["a"], solo(sampler, 0, ext))
    assert 0 < second["c"].reused <= 12
    same(second["c"], solo(sampler, 1, rew))


@pytest.mark.slow  # eviction is the same reset-and-prefill path as a fresh session (tested above)
def test_more_sessions_than_rows_evict_the_least_recently_used(sampler):
    with Engine(sampler, slots=2, stop_token_ids=STOP, seed=3) as e:
        for i in range(3):
            e.open(f"s{i}", i)
        got = [e.submit(f"s{i}", list(range(20 + i, 40)), max_new_tokens=4, sampling=SAMPLING) for i in range(3)]
        got = [f.result() for f in got]
        assert e.stats["evictions"] >= 1
    for i in range(3):
        same(got[i], solo(sampler, i, list(range(20 + i, 40)), n=4))


def test_a_closed_session_fails_only_its_own_waiting_call(sampler):
    with Engine(sampler, slots=2, stop_token_ids=STOP, seed=3) as e:
        e.open("x", 0)
        e.open("y", 1)
        e.open("z", 2)  # never calls: the round starts once calls stop arriving
        fx = e.submit("x", list(range(10, 20)), max_new_tokens=3, sampling=SAMPLING)
        e.close_session("x")
        fy = e.submit("y", list(range(10, 20)), max_new_tokens=3, sampling=SAMPLING)
        try:
            fx.result(timeout=60)
        except EngineClosed:
            pass  # closed while it waited
        assert len(fy.result(timeout=60).ids) == 3
        with pytest.raises(ValueError, match="not open"):
            e.submit("x", [1, 2], max_new_tokens=3, sampling=SAMPLING)
        with pytest.raises(ValueError, match="no room"):
            e.submit("y", list(range(160)), max_new_tokens=3, sampling=SAMPLING)
    with pytest.raises(EngineClosed):
        e.submit("y", [1, 2], max_new_tokens=3, sampling=SAMPLING)
