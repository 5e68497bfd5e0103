"""Builders of a run's parts from its `TrainerConfig`: the rollout source (`rollout_source`:
the env or an agent program, chosen once), tokenizer, policy, critic, KL reference, the
placement and its update strategy (`make_placement`: the update step and the log-prob
pass, padded or trimmed, chosen once), the RL state, the episode loop, and `build_run`,
which does all of it in the order a run needs (before anything is compiled, the memory
check).

Keys: `jax.random.key(config.seed)` splits into (model, critic, rng): the from-scratch
policy's initialisation, the critic's fresh value head and `TrainState.rng`; the warm
start folds in 1 for its own keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxagent import parallel as par
from jaxagent.dataclass_yaml import ConfigError
from jaxagent.train.config import TrainerConfig
from jaxagent.train.config.model import ModelSection
from jaxagent.train.placement import Placement
from jaxagent.train.sources import RolloutSource
from jaxagent.train.update.state import TrainState, init_train_state


def build_tokenizer(section: ModelSection):
    """The tokenizer the model section names (see `ModelSection.tokenizer`; "bpe" is
    trained by `run_tokenizer`)."""
    name = section.tokenizer
    if name is None:
        name = "byte" if section.path is None else section.path
    if name == "byte":
        from jaxagent.models.byte_tokenizer import byte_chat_tokenizer

        return byte_chat_tokenizer()
    from jaxagent.models import load_tokenizer

    return load_tokenizer(name)


def rollout_source(config: TrainerConfig) -> RolloutSource:
    """The run's `RolloutSource`, chosen here, once: the user's agent program through the
    gateway (`agent.program` set: `ProgramSource`), else the env's agent loop (`EnvSource`).
    Nothing else in the trainer asks which it is."""
    if config.agent.program is not None:
        from jaxagent.train.sources.program import ProgramSource

        return ProgramSource(config)
    from jaxagent.train.sources.env import EnvSource

    return EnvSource(config)


def run_tokenizer(config: TrainerConfig, source: RolloutSource, run_dir: Path, *, resume: bool, log=print):
    """`build_tokenizer`, or for "bpe" the tokenizer trained on the source's text
    (`RolloutSource.tokenizer_texts`: a fresh run) or saved in `<run_dir>/tokenizer`
    (resume). A tokenizer the run makes itself (`model.path` null) gets the source's chat
    template when it has one (an agent program's: ChatML with tools)."""
    if config.model.tokenizer != "bpe":
        tok = build_tokenizer(config.model)
        if source.chat_template is not None and config.model.path is None:
            tok.chat_template = source.chat_template
        return tok
    from jaxagent.models.tokenizer_training import train_bpe_tokenizer

    saved = Path(run_dir) / "tokenizer"
    if resume:
        if not saved.is_dir():
            raise FileNotFoundError(f"--resume: the run's trained tokenizer {saved} is missing")
        from jaxagent.models import load_tokenizer

        return load_tokenizer(saved)
    m = config.model
    tok = train_bpe_tokenizer(source.tokenizer_texts(log), m.tokenizer_vocab_size, pieces=m.tokenizer_pieces)
    if source.chat_template is not None:
        tok.chat_template = source.chat_template
    return tok


def scratch_config(section: ModelSection, tokenizer):
    """The `DecoderConfig` of a from-scratch policy (`section.path` is None)."""
    from jaxagent import models

    return models.DecoderConfig(
        vocab_size=len(tokenizer),
        hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size,
        num_layers=section.num_layers,
        num_heads=section.num_heads,
        num_kv_heads=section.num_kv_heads,
        head_dim=section.head_dim,
        qkv_bias=section.qkv_bias,
        tie_word_embeddings=section.tie_word_embeddings,
        model_type=section.model_type,
        lora=section.lora,
        attention=section.attention,
    )


def build_policy(section: ModelSection, tokenizer, key: jax.Array):
    """`(params, model_config)`: loaded from `section.path`, else initialised from `key`."""
    from jaxagent import models

    k_init, k_lora = jax.random.split(key)
    if section.path is not None:
        model = models.load_pretrained(section.path, dtype=section.dtype)
        if model.config.vocab_size < len(tokenizer):
            raise ConfigError(
                f"model.tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {model.config.vocab_size}"
            )
        params, config = model.params, model.config
    else:
        config = scratch_config(section, tokenizer).replace(lora=None)
        params = models.init_params(k_init if section.lora else key, config, dtype=section.dtype, std=section.init_std)
    if section.lora is not None:  # float32 adapters on any base dtype: the trained weights stay exact
        params, config = models.add_lora(k_lora, params, config, section.lora, adapter_dtype="float32")
    return params, config.replace(attention=section.attention)


def needs_reference(config: TrainerConfig) -> bool:
    """The run keeps a frozen KL reference (KL as a loss term or as a reward penalty)."""
    return config.loss.kl_coef > 0 or config.algo.kl_reward_coef > 0


def reference_copy(params):
    """What the trainer keeps of `params` as its KL reference: a copy (the state's are
    donated to the update); with LoRA, of the adapters only (`split_lora`: the frozen
    leaves are None), since the base weights never change and are the state's own."""
    from jaxagent.models import has_lora, split_lora

    return jax.tree.map(jnp.copy, split_lora(params)[0] if has_lora(params) else params)


def full_reference(ref, state_params):
    """The reference's full params: `ref` itself, or (LoRA) its adapters over the frozen
    base weights of the current state (no second copy of them)."""
    from jaxagent.models import combine_lora, has_lora, split_lora

    return combine_lora(ref, split_lora(state_params)[1]) if has_lora(state_params) else ref


def make_placement(config: TrainerConfig, model_config) -> Placement:
    """The run's `Placement`, given the update strategy chosen here, once: whole padded
    mini-batches and log-prob passes (`PaddedUpdate`), or with `update.trim_chunks`
    micro-batches and log-prob chunks cut to their rows' length (`TrimmedUpdate`; on a
    mesh a micro-batch's rows must split over data * fsdp)."""
    from jaxagent.train.update import PaddedUpdate
    from jaxagent.train.update.trimmed import TrimmedUpdate

    up = config.update
    if not up.trim_chunks:
        return Placement(config, model_config, update=PaddedUpdate())
    placement = Placement(
        config,
        model_config,
        update=TrimmedUpdate(
            up.trim_padding, logprob_rows=up.logprob_rows, micro_batches=up.mini_batches * up.micro_batches
        ),
    )
    micro = up.micro_batch_rows(config.env.batch_size)
    if placement.mesh is not None and micro % placement.row_shards:
        raise ConfigError(
            f"update.trim_chunks on a mesh: each micro-batch's {micro} rows (env.group_size * "
            f"env.tasks_per_iteration / update.mini_batches / update.micro_batches) are split over "
            f"mesh.data * mesh.fsdp = {placement.row_shards} and must be divisible by it"
        )
    return placement


def check_memory(config: TrainerConfig, placement: Placement, log) -> dict:
    """`jaxagent.train.memory.check_memory` for the run `placement` places (its meshes,
    this process's rows, whether the sampler shares the state's params)."""
    from jaxagent.train import memory

    return memory.check_memory(
        config,
        placement.model_config,
        placement.mesh,
        placement.sampler_mesh,
        rows=len(placement.rows),
        sampler_shares_params=placement.sampler_params_shared,
        log=log,
    )


def reference_params(config: TrainerConfig, params, placement: Placement):
    """The KL reference (`reference_copy`), placed, or None when the run needs none."""
    if not needs_reference(config):
        return None
    return placement.place_params(reference_copy(params))


def rl_state(
    config: TrainerConfig, params, model_config, placement: Placement, *, critic_key: jax.Array, rng_key: jax.Array
) -> TrainState:
    """A fresh, placed RL `TrainState` over `params`, with the critic (the policy's trunk
    and a fresh value head from `critic_key`) when the estimator consumes values."""
    critic_params = critic_config = None
    if config.algo.uses_critic:
        from jaxagent.models import value_params_from_policy

        critic_params = value_params_from_policy(critic_key, params, model_config)
        critic_config = model_config
    state = init_train_state(
        rng_key, params, model_config, config.step_config, critic_params=critic_params, critic_config=critic_config
    )
    return placement.place_state(state)


def sandbox_notice(isolation: str | None) -> str | None:
    """The line a run logs at start when its env's code sandbox runs with less than
    bubblewrap's isolation (accepted deliberately, `env.kwargs.isolation`), else None."""
    if isolation in (None, "bwrap"):
        return None
    from envs.sandbox import WEAKER

    return (
        f"code sandbox: isolation {isolation!r} accepted by env.kwargs.isolation, not bubblewrap: "
        f"{WEAKER.get(isolation, 'weaker than bubblewrap')}"
    )


def episode_loop(source: RolloutSource, tokenizer, model_config, placement: Placement, state: TrainState):
    """The run's `EpisodeLoop` (`source.loop`) over the sampler's copy of the policy, on the
    mesh when `placement` samples there, with the `reward` section's judge."""
    loop = source.loop(
        placement.sampler_params(state),
        model_config,
        tokenizer,
        rows=len(placement.rows),
        mesh=placement.mesh if placement.sampler_on_mesh else None,
    )
    loop.reward_fn = judge_reward(source.config)
    return loop


def judge_reward(config: TrainerConfig):
    """The `reward` section's judge as the loop's `reward_fn` (None: the env's reward);
    a judge that cannot be built (a missing key variable, a bad spec) is a ConfigError."""
    if config.reward.judge is None:
        return None
    from jaxagent.rewards import JudgeReward

    try:
        return JudgeReward.from_config(config.reward)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"reward.judge: {e}") from None


