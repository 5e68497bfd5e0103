"""A custom env trained from the command line (README, "Your own environment"; docs/guides/environments.md).

    jaxagent train --config configs/tiny_countdown_grpo.yaml env.imports=[examples.guess_env] \
        env.name=guess env.kwargs={high: 8}

Importing this module registers "guess": find a number in 1..high with higher/lower hints.
"""

import random
import re

import envs


class Guess(envs.TextEnv):
    action_format = "Answer with <guess>N</guess>."
    system_prompt = "Guess my number; after each guess I say higher or lower. " + action_format

    def __init__(self, high: int = 8, max_steps: int = 4):
        super().__init__(max_steps=max_steps)
        self.high, self.secret, self.tried = high, 0, ()

    def state_key(self):  # what GiGPO's step groups compare
        return ("guess", self.secret, self.tried)

    def _reset(self, seed):
        self.secret, self.tried = random.Random(seed).randint(1, self.high), ()
        return f"A number from 1 to {self.high}.", {}

    def _step(self, action):
        m = re.search(r"<guess>(\d+)</guess>", action)
        if m is None:
            raise envs.InvalidAction("answer with <guess>N</guess>")
        n = int(m.group(1))
        self.tried += (n,)
        if n == self.secret:
            return "Right!", 1.0, True, {"success": True}
        return ("higher" if n < self.secret else "lower"), 0.0, False, {}


envs.register("guess", Guess)
