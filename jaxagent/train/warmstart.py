"""Warm start: expert demonstrations, the text a tokenizer is trained on, and SFT batches.

`collect_demonstrations(name, kwargs, seeds, noise=..., max_turns=..., expert=...)` plays
one episode per seed in this process with the env's expert (`Env.expert_action(**expert)`:
an env may offer other demonstrators, e.g. intake's imperfect clinician). With
`noise > 0` the expert is deliberately imperfect: at each turn, with probability
`noise`, its action is replaced by one drawn uniformly from `Env.random_actions`
(the env's action vocabulary, which may include the expert's own choice). The noise is
drawn from `random.Random(f"{seed}/noise/{noise_seed}")`, so a demonstration set is a
pure function of its arguments.

`demonstration_tokens(chat, demo)` lays a demonstration out exactly as
`jaxagent.rollout.AgentLoop` lays out an episode the policy played (prompt segment,
each action's tokens followed by the template's end-of-turn token, each observation
segment; `ChatFormat` renders every segment): SFT trains on the token sequences RL
will sample, with the loss on the action tokens (and their end-of-turn token) only.

`demonstration_texts(demos)` is the corpus a run's own tokenizer is trained on
(`jaxagent.models.tokenizer_training.train_bpe_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxagent.rollout.episode import episode_success


@dataclasses.dataclass
class Demonstration:
    """One expert episode: the system prompt, observations `obs_0..obs_n` and the actions
    between them (`len(observations) == len(actions) + 1`), rewards per action."""

    seed: int
    system_prompt: str | None
    observations: list[Any]
    actions: list[str]
    rewards: list[float]
    done: bool
    success: bool
    noisy_actions: int
    #: a conclusion demonstration: SFT trains only on its final action (see `demonstration_tokens`)
    final_only: bool = False
    #: a conclusion demonstration's final action: its first tokens not taught
    skip_final: int = 0
    #: an agent program's demonstration, recorded through the gateway: its token sequence and
    #: loss mask as they are (`demonstration_tokens` lays out no chat; observations unused)
    tokens: list[int] | None = None
    loss_mask: list[int] | None = None
    #: with `tokens`: the sequence (1, 2, ...) of each token when the row packs several (a
    #: program that rewrote its history), each attending only within itself (`SFTBatch.segment_ids`)
    segment_ids: list[int] | None = None

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))


def random_actions(env) -> tuple[str, ...]:
    """The env's action vocabulary for the noisy expert (`Env.random_actions`)."""
    acts = getattr(env, "random_actions", None)
    if not acts:
        raise ValueError(
            f"{type(env).__name__} has no random_actions: a noisy expert needs the env's "
            f"action vocabulary (set expert noise to 0, or give the env random_actions)"
        )
    return tuple(acts)


def collect_demonstrations(
    name: str,
    kwargs: dict,
    seeds: Sequence[int],
    *,
    noise: float = 0.0,
    max_turns: int,
    noise_seed: int = 0,
    expert: dict | None = None,
    final_only: bool = False,
    skip_final: int = 0,
) -> list[Demonstration]:
    """One (possibly noisy) expert episode per seed, played in this process; `expert`:
    keyword arguments of the env's `expert_action` (e.g. intake's `{"style": "weak"}`);
    `final_only`: conclusion demonstrations (SFT trains on their final action only, less
    its first `skip_final` tokens)."""
    import envs

    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"expert noise must be in [0, 1], got {noise!r}")
    out = []
    env = envs.make(name, **kwargs)
    try:
        if not getattr(env, "has_expert", False):
            raise ValueError(f"env {name!r} has no expert (has_expert is False): it cannot give demonstrations")
        choices = random_actions(env) if noise > 0 else ()
        for seed in seeds:
            rng = random.Random(f"{seed}/noise/{noise_seed}")
            obs, info = env.reset(seed=int(seed))
            demo = Demonstration(
                seed=int(seed),
                system_prompt=info.get("system_prompt", env.system_prompt),
                observations=[obs],
                actions=[],
                rewards=[],
                done=False,
                success=False,
                noisy_actions=0,
                final_only=bool(final_only),
                skip_final=int(skip_final),
            )
            last_info: dict = {}
            for _ in range(max_turns):
                try:
                    action = env.expert_action(**(expert or {}))
                except TypeError as e:  # an option the env's expert_action does not take
                    raise ValueError(
                        f"warm_start.expert {expert!r} does not fit env {name!r}'s expert_action: {e}"
                    ) from None
                if noise > 0 and rng.random() < noise:
                    action = rng.choice(choices)
                    demo.noisy_actions += 1
                obs, reward, terminated, truncated, last_info = env.step(action)
                demo.actions.append(action)
                demo.rewards.append(float(reward))
                demo.observations.append(obs)
                if terminated or truncated:
                    demo.done = bool(terminated)
                    break
            demo.success = episode_success(demo.done, demo.rewards, last_info)
            out.append(demo)
    finally:
        env.close()
    return out


