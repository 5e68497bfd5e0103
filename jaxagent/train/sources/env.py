"""`EnvSource`: the policy acts in the run's env (`env:`), in an `envs.EnvPool` of worker
processes driven by `jaxagent.rollout.AgentLoop`."""

from __future__ import annotations

import contextlib
import functools
import json

from jaxagent.dataclass_yaml import ConfigError
from jaxagent.train.sources import Pools, RolloutSource, same_pool


class EnvSource(RolloutSource):
    """The env path (module docstring): the warm start's demonstrations are the env
    expert's episodes (`jaxagent.train.warmstart.warm_start_demonstrations`), played before
    the tokenizer exists so that a "bpe" tokenizer can be trained on their text."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._demonstrations: list | None = None

    def env_factory(self):
        """A zero-argument, picklable factory of the run's env (`envs.make_with_imports`:
        an env worker that unpickles it imports `envs` and the config's `env.imports`, not
        JAX)."""
        import envs

        e = self.config.env
        return functools.partial(envs.make_with_imports, tuple(e.imports), e.name, dict(e.kwargs))

    def check(self) -> str | None:
        """Builds and resets one env of the config in this process, so that bad
        `env.kwargs` (or an env that cannot reset, such as a code sandbox whose isolation
        does not work here) are named within seconds; returns the env's sandbox isolation
        (its `isolation` attribute, as `pycode`'s) or None for an env that runs no code."""
        e = self.config.env
        env = None
        try:
            env = self.env_factory()()
            env.reset(seed=e.seed)
            return getattr(env, "isolation", None)
        except Exception as err:  # noqa: BLE001 - whatever the env raises, named with its config
            raise ConfigError(
                f"env {e.name!r} with kwargs {dict(e.kwargs)} cannot be built and reset "
                f"(seed {e.seed}): {type(err).__name__}: {err}"
            ) from None
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()

    def pool(self, slots: int):
        """The run's `EnvPool` of `slots` envs, with the config's workers, timeout and limits."""
        import envs

        e = self.config.env
        return envs.EnvPool(
            [self.env_factory()] * slots,
            num_workers=e.num_workers,
            step_timeout=e.step_timeout,
            memory_limit_mb=e.worker_memory_mb,
            cpu_limit_s=e.worker_cpu_s,
        )

    def open_pools(self, slots: int) -> contextlib.AbstractContextManager[Pools]:
        """One `EnvPool` for training and evaluation: held-out seeds are other seeds of the
        same env."""
        return same_pool(self.pool(slots))

    def loop(self, params, model_config, tokenizer, *, rows: int, mesh):
        from jaxagent.rollout import AgentLoop

        pad = tokenizer.pad_token_id
        return AgentLoop(
            params, model_config, tokenizer, self.config.rollout.loop_config(0 if pad is None else int(pad)), mesh=mesh
        )

    def demonstrations(self, tokenizer, log) -> list:
        if self._demonstrations is None:
            from jaxagent.train.warmstart import warm_start_demonstrations

            self._demonstrations = warm_start_demonstrations(self.config, log)
        return self._demonstrations

    def tokenizer_texts(self, log) -> list[str]:
        """The demonstrations' text: the warm start's, else noise-free expert episodes on
        256 seeds from `warm_start.seed`."""
        from jaxagent.train import warmstart

        cfg = self.config
        ws = cfg.warm_start
        if ws.enabled:
            demos = self.demonstrations(None, log)
        else:
            demos = warmstart.collect_demonstrations(
                cfg.env.name,
                cfg.env.kwargs,
                range(ws.seed, ws.seed + 256),
                max_turns=cfg.rollout.max_turns,
                expert=ws.expert,
            )
        across = cfg.model.tokenizer_pieces != "words"  # the prompt as often as the policy reads it
        return warmstart.demonstration_texts(demos, prompt_per_episode=across)

    def summarizer(self):
        """The env's own summary of evaluated episodes (its `summarize(per_episode)`, e.g.
        intake's rubric means and triage rates), or None when it has none. Looked up with
        an env built in this process, once per env name, imports and (JSON) kwargs."""
        e = self.config.env
        try:
            key = (e.name, tuple(e.imports), json.dumps(e.kwargs, sort_keys=True))
        except TypeError:  # kwargs JSON cannot hold (a callable simulator ...): no cache
            key = None
        if key is not None and key in _SUMMARIZERS:
            return _SUMMARIZERS[key]
        env = self.env_factory()()
        try:
            summarize = getattr(env, "summarize", None)
            summarize = summarize if callable(summarize) else None
        finally:
            env.close()
        if key is not None:
            _SUMMARIZERS[key] = summarize
        return summarize


_SUMMARIZERS: dict = {}