@dataclasses.dataclass
class Run:
    """What `build_run` builds: the parts a training (or evaluation) run is made of."""

    tokenizer: Any
    model_config: Any
    placement: Placement
    state: TrainState
    ref_params: Any  # None = no KL reference
    demonstrations: list | None  # the warm start's (fresh runs with a warm start), warm_start.extra's last
    keys: dict[str, jax.Array]  # "critic", "rng": for the RL state after a warm start
    memory_estimate: dict
    source: RolloutSource  # where the run's episodes come from
    sandbox_isolation: str | None = None  # the env's code sandbox ("bwrap", ...; None: it runs no code)


def compilation_cache(config: TrainerConfig) -> str | None:
    """Turns on JAX's persistent compilation cache in `config.jit_cache_dir` (created if
    missing) and returns its directory; None when the key is null. One already chosen
    (`$JAX_COMPILATION_CACHE_DIR`, or `jax_compilation_cache_dir` set by this process)
    is kept and returned."""
    import os

    if config.jit_cache_dir is None:
        return None
    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
    if chosen:
        return chosen
    if config.jit_cache_dir == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "jaxagent" / "jit"
    else:
        path = Path(config.jit_cache_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"jit_cache_dir: cannot create {path} ({err.strerror}); choose another directory or set jit_cache_dir: null"
        ) from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def matmul_precision(config: TrainerConfig) -> str | None:
    """Sets JAX's default matmul precision for the run (`model.matmul_precision`, resolved
    for `jaxagent.code_platform()`) and returns it; None: JAX's default is left alone."""
    from jaxagent import code_platform

    precision = config.model.resolved_matmul_precision(code_platform())
    if precision is not None:
        jax.config.update("jax_default_matmul_precision", precision)
    return precision


