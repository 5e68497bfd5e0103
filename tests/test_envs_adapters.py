"""Adapters to Gymnasium, TextWorld and TextArena (each skipped when its extra is absent)."""

import functools
import os
import random
import re

import pytest
from envs_testlib import no_leftover_processes  # noqa: F401  (autouse fixture)

import envs
from envs import EnvPool


def play(env, seed, policy, limit=500):
    obs, _ = env.reset(seed)
    total, trans = 0.0, [obs]
    for _ in range(limit):
        a = policy(env)
        obs, r, term, trunc, info = env.step(a)
        total += r
        trans.append((a, obs, r))
        if term or trunc:
            break
    return total, term, info, trans


# ---------------------------------------------------------------- Gymnasium


def test_gymnasium_taxi_expert_delivers_and_random_does_not():
    gym = pytest.importorskip("gymnasium")
    env = envs.make("gymnasium/Taxi-v4")
    rand = random.Random(0)
    names = ["south", "north", "east", "west", "pickup", "dropoff"]
    for seed in range(10):
        total, term, info, trans = play(env, seed, lambda e: e.expert_action())
        assert term and trans[-1][2] == 20  # Taxi pays +20 for a correct drop-off
        # The same action indices replayed in Gymnasium itself give the same rewards.
        ref = gym.make("Taxi-v4")
        ref.reset(seed=seed)
        ref_total = 0
        for a, _, _ in trans[1:]:
            _, r, *_ = ref.step(names.index(re.search(r"<action>(\w+)</action>", a).group(1)))
            ref_total += r
        assert ref_total == total
        total_r, term_r, *_ = play(env, seed, lambda e: rand.choice([f"<action>{n}</action>" for n in names]))
        assert total_r < total


def test_gymnasium_frozenlake_cliff_and_blackjack():
    pytest.importorskip("gymnasium")
    lake = envs.make("gymnasium/FrozenLake-v1", is_slippery=False)
    obs, _ = lake.reset(0)
    assert "SFFF" in obs and "You are at row 1, column 1." in obs and "\x1b" not in obs
    total, term, *_ = play(lake, 0, lambda e: e.expert_action())
    assert term and total == 1.0
    slippery = envs.make("gymnasium/FrozenLake-v1")
    wins = sum(play(slippery, s, lambda e: e.expert_action())[0] for s in range(30))
    rand = random.Random(1)
    rwins = sum(play(slippery, s, lambda e: rand.choice(["left", "down", "right", "up"]))[0] for s in range(30))
    assert wins > rwins + 5
    cliff = envs.make("gymnasium/CliffWalking-v1")
    total, term, *_ = play(cliff, 0, lambda e: e.expert_action())
    assert term and total == -13  # the shortest safe path: 13 steps of -1
    bj = envs.make("gymnasium/Blackjack-v1")
    obs, _ = bj.reset(3)
    assert re.fullmatch(r"Your hand sums to \d+( \(with a usable ace\))?\. The dealer shows (an ace|\d+)\.", obs)
    obs, r, term, trunc, info = bj.step("I'll stand")
    assert term and info["action_index"] == 0


def test_gymnasium_action_parsing_and_errors():
    pytest.importorskip("gymnasium")
    env = envs.make("gymnasium/Taxi-v4", invalid_penalty=-2.0)
    env.reset(5)
    key = env.state_key()
    obs, r, term, trunc, info = env.step("<action>fly</action>")
    assert r == -2.0 and "unknown action 'fly'" in obs and env.state_key() == key
    assert env.step("1")[4]["action_index"] == 1
    assert env.step("go UP")[4]["action_index"] == 1  # synonym of north
    assert env.step("<action>Pickup</action>")[4]["action_index"] == 4
    with pytest.raises(ValueError, match="unknown Gymnasium env id 'Nope-v0'"):
        envs.make("gymnasium/Nope-v0")
    with pytest.raises(ValueError, match="Discrete action spaces"):
        envs.make("gymnasium/Pendulum-v1")


def test_gymnasium_generic_discrete_env_through_a_pool():
    pytest.importorskip("gymnasium")
    fns = [functools.partial(envs.make, "gymnasium/CartPole-v1")] * 2
    with EnvPool(fns, num_workers=1) as pool:
        obs = pool.reset([0, 1])
        assert obs[0][0].startswith("Observation: ") and obs[0][0] != obs[1][0]
        res = pool.step(["<action>1</action>", "0"])
        assert all(r[1] == 1.0 for r in res)


# ---------------------------------------------------------------- TextArena


