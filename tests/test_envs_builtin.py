"""Built-in envs: experts solve them, random play mostly does not, seeds reproduce,
malformed actions are handled. Reference checks are independent of the env code."""

import json
import random
import re
from fractions import Fraction

import pytest

import envs
from envs.core import InvalidAction, parse_direction

DIRS = ["up", "down", "left", "right"]


def play(env, seed, policy):
    obs, info = env.reset(seed)
    trans = [obs]
    while True:
        action = policy(env)
        obs, r, term, trunc, info = env.step(action)
        trans.append((action, obs, r, term, trunc))
        if term or trunc:
            return trans, r, term, info


def random_policy(seed, choices):
    rng = random.Random(seed)
    return lambda env: f"<action>{rng.choice(choices)}</action>"


# ---------------------------------------------------------------- FrozenLake


def _lake_walk(grid_text, moves):
    """Independent walker on the rendered map: the cell the moves lead to."""
    rows = [r.split() for r in grid_text]
    r = c = 0
    step = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    for m in moves:
        dr, dc = step[m]
        if 0 <= r + dr < len(rows) and 0 <= c + dc < len(rows):
            r, c = r + dr, c + dc
        if rows[r][c] in "HG":
            break
    return rows[r][c]


@pytest.mark.parametrize("size", [4, 6])
def test_frozenlake_expert_solves_every_map_and_random_mostly_fails(size):
    env = envs.make("frozenlake", size=size)
    random_wins = 0
    for seed in range(40):
        trans, r, term, info = play(env, seed, lambda e: e.expert_action())
        assert term and r == 1.0 and info["success"]
        # Replay the expert's moves on the first observation's map, independently.
        grid = [ln for ln in trans[0].splitlines()[1:-1]]
        grid[0] = "S" + grid[0][1:]
        moves = [re.search(r"<action>(\w+)</action>", a).group(1) for a, *_ in trans[1:]]
        assert _lake_walk(grid, moves) == "G"
        _, r, _, _ = play(env, seed, random_policy(seed, DIRS))
        random_wins += r == 1.0
    assert random_wins < 40 * 0.3


def test_frozenlake_blind_demonstrator_walks_toward_the_goal_without_looking_at_holes():
    """style="blind": only right/down moves that stay on the map, the same move in the same
    state, and where exactly one of the two forward cells is a hole it steps into it about
    half the time (the expert never does); over many 3x3 maps at hole_prob 0.3 it reaches G
    about as often as a fair coin walker on the same maps, computed here independently."""
    env = envs.make("frozenlake", size=3, hole_prob=0.3)
    into_hole = choices = wins = 0
    coin_wins = 0.0
    for seed in range(400):
        obs, info = env.reset(seed)
        rows = info["map"].splitlines()

        # an independent fair-coin walker's success probability on this map (exact)
        def p_win(r, c, rows=rows):
            if rows[r][c] == "H":
                return 0.0
            if rows[r][c] == "G":
                return 1.0
            nxt = [(r, c + 1)] * (c < 2) + [(r + 1, c)] * (r < 2)
            return sum(p_win(*n) for n in nxt) / len(nxt)

        coin_wins += p_win(0, 0)
        r = c = 0
        while True:
            action = env.expert_action(style="blind")
            assert action == env.expert_action(style="blind")  # a function of the state
            move = re.fullmatch(r"<action>(right|down)</action>", action).group(1)
            assert (move == "right" and c < 2) or (move == "down" and r < 2)
            right, down = (rows[r][c + 1] if c < 2 else None), (rows[r + 1][c] if r < 2 else None)
            if {right, down} & {"H"} and {right, down} - {"H", None}:
                choices += 1
                into_hole += (right if move == "right" else down) == "H"
                best = re.fullmatch(r"<action>(\w+)</action>", env.expert_action()).group(1)
                dr, dc = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}[best]
                assert rows[min(max(r + dr, 0), 2)][min(max(c + dc, 0), 2)] != "H"
            r, c = (r, c + 1) if move == "right" else (r + 1, c)
            _, reward, term, trunc, info = env.step(action)
            if term or trunc:
                wins += reward == 1.0
                break
    assert choices > 100 and 0.35 < into_hole / choices < 0.65
    assert abs(wins - coin_wins) < 0.1 * 400
    with pytest.raises(ValueError, match="style"):
        env.expert_action(style="lazy")


