"""The jitted update: exact micro-batch accumulation, clipping, AdamW, the skip rule, and
the steps built from them (the plain `train_step` and `sft_step`, and `make_update_step`,
the update step of a run: jitted with explicit shardings on its mesh).

One update on a mini-batch of `B` rows (`B = M * b`, `M = num_micro_batches`), with the
losses of `jaxagent.train.update.losses` and the denominators `N`, `S`, `T'` of the whole
mini-batch: every aggregation is a sum over rows divided by a constant, so

    L(mini-batch) = sum_k L(micro-batch k),   grad L(mini-batch) = sum_k grad L(micro-batch k)

exactly (up to float32 summation order): gradient accumulation over the `M`
micro-batches of a `lax.scan` *is* the full mini-batch gradient, whatever the
aggregation mode and however ragged the masks.

Then, with `g` the accumulated gradient of the trainable parameters (the LoRA adapters
only when the parameters carry adapters):

    ||g|| = sqrt(sum g^2);   g <- g * min(1, c / ||g||)          (global-norm clipping, c = max_grad_norm)
    params <- AdamW(g; lr(step), b1, b2, eps, weight_decay)        (optax)

If the loss or `||g||` (policy or critic) is not finite, or the mini-batch has no
valid token at all, or (RL, without KL, entropy or critic terms) every valid token's
advantage is 0 (zero gradient: AdamW would still move the params along its momentum),
nothing is applied: params, optimizer states and `step` are
returned unchanged (bitwise) and `skipped` counts up; the metrics say `skipped = 1`
(and `num_tokens = 0` for an empty batch).

`train_step` and `sft_step` are jitted once (`config` is static, the state donated):
call them with a fixed batch shape and they never recompile. Shardings are those of
the arguments; `make_update_step` pins them (the state's layout in and out, the batch's
rows over ("data", "fsdp")) on a mesh, of one device or several. Metrics come back as device scalars: the loop
dispatches step N before reading step N-1's metrics, so the device never waits on logging.

Optimizer changes that keep the state's shapes (learning rate, schedule, betas, clipping)
may differ between runs of one checkpoint; the LoRA set-up and the presence of a critic
may not (`jaxagent.train.rundir.checkpoint` checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxagent import algos
from jaxagent.models import combine_lora, has_lora, split_lora
from jaxagent.models import decoder as _decoder
from jaxagent.parallel.mesh import LOGICAL_AXIS_RULES, activation_constraint, batch_sharding
from jaxagent.train.config.step import OptimizerConfig, StepConfig
from jaxagent.train.update.batch import (
    Denominators,
    SFTBatch,
    UpdateBatch,
    batch_denominators,
    check_batch,
    required_fields,
)
from jaxagent.train.update.losses import LossSums, policy_loss_and_grads, sft_loss_and_grads
from jaxagent.train.update.state import (
    Grads,
    TrainState,
    learning_rate_schedule,
    make_optimizer,
    split_trainable,
    state_shardings,
)


# ----------------------------------------------------------------------------- accumulation
def zero_accumulator(loss_and_grads, state, micro_batch, config: StepConfig, denominators: Denominators):
    """float32 zeros shaped as `loss_and_grads`'s `(grads, sums)` on `micro_batch`."""
    shapes = jax.eval_shape(lambda b: loss_and_grads(state, b, config, denominators), micro_batch)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)


def accumulate(loss_and_grads, state, batch, config: StepConfig, denominators: Denominators):
    """Sum of the micro-batch gradients and sums (a `lax.scan` over micro-batches)."""
    M = config.num_micro_batches
    micro = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    zeros = zero_accumulator(loss_and_grads, state, jax.tree.map(lambda x: x[0], micro), config, denominators)

    def body(acc, mb):
        out = loss_and_grads(state, mb, config, denominators)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, out), None

    (grads, sums), _ = jax.lax.scan(body, zeros, micro)
    return grads, sums