def expert_player(config):
    """`play(seeds, *, expert=None, final_only=False, skip_final=0)`: the demonstrations
    of the run's env (`config.env`) played by its expert, `expert=None` meaning the warm
    start's own options (`warm_start.expert`); what a `warm_start.extra` source collects
    with."""

    def play(seeds, *, expert=None, final_only=False, skip_final=0):
        return collect_demonstrations(
            config.env.name,
            config.env.kwargs,
            seeds,
            max_turns=config.rollout.max_turns,
            expert=config.warm_start.expert if expert is None else expert,
            final_only=final_only,
            skip_final=skip_final,
        )

    return play


def warm_start_demonstrations(config, log=print) -> list[Demonstration]:
    """The warm start's demonstrations: `warm_start.episodes` expert episodes (with its
    noise), then those of its `extra` source."""
    ws = config.warm_start
    demos = collect_demonstrations(
        config.env.name,
        config.env.kwargs,
        range(ws.seed, ws.seed + ws.episodes),
        noise=ws.expert_noise,
        max_turns=config.rollout.max_turns,
        expert=ws.expert,
    )
    if ws.source is not None:
        extra = list(ws.source.collect(expert_player(config), log))
        bad = next((d for d in extra if not isinstance(d, Demonstration)), None)
        if bad is not None:
            raise TypeError(f"warm_start.extra: its collect() gave {type(bad).__name__}, not a Demonstration")
        demos += extra
    return demos


def demonstration_tokens(chat, demo: Demonstration, max_context: int) -> tuple[list[int], list[int]]:
    """`(tokens, loss_mask)` of a demonstration as the agent loop would have laid it out
    (see the module docstring); cut at `max_context` tokens (the cut turn is dropped). A
    conclusion demonstration (`demo.final_only`) has the loss on its final action (and its
    end-of-turn token) only, less the action's first `demo.skip_final` tokens, and none at
    all when that action was cut."""
    if demo.tokens is not None:  # recorded through the gateway: the sequence as the program made it
        mask = list(demo.loss_mask or [])
        if len(mask) != len(demo.tokens):
            raise ValueError(f"a recorded demonstration has {len(demo.tokens)} tokens but {len(mask)} mask entries")
        if demo.segment_ids is not None and len(demo.segment_ids) != len(demo.tokens):
            raise ValueError(
                f"a recorded demonstration has {len(demo.tokens)} tokens but {len(demo.segment_ids)} segment ids"
            )
        return list(demo.tokens[:max_context]), mask[:max_context]
    eot = chat.stop_token_ids[0] if chat.stop_token_ids else None
    tokens = chat.prompt_tokens(demo.system_prompt, demo.observations[0])
    mask = [0] * len(tokens)
    if len(tokens) >= max_context:
        raise ValueError(
            f"a demonstration's first prompt has {len(tokens)} tokens, more than max_context {max_context}"
        )
    for k, action in enumerate(demo.actions):
        act = chat.encode(action) + ([eot] if eot is not None else [])
        seg = []
        last = k + 1 == len(demo.actions)
        if not last:
            seg = chat.observation_tokens(demo.observations[k + 1], after_end_of_turn=eot is not None)
        if len(tokens) + len(act) > max_context:
            break
        tokens += act
        # how many of the action's last tokens are taught (the end-of-turn token always is)
        taught = len(act) if not demo.final_only else max(1, len(act) - demo.skip_final) if last else 0
        mask += [0] * (len(act) - taught) + [1] * taught
        if last or len(tokens) + len(seg) >= max_context:
            break
        tokens += seg
        mask += [0] * len(seg)
    return tokens, mask


