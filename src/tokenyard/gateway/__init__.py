"""Stages 3 to 9 and 19: what the gateway decides about a request before and after a replica.

- `pipeline`: `Pipeline.run`, the one owner of a request's order of stages, for HTTP
  routes and callers without HTTP alike; it hands back a `Run`, which answers (a body
  or a stream's events) and ends the request in order: settle, the dialect's finish
  hook, capture, close.
- `call`: a request's data (`Call`, `Prepared`, `Build`) and what the pipeline needs of
  a generation (`Generating`), with the base of the stages that wrap one (`Wrapper`).
- `kinds`: every kind of deployment (engine, upstream, embeddings) as an object, and
  `build_served`; `served`: the deployments as served (`Served`, `Fleet`).
- `gate`: `Gateway` and its `Ticket`s: admission (limits, billing holds) and settlement.
- `limits`: rate limits (RPM, TPM, concurrency) per API key and per org, in process;
  `redis_limits`: the same limits shared by every gateway process through Redis.

Nothing in this package imports torch: the gateway runs on CPU-only hosts.
"""
