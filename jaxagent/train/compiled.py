"""Every program a run compiles, compiled at the run's shapes without running it, and
its memory as XLA assigns it (`Compiled.memory_analysis()`) beside the memory check's
estimate of it (`jaxagent.train.memory.check_memory`).

    # a built `Trainer`: nothing is run or trained; the flags say what the run's source does
    passes = compiled_passes(trainer)
    for p in passes:
        print(p.line())

The programs, each at the largest shape a run gives it:

    rollout_append      the sampler's append of a prompt or observation (its rows: a
                        pipeline group's, or `rollout.slots`), against `prefill`
    rollout_decode      the sampler's decode of a turn, at `rollout.sampling`; and
                        `eval_decode` at the evaluation's sampling when that differs
                        (evaluation pads its episodes to the rollout's batch, so its
                        shapes are the rollout's), against `decode`
    rollout_decode_rows the continuous scheduler's (or the gateway engine's) gather-append-
                        decode-scatter of half its rows (`rollout.slots`, or a source whose
                        sampler calls take fewer rows: `partial_rounds`), against `decode`
    logprob_pass        the old policy's log-probs over the batch (`logprob_rows` rows a
                        pass); the KL reference's pass is the same program
    value_pass          the critic's values (a critic only), against `logprob_pass`
    store_entropy       the episode store's entropy pass (`logging.episodes_per_iteration`),
                        against `logprob_pass`
    update              one RL update on a mini-batch, against `activations + grads`
    warm_start          one SFT step of the warm start (when enabled), against
                        `warm_start`

`temp_bytes` is the program's scratch memory; its arguments (params, optimizer state,
KV cache) are the estimate's resident components. `update.trim_chunks` runs the update
and the log-prob pass on micro-batches cut shorter than `max_context`: the programs here
are the uncut ones, the largest the run can compile. Identical programs (the same
lowered text) compile once. `tests/test_train_compiled.py` holds every shipped config's
programs within 1.5x of the estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CompiledPass", "compiled_passes", "format_passes"]


@dataclasses.dataclass(frozen=True)
class CompiledPass:
    """One compiled program's memory (bytes, per device) and the estimate's figure for it."""

    name: str
    component: str  # the memory estimate's key(s) it is compared against, "+"-joined
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    estimate_bytes: int
    compile_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Compiled scratch memory over the estimate (above 1: the estimate is low)."""
        return self.temp_bytes / max(self.estimate_bytes, 1)

    @property
    def peak_bytes(self) -> int:
        """Arguments, outputs not written over an argument, and scratch: the program's own
        memory while it runs."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def line(self) -> str:
        return (
            f"{self.name:<20} compiled {_gib(self.temp_bytes):>10}  estimate ({self.component}) "
            f"{_gib(self.estimate_bytes):>10}  ratio {self.ratio:5.2f}  arguments {_gib(self.argument_bytes)}"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def format_passes(passes) -> str:
    return "\n".join(p.line() for p in passes)


class _Compiler:
    """Compiles lowered programs once per distinct text."""

    def __init__(self, log) -> None:
        self.seen: dict[str, tuple] = {}
        self.log = log

    def __call__(self, name: str, component: str, estimate: int, lowered) -> CompiledPass:
        key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        t0 = time.perf_counter()
        if key not in self.seen:
            m = lowered.compile().memory_analysis()
            self.seen[key] = (
                int(m.temp_size_in_bytes),
                int(m.argument_size_in_bytes),
                int(m.output_size_in_bytes),
                int(m.alias_size_in_bytes),
            )
        temp, arg, out, alias = self.seen[key]
        p = CompiledPass(name, component, temp, arg, out, alias, int(estimate), time.perf_counter() - t0)
        self.log(p.line())
        return p


def compiled_passes(trainer, config=None, *, log=lambda *_: None) -> list[CompiledPass]:
    """The memory of every program `trainer`'s run compiles (module docstring), each
    compiled at the run's shapes and none run. `trainer` is a built `Trainer` (its memory
    check done: `trainer.memory_estimate`). `config`: the run config whose programs to
    compile, if not the trainer's: the same config but for the warm start, so that the
    trainer is built without playing the warm start's demonstrations (its estimate is
    then `config`'s, from `jaxagent.train.memory.check_memory`).

    The run's rollout source (`trainer.source`) says what the passes carry: rows that
    pack several sequences (`packed_sequences`: the passes and the warm start's SFT step
    carry `segment_ids`) and sampler calls on fewer rows than its own (`partial_rounds`,
    as with `rollout.slots`: the row decode `rollout_decode_rows` is compiled too)."""
    from jaxagent.train.build import check_memory

    place, est, cfg = trainer.placement, trainer.memory_estimate, trainer.config
    if config is not None:
        _check_same_run(cfg, config)
        cfg, est = config, check_memory(config, place, log)
    compile_ = _Compiler(log)
    packed_sequences, partial_rounds = trainer.source.packed_sequences, trainer.source.partial_rounds
    out = _sampler_passes(trainer, cfg, est, compile_, partial_rounds=partial_rounds)
    out += _pre_update_passes(trainer, cfg, est, compile_, packed_sequences=packed_sequences)
    out.append(_update_pass(trainer, cfg, est, compile_, packed_sequences=packed_sequences))
    if cfg.warm_start.enabled:  # the estimate has "warm_start" exactly then
        out.append(_warm_start_pass(trainer, cfg, est, compile_, packed_sequences=packed_sequences))
    return out


# ---- the sampler (rollout and evaluation)
def _sampler_passes(trainer, cfg, est, compile_, *, partial_rounds: bool) -> list[CompiledPass]:
    """The sampler's append, its decode at each sampling the run decodes at, and its row
    decode when it is called on fewer rows than its own (continuous scheduler, gateway)."""
    from jaxagent.rollout.sampler import bucket

    loop = trainer.episode_loop()
    sampler, lc = loop.sampler, loop.config
    rows = cfg.rollout.sampler_rows(len(trainer.placement.rows))
    state = jax.eval_shape(lambda: sampler.init_state(rows))
    tokens = sampler._put_rows(np.zeros((rows, bucket(cfg.rollout.max_context, lc.min_bucket)), np.int32))
    appended = sampler._append.lower(sampler.params, state, tokens, tokens)
    out = [compile_("rollout_append", "prefill", est["prefill"], appended)]
    for name, sampling in _samplings(cfg, lc).items():
        args = [sampler._put_rows(x) for x in _turn_args(loop, rows)]
        lowered = sampler._decode.lower(sampler.params, state, *args, sampling, lc.max_tokens_per_turn)
        out.append(compile_(name, "decode", est["decode"], lowered))
    if (lc.slots or partial_rounds) and rows > 1:  # calls of fewer rows than the sampler's
        out.append(_decode_rows_pass(loop, cfg, est, compile_, state, rows))
    return out


def _samplings(cfg, lc) -> dict:
    """The decode's samplings by pass name: the rollout's, and evaluation's where they
    differ (evaluation pads its episodes to the rollout's batch: the same shapes)."""
    samplings = {"rollout_decode": lc.sampling}
    if cfg.eval.episodes:
        temp = cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature
        for name, t in (("eval_decode", temp), ("eval_decode_greedy", 0.0 if cfg.eval.greedy else None)):
            ev = None if t is None else dataclasses.replace(lc.sampling, temperature=float(t))
            if ev is not None and ev not in samplings.values():
                samplings[name] = ev
    return samplings


def _turn_args(loop, rows: int) -> tuple:
    """A decode's per-row arguments for `rows` rows (host arrays): which rows decode, their
    token budget, stop tokens and stop sequences."""
    from jaxagent.rollout.sampler import _stop_seq_array, _stop_token_array

    seqs = loop.stop_sequences or None
    return (
        np.ones((rows,), bool),
        np.full((rows,), loop.config.max_tokens_per_turn, np.int32),
        _stop_token_array(list(loop.chat.stop_token_ids), rows),
        _stop_seq_array(None if seqs is None else [seqs] * rows, rows),
    )


def _decode_rows_pass(loop, cfg, est, compile_, state, rows: int) -> CompiledPass:
    """The continuous scheduler's (or the gateway engine's) gather-append-decode-scatter,
    at the largest gather below every slot (`decode_rows`)."""
    from jaxagent.rollout.sampler import bucket

    sampler, lc = loop.sampler, loop.config
    R = 1 << ((rows - 1).bit_length() - 1)
    idx = np.zeros((R,), np.int32)
    cut = np.zeros((R, bucket(cfg.rollout.max_context, lc.min_bucket)), np.int32)
    args = [sampler._put_rows(x) for x in (cut, cut, *_turn_args(loop, R))]
    lowered = sampler._decode_rows.lower(
        sampler.params, state, jnp.asarray(idx), *args, lc.sampling, lc.max_tokens_per_turn
    )
    return compile_("rollout_decode_rows", "decode+prefill", est["decode"] + est["prefill"], lowered)


# ---- the passes before the update
def _pre_update_passes(trainer, cfg, est, compile_, *, packed_sequences: bool) -> list[CompiledPass]:
    """The passes over the batch before the update: the old policy's log-probs (the KL
    reference's pass is the same program), the critic's values, the store's entropy."""
    ids = np.zeros((cfg.env.batch_size, cfg.rollout.max_context), np.int32)
    segs = ids if packed_sequences else None  # rows packing sequences carry their segment ids
    out = []
    if cfg.update.old_logprobs != "sampler" or trainer.ref_params is not None:
        out.append(
            compile_("logprob_pass", "logprob_pass", est["logprob_pass"], _logprobs_lowered(trainer, cfg, ids, segs))
        )
    if cfg.algo.uses_critic:
        out.append(
            compile_("value_pass", "logprob_pass", est["logprob_pass"], _values_lowered(trainer, cfg, ids, segs))
        )
    if cfg.logging.episodes_per_iteration:
        out.append(
            compile_("store_entropy", "logprob_pass", est["logprob_pass"], _entropy_lowered(trainer, cfg, ids, segs))
        )
    return out


def _forward_kw(cfg) -> dict:
    sc = cfg.step_config
    return dict(
        temperature=sc.loss.temperature,
        seq_chunk=sc.seq_chunk,
        vocab_chunk=sc.vocab_chunk,
        compute_dtype=sc.compute_dtype,
    )


def _placed_inputs(place, ids, segs):
    from jaxagent.train.update.batch import ModelInputs

    return place.to_device(ModelInputs(tokens=ids, attention_mask=ids, segment_ids=segs))


def _logprobs_lowered(trainer, cfg, ids, segs):
    """The old policy's log-prob pass over the batch (`logprob_rows` rows a pass)."""
    from jaxagent.train.placement import policy_logprobs

    place = trainer.placement
    if place.mesh is None:
        return policy_logprobs.lower(
            trainer.state.params,
            trainer.model_config,
            tokens_BxT=ids,
            attention_mask_BxT=ids,
            segment_ids_BxT=segs,
            row_chunks=place.logprob_chunks,
            **_forward_kw(cfg),
        )
    placed = _placed_inputs(place, ids, segs)
    return place._logprobs[False].lower(
        trainer.state.params, placed.tokens, placed.attention_mask, placed.segment_ids, row_chunks=place.logprob_chunks
    )


def _values_lowered(trainer, cfg, ids, segs):
    """The critic's values over the batch."""
    from jaxagent.train.placement import _critic_values
    from jaxagent.train.update.batch import ModelInputs

    place, probe = trainer.placement, ModelInputs(tokens=ids, attention_mask=ids, segment_ids=segs)
    if place.mesh is None:
        return _critic_values.lower(
            trainer.state.critic_params,
            trainer.state.critic_config,
            probe,
            compute_dtype=cfg.step_config.compute_dtype,
            row_chunks=place.logprob_chunks,
        )
    return place._values.lower(trainer.state.critic_params, place.to_device(probe))


def _entropy_lowered(trainer, cfg, ids, segs):
    """The episode store's entropy pass (`store_entropy_passes`; on a mesh, the log-prob
    pass's rows)."""
    from jaxagent.train.placement import policy_logprobs
    from jaxagent.train.trainer import store_entropy_passes

    place = trainer.placement
    if place.mesh is None:
        passes, chunk = store_entropy_passes(cfg)
        sel = np.zeros((passes * chunk, cfg.rollout.max_context), np.int32)
        return policy_logprobs.lower(
            trainer.state.params,
            trainer.model_config,
            tokens_BxT=sel,
            attention_mask_BxT=sel,
            segment_ids_BxT=None if segs is None else sel,
            row_chunks=passes,
            with_entropy=True,
            **_forward_kw(cfg),
        )
    placed = _placed_inputs(place, ids, segs)
    return place._logprobs[True].lower(
        trainer.state.params, placed.tokens, placed.attention_mask, placed.segment_ids, row_chunks=place.logprob_chunks
    )


# ---- the update
def _update_pass(trainer, cfg, est, compile_, *, packed_sequences: bool) -> CompiledPass:
    """One RL update on a mini-batch."""
    from jaxagent.train.update import make_update_step, train_step
    from jaxagent.train.update.batch import UpdateBatch

    place, sc = trainer.placement, cfg.step_config
    mb = cfg.env.batch_size // cfg.update.mini_batches
    f = np.zeros((mb, cfg.rollout.max_context), np.float32)
    i = np.zeros((mb, cfg.rollout.max_context), np.int32)
    batch = UpdateBatch(
        tokens=i,
        loss_mask=f,
        advantages=f,
        old_logp=f,
        attention_mask=i,
        segment_ids=i if packed_sequences else None,
        ref_logp=f if cfg.loss.kl_coef > 0 else None,
        kl_mask=f if cfg.loss.kl_turns == "last" else None,
        rollout_logp=f,
        returns=f if cfg.algo.uses_critic else None,
        old_values=f if cfg.algo.uses_critic else None,
    )
    if place.mesh is None:
        lowered = train_step.lower(trainer.state, batch, config=sc)
    else:
        lowered = make_update_step(sc, trainer.state, place.mesh).lower(trainer.state, place.to_device(batch))
    return compile_("update", "activations+grads", est["activations"] + est["grads"], lowered)


# ---- the warm start's SFT step
def _warm_start_pass(trainer, cfg, est, compile_, *, packed_sequences: bool) -> CompiledPass:
    """One SFT step of the warm start, at its most rows."""
    from jaxagent.train.update import make_update_step, sft_step
    from jaxagent.train.update.batch import SFTBatch
    from jaxagent.train.update.state import init_train_state
    from jaxagent.train.warmstart import sft_rows_at_most, sft_step_config

    place, T = trainer.placement, cfg.rollout.max_context
    wsc = sft_step_config(cfg)
    params = trainer.state.params
    sft_state = jax.eval_shape(lambda: init_train_state(jax.random.key(0), params, trainer.model_config, wsc))
    rows = sft_rows_at_most(cfg)
    b = SFTBatch(
        tokens=np.zeros((rows, T), np.int32),
        loss_mask=np.zeros((rows, T), np.float32),
        attention_mask=np.zeros((rows, T), np.int32),
        # recorded demonstrations whose rows pack a session's sequences
        segment_ids=np.zeros((rows, T), np.int32) if packed_sequences else None,
    )
    if place.mesh is None:
        lowered = sft_step.lower(sft_state, b, config=wsc)
    else:
        lowered = make_update_step(wsc, trainer.state, place.mesh, kind="sft").lower(sft_state, place.to_device(b))
    # its estimate also holds the SFT optimizer state (an argument here, not scratch)
    opt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sft_state.opt_state))
    return compile_("warm_start", "warm_start-opt_state", est["warm_start"] - opt, lowered)


def _check_same_run(built, config) -> None:
    """`config` may differ from the trainer's only in its warm start."""
    if dataclasses.replace(config, warm_start=built.warm_start) != built:
        raise ValueError("compiled_passes: config may differ from the trainer's config only in warm_start")