def test_frozenlake_summary_replays_actions_on_each_map():
    """`FrozenLake.summarize` on hand-made episodes whose counts are worked out here."""

    def ep(rows, *actions):
        return {
            "actions": [f"<action>{a}</action>" if a in ("up", "down", "left", "right") else a for a in actions],
            "info": {"map": "\n".join(rows), "moved": "right"},
        }

    episodes = [
        ep(("SHF", "FFF", "FFG"), "right"),  # a hole; down was ice: avoidable
        ep(("SHF", "HFF", "FFG"), "right"),  # a hole; down was a hole too
        ep(("SFF", "FFF", "FFG"), "down", "I jump", "down", "right", "right"),  # the goal, one invalid turn
        ep(("SFF", "FFH", "FFG"), "left", "up", "right", "right", "down"),  # the edge twice, then (2,3): a hole
        {"actions": [], "info": {"failure_kind": "crashed"}},  # failed in the pool: not replayed
    ]
    got = envs.make("frozenlake", size=3).summarize(episodes)
    # 12 actions, counted by hand: ep1 right; ep2 right; ep3 down, invalid, down, right, right;
    # ep4 left, up, right, right, down
    assert got["move_share"] == pytest.approx(
        {"up": 1 / 12, "down": 3 / 12, "left": 1 / 12, "right": 6 / 12, "invalid": 1 / 12}
    )
    # ep4 steps down from (1,3) into the hole at (2,3); right is off the map, so not avoidable
    assert got["replayed_episodes"] == 4
    assert got["hole_rate"] == pytest.approx(3 / 4) and got["avoidable_hole_rate"] == pytest.approx(1 / 4)
    # slippery: the move taken is not the one chosen, so nothing is replayed
    slip = envs.make("frozenlake", size=3, slippery=True).summarize(episodes)
    assert "hole_rate" not in slip and slip["move_share"] == got["move_share"]
    # the expert never steps into a hole; the map is in every step's info
    env = envs.make("frozenlake", size=3, hole_prob=0.3)
    played = []
    for seed in range(20):
        env.reset(seed=seed)
        actions = []
        while True:
            actions.append(env.expert_action())
            *_, term, trunc, info = env.step(actions[-1])
            if term or trunc:
                break
        played.append({"actions": actions, "info": info})
    assert env.summarize(played)["hole_rate"] == 0.0


def test_frozenlake_slippery_expert_beats_random():
    env = envs.make("frozenlake", size=4, slippery=True)
    expert = sum(play(env, s, lambda e: e.expert_action())[1] for s in range(60))
    rand = sum(play(env, s, random_policy(s, DIRS))[1] for s in range(60))
    assert expert > 2 * rand and expert >= 20


def test_frozenlake_seeds_reproduce_and_differ():
    a, b = envs.make("frozenlake", size=5), envs.make("frozenlake", size=5)
    pol = random_policy(7, DIRS)
    t1 = play(a, 3, pol)[0]
    pol = random_policy(7, DIRS)
    t2 = play(b, 3, pol)[0]
    assert t1 == t2
    maps = {envs.make("frozenlake", size=5).reset(s)[1]["map"] for s in range(20)}
    assert len(maps) > 15


def test_frozenlake_invalid_actions_and_state_key():
    env = envs.make("frozenlake", invalid_penalty=-0.5)
    obs, _ = env.reset(1)
    key0 = env.state_key()
    obs, r, term, trunc, info = env.step("I think I should jump")
    assert r == -0.5 and not term and "no direction found" in obs and "<action>up</action>" in obs
    assert info["invalid_action"] and env.state_key() == key0
    obs, r, *_ = env.step("go up or down")
    assert r == -0.5 and "several directions" in obs
    obs, r, *_ = env.step("Let me move RIGHT.")
    assert r == 0.0 and env.state_key() != key0
    # the key is a usable anchor: the same state reached again (a fresh reset, the same
    # move) gives an equal key with an equal hash, and the two states are two set entries
    key1 = env.state_key()
    env.reset(1)
    assert env.state_key() == key0 and hash(env.state_key()) == hash(key0)
    env.step("<action>right</action>")
    assert env.state_key() == key1 and hash(env.state_key()) == hash(key1)
    assert len({key0, key1, env.state_key()}) == 2 and {key0: "start", key1: "moved"}[env.state_key()] == "moved"
    with pytest.raises(ValueError, match="size"):
        envs.make("frozenlake", size=1)


