"""The gateway's HTTP side: the OpenAI chat-completions API on Starlette under uvicorn.

Why Starlette and uvicorn: the smallest kept ASGI stack that streams server-sent events
and runs in a thread of the trainer's process (uvicorn's `Server` with its own event
loop), so the engine, which owns the device, stays in the same process as the training
step; FastAPI would add request models the gateway already has (`protocol`), aiohttp a
second HTTP stack beside the one the `openai` client's tests already use (httpx).

Routes (each also under `/s/<session>/v1/...`, a training session's own base URL):

- `GET /v1/models`: the served model's id.
- `POST /v1/chat/completions`: `jaxagent.gateway.service.Gateway.chat`, answered as a
  `chat.completion`, or with `"stream": true` as server-sent events (the reply's chunks
  once it is sampled, then `data: [DONE]`).

Safety: the server binds to 127.0.0.1 unless given another host; every request needs
`Authorization: Bearer <key>` (compared in constant time; a missing or wrong key is a
401 that never shows the key sent); a body over `Limits.max_request_bytes` is a 413
before it is read whole; every refused request is answered in OpenAI's error shape with
the 4xx status and the field it names; an unexpected failure is a 500 saying only that
the server failed (the traceback goes to the server's log, never to the client).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

from jaxagent.gateway.protocol import RequestError, authentication_error, error_body, parse_request
from jaxagent.gateway.responses import SSE_DONE, completion_response, models_response, sse, stream_chunks
from jaxagent.gateway.service import ChatResult, Gateway

log = logging.getLogger("jaxagent.gateway")


def _require(module: str) -> None:
    """ImportError naming the extra when the gateway's HTTP stack is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"the gateway needs {module}, which is not installed: pip install 'jaxagent[agents]' "
            "(Starlette, uvicorn and the openai client)"
        )


def _error(err: RequestError):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(err), status_code=err.status)


def make_app(gateway: Gateway, api_key: str):
    """The Starlette app serving `gateway` to callers that hold `api_key`."""
    _require("starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    if not isinstance(api_key, str) or len(api_key) < 16:
        raise ValueError("make_app: the API key must be a string of at least 16 characters")
    expected = f"Bearer {api_key}".encode()
    limits = gateway.limits

    def authorized(request: Request) -> bool:
        got = request.headers.get("authorization", "").encode()
        return secrets.compare_digest(got, expected)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        too_big = RequestError(
            413,
            f"the request body is over the gateway's limit of {limits.max_request_bytes} bytes",
            code="request_too_large",
        )
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limits.max_request_bytes:
                raise too_big
        return bytes(body)

    async def models(request: Request):
        if not authorized(request):
            return _error(authentication_error())
        return JSONResponse(models_response([gateway.model_name], gateway.created))

    async def completions(request: Request):
        if not authorized(request):
            return _error(authentication_error())
        session = request.path_params.get("session")
        try:
            body = await read_body(request)
            parsed = parse_request(body, limits=limits, models=None)
            result = await gateway.chat(session, parsed)
        except RequestError as err:
            return _error(err)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the gateway failed on a chat-completions request")
            return _error(RequestError(500, "the gateway failed on this request (see the server's log)"))
        if not parsed.stream:
            return JSONResponse(_completion(result))
        return StreamingResponse(_events(result, parsed.include_usage), media_type="text/event-stream")

    async def not_found(request: Request, exc: HTTPException):
        status = exc.status_code if 400 <= exc.status_code <= 599 else 404
        what = "method not allowed" if status == 405 else "no such route"
        return _error(RequestError(status, f"{request.method} {request.url.path}: {what}", code="not_found"))

    routes = []
    for prefix in ("", "/s/{session:str}"):
        routes += [
            Route(f"{prefix}/v1/models", models, methods=["GET"]),
            Route(f"{prefix}/v1/chat/completions", completions, methods=["POST"]),
        ]
    handlers: dict[Any, Any] = {HTTPException: not_found}
    return Starlette(routes=routes, exception_handlers=handlers)


def _completion(r: ChatResult) -> dict:
    return completion_response(
        r.id, r.model, r.created, r.message, r.finish_reason, r.usage, logprobs=r.logprobs, extension=r.extension
    )


async def _events(r: ChatResult, include_usage: bool) -> AsyncIterator[bytes]:
    chunks = stream_chunks(
        r.id,
        r.model,
        r.created,
        r.message,
        r.finish_reason,
        r.usage,
        include_usage=include_usage,
        logprobs=r.logprobs,
        extension=r.extension,
    )
    for c in chunks:
        yield sse(c)
    yield SSE_DONE


class GatewayServer:
    """`make_app(gateway, key)` under uvicorn in a thread of this process.

    Args:
      gateway: the `Gateway`.
      host: the address to bind (default 127.0.0.1, this machine only).
      port: the port (0 = a free one; `port` tells which after `start`).
      api_key: the bearer key (default: a new random one, `api_key`; never logged).
      keep_alive_s: seconds an idle kept-alive connection stays open (uvicorn's
        `timeout_keep_alive`). Longer than a client's own expiry (httpx, and so the
        `openai` client, drop idle connections after 5 s): at equal expiries a client
        can send a call on a connection the server is closing, and that call fails with
        a connection error though nothing was wrong (seen in training: one episode lost).

    Use as a context manager (`start` / `stop`). `base_url(session)` is what an
    `openai.AsyncOpenAI(base_url=..., api_key=server.api_key)` is given.
    """

    def __init__(
        self,
        gateway: Gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        keep_alive_s: int = 120,
    ):
        if isinstance(keep_alive_s, bool) or not isinstance(keep_alive_s, int) or keep_alive_s < 1:
            raise ValueError(f"GatewayServer: keep_alive_s must be a positive int, got {keep_alive_s!r}")
        self.gateway = gateway
        self.keep_alive_s = int(keep_alive_s)
        self.host = host
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(32)
        self.app = make_app(gateway, self.api_key)
        self._requested_port = int(port)
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        _require("uvicorn")
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self._requested_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=self.keep_alive_s,
        )
        server = uvicorn.Server(config)
        self._server = server
        errors: list[BaseException] = []

        def run() -> None:
            try:
                server.run()
            except BaseException as err:  # reported by start(), which waits for the bind
                errors.append(err)

        self._thread = threading.Thread(target=run, name="jaxagent-gateway-http", daemon=True)
        self._thread.start()
        waited = 0.0
        while not server.started:
            if errors or not self._thread.is_alive():
                raise RuntimeError(
                    f"the gateway could not start on {self.host}:{self._requested_port}"
                    + (f": {type(errors[0]).__name__}: {errors[0]}" if errors else " (see the log above)")
                )
            if waited > timeout_s:
                self.stop()
                raise TimeoutError(f"the gateway did not start on {self.host}:{self._requested_port} in {timeout_s} s")
            threading.Event().wait(0.01)
            waited += 0.01
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        return self

    def base_url(self, session: str | None = None) -> str:
        if self.port is None:
            raise RuntimeError("GatewayServer.base_url: the server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}" + (f"/s/{session}" if session else "") + "/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._server, self._thread = None, None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
