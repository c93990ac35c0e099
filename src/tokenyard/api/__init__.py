"""The HTTP API: the OpenAI and Anthropic dialects over the gateway's pipeline.

- `openai/`, `anthropic/`: each dialect's request and response bodies (`schemas`),
  conversions to the engine's values and back (`convert`), stream events and the
  `Format` the one response writer fills in (`stream`), and `routes`.
- `schemas`, `convert`: what both dialects' schemas and conversions share.
- `respond`: the one response writer: bytes only (the body, or the SSE events in the
  writes the run marks); the run itself orders the request's end.
- `middleware`, `context`: request id, timeline, authentication, idempotency, and what
  handlers read; `errors`, `ratelimit_headers`: errors in each dialect's shape.
- `sse`: server-sent-event encoders and an incremental parser; `ops`: probes, metrics,
  the OpenAPI document; `app`: the application.

Nothing in this package imports torch: the HTTP process runs on CPU-only hosts.
"""
