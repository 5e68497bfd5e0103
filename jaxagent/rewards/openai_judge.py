"""The LLM judge behind an OpenAI-compatible endpoint (`jaxagent.rewards.judge` has the
judge interface, its threads, retries and deadline; this module only makes the call).

``OpenAIJudge(base_url, model, api_key_env=None, prompt=DEFAULT_PROMPT, temperature=0.0, max_tokens=512, **opts)``
    POSTs ``{"model", "messages": [{"role": "user", "content": <prompt>}],
    "temperature", "max_tokens"}`` as JSON to ``{base_url}/chat/completions`` (any
    OpenAI-compatible server: OpenAI, vLLM, SGLang, llama.cpp) and parses
    ``choices[0].message.content`` with `parse_score`.

    * The API key is read once, when the judge is built, from the environment variable
      named by `api_key_env` (None: no Authorization header, e.g. a local server). A
      missing or empty variable is a ValueError that names the variable. A key passed
      directly (``api_key=...``) is refused: name an environment variable instead.
    * The key is sent only as ``Authorization: Bearer <key>`` and never appears in
      ``repr()``/``str()``, in a JudgeResult's detail (server text is redacted) or in
      an error message. Redirects are refused, so the key never follows one.
    * `prompt` is a ``str.format`` template with the fields ``{transcript}`` (required:
      the messages, one block per message) and ``{info[...]}`` (fields of the item's
      info; a missing one is "judge_error" for that item). Literal braces are doubled.
      The default, `DEFAULT_PROMPT`, shows the transcript and asks for a final line
      ``Score: <number between 0 and 1>``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

from jaxagent.rewards.judge import (
    _DETAIL_CHARS,
    _ENV_NAME,
    DEFAULT_PROMPT,
    Judge,
    JudgeItem,
    _check_prompt,
    _Failure,
    _prompt_or_fail,
    render_prompt,
)


class _Secret:
    """Holds the API key; its repr never shows it (so neither does vars(judge))."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a judge's API key is not pickled; build the judge where it runs")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises HTTPError(code): the key never follows a redirect


class OpenAIJudge(Judge):
    """An LLM judge behind an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        prompt: str = DEFAULT_PROMPT,
        temperature: float = 0.0,
        max_tokens: int = 512,
        *,
        api_key: Any = None,
        **opts,
    ):
        if api_key is not None:
            raise ValueError(
                "OpenAIJudge does not take an API key directly: put it in an environment variable "
                "and pass that variable's name as api_key_env"
            )
        if not isinstance(base_url, str) or not re.match(r"https?://[^/\s]", base_url):
            raise ValueError("base_url must be an http:// or https:// URL, e.g. https://api.openai.com/v1")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < 100:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        _check_prompt(prompt)
        self._key = _read_key(api_key_env)
        super().__init__(**opts)
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.prompt = prompt
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self._opener = urllib.request.build_opener(_NoRedirect())

    def render(self, item: JudgeItem) -> str:
        """The judge prompt for one item."""
        return render_prompt(self.prompt, item)

    def _call(self, item: JudgeItem, timeout_s: float) -> str:
        content = _prompt_or_fail(self.prompt, item)
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": content}],
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "jaxagent-judge"},
        )
        if self._key is not None:
            req.add_unredirected_header("Authorization", "Bearer " + self._key.reveal())
        try:
            with self._opener.open(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            try:
                text = e.read(_DETAIL_CHARS).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - the body is only for the detail
                text = ""
            retryable = e.code == 429 or e.code >= 500
            raise _Failure("judge_http_error", f"HTTP {e.code}: {text}", retryable) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Failure("judge_timeout", f"no reply within {timeout_s:.3g} s") from None
            raise _Failure("judge_http_error", f"connection error: {e.reason}", retryable=True) from None
        except TimeoutError:
            raise _Failure("judge_timeout", f"no reply within {timeout_s:.3g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise _Failure("judge_http_error", f"connection error: {type(e).__name__}: {e}", retryable=True) from None
        try:
            reply = json.loads(raw)
            text = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failure(
                "judge_bad_reply", "not a chat completion: " + raw[:_DETAIL_CHARS].decode("utf-8", "replace")
            ) from None
        if not isinstance(text, str):
            raise _Failure("judge_bad_reply", f"message content is {type(text).__name__}, not text")
        return text

    def _redact(self, text: str) -> str:
        if self._key is not None:
            text = text.replace(self._key.reveal(), "<redacted>")
        return text

    def __repr__(self) -> str:
        return (
            f"OpenAIJudge(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
            f"{self._opts_repr()})"
        )


def _read_key(api_key_env: Any) -> _Secret | None:
    if api_key_env is None:
        return None
    if not isinstance(api_key_env, str) or not _ENV_NAME.match(api_key_env):
        # Not echoed: a key pasted here by mistake must not end up in a log.
        raise ValueError("api_key_env must be the name of an environment variable (like OPENAI_API_KEY), not a key")
    value = os.environ.get(api_key_env)
    if value is None:
        raise ValueError(f"the judge's API key variable {api_key_env} is not set in the environment")
    if not value.strip():
        raise ValueError(f"the judge's API key variable {api_key_env} is empty")
    return _Secret(value.strip())