def has_signal(state: TrainState, batch: UpdateBatch, config: StepConfig) -> jax.Array:
    """Whether the RL mini-batch has anything to learn from: False when the policy
    gradient is its only loss term (no KL, entropy or critic) and every valid token's
    advantage is 0 (the gradient is 0, but AdamW would still move the params)."""
    if config.loss.kl_coef == 0 and config.loss.entropy_coef == 0 and not state.has_critic:
        return jnp.any((batch.advantages != 0) & (batch.loss_mask != 0))
    return jnp.asarray(True)


# ----------------------------------------------------------------------------- apply
def _clip(grads, norm, max_norm):
    """optax.clip_by_global_norm's rule: scale by `max_norm / norm` when `norm > max_norm`."""
    if max_norm is None:
        return grads
    scale = jnp.where(norm < max_norm, 1.0, max_norm / jnp.where(norm > 0, norm, 1.0))
    return jax.tree.map(lambda g: g * scale, grads)


def _update(params, opt_state, grads, optim: OptimizerConfig):
    """One clipped AdamW update of the trainable leaves; frozen leaves are passed through."""
    norm = optax.tree.norm(grads)
    grads = _clip(grads, norm, optim.max_grad_norm)
    trainable, rebuild = split_trainable(params)
    if has_lora(params):  # lora_optimizer wants full-structure gradients (zeros on frozen leaves)
        full = combine_lora(grads, jax.tree.map(jnp.zeros_like, split_lora(params)[1]))
    else:
        full = grads
    full = jax.tree.map(lambda g, p: g.astype(p.dtype), full, params)
    updates, new_opt = make_optimizer(optim, params).update(full, opt_state, params)
    upd_trainable, _ = split_trainable(updates)
    new_params = rebuild(optax.apply_updates(trainable, upd_trainable))
    return new_params, new_opt, norm


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _loss_metrics(sums: LossSums, num_tokens) -> dict:
    """The reported loss metrics, group by group: the losses as they are (and the
    objective as `loss`), the token sums as means per valid token, and from the critic's
    sums the mean return and the explained variance `1 - Var(R - V) / Var(R)` over the
    valid tokens (biased variances)."""

    def per_token(s):
        return algos.masked.safe_div(s, num_tokens)

    metrics = {**sums.losses, "loss": sums.loss}
    metrics.update({k: per_token(v) for k, v in sums.token_sums.items()})
    if sums.value_stats is not None:
        v = sums.value_stats
        var_ret = per_token(v["return_sq"]) - jnp.square(per_token(v["return"]))
        var_err = per_token(v["value_err_sq"]) - jnp.square(per_token(v["value_err"]))
        metrics["explained_variance"] = 1.0 - algos.masked.safe_div(var_err, var_ret)
        metrics["return_mean"] = per_token(v["return"])
    return metrics


def apply_gradients(
    state: TrainState, grads: Grads, sums: LossSums, config: StepConfig, denominators: Denominators, has_signal=True
) -> tuple[TrainState, dict]:
    """Optimizer updates, the skip rule and the metrics: `(new_state, metrics)`."""
    # an empty mini-batch (no policy token), or one without signal (`has_signal`), has
    # nothing to learn from: AdamW would still move the params by momentum and weight
    # decay, so it is skipped as well as a non-finite one
    ok = jnp.isfinite(sums.loss) & (denominators.num_tokens > 0) & has_signal
    new_params, new_opt, g_norm = _update(state.params, state.opt_state, grads.policy, config.optim)
    ok &= jnp.isfinite(g_norm)
    optimizer_metrics = {"grad_norm": g_norm, "lr": learning_rate_schedule(config.optim)(state.step)}
    new_cp, new_copt = state.critic_params, state.critic_opt_state
    if grads.critic is not None:
        new_cp, new_copt, c_norm = _update(
            state.critic_params, state.critic_opt_state, grads.critic, config.critic_optimizer
        )
        ok &= jnp.isfinite(c_norm) & jnp.isfinite(sums.losses["value_loss"])
        optimizer_metrics["critic_grad_norm"] = c_norm
        optimizer_metrics["critic_lr"] = learning_rate_schedule(config.critic_optimizer)(state.step)
    new_state = state.replace(
        params=_select(ok, new_params, state.params),
        opt_state=_select(ok, new_opt, state.opt_state),
        critic_params=_select(ok, new_cp, state.critic_params),
        critic_opt_state=_select(ok, new_copt, state.critic_opt_state),
        step=jnp.where(ok, state.step + 1, state.step),
        skipped=jnp.where(ok, state.skipped, state.skipped + 1),
    )
    metrics = {
        **_loss_metrics(sums, denominators.num_tokens),
        **optimizer_metrics,
        "num_tokens": denominators.num_tokens,
        "skipped": jnp.where(ok, 0.0, 1.0),
    }
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return new_state, {**metrics, "step": new_state.step}