def pack_rows(rows: Sequence[tuple[list[int], list[int]]], length: int, pad_id: int):
    """`(tokens, loss_mask, attention_mask)` int32/float32/int32 arrays `[N, length]`."""
    n = len(rows)
    tokens = np.full((n, length), pad_id, np.int32)
    loss = np.zeros((n, length), np.float32)
    attn = np.zeros((n, length), np.int32)
    for i, (t, m) in enumerate(rows):
        if len(t) > length:
            raise ValueError(f"row {i} has {len(t)} tokens, more than the padded length {length}")
        tokens[i, : len(t)], loss[i, : len(t)], attn[i, : len(t)] = t, m, 1
    return tokens, loss, attn


def demonstration_texts(demos: Sequence[Demonstration], prompt_per_episode: bool = False) -> list[str]:
    """The texts of demonstrations (system prompts once, observations, actions) and the
    chat roles: a tokenizer's training corpus. `prompt_per_episode`: a system prompt as
    often as the episodes show it (with merges across words, a fixed prompt becomes a
    few tokens)."""
    if prompt_per_episode:
        texts = ["tool"] + [d.system_prompt for d in demos if d.system_prompt]
    else:
        texts = ["tool"] + sorted({d.system_prompt for d in demos if d.system_prompt})
    for d in demos:  # the chat roles as often as the template writes them
        texts += ["system"] + ["user", "assistant"] * max(1, len(d.actions))
        texts += [o for o in d.observations if isinstance(o, str)]
        texts += list(d.actions)
    return texts


#: rows sorted by length together (`warm_start.length_buckets`): this many batches
BUCKET_CHUNK = 8
#: a length-bucketed batch's padded length is a multiple of this (few jit shapes)
BUCKET_MULTIPLE = 64


def length_bucketed(batches: Sequence[np.ndarray], lengths: np.ndarray, key) -> list[np.ndarray]:
    """`batches` (row indices of one epoch, in a random order) regrouped so that a batch
    holds rows of similar length: every `BUCKET_CHUNK` consecutive batches are pooled,
    sorted by length and cut again into batches of the same sizes; then the batches are
    shuffled with `key`. Every row stays in the epoch exactly once."""
    import jax

    out = []
    for c in range(0, len(batches), BUCKET_CHUNK):
        chunk = list(batches[c : c + BUCKET_CHUNK])
        pooled = np.concatenate(chunk)
        pooled = pooled[np.argsort(lengths[pooled], kind="stable")]
        at = 0
        for b in chunk:
            out.append(pooled[at : at + len(b)])
            at += len(b)
    order = np.asarray(jax.random.permutation(key, len(out)))
    return [out[i] for i in order]