def precision_warning(config: TrainerConfig) -> str | None:
    """The warning a run on a GPU or TPU (`jaxagent.code_platform()`) logs at start when it
    computes in float32 without the config saying so: `model.dtype` float32 with
    `model.compute_dtype` unset and `model.matmul_precision` left on "auto". None on the
    CPU, and where the config chose (bfloat16 weights, a compute dtype, a precision)."""
    from jaxagent import code_platform

    m = config.model
    platform = code_platform()
    if platform == "cpu" or m.dtype != "float32" or m.compute_dtype is not None or m.matmul_precision != "auto":
        return None
    return (
        f"warning: this {platform} run computes in float32 because the config leaves it so (model.dtype "
        "float32, model.compute_dtype unset, model.matmul_precision auto): its matmuls run at 'highest' "
        "precision to match the CPU's results (true float32 on a GPU, several bfloat16 passes on a TPU, "
        "not the tensor cores' bfloat16 rate), and its activations and the sampler's KV cache take twice "
        "the memory and bandwidth of bfloat16. For the accelerator defaults set model.compute_dtype: "
        "bfloat16 (float32 master weights and optimizer state; the passes and the KV cache in bfloat16; "
        "configs/gpu_countdown_grpo.yaml); to keep float32, say so with model.matmul_precision: highest "
        "(the CPU's results) or default (the accelerator's faster float32 matmuls), or model.compute_dtype: "
        "float32"
    )


