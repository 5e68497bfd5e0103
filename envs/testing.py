"""Envs for testing and benchmarking pools: deterministic counters that fail on demand.

- :class:`FaultyEnv` (``envs.make("testing/faulty", fault=..., at_step=...)``): a
  deterministic counting game that can crash its process, hang, raise, return garbage,
  return an unpicklable result, or behave non-deterministically, at a chosen step.
- :class:`NullEnv` (``"testing/null"``): a step that does no work, to measure a pool's
  own overhead per step.
- :class:`UnevenEnv` (``"testing/uneven"``): episodes of seeded uneven length whose
  steps wait (sleep) a seeded log-normal latency, as a remote tool or a simulated user
  would (the W9 benchmark).
- :class:`BusyEnv` (``"testing/busy"``): a step that does a fixed amount of CPU work
  (a chain of SHA-256 hashes), to measure how a pool scales with workers.

Neither is a benchmark of anything an agent would learn.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import signal
import threading
import time

from envs.core import TextEnv
from jaxagent import failures

FAULTS = (
    "crash",
    "segfault",
    "hang",
    "raise",
    "garbage",
    "nan_reward",
    "unpicklable",
    "unloadable",
    "nondeterministic",
    "raise_on_reset",
    "crash_on_reset",
    "memory_bomb",
    "cpu_bomb",
)


def _bomb(kind: str, seconds: float) -> None:
    """`memory_bomb`: touch 64 GiB; `cpu_bomb`: compute for `seconds`."""
    if kind == "memory_bomb":
        hog = bytearray(64 * 2**30)
        hog[::4096] = b"x" * len(hog[::4096])
    else:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(i * i for i in range(10_000))


def _refuse_to_load(what: str):
    raise RuntimeError(f"{what} cannot be rebuilt here")


class Unloadable:
    """Pickles fine but raises when unpickled (as an object of a class only the worker
    process can import would)."""

    def __reduce__(self):
        return _refuse_to_load, ("an Unloadable",)


class FaultyEnv(TextEnv):
    """A counting game: the observation states the seed, the step and a running checksum
    of the actions; reward is a deterministic function of the seed and the action. The
    episode terminates after ``horizon`` steps.

    Args:
      fault: None or one of ``FAULTS``. ``crash``: ``os._exit(17)``; ``segfault``: the
        process kills itself with SIGSEGV; ``hang``: sleeps for ``hang_s``; ``raise``:
        raises RuntimeError; ``garbage``: returns a 3-tuple; ``nan_reward``: reward NaN;
        ``unpicklable``: a lock in ``info``; ``unloadable``: an object in ``info`` that
        pickles but cannot be unpickled; ``nondeterministic``: from the start, the
        observation includes a fresh random number (so replaying it diverges);
        ``raise_on_reset`` / ``crash_on_reset``: fail in ``reset``; ``memory_bomb``:
        allocates 64 GiB; ``cpu_bomb``: computes for ``hang_s`` seconds.
      at_step: the 1-based step at which the fault fires.
      fault_seeds: if given, the fault fires only in episodes with these seeds.
      horizon: episode length.
      hang_s: how long ``hang`` sleeps.
    """

    has_expert = True

    def __init__(
        self, fault: str | None = None, at_step: int = 3, fault_seeds=None, horizon: int = 8, hang_s: float = 3600.0
    ):
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
        super().__init__(max_steps=horizon + 1)
        self.fault, self.at_step, self.horizon, self.hang_s = fault, at_step, horizon, hang_s
        self.fault_seeds = None if fault_seeds is None else frozenset(fault_seeds)
        self.checksum = 0
        self.seed = 0

    system_prompt = "Testing env: send any text; the episode ends after a fixed number of steps."
    action_format = "Any text."

    def _armed(self) -> bool:
        return self.fault is not None and (self.fault_seeds is None or self.seed in self.fault_seeds)

    def _reset(self, seed: int):
        self.seed = seed
        self.checksum = seed
        if self._armed() and self.fault == "raise_on_reset":
            raise RuntimeError(f"injected fault in reset (seed {seed})")
        if self._armed() and self.fault == "crash_on_reset":
            os._exit(19)
        return self._obs(), {}

    def _obs(self) -> str:
        text = f"seed {self.seed} step {self._steps} checksum {self.checksum}"
        if self._armed() and self.fault == "nondeterministic":
            text += f" noise {random.SystemRandom().random()}"
        return text

    def _step(self, action: str):
        if self._armed() and self._steps == self.at_step:
            f = self.fault
            if f == "crash":
                os._exit(17)
            if f == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
                time.sleep(10)
            if f == "hang":
                time.sleep(self.hang_s)
            if f == "raise":
                raise RuntimeError(f"injected fault at step {self._steps} (seed {self.seed})")
            if f in ("memory_bomb", "cpu_bomb"):
                _bomb(f, self.hang_s)
        for ch in action:
            self.checksum = (self.checksum * 31 + ord(ch)) % 1_000_003
        reward = ((self.seed * 7 + self.checksum) % 10) / 10
        done = self._steps >= self.horizon
        info: dict[str, object] = {"checksum": self.checksum}
        if self._armed() and self._steps == self.at_step:
            if self.fault == "nan_reward":
                reward = float("nan")
            if self.fault == "unpicklable":
                info["lock"] = threading.Lock()
            if self.fault == "unloadable":
                info["object"] = Unloadable()
        return self._obs(), reward, done, info

    def step(self, action: str):
        result = super().step(action)
        if self._armed() and self.fault == "garbage" and self._steps == self.at_step:
            return result[:3]
        return result

    def state_key(self):
        return ("faulty", self.seed, self._steps, self.checksum)

    def expert_action(self) -> str:
        return f"move {self._steps}"


class NullEnv(TextEnv):
    """Returns the same short observation at every step and never ends by itself."""

    system_prompt = "Testing env that does nothing."
    action_format = "Any text."

    def __init__(self, max_steps: int = 1_000_000):
        super().__init__(max_steps=max_steps)

    def _reset(self, seed: int):
        return "ok", {}

    def _step(self, action: str):
        return "ok", 0.0, False, {}

    def state_key(self):
        return ("null",)


class BusyEnv(TextEnv):
    """Each step hashes the action ``work`` times (SHA-256 chain) and reports the digest.

    ``work=400`` is about 0.1 ms of one core on the 2-core development machine.
    """

    system_prompt = "Testing env that burns a fixed amount of CPU per step."
    action_format = "Any text."

    def __init__(self, work: int = 1000, max_steps: int = 1_000_000):
        if not isinstance(work, int) or work < 0:
            raise ValueError(f"work must be an int >= 0, got {work!r}")
        super().__init__(max_steps=max_steps)
        self.work = work
        self.digest = b""

    def _reset(self, seed: int):
        self.digest = hashlib.sha256(str(seed).encode()).digest()
        return f"start {self.digest.hex()[:16]}", {}

    def _step(self, action: str):
        d = hashlib.sha256(self.digest + action.encode()).digest()
        for _ in range(self.work):
            d = hashlib.sha256(d).digest()
        self.digest = d
        return f"digest {d.hex()[:16]}", 0.0, False, {}

    def state_key(self):
        return ("busy", self.digest)


#: the faults `ChaosEnv` injects, with their default weights
CHAOS_KINDS = {"crash": 3, "raise": 3, "garbage": 2, "memory_bomb": 2, "hang": 1, "cpu_bomb": 1}
#: the pool's failure kind each injected fault must be reported as
CHAOS_REPORTED_AS = {
    "crash": failures.CRASHED,
    "raise": failures.RAISED,
    "garbage": failures.INVALID_RESULT,
    "memory_bomb": failures.MEMORY_LIMIT,
    "hang": failures.TIMEOUT,
    "cpu_bomb": failures.CPU_LIMIT,
}


def chaos_fault(seed: int, checksum: int, step: int, rate: float, kinds: dict[str, float]) -> str | None:
    """The fault `ChaosEnv` injects at 1-based `step` of an episode whose checksum is
    `checksum` before that step's action (None = none): a pure function of the seed and
    the actions so far, so replays and fault-free reference runs agree."""
    if rate <= 0:
        return None
    rng = random.Random(f"chaos:{seed}:{checksum}:{step}")
    if rng.random() >= rate:
        return None
    names = sorted(kinds)
    return rng.choices(names, weights=[kinds[k] for k in names])[0]


class ChaosEnv(FaultyEnv):
    """`FaultyEnv`'s counting game with faults injected at random (`chaos_fault`): at each
    step, with probability `fault_rate`, one of `kinds` (default `CHAOS_KINDS`) fires. With
    `fault_rate=0` its episodes are exactly `FaultyEnv`'s. For the fault soak: run it in a
    pool with a memory limit (`memory_bomb` allocates 64 GiB), a CPU limit and a step
    timeout below `hang_s`."""

    def __init__(self, fault_rate: float = 0.1, kinds: dict | None = None, horizon: int = 8, hang_s: float = 30.0):
        super().__init__(fault=None, horizon=horizon, hang_s=hang_s)
        kinds = dict(CHAOS_KINDS if kinds is None else kinds)
        unknown = sorted(set(kinds) - set(CHAOS_KINDS))
        if unknown:
            raise ValueError(f"kinds: unknown faults {unknown}; known: {sorted(CHAOS_KINDS)}")
        if not 0 <= fault_rate <= 1:
            raise ValueError(f"fault_rate must be in [0, 1], got {fault_rate!r}")
        self.fault_rate, self.kinds = float(fault_rate), kinds
        self._pending: str | None = None

    def step(self, action: str):
        self._pending = chaos_fault(self.seed, self.checksum, self._steps + 1, self.fault_rate, self.kinds)
        if self._pending == "garbage":
            return super().step(action)[:3]
        return super().step(action)

    def _step(self, action: str):
        kind, self._pending = self._pending, None
        if kind == "crash":
            os._exit(17)
        if kind == "raise":
            raise RuntimeError(f"chaos: injected exception at step {self._steps} (seed {self.seed})")
        if kind == "hang":
            time.sleep(self.hang_s)
        if kind in ("memory_bomb", "cpu_bomb"):
            _bomb(kind, self.hang_s)
        return super()._step(action)


class UnevenEnv(TextEnv):
    """W9's env (``"testing/uneven"``): `prompt_words` / `obs_words` random words per observation; the episode
    lasts `randint(min_turns, max_turns)` steps (from its seed); step `t` first sleeps a
    log-normal latency seeded by (seed, t)."""

    system_prompt = "w1 w2"
    action_format = "Any words."

    def __init__(
        self,
        prompt_words: int = 54,
        obs_words: int = 10,
        min_turns: int = 2,
        max_turns: int = 8,
        median_ms: float = 20.0,
        sigma: float = 1.0,
        cap_s: float = 1.0,
        vocab_words: int = 4090,
    ):
        super().__init__(max_steps=max_turns + 1)
        self.prompt_words, self.obs_words = prompt_words, obs_words
        self.min_turns, self.max_turns = min_turns, max_turns
        self.median_s, self.sigma, self.cap_s = median_ms / 1e3, sigma, cap_s
        self.vocab_words = vocab_words
        self.seed, self.length, self.waited_s = 0, 0, 0.0

    def _words(self, n: int, t: int) -> str:
        rng = random.Random(f"obs-{self.seed}-{t}")
        return " ".join(f"w{rng.randrange(self.vocab_words)}" for _ in range(n))

    def latency(self, t: int) -> float:
        """Seconds step `t` (1-based) waits in episode `self.seed`."""
        rng = random.Random(f"latency-{self.seed}-{t}")
        return min(self.cap_s, self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))

    def _reset(self, seed: int):
        self.seed = seed
        self.length = random.Random(f"length-{seed}").randint(self.min_turns, self.max_turns)
        return self._words(self.prompt_words, 0), {}

    def _step(self, action: str):
        wait = self.latency(self._steps)
        time.sleep(wait)
        self.waited_s += wait
        return self._words(self.obs_words, self._steps), 0.0, self._steps >= self.length, {"latency_s": wait}

    def state_key(self):
        return (self.seed, self._steps)
