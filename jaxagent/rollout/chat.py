"""Token-exact chat formatting: the first prompt once, then each observation as a continuation.

The chat is never re-rendered. `ChatFormat` renders the tokenizer's chat template once
per segment and tokenizes only the new segment:

* the first prompt: `template([system, user(obs_0)], add_generation_prompt=True)`;
* each later observation: the text a template would put after an assistant message's
  content, up to and including the next generation prompt. It is read off a rendering
  of `[system, user, assistant(<MARK>), <observation messages>]` as the part after
  `<MARK>`, so the turn delimiters are exactly the template's (whatever the model
  family). When the policy ended its turn with the template's end-of-turn token, that
  token is already in the sequence (it was sampled), so the segment starts after it.

Token-exactness (what tests check): a segment's tokens are
`tokenizer.encode(segment_text, add_special_tokens=False)`; the trajectory is the
concatenation prompt + policy tokens + segment + policy tokens + ...; the policy
tokens are exactly the sampler's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_MARK = "\x00JAXAGENT-ASSISTANT-MARK\x00"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact continuation."""


class ChatFormat:
    """Segments of a multi-turn chat for one tokenizer (see the module docstring).

    Args:
      tokenizer: a transformers tokenizer with a chat template.
      observation_role: the role of observations given as plain text ("user" or "tool").
    """

    def __init__(self, tokenizer, observation_role: str = "user"):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template (tokenizer.chat_template is empty)")
        self.tokenizer = tokenizer
        self.observation_role = observation_role
        close = self._suffix([])
        specials = sorted(
            (t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True
        )
        #: the template's end-of-turn text after an assistant message (e.g. "<|im_end|>"), or None
        self.end_of_turn_text = next((s for s in specials if close.startswith(s)), None)
        ids = []
        if self.end_of_turn_text is not None:
            ids.append(tokenizer.convert_tokens_to_ids(self.end_of_turn_text))
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
            ids.append(tokenizer.eos_token_id)
        #: token ids that end a policy turn (end-of-turn first, then eos)
        self.stop_token_ids: tuple[int, ...] = tuple(int(i) for i in ids)

    # ---------------------------------------------------------------- rendering
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        out = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        if not isinstance(out, str):
            raise ChatTemplateError(f"apply_chat_template returned {type(out).__name__}, expected text")
        return out

    def _suffix(self, obs_messages: list[dict]) -> str:
        msgs = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": _MARK},
        ] + obs_messages
        text = self._render(msgs, add_generation_prompt=bool(obs_messages))
        if text.count(_MARK) != 1:
            raise ChatTemplateError("the chat template does not render an assistant message's content verbatim")
        return text.split(_MARK, 1)[1]

    def messages(self, observation: Any) -> list[dict]:
        """An observation (text, or a list of chat messages) as chat messages."""
        if isinstance(observation, str):
            return [{"role": self.observation_role, "content": observation}]
        if isinstance(observation, Sequence) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in observation
        ):
            return [dict(m) for m in observation]
        raise TypeError(
            f"an observation must be text or a list of {{'role', 'content'}} messages, got {type(observation).__name__}"
        )

    # ---------------------------------------------------------------- segments
    def prompt_text(self, system_prompt: str | None, observation: Any) -> str:
        """The first prompt: system message (if any) + the first observation + generation prompt."""
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + self.messages(observation)
        return self._render(msgs, add_generation_prompt=True)

    def observation_text(self, observation: Any, after_end_of_turn: bool) -> str:
        """The continuation segment for an observation (see the module docstring)."""
        text = self._suffix(self.messages(observation))
        if after_end_of_turn and self.end_of_turn_text is not None:
            if not text.startswith(self.end_of_turn_text):  # pragma: no cover - guarded in __init__
                raise ChatTemplateError("the observation segment does not start with the end-of-turn token")
            text = text[len(self.end_of_turn_text) :]
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of one segment (no BOS / EOS added: the template writes its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, system_prompt: str | None, observation: Any) -> list[int]:
        return self.encode(self.prompt_text(system_prompt, observation))

    def observation_tokens(self, observation: Any, after_end_of_turn: bool) -> list[int]:
        return self.encode(self.observation_text(observation, after_end_of_turn))

    def action_text(self, tokens: Sequence[int]) -> str:
        """The text an env receives for a turn's policy tokens (special tokens dropped)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
