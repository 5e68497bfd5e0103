"""Orbax checkpoints of a `TrainState` plus JSON extras; export to Hugging Face.

A checkpoint is one step directory `<dir>/<step>/` with three items:

    state/    the TrainState's arrays (params, optimizer state, critic, step, skipped,
              the RNG key as its raw key data)           orbax StandardSave
    extras/   whatever JSON the trainer passes: task/seed stream position, metrics
              history, the config dict ...               orbax JsonSave
    meta/     format version, the model/critic configs, the RNG implementation and
              the path, shape and dtype of every state leaf   (for the compatibility check)

Guarantees (all from orbax's `CheckpointManager`, configured here):

- atomic: a step is written into a temporary directory and renamed to `<step>/` only
  after everything in it is on disk (a commit marker is written first); a process
  killed mid-save leaves at most a temporary directory, which is never listed, never
  restored, and is deleted when the next manager opens the directory.
- asynchronous: `save` returns once the arrays are copied off the device; writing goes
  on in a background thread (the state can be donated to the next step at once).
  `wait_until_finished()` / `close()` block until it is on disk.
- keep-N: only the `max_to_keep` newest steps are kept, and step 0 (the warm-started
  policy before RL), which is never deleted.
- exact: restoring gives bitwise the saved arrays (params, optimizer state, RNG key).
- compatible or a clear error: `restore` compares the checkpoint's configs and leaf
  shapes/dtypes with the template state's and raises `IncompatibleCheckpointError`
  naming every differing config field and leaf before reading any array.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp  # type: ignore[import-untyped]  # orbax ships no py.typed marker

from jaxagent.models import Model, save_pretrained
from jaxagent.train.update.state import TrainState

FORMAT_VERSION = 1
_MAX_LISTED = 12


class IncompatibleCheckpointError(ValueError):
    """The checkpoint's model/optimizer layout differs from the state restored into."""


def _config_dict(config) -> dict | None:
    if config is None:
        return None
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _leaf_layout(tree) -> dict[str, list]:
    """`{path: [shape, dtype]}` of every array leaf."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[jax.tree_util.keystr(path)] = [list(leaf.shape), str(leaf.dtype)]
    return out


def _to_saveable(state: TrainState) -> TrainState:
    """The typed PRNG key replaced by its raw `uint32` key data (what orbax stores)."""
    return state.replace(rng=jax.random.key_data(state.rng))


def _meta(state: TrainState) -> dict:
    return {
        "format": FORMAT_VERSION,
        "model_config": _config_dict(state.model_config),
        "critic_config": _config_dict(state.critic_config),
        "rng_impl": str(jax.random.key_impl(state.rng)),
        "layout": _leaf_layout(_to_saveable(state)),
    }


def _differences(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between two `_meta` dicts."""
    diffs = []
    for name in ("model_config", "critic_config"):
        a, b = saved.get(name), current.get(name)
        if a == b:
            continue
        if a is None or b is None:
            diffs.append(
                f"{name}: checkpoint {'has none' if a is None else 'has one'}, "
                f"this run {'has none' if b is None else 'has one'}"
            )
            continue
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{name}.{key}: checkpoint {a.get(key)!r}, this run {b.get(key)!r}")
    if saved.get("rng_impl") != current.get("rng_impl"):
        diffs.append(f"rng implementation: checkpoint {saved.get('rng_impl')}, this run {current.get('rng_impl')}")
    a, b = saved.get("layout", {}), current.get("layout", {})
    leaf_diffs = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            leaf_diffs.append(f"state{key}: only in the checkpoint {a[key]}")
        elif key not in a:
            leaf_diffs.append(f"state{key}: only in this run {b[key]}")
        elif a[key] != b[key]:
            leaf_diffs.append(f"state{key}: checkpoint shape/dtype {a[key]}, this run {b[key]}")
    if len(leaf_diffs) > _MAX_LISTED:
        leaf_diffs = leaf_diffs[:_MAX_LISTED] + [f"... and {len(leaf_diffs) - _MAX_LISTED} more leaves"]
    return diffs + leaf_diffs


