"""`jaxagent serve`: a run's checkpoint, or a Hugging Face / GGUF model, behind the gateway's
OpenAI chat-completions API, for evaluation with any OpenAI client, or as the voice of a
simulated user or a judge.

Unlike a training run's gateway, `serve` honours each request's sampling settings
(temperature, top_p, max_tokens within `--max-tokens`, stop, seed). A request names no
session (`/v1/...`): it is a one-call session, sampled with the key of its `seed` when it
gives one. A client that wants its multi-turn calls to reuse the KV cache uses its own
session URL, `/s/<id>/v1/...`, which `serve` opens on first use (`--sessions` at most at
once; the least recently used is closed when a new one needs room).

The key: `--api-key-env VAR` reads it from the environment variable VAR (at least 16
characters); without it a new key is made and shown once on the terminal. It is never
written to a file or a log.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from jaxagent.gateway.engine import Engine
from jaxagent.gateway.protocol import Limits
from jaxagent.gateway.server import GatewayServer
from jaxagent.gateway.service import Gateway
from jaxagent.rollout.chat import ChatFormat
from jaxagent.rollout.sampler import Sampler


def api_key_from(env_var: str | None) -> tuple[str, bool]:
    """`(key, generated)`: the key in `env_var`, or a new one."""
    if env_var is None:
        return secrets.token_urlsafe(32), True
    key = os.environ.get(env_var)
    if not key:
        raise ValueError(f"--api-key-env {env_var}: the environment variable {env_var} is not set")
    if len(key) < 16:
        raise ValueError(f"--api-key-env {env_var}: the key must be at least 16 characters, got {len(key)}")
    return key, False


def serve(
    params,
    model_config,
    tokenizer,
    model_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key_env: str | None = None,
    max_context: int = 4096,
    max_tokens: int = 1024,
    slots: int = 16,
    sessions: int = 64,
    ready: Callable[[str, str | None], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve the policy (`model_id` is what `GET /v1/models` lists) until SIGINT / SIGTERM
    (or `stop` is set). `ready(url, key)` is called once listening, with the key when it
    was generated (None when it came from the environment)."""
    key, generated = api_key_from(api_key_env)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_id}: its tokenizer has no chat template, so chat messages cannot be rendered")
    sampler = Sampler(params, model_config, max_len=max_context)
    engine = Engine(sampler, slots=slots, stop_token_ids=ChatFormat(tokenizer).stop_token_ids)
    limits = Limits(max_tokens=max_tokens, max_sessions=sessions)
    gateway = Gateway(engine, tokenizer, model_name=model_id, limits=limits, open_on_demand=True)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with GatewayServer(gateway, host=host, port=port, api_key=key) as server:
            if ready is not None:
                ready(server.base_url(), key if generated else None)
            stop.wait()
    finally:
        engine.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args, load_policy: Callable[..., tuple[Any, Any, Any, str]]) -> int:
    """The `jaxagent serve` command (`jaxagent.cli`); `load_policy(source, step, log=)` gives
    `(params, model_config, tokenizer, model_id)` (`jaxagent.train.runtools.load_policy`)."""

    def ready(url: str, key: str | None) -> None:
        print(f"jaxagent serve: {url} (Ctrl-C stops)", flush=True)
        if key is not None:  # shown once, on the terminal only
            print(f"jaxagent serve: API key (shown once): {key}", flush=True)

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        serve(
            *load_policy(args.source, args.step, log=log),
            host=args.host,
            port=args.port,
            api_key_env=args.api_key_env,
            max_context=args.max_context,
            max_tokens=args.max_tokens,
            slots=args.slots,
            sessions=args.sessions,
            ready=ready,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"jaxagent serve: error: {err}", file=sys.stderr)
        return 2
    return 0