def test_parse_direction_is_lenient_only_when_unambiguous():
    assert parse_direction("<action>Left</action>") == "left"
    assert parse_direction("think: up? no. <action>down</action>") == "down"
    assert parse_direction(" R ") == "right"
    assert parse_direction("north") == "up"
    assert parse_direction("I'll go west.") == "left"
    for bad in ("", "up and left", "<action>jump</action>"):
        with pytest.raises(InvalidAction):
            parse_direction(bad)


# ---------------------------------------------------------------- Sokoban


def _final_map_solved(obs, num_boxes):
    grid = "\n".join(ln for ln in obs.splitlines() if ln.startswith("#"))
    return grid.count("$") == 0 and grid.count("*") == num_boxes


@pytest.mark.parametrize("kw", [dict(), dict(height=8, width=8, num_boxes=3)])
def test_sokoban_expert_solves_every_level_by_replay(kw):
    env = envs.make("sokoban", **kw)
    nb = kw.get("num_boxes", 2)
    for seed in range(25):
        obs, info = env.reset(seed)
        grid = "\n".join(ln for ln in obs.splitlines() if ln.startswith("#"))
        assert grid.count("$") == nb and grid.count("@") + grid.count("+") == 1
        trans, r, term, info = play(env, seed, lambda e: e.expert_action())
        assert term and info["success"] and r == 1.0
        assert _final_map_solved(trans[-1][1], nb)
        # Replaying the recorded moves into a fresh env solves it again.
        fresh = envs.make("sokoban", **kw)
        fresh.reset(seed)
        for action, *_ in trans[1:]:
            out = fresh.step(action)
        assert out[2] and _final_map_solved(out[0], nb)


def test_sokoban_random_play_mostly_fails_and_seeds_reproduce():
    env = envs.make("sokoban")
    wins = sum(play(env, s, random_policy(s, DIRS))[1] >= 1.0 for s in range(30))
    assert wins <= 8
    assert play(env, 5, random_policy(1, DIRS))[0] == play(envs.make("sokoban"), 5, random_policy(1, DIRS))[0]
    levels = {envs.make("sokoban").reset(s)[0] for s in range(20)}
    assert len(levels) == 20


def test_sokoban_push_rules_and_expert_recovers_after_detour():
    env = envs.make("sokoban")
    env.reset(11)
    key = env.state_key()
    obs, r, *_ = env.step("<action>fly</action>")
    assert r == -0.1 and "no direction found" in obs and env.state_key() == key
    # A few random moves, then the expert re-plans and still solves it (if still solvable).
    rng = random.Random(0)
    for _ in range(3):
        env.step(rng.choice(DIRS))
    from envs.sokoban import solve

    if solve(env.level, env.player, env.boxes) is not None:
        for _ in range(100):
            obs, r, term, trunc, info = env.step(env.expert_action())
            if term or trunc:
                break
        assert term and r == 1.0


def test_sokoban_noop_penalty_charges_exactly_the_moves_that_change_nothing():
    env = envs.make("sokoban", height=6, width=6, num_boxes=1, noop_penalty=-0.25, step_penalty=-0.01)
    plain = envs.make("sokoban", height=6, width=6, num_boxes=1)
    seen = {"wall": 0, "move": 0}
    for seed in range(30):
        env.reset(seed)
        for d in ("up", "down", "left", "right"):
            key = env.state_key()
            nxt = env.player + env.level.offsets[d]
            kind = "wall" if not env.level.floor(nxt) else ("box" if nxt in env.boxes else "move")
            if kind == "box":
                continue
            obs, r, term, trunc, info = env.step(f"<action>{d}</action>")
            if kind == "wall":
                assert r == pytest.approx(-0.26) and info.get("noop") is True
                assert env.state_key() == key and "into a wall" in obs
                plain.reset(seed)
                assert plain.step(f"<action>{d}</action>")[1] == 0.0
            elif not term:
                assert r == pytest.approx(-0.01) and "noop" not in info and env.state_key() != key
            seen[kind] += 1
            env.reset(seed)
    assert seen["wall"] > 10 and seen["move"] > 10
    for bad in (float("nan"), "x", True):
        with pytest.raises(ValueError, match="noop_penalty"):
            envs.make("sokoban", noop_penalty=bad)