def _hanoi_moves(n, src="A", dst="C", via="B"):
    if n == 0:
        return []
    return _hanoi_moves(n - 1, src, via, dst) + [f"[{src} {dst}]"] + _hanoi_moves(n - 1, via, dst, src)


def test_textarena_tower_of_hanoi_solved_by_the_classic_recursion():
    pytest.importorskip("textarena")
    env = envs.make("textarena/TowerOfHanoi-v0")
    obs, _ = env.reset(0)
    assert "Tower of Hanoi" in obs and "A: [3, 2, 1]" in obs
    disks = int(re.search(r"with (\d+) disks", obs).group(1))
    keys = set()
    for move in _hanoi_moves(disks):
        obs, r, term, trunc, info = env.step(f"<action>{move}</action>")
        keys.add(env.state_key())
    assert term and r == 1.0 and len(keys) == 2**disks - 1
    env.reset(0)
    obs, r, term, trunc, info = env.step("")
    assert r == -0.1 and "the move is empty" in obs


def test_textarena_errors():
    pytest.importorskip("textarena")
    with pytest.raises(ValueError, match="unknown TextArena game 'NoSuchGame-v0'"):
        envs.make("textarena/NoSuchGame-v0")
    env = envs.make("textarena/ConnectFour-v0")
    with pytest.raises(ValueError, match="cannot be played by one player"):
        env.reset(0)


def test_textarena_seeds_reproduce():
    pytest.importorskip("textarena")
    # Minesweeper places its mines with the global RNG on the first move: other envs
    # drawing in between must not change an episode.
    a, b, c = (envs.make("textarena/Minesweeper-v0") for _ in range(3))
    assert a.reset(3) == b.reset(3)
    c.reset(4)
    first = a.step("[3 3]")[:4]
    c.step("[2 2]")
    assert b.step("[3 3]")[:4] == first


# ---------------------------------------------------------------- TextWorld


@pytest.fixture(scope="module")
def tw_cache(tmp_path_factory):
    pytest.importorskip("textworld")
    return str(tmp_path_factory.mktemp("textworld"))


def test_textworld_game_generated_cached_and_won_by_its_walkthrough(tw_cache):
    env = envs.make("textworld/tw-simple", cache_dir=tw_cache)
    obs, info = env.reset(7)
    assert "$$" not in obs and "-= " in obs and "Admissible commands:" in obs
    assert os.path.exists(info["game_file"]) and info["game_file"].startswith(tw_cache)
    total, term, last, trans = play(env, 7, lambda e: e.expert_action())
    assert term and last["won"] and total == info["max_score"] > 0
    # Cached: a new env on the same seed reuses the game file and plays identically.
    stamp = os.stat(info["game_file"]).st_mtime_ns
    again = envs.make("textworld/tw-simple", cache_dir=tw_cache)
    total2, _, _, trans2 = play(again, 7, lambda e: e.expert_action())
    assert trans2 == trans and os.stat(info["game_file"]).st_mtime_ns == stamp
    # Wrong commands are answered by the game; empty ones are penalised.
    again.reset(7)
    obs, r, *_ = again.step("<action>dance wildly</action>")
    assert r == 0.0 and obs
    obs, r, *_ = again.step("   ")
    assert r == -0.1 and "the command is empty" in obs
    with pytest.raises(ValueError, match="unknown TextWorld game type 'tw-chess'"):
        envs.make("textworld/tw-chess")


def test_textworld_in_a_pool(tw_cache):
    fn = functools.partial(envs.make, "textworld/tw-simple", cache_dir=tw_cache)
    with EnvPool([fn, fn], num_workers=2, reset_timeout=120) as pool:
        res = pool.reset([7, 7])  # the game from the test above, from the cache
        assert res[0][0] == res[1][0] and not res[0][1].get("failed")
        out = pool.step(pool.expert_actions())
    # both slots step exactly as the same game played in this process does
    direct = fn()
    obs, _ = direct.reset(7)
    expected = direct.step(direct.expert_action())[:4]
    direct.close()
    assert res[0][0] == obs
    assert out[0][:4] == out[1][:4] == expected


@pytest.mark.slow
@pytest.mark.parametrize("game_type", ["tw-coin_collector", "tw-treasure_hunter", "tw-cooking"])
def test_textworld_other_game_types_are_won_by_their_walkthrough(tw_cache, game_type):
    env = envs.make(f"textworld/{game_type}", cache_dir=tw_cache)
    obs, info = env.reset(1)
    total, term, last, _ = play(env, 1, lambda e: e.expert_action())
    assert term and last["won"] and total == info["max_score"]