def build_run(config: TrainerConfig, *, resume: bool = False, log=print) -> Run:
    """Chooses the rollout source (`rollout_source`) and checks it, connects the processes
    (`config.distributed`), plays the warm start's demonstrations (fresh runs), builds the
    tokenizer, checks the memory estimate before anything is built or compiled, then
    builds the policy, the KL reference and the placed RL state."""
    if resume:  # before anything is created: a run dir without checkpoints is named as such
        from jaxagent.train.rundir import require_checkpoints

        require_checkpoints(config.run_dir)
    source = rollout_source(config)
    isolation = source.check()
    compilation_cache(config)  # before anything is compiled
    dist = config.distributed
    par.initialize(dist.coordinator_address, dist.num_processes, dist.process_id, auto=True if dist.auto else None)
    # after initialize: reading the backend (code_platform) starts it, which
    # jax.distributed.initialize refuses to follow
    precision = matmul_precision(config)
    if not par.is_primary():
        log = _silent
    notice = sandbox_notice(isolation)
    if notice:
        log(notice)
    if precision is not None:
        log(f"float32 matmuls at precision {precision!r} (model.matmul_precision: {config.model.matmul_precision})")
    implicit_float32 = precision_warning(config)
    if implicit_float32:
        log(implicit_float32)
    demos = None
    warm = config.warm_start.enabled and not resume
    if warm and not source.demonstrations_need_tokenizer:  # played first: a "bpe" tokenizer reads them
        demos = source.demonstrations(None, log)
    tokenizer = run_tokenizer(config, source, Path(config.run_dir), resume=resume, log=log)
    if warm and source.demonstrations_need_tokenizer:  # recorded in the run's own tokens
        demos = source.demonstrations(tokenizer, log)
    k_model, k_critic, k_rng = jax.random.split(jax.random.key(config.seed), 3)
    if config.model.path is None:  # the architecture is known: check before building anything
        placement = make_placement(config, scratch_config(config.model, tokenizer))
        estimate = check_memory(config, placement, log)
        params, model_config = build_policy(config.model, tokenizer, k_model)
    else:
        params, model_config = build_policy(config.model, tokenizer, k_model)
        placement = make_placement(config, model_config)
        estimate = check_memory(config, placement, log)
    ref = reference_params(config, params, placement)
    state = rl_state(config, params, model_config, placement, critic_key=k_critic, rng_key=k_rng)
    return Run(
        tokenizer=tokenizer,
        model_config=model_config,
        placement=placement,
        state=state,
        ref_params=ref,
        demonstrations=demos,
        keys={"critic": k_critic, "rng": k_rng},
        memory_estimate=estimate,
        source=source,
        sandbox_isolation=isolation,
    )


def _silent(*_, **__) -> None:
    return None


def check_trackers(config) -> None:
    """`ConfigError` naming the extra to install when a tracker's package is missing
    (training only: evaluating or exporting a run needs no tracker)."""
    if config.logging.trackers:
        from jaxagent.train.rundir.trackers import check_available

        try:
            check_available(config.logging.trackers)
        except ValueError as err:
            raise ConfigError(f"logging.trackers: {err}") from None


def trackers(config, run_dir) -> list:
    """The run's experiment trackers besides TensorBoard (`logging.trackers`), each
    given the flattened training config."""
    lc = config.logging
    if not lc.trackers:
        return []
    import warnings

    from jaxagent.dataclass_yaml import flatten, to_dict
    from jaxagent.train.rundir.trackers import make_trackers

    options = {
        "wandb": {"project": lc.wandb_project, "mode": lc.wandb_mode},
        "mlflow": {"tracking_uri": lc.mlflow_tracking_uri, "experiment": lc.mlflow_experiment},
    }

    def skip(name, err):  # logging never stops training
        warnings.warn(
            f"logging.trackers: {name} could not start ({type(err).__name__}: {err}); training continues without it",
            RuntimeWarning,
            stacklevel=2,
        )

    return make_trackers(lc.trackers, run_dir, config=flatten(to_dict(config)), options=options, on_error=skip)