# ---------------------------------------------------------------- Countdown


def _fraction_eval(expr):
    """Python's own evaluation, every literal a Fraction."""
    return eval(re.sub(r"\d+(?:\.\d+)?", lambda m: f"Fraction('{m.group()}')", expr), {"Fraction": Fraction})


@pytest.mark.parametrize("kw", [dict(), dict(num_numbers=5, max_number=25, use_all=False)])
def test_countdown_expert_is_exactly_right(kw):
    env = envs.make("countdown", **kw)
    for seed in range(30):
        obs, info = env.reset(seed)
        numbers = [int(x) for x in re.search(r"Numbers: (.*)", obs).group(1).split(", ")]
        target = int(re.search(r"Target: (\d+)", obs).group(1))
        action = env.expert_action()
        expr = re.search(r"<answer>(.*)</answer>", action).group(1)
        assert _fraction_eval(expr) == target
        used = sorted(int(x) for x in re.findall(r"\d+", expr))
        if kw.get("use_all", True):
            assert used == sorted(numbers)
        else:
            remaining = list(numbers)
            for u in used:
                remaining.remove(u)
        obs, r, term, trunc, info = env.step(action)
        assert r == 1.0 and term and info["success"]


def test_countdown_rejects_wrong_answers_with_reasons():
    env = envs.make("countdown", max_attempts=3)
    obs, info = env.reset(0)
    nums, target = info["numbers"], info["target"]
    obs, r, term, *_ = env.step(f"<answer>{nums[0]} + {nums[0]}</answer>")
    assert r == 0.0 and not term and ("not available" in obs or "does not use every number" in obs)
    obs, r, term, *_ = env.step("<answer>" + " + ".join(map(str, nums)) + "</answer>")
    total = sum(nums)
    if total != target:
        assert r == 0.0 and f"equals {total}, not {target}" in obs
    obs, r, term, trunc, _ = env.step("I give up")
    assert r == -0.1 and "no expression found" in obs and (term or trunc)


def test_countdown_lenient_formats():
    env = envs.make("countdown")
    env.reset(4)
    expr = re.search(r"<answer>(.*)</answer>", env.expert_action()).group(1)
    pretty = expr.replace("*", "×").replace("/", "÷")
    obs, r, term, *_ = env.step(f"So the answer is:\n{pretty} = {env.target}")
    assert r == 1.0, obs


def test_countdown_random_expressions_mostly_miss():
    env = envs.make("countdown")
    hits = 0
    for seed in range(50):
        _, info = env.reset(seed)
        rng = random.Random(seed)
        nums = list(info["numbers"])
        rng.shuffle(nums)
        expr = str(nums[0])
        for n in nums[1:]:
            expr = f"({expr} {rng.choice('+-*/')} {n})"
        hits += env.step(f"<answer>{expr}</answer>")[1] == 1.0
    assert hits < 10


# ---------------------------------------------------------------- tool-use math


def _reference_answer(template, question):
    """The answer computed here from the question's own numbers, with fractions."""
    nums = [Fraction(x) for x in re.findall(r"\d+(?:\.\d+)?", question)]
    if template == "shop":
        n1, p1, n2, p2, cash = nums
        return cash - (n1 * p1 + n2 * p2)
    if template == "warehouse":
        crates, per, shipped, stores = nums
        return (crates * per - shipped) / stores
    if template == "interest":
        principal, rate, years = nums
        return principal * (1 + rate / 100) ** int(years)
    if template == "trip":
        v1, t1, v2, t2 = nums
        return v1 * t1 + v2 * t2
    raise AssertionError(template)