def padded_length(longest: int, cap: int) -> int:
    """A bucketed batch's length: `longest` rounded up to `BUCKET_MULTIPLE`, at most `cap`."""
    return min(cap, -(-longest // BUCKET_MULTIPLE) * BUCKET_MULTIPLE)


def sft_rows_at_most(config) -> int:
    """The most rows an SFT step of the warm start takes: `warm_start.batch_size`, or all
    of its demonstrations when there are fewer (the memory check's and its compile's)."""
    ws = config.warm_start
    return min(ws.batch_size, ws.rows)


def sft_step_config(config):
    """The warm start's `StepConfig`: the run's, with its own optimizer (`warm_start.optim`),
    no micro-batches and the loss at temperature 1."""
    from jaxagent.train.config.step import LossConfig

    return dataclasses.replace(
        config.step_config, loss=LossConfig(temperature=1.0), optim=config.warm_start.optim, num_micro_batches=1
    )


def sft_warm_start(
    config, params, model_config, tokenizer, demonstrations: Sequence[Demonstration], placement, log=print
):
    """Supervised fine-tuning of `params` on `demonstrations` (the `warm_start` section of
    the `TrainerConfig` `config`), with its own optimizer; updates placed by `placement`.

    Returns `(params, lines, summary)`: the SFT weights, the progress lines (about ten,
    for `<run_dir>/warm_start.jsonl`) and the summary (`summary.json`'s "warm_start")."""
    import time

    import jax

    from jaxagent.train.update.state import init_train_state

    ws = config.warm_start
    t_start = time.perf_counter()
    data = _sft_rows(config, tokenizer, demonstrations)
    n = len(data.lengths)
    bs = min(ws.batch_size, n)
    per_epoch = n // bs
    sc = sft_step_config(config)
    k_sft, k_shuffle = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), 1))
    placement.check_batch_rows(bs, "warm_start.batch_size")
    state = placement.place_state(init_train_state(k_sft, params, model_config, sc))
    update = placement.update_step(sc, state, kind="sft")
    acting = [d.success for d in demonstrations if not d.final_only]
    success = float(np.mean(acting)) if acting else None  # None: conclusion demonstrations only
    log(_sft_plan_line(ws, data, success, bs, per_epoch))
    state, lines = _sft_steps(
        ws, data, placement, update, state, k_shuffle, bs=bs, per_epoch=per_epoch, t_start=t_start, log=log
    )
    summary = {
        "demonstrations": n - data.n_final,
        "conclusion_demonstrations": data.n_final,
        "conclusions_dropped": data.cut,
        "demonstration_success": success,
        "steps": per_epoch * ws.epochs,
        "final_loss": lines[-1]["loss"] if lines else None,
        "seconds": time.perf_counter() - t_start,
    }
    return state.params, lines, summary