def _abstract(tree):
    def spec(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(spec, tree)


#: orbax keeps every step divisible by `keep_period`: with this one, only step 0 (the
#: policy after the warm start, before RL: `jaxagent eval --step 0`) in practice
KEEP_STEP_ZERO = 10**15


class CheckpointManager:
    """Async, keep-N, atomic checkpoints of a `TrainState` and JSON extras.

        with CheckpointManager(run_dir / "checkpoints", max_to_keep=3) as ckpt:
            ckpt.save(iteration, state, extras={"task_position": 17, "history": [...]})
            ...
            state, extras = ckpt.restore(template_state)          # the latest step

    `template_state` is a state built from the current config (e.g. `init_train_state`);
    only its structure, shapes, dtypes, shardings and static configs are used.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            keep_period=KEEP_STEP_ZERO,  # step 0 (the warm-started policy) is never deleted
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=("state", "extras", "meta"),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "extras": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def reload(self) -> None:
        """Re-reads the step directories (after some were moved away on disk)."""
        self._manager.reload()

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: TrainState, extras: dict[str, Any] | None = None) -> None:
        """Starts saving `state` and `extras` as checkpoint `step` (returns once the
        arrays are off the device; the write finishes in the background).

        extras: JSON-serialisable dict (checked now, so an error names the problem
        before anything is written).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        if not isinstance(state, TrainState):
            raise TypeError(f"save expects a TrainState, got {type(state).__name__}")
        extras = {} if extras is None else extras
        if not isinstance(extras, dict):
            raise TypeError(f"extras must be a dict, got {type(extras).__name__}")
        try:
            json.dumps(extras, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"extras must be JSON-serialisable: {e}") from None
        if step in self._manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_saveable(state)),
                extras=ocp.args.JsonSave(extras),
                meta=ocp.args.JsonSave(_meta(state)),
            ),
            force=True,
        )
        if not saved:
            raise RuntimeError(f"orbax declined to save checkpoint step {step} in {self.directory}")

    def wait_until_finished(self) -> None:
        """Blocks until every started save is committed (or raises its error)."""
        self._manager.wait_until_finished()

    # ------------------------------------------------------------------ restore
    def check_compatible(self, template: TrainState, step: int | None = None) -> int:
        """Raises `IncompatibleCheckpointError` naming every difference between checkpoint
        `step` (default latest) and `template`; returns the step."""
        step = self._resolve(step)
        saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if saved.get("format") != FORMAT_VERSION:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} has format {saved.get('format')!r}, "
                f"this version reads {FORMAT_VERSION}"
            )
        diffs = _differences(saved, _meta(template))
        if diffs:
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} does not fit this run's model/optimizer:\n  "
                + "\n  ".join(diffs)
            )
        return step

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """`(state, extras)` of checkpoint `step` (default: the latest committed one).

        The arrays are restored with the template's shardings; the static configs come
        from the template (they were checked equal to the checkpoint's).
        """
        self.wait_until_finished()
        step = self.check_compatible(template, step)
        target = _abstract(_to_saveable(template))
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), extras=ocp.args.JsonRestore())
        )
        restored: TrainState = out["state"]
        if not isinstance(restored, TrainState):  # orbax may hand back the raw tree
            restored = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored))
        impl = jax.random.key_impl(template.rng)
        restored = restored.replace(rng=jax.random.wrap_key_data(jnp.asarray(restored.rng), impl=impl))
        return restored, dict(out["extras"] or {})

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; committed steps: {steps}")
        return step

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Waits for pending saves and releases orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_policy(state: TrainState, path: str | os.PathLike, *, tokenizer=None, overwrite: bool = False) -> Path:
    """Writes the policy as a Hugging Face model directory (`config.json` + safetensors),
    LoRA adapters merged into the kernels (`jaxagent.models.save_pretrained`). The
    directory appears whole or not at all."""
    return save_pretrained(
        Model(params=state.params, config=state.model_config), path, tokenizer=tokenizer, overwrite=overwrite
    )
