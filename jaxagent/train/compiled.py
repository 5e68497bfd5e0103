"""Every program a run compiles, compiled at the run's shapes without running it, and
its memory as XLA assigns it (`Compiled.memory_analysis()`) beside the memory check's
estimate of it (`jaxagent.train.memory.check_memory`).

    passes = compiled_passes(trainer)      # a built `Trainer`: nothing is run or trained
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
                        decode-scatter of half its rows (`rollout.slots` or `agent.program`
                        only), against `decode`
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

    def __init__(self, log):
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
    then `config`'s, from `jaxagent.train.memory.check_memory`)."""
    from jaxagent.rollout.sampler import _stop_seq_array, _stop_token_array, bucket
    from jaxagent.train.batch import ModelInputs, SFTBatch, UpdateBatch
    from jaxagent.train.build import check_memory
    from jaxagent.train.placement import _critic_values, policy_logprobs
    from jaxagent.train.state import init_train_state
    from jaxagent.train.trainer import store_entropy_passes
    from jaxagent.train.update import make_update_step, sft_step, train_step

    place, est, cfg = trainer.placement, trainer.memory_estimate, trainer.config
    if config is not None:
        _check_same_run(cfg, config)
        cfg, est = config, check_memory(config, place, log)
    sc, T = cfg.step_config, cfg.rollout.max_context
    compile_ = _Compiler(log)
    out: list[CompiledPass] = []

    # ---- the sampler (rollout and evaluation)
    loop = trainer.agent_loop()
    sampler, lc = loop.sampler, loop.config
    B = len(place.rows)
    rows = cfg.rollout.sampler_rows(B)
    state = jax.eval_shape(lambda: sampler.init_state(rows))
    tokens = sampler._put_rows(np.zeros((rows, bucket(T, lc.min_bucket)), np.int32))
    out.append(
        compile_(
            "rollout_append", "prefill", est["prefill"], sampler._append.lower(sampler.params, state, tokens, tokens)
        )
    )
    stop_tokens = list(loop.chat.stop_token_ids)
    seqs = loop.stop_sequences or None
    samplings = {"rollout_decode": lc.sampling}
    if cfg.eval.episodes:  # evaluation pads its episodes to the rollout's batch: the same shapes
        temp = cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature
        for name, t in (("eval_decode", temp), ("eval_decode_greedy", 0.0 if cfg.eval.greedy else None)):
            ev = None if t is None else dataclasses.replace(lc.sampling, temperature=float(t))
            if ev is not None and ev not in samplings.values():
                samplings[name] = ev
    for name, sampling in samplings.items():
        args = [
            sampler._put_rows(x)
            for x in (
                np.ones((rows,), bool),
                np.full((rows,), lc.max_tokens_per_turn, np.int32),
                _stop_token_array(stop_tokens, rows),
                _stop_seq_array(None if seqs is None else [seqs] * rows, rows),
            )
        ]
        out.append(
            compile_(
                name,
                "decode",
                est["decode"],
                sampler._decode.lower(sampler.params, state, *args, sampling, lc.max_tokens_per_turn),
            )
        )
    if (lc.slots or cfg.agent.program) and rows > 1:  # calls of fewer rows than the sampler's (continuous, gateway)
        R = 1 << ((rows - 1).bit_length() - 1)  # the largest gather below every slot (`decode_rows`)
        idx = np.zeros((R,), np.int32)
        cut = np.zeros((R, bucket(T, lc.min_bucket)), np.int32)
        args = [
            sampler._put_rows(x)
            for x in (
                cut,
                cut,
                np.ones((R,), bool),
                np.full((R,), lc.max_tokens_per_turn, np.int32),
                _stop_token_array(stop_tokens, R),
                _stop_seq_array(None if seqs is None else [seqs] * R, R),
            )
        ]
        out.append(
            compile_(
                "rollout_decode_rows",
                "decode+prefill",
                est["decode"] + est["prefill"],
                sampler._decode_rows.lower(
                    sampler.params, state, jnp.asarray(idx), *args, lc.sampling, lc.max_tokens_per_turn
                ),
            )
        )

    # ---- the passes before the update
    Bg = cfg.env.batch_size
    ids = np.zeros((Bg, T), np.int32)
    kw = dict(
        temperature=sc.loss.temperature,
        seq_chunk=sc.seq_chunk,
        vocab_chunk=sc.vocab_chunk,
        compute_dtype=sc.compute_dtype,
    )
    params = trainer.state.params
    # an agent program's rows may pack several sequences of a session (`Trajectory.segment_ids`)
    segs = ids if cfg.agent.program else None
    if place.mesh is None:
        lowered = policy_logprobs.lower(
            params,
            trainer.model_config,
            tokens_BxT=ids,
            attention_mask_BxT=ids,
            segment_ids_BxT=segs,
            row_chunks=place.logprob_chunks,
            **kw,
        )
    else:
        placed = place.to_device(ModelInputs(tokens=ids, attention_mask=ids, segment_ids=segs))
        lowered = place._logprobs[False].lower(
            params, placed.tokens, placed.attention_mask, placed.segment_ids, row_chunks=place.logprob_chunks
        )
    if cfg.update.old_logprobs != "sampler" or trainer.ref_params is not None:
        out.append(compile_("logprob_pass", "logprob_pass", est["logprob_pass"], lowered))
    if cfg.algo.uses_critic:
        probe = ModelInputs(tokens=ids, attention_mask=ids, segment_ids=segs)
        if place.mesh is None:
            lowered = _critic_values.lower(
                trainer.state.critic_params,
                trainer.state.critic_config,
                probe,
                compute_dtype=sc.compute_dtype,
                row_chunks=place.logprob_chunks,
            )
        else:
            lowered = place._values.lower(trainer.state.critic_params, place.to_device(probe))
        out.append(compile_("value_pass", "logprob_pass", est["logprob_pass"], lowered))
    if cfg.logging.episodes_per_iteration:
        if place.mesh is None:
            passes, chunk = store_entropy_passes(cfg)
            sel = np.zeros((passes * chunk, T), np.int32)
            lowered = policy_logprobs.lower(
                params,
                trainer.model_config,
                tokens_BxT=sel,
                attention_mask_BxT=sel,
                segment_ids_BxT=None if segs is None else sel,
                row_chunks=passes,
                with_entropy=True,
                **kw,
            )
        else:
            lowered = place._logprobs[True].lower(
                params, placed.tokens, placed.attention_mask, placed.segment_ids, row_chunks=place.logprob_chunks
            )
        out.append(compile_("store_entropy", "logprob_pass", est["logprob_pass"], lowered))

    # ---- the update
    mb = Bg // cfg.update.mini_batches
    f = np.zeros((mb, T), np.float32)
    i = np.zeros((mb, T), np.int32)
    batch = UpdateBatch(
        tokens=i,
        loss_mask=f,
        advantages=f,
        old_logp=f,
        attention_mask=i,
        segment_ids=i if cfg.agent.program else None,
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
    out.append(compile_("update", "activations+grads", est["activations"] + est["grads"], lowered))

    # ---- the warm start's SFT step
    if cfg.warm_start.enabled:  # the estimate has "warm_start" exactly then
        from jaxagent.train.warmstart import sft_rows_at_most, sft_step_config

        wsc = sft_step_config(cfg)
        sft_state = jax.eval_shape(lambda: init_train_state(jax.random.key(0), params, trainer.model_config, wsc))
        rows_ws = sft_rows_at_most(cfg)
        b = SFTBatch(
            tokens=np.zeros((rows_ws, T), np.int32),
            loss_mask=np.zeros((rows_ws, T), np.float32),
            attention_mask=np.zeros((rows_ws, T), np.int32),
            # a program's recorded demonstrations pack a session's sequences in a row
            segment_ids=np.zeros((rows_ws, T), np.int32) if cfg.agent.program else None,
        )
        if place.mesh is None:
            lowered = sft_step.lower(sft_state, b, config=wsc)
        else:
            lowered = make_update_step(wsc, trainer.state, place.mesh, kind="sft").lower(sft_state, place.to_device(b))
        # its estimate also holds the SFT optimizer state (an argument here, not scratch)
        opt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sft_state.opt_state))
        out.append(compile_("warm_start", "warm_start-opt_state", est["warm_start"] - opt, lowered))
    return out


def _check_same_run(built, config) -> None:
    """`config` may differ from the trainer's only in its warm start."""
    if dataclasses.replace(config, warm_start=built.warm_start) != built:
        raise ValueError("compiled_passes: config may differ from the trainer's config only in warm_start")
