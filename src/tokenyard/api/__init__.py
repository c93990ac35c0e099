"""The HTTP API: OpenAI- and Anthropic-compatible schemas, conversions, errors and SSE.

- `schemas_openai`, `schemas_anthropic`: request and response bodies (pydantic).
- `convert`: requests → engine inputs (template messages / prompts, SamplingParams), engine
  outputs → response bodies and stream chunks.
- `errors`: `APIError` and its rendering in either API's shape.
- `sse`: server-sent-event encoders and an incremental parser.

Nothing in this package imports torch: the HTTP process runs on CPU-only hosts.
"""