# ----------------------------------------------------------------------------- jitted steps
def _train_step(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[TrainState, dict]:
    check_batch(batch, required_fields(config, state.has_critic), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    grads, sums = accumulate(policy_loss_and_grads, state, batch, config, denominators)
    return apply_gradients(state, grads, sums, config, denominators, has_signal(state, batch, config))


def _sft_step(state: TrainState, batch: SFTBatch, config: StepConfig) -> tuple[TrainState, dict]:
    check_batch(batch, (), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask)
    grads, sums = accumulate(sft_loss_and_grads, state, batch, config, denominators)
    return apply_gradients(state, grads, sums, config, denominators)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def train_step(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[TrainState, dict]:
    """One RL update on a mini-batch: micro-batch gradient accumulation, clipping, AdamW
    (policy, and critic when the state has one), non-finite skip.

    Returns `(new_state, metrics)`; metrics are float32 scalars: `loss` (policy), `pg_loss`,
    `kl_loss`, `entropy_loss` (when on), token means `entropy`, `clipfrac`,
    `clipfrac_lower`, `approx_kl`, `kl`, `tis_weight`; `grad_norm` (before clipping), `lr`,
    `num_tokens`, `skipped`, `step` (int32, after the update); with a critic `value_loss`,
    `vf_clipfrac`, `value`, `return_mean`, `explained_variance`, `critic_grad_norm`,
    `critic_lr`. `state` is donated: do not use it after the call.

    Output shardings are the compiler's choice; for a sharded state use
    `make_update_step`, which pins them to the input layout.
    """
    return _train_step(state, batch, config)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def sft_step(state: TrainState, batch: SFTBatch, config: StepConfig) -> tuple[TrainState, dict]:
    """One supervised update (masked token cross-entropy on demonstrations) with the same
    accumulation, clipping, optimizer and skip rule as `train_step`. The critic, if any,
    is left untouched. Metrics: `loss` = `sft_loss`, `entropy`, `grad_norm`, `lr`,
    `num_tokens`, `skipped`, `step`."""
    return _sft_step(state, batch, config)


def accumulated_grads(state: TrainState, batch: UpdateBatch, config: StepConfig) -> tuple[Grads, LossSums]:
    """The accumulated mini-batch gradients `train_step` applies (before clipping), and
    the summed loss parts: for tests and diagnostics (not jitted; wrap it if needed)."""
    check_batch(batch, required_fields(config, state.has_critic), config.num_micro_batches)
    denominators = batch_denominators(batch.loss_mask, config.loss.seq_len_norm, batch.kl_mask)
    return accumulate(policy_loss_and_grads, state, batch, config, denominators)


# ----------------------------------------------------------------------------- the update step
#: the unjitted steps, by `make_update_step`'s `kind`
_STEPS = {"rl": _train_step, "sft": _sft_step}


def on_mesh(fn, mesh: jax.sharding.Mesh, rules=LOGICAL_AXIS_RULES):
    """`fn` traced with the decoder's activations laid out on `mesh` by `rules` (the
    residual stream's rows over ("data", "fsdp"):
    `jaxagent.models.decoder.activation_constraint`), under `fn`'s name and signature (the
    compilation logs and `jax.jit`'s argument names see `fn`). On a mesh of one device
    the constraints compile to nothing: the program is the unconstrained one."""
    layout = activation_constraint(mesh, rules)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with _decoder.activation_constraint(layout):
            return fn(*args, **kwargs)

    return traced


def make_update_step(config: StepConfig, state: TrainState, mesh: jax.sharding.Mesh, *, kind: str = "rl", rules=None):
    """The update step `step(state, batch) -> (state, metrics)` on whole (padded)
    mini-batches: `train_step` (`kind` "rl") or `sft_step` ("sft") jitted once with
    explicit shardings (nanodo's shape): the state in and out with the layout it has now
    on `mesh` (so it keeps its layout and the step never recompiles; donated), the
    batch's rows split over ("data", "fsdp") (`place_batch`, `shard_batch`), metrics
    replicated, the activations laid out by `rules` (`on_mesh`). Every leaf of `state`
    must be on `mesh` (`shard_train_state(state, mesh, rules)`: checked, a leaf laid out
    otherwise is named). One device is a mesh of one device (`jaxagent.train.placement`),
    compiled to `train_step`'s own program; `train_step` and `sft_step` stay the plain
    functions for a state that is on no mesh. Steps of one `kind`, `config`, mesh,
    `rules` and state layout are one jitted function (a resumed or warm-started state
    placed alike compiles nothing new)."""
    if kind not in _STEPS:
        raise ValueError(f"make_update_step: kind must be 'rl' or 'sft', got {kind!r}")
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        have = getattr(x, "sharding", None)
        if not (isinstance(have, jax.NamedSharding) and have.mesh == mesh):
            raise ValueError(
                f"make_update_step: state leaf {jax.tree_util.keystr(path)} is laid out as {have}, not on "
                f"the step's mesh of {mesh.devices.size} devices {dict(mesh.shape)} (the state's leaves live "
                "on different device sets or meshes); place the whole state with shard_train_state(state, mesh) "
                "first (step, skipped, rng and optimizer counters too)"
            )
    leaves, treedef = jax.tree.flatten(state_shardings(state))
    rules = LOGICAL_AXIS_RULES if rules is None else tuple(rules)
    return _jitted_step(kind, config, mesh, rules, treedef, tuple(leaves))


@functools.lru_cache(maxsize=32)
def _jitted_step(kind, config, mesh, rules, treedef, leaves):
    """`make_update_step`'s jitted function, one per step and layout."""
    shardings = jax.tree.unflatten(treedef, leaves)
    fn = functools.partial(on_mesh(_STEPS[kind], mesh, rules), config=config)
    return jax.jit(
        fn,
        in_shardings=(shardings, batch_sharding(mesh, rules)),
        out_shardings=(shardings, jax.NamedSharding(mesh, jax.P())),
        donate_argnames=("state",),
    )


# ----------------------------------------------------------------------------- the padded strategy
class PaddedUpdate:
    """The update strategy of a run that does not cut its chunks (`update.trim_chunks`
    off): every mini-batch whole at its padded length, and the log-prob pass over the
    whole batch, `logprob_rows` rows a pass. An update strategy is chosen once, by the
    run's builder (`jaxagent.train.build.make_placement`), and `Placement` runs it; it has
    three parts (`jaxagent.train.update.trimmed.TrimmedUpdate` is the other one):

        step(config, state, mesh, kind=)  the update step `step(state, batch) -> (state, metrics)`
        input(place, batch)               what that step takes for a host mini-batch
        logprobs(place, params, placed, with_entropy)   the log-prob pass over a batch
                                          from `Placement.global_batch`, host-side
    """

    #: the update step (`make_update_step` itself)
    step = staticmethod(make_update_step)

    def input(self, place, batch):
        """The mini-batch placed for the step (`Placement.to_device`: rows split on a mesh)."""
        return place.to_device(batch)

    def logprobs(self, place, params, placed, *, with_entropy: bool = False):
        """`log pi(tokens)` `[B, T]` of every row in one pass of `place.logprob_chunks`
        row chunks (`Placement.row_logprobs`); `(logp, entropy)` with `with_entropy`."""
        out = place.row_logprobs(
            params,
            placed.tokens,
            placed.attention_mask,
            placed.segment_ids,
            row_chunks=place.logprob_chunks,
            with_entropy=with_entropy,
        )
        return place.gathered(out)
