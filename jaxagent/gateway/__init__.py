"""The OpenAI-compatible chat-completions gateway on jaxagent's own sampler.

- `protocol`: the requests: `parse_request` into a `ChatRequest` (or a `RequestError` in
  OpenAI's error shape, `error_body`), and the `Limits`.
- `tools`: tool calls through the model's own chat template: OpenAI messages as template
  messages, Hermes / Qwen2.5 `<tool_call>` blocks parsed back into `tool_calls`, and
  `TOOL_CHATML_TEMPLATE` for the byte-level ChatML tokenizers.
- `responses`: completions, stream chunks and server-sent events in OpenAI's shapes, with
  the `jaxagent` extension.
- `sessions`: the per-session exact-token ledger (`SessionLedger`: each call's prompt
  and completion token ids); `records`: what it records (`PromptPlan`, `Call`, a
  session's training `Sequence`s); `store`: `SessionStore`, the sessions by id.
- `engine`: `Engine`, the sessions' calls batched on one `Sampler`, each session's KV
  cache kept between its calls.
- `service`: `Gateway`, one call from a parsed request to a reply (no HTTP).
- `server`: `GatewayServer`, the HTTP API (Starlette under uvicorn, a thread).
- `program`: agent programs (`agent.program`) and their tasks; `processes`: programs in
  worker processes of their own (`agent.processes`; the child side `program_worker`);
  `loop`: `ProgramLoop`, programs as the trainer's rollout; `serve`: `jaxagent serve`.

`protocol`, `tools`, `responses`, `sessions`, `records`, `store`, `program`,
`processes` and `program_worker` are pure Python (no HTTP framework, no JAX); the
package imports nothing of `jaxagent.train`. It re-exports nothing: import
from the modules.
"""
