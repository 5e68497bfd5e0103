"""Agent programs and task sources for the gateway's training tests: written as any
`openai` user writes them (an `AsyncOpenAI` client, chat messages), plus programs that
misbehave in each way an episode can fail."""

import asyncio

LETTERS = "abcdefgh"


def task(seed: int) -> dict:
    """Task `seed`: say a letter."""
    letter = LETTERS[seed % len(LETTERS)]
    return {"question": f"Say the letter {letter}.", "letter": letter, "kind": "chat"}


async def chat_rollout(client, task: dict) -> dict:
    """Two turns of chat; reward: the first reply holds the task's letter."""
    messages = [{"role": "system", "content": "Answer with one letter."}, {"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, temperature=0.7)
    text = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    await client.chat.completions.create(model="policy", messages=messages)
    return {"reward": float(task["letter"] in text), "reply_chars": len(text)}


async def misbehaving_rollout(client, task: dict):
    """By seed: raises after a call, hangs, never calls, returns a string, or plays."""
    kind = task["seed"] % 5 if "seed" in task else 4
    if kind == 0:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("the agent's own bug")
    if kind == 1:
        await asyncio.sleep(3600)
    if kind == 2:
        return 1.0
    if kind == 3:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return "not a number"
    return await chat_rollout(client, task)


def numbered_task(seed: int) -> dict:
    return {**task(seed), "seed": seed}


#: set by a test: `first` (a threading.Semaphore) is released after each session's first
#: call; the second call waits for `go` (a threading.Event)
STAGES: dict = {}


async def staged_two_calls(client, task: dict) -> float:
    """Two calls, the second only once the test says go (after it changed the policy)."""
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    STAGES["first"].release()
    await asyncio.to_thread(STAGES["go"].wait, 60)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


#: filled by `rewriting_rollout`: per task letter, the completion token ids of its calls
#: (the `jaxagent` extension of each response), in call order
COMPLETIONS: dict = {}


async def rewriting_rollout(client, task: dict) -> dict:
    """Three calls; the third starts over with a new conversation (a history rewrite), so
    the session has two sequences: calls 1-2 and call 3."""
    system = {"role": "system", "content": "Answer with one letter."}
    messages = [system, {"role": "user", "content": task["question"]}]
    got = []
    first = await client.chat.completions.create(model="policy", messages=messages)
    got.append(first)
    text = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    got.append(await client.chat.completions.create(model="policy", messages=messages))
    fresh = [system, {"role": "user", "content": "Once more, from the start: " + task["question"]}]
    got.append(await client.chat.completions.create(model="policy", messages=fresh))
    COMPLETIONS.setdefault(task["letter"], []).append([r.model_extra["jaxagent"]["completion_token_ids"] for r in got])
    return {"reward": float(task["letter"] in text)}


async def crashing_rollout(client, task: dict):
    """Seed 0: one call, a line of output, then the process exits at once (`os._exit`);
    otherwise it plays."""
    import os

    if task.get("seed") == 0:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        print("the agent is about to exit the interpreter", flush=True)
        os._exit(3)
    return await chat_rollout(client, task)


async def blocking_rollout(client, task: dict):
    """Seed 0: blocks its event loop (a synchronous sleep, no timeout can fire); otherwise it plays."""
    import time

    if task.get("seed") == 0:
        time.sleep(3600)
    return await chat_rollout(client, task)


def letter_expert(prompt_text: str, *, noise: float, rng) -> str:
    """An expert that always answers the letter b."""
    return "b"