@dataclasses.dataclass
class _SFTRows:
    """The warm start's demonstrations as padded rows (`pack_rows`), `length` columns."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    attention_mask: np.ndarray
    segments: np.ndarray | None  # packed rows' sequences (recorded programs' demonstrations)
    lengths: np.ndarray  # each row's tokens
    length: int
    n_final: int  # conclusion demonstrations among the rows
    cut: int  # conclusion demonstrations dropped: their final action is past max_context

    def batch(self, idx, cols: int):
        from jaxagent.train.update.batch import SFTBatch

        return SFTBatch(
            tokens=self.tokens[idx, :cols],
            loss_mask=self.loss_mask[idx, :cols],
            attention_mask=self.attention_mask[idx, :cols],
            segment_ids=None if self.segments is None else self.segments[idx, :cols],
        )


def _sft_rows(config, tokenizer, demonstrations: Sequence[Demonstration]) -> _SFTRows:
    """The demonstrations SFT trains on (`warm_start.only_successful`; not a conclusion
    whose final action is past `rollout.max_context`), laid out and padded to a multiple
    of 16 tokens."""
    from jaxagent.rollout.chat import ChatFormat

    demos = list(demonstrations)
    if config.warm_start.only_successful:
        demos = [d for d in demos if d.success or d.final_only]
        if not any(not d.final_only for d in demos):
            raise RuntimeError("warm_start.only_successful: none of the demonstrations succeeded")
    chat = ChatFormat(tokenizer)
    rows = [demonstration_tokens(chat, d, config.rollout.max_context) for d in demos]
    # a conclusion demonstration whose final action is past max_context teaches nothing
    kept = [(d, r) for d, r in zip(demos, rows, strict=True) if any(r[1]) or not d.final_only]
    cut = len(rows) - len(kept)
    rows = [r for _, r in kept]
    if not rows:
        raise ValueError(f"warm start: no demonstration fits rollout.max_context {config.rollout.max_context}")
    lengths = np.array([len(t) for t, _ in rows])
    length = -(-int(lengths.max()) // 16) * 16
    pad = tokenizer.pad_token_id
    tokens, loss_mask, attn = pack_rows(rows, length, 0 if pad is None else int(pad))
    segments = None
    if any(d.segment_ids is not None for d, _ in kept):
        segments = np.zeros(tokens.shape, np.int32)
        for i, (d, (t, _)) in enumerate(kept):
            segments[i, : len(t)] = (d.segment_ids or [1] * len(t))[: len(t)]
    n_final = sum(d.final_only for d, _ in kept)
    return _SFTRows(tokens, loss_mask, attn, segments, lengths, length, n_final, cut)


def _sft_plan_line(ws, data: _SFTRows, success: float | None, bs: int, per_epoch: int) -> str:
    """The log line before the warm start's steps: its demonstrations and its steps."""
    n, length = len(data.lengths), data.length
    columns = f"up to {length} (length buckets, mean {data.lengths.mean():.0f})" if ws.length_buckets else f"{length}"
    also = (
        f" + {data.n_final} conclusion demonstrations (loss on the final action only"
        + (f"; {data.cut} dropped: their final action is past rollout.max_context" if data.cut else "")
        + ")"
        if data.n_final or data.cut
        else ""
    )
    return (
        f"warm start: {n - data.n_final} demonstrations (expert noise {ws.expert_noise}, demonstration success "
        f"{'n/a' if success is None else f'{success:.2f}'}){also}, {ws.epochs} epochs x {per_epoch} steps of "
        f"{bs} rows x {columns} tokens"
    )


def _sft_steps(ws, data: _SFTRows, placement, update, state, key, *, bs, per_epoch, t_start, log):
    """`ws.epochs` epochs of `per_epoch` SFT steps of `bs` rows (shuffled with `key`, length
    bucketed with `warm_start.length_buckets`): the final state and the progress lines
    (about ten, each the mean over the steps since the previous one)."""
    import time

    import jax

    n, total = len(data.lengths), per_epoch * ws.epochs
    lines, window = [], []
    every = max(1, total // 10)
    for epoch, k in enumerate(jax.random.split(key, ws.epochs)):
        perm = np.asarray(jax.random.permutation(k, n))
        batches = [perm[j * bs : (j + 1) * bs] for j in range(per_epoch)]
        if ws.length_buckets:
            batches = length_bucketed(batches, data.lengths, jax.random.fold_in(k, 1))
        for j, idx in enumerate(batches):
            cols = padded_length(int(data.lengths[idx].max()), data.length) if ws.length_buckets else data.length
            state, m = update(state, placement.to_device(data.batch(idx, cols)))
            window.append(m)
            step = epoch * per_epoch + j + 1
            if step % every == 0 or step == total:
                got = placement.fetch(window)
                line = {
                    "sft_step": step,
                    "epoch": epoch + 1,
                    "loss": float(np.mean([g["loss"] for g in got])),
                    "entropy": float(np.mean([g["entropy"] for g in got])),
                    "skipped": int(sum(float(g["skipped"]) for g in got)),
                    "time_s": time.perf_counter() - t_start,
                }
                lines.append(line)
                window = []
                log(
                    f"warm start: step {step}/{total} | loss {line['loss']:.4f} | "
                    f"entropy {line['entropy']:.4f} | {line['time_s']:.0f}s"
                )
    return state, lines
