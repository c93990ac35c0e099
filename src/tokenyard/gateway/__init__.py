"""Stages 3 to 9 and 19: what the gateway decides about a request before and after a replica.

- `pipeline`: `Pipeline.run`, the one owner of a request's order of stages, for HTTP
  routes and callers without HTTP alike; it hands back a `Run`.
- `gate`: `Gateway` and its `Ticket`s: admission (limits, billing holds) and settlement.
- `limits`: rate limits (RPM, TPM, concurrency) per API key and per org, in process;
  `redis_limits`: the same limits shared by every gateway process through Redis.

Nothing in this package imports torch: the gateway runs on CPU-only hosts.
"""