def test_toolmath_expert_uses_the_tool_and_answers_exactly():
    env = envs.make("toolmath")
    seen = set()
    for seed in range(40):
        obs, info = env.reset(seed)
        seen.add(info["template"])
        ref = _reference_answer(info["template"], obs)
        turns = 0
        while True:
            action = env.expert_action()
            obs, r, term, trunc, step_info = env.step(action)
            turns += 1
            call = re.search(r"<tool_call>(.*)</tool_call>", action)
            if call:
                expr = json.loads(call.group(1))["arguments"]["expression"]
                shown = re.search(r"<tool_response>(.*)</tool_response>", obs).group(1)
                assert Fraction(shown) == _fraction_eval(expr)
            if term or trunc:
                break
        assert term and r == 1.0 and turns >= 3
        answer = re.search(r"<answer>(.*)</answer>", action).group(1)
        assert Fraction(answer) == ref
    assert seen == {"shop", "warehouse", "interest", "trip"}


def test_toolmath_formats_errors_and_wrong_answers():
    env = envs.make("toolmath", max_turns=6)
    obs, info = env.reset(2)
    # Python-style dict and arguments given as a string are accepted.
    obs, r, *_ = env.step("<tool_call>{'name': 'calculator', 'arguments': {'expression': '2**10'}}</tool_call>")
    assert obs == "<tool_response>1024</tool_response>" and r == 0.0
    obs, r, *_ = env.step('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7/4\\"}"}</tool_call>')
    assert obs == "<tool_response>1.75</tool_response>"
    obs, r, *_ = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    assert "error: division by zero" in obs and r == 0.0
    obs, r, *_ = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert r == -0.1 and "no tool named 'search'" in obs
    obs, r, *_ = env.step("<tool_call>not json</tool_call>")
    assert r == -0.1 and "not valid JSON" in obs
    obs, r, term, trunc, info = env.step("<answer>-1</answer>")
    assert r == 0.0 and term and obs == "Incorrect."


def test_toolmath_truncates_and_random_answers_fail():
    env = envs.make("toolmath", max_turns=3)
    env.reset(0)
    for _ in range(3):
        out = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    assert out[3] and not out[2] and "step limit (3)" in out[0]
    wins = 0
    for seed in range(30):
        env.reset(seed)
        wins += env.step(f"<answer>{random.Random(seed).randint(1, 5000)}</answer>")[1] == 1.0
    assert wins == 0
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("<answer>1</answer>")


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "countdown", "toolmath"])
def test_seeds_reproduce_across_instances_and_differ_between_seeds(name):
    a, b = envs.make(name), envs.make(name)
    first = [a.reset(s)[0] for s in range(12)]
    assert first == [b.reset(s)[0] for s in range(12)]
    assert len(set(first)) >= 10
    # Re-using an instance does not leak state between episodes.
    a.reset(3)
    a.step(a.expert_action())
    assert a.reset(5)[0] == first[5] and a.state_key() == (b.reset(5), b.state_key())[1]


@pytest.mark.parametrize(
    "action, message",
    [
        # a long integer within the limits parses (JSON with more than 4,300 digits, where
        # json.loads raises ValueError, is past the length limit)
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "n": ' + "9" * 3900 + "}}</tool_call>",
            None,
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "n": ' + "9" * 4400 + "}}</tool_call>",
            "longer than 4000 characters",
        ),
        ("<tool_call>" + "[" * 2000 + "]" * 1999 + "</tool_call>", "nests brackets deeper than 16"),
        ("<tool_call>" + "[" * 200000 + "]" * 200000 + "</tool_call>", "longer than 4000 characters"),  # RecursionError
        ("<tool_call>" + "{'a': " * 1500 + "1" + "}" * 1500 + "</tool_call>", "longer than 4000 characters"),
        ("<answer>" + "9" * 5000 + "</answer>", "is not a number"),
    ],
)
def test_toolmath_abusive_actions_are_invalid_actions_not_crashes(action, message):
    import envs

    env = envs.make("toolmath")
    env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step(action)
    assert not terminated
    if message is None:  # within the limits: a well-formed call whose extra key is ignored
        assert obs == "<tool_response>1</tool_response>"
    else:
        assert message in info["invalid_action"] and reward == env.invalid_penalty
    # the env still works afterwards
    obs, *_ = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert obs == "<tool_response>42</tool_response>"
