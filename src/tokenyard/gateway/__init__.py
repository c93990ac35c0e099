"""Stages 3 to 9 and 19: what the gateway decides about a request before and after a replica.

- `limits`: rate limits (RPM, TPM, concurrency) per API key and per org, in process;
  `redis_limits`: the same limits shared by every gateway process through Redis.

Nothing in this package imports torch: the gateway runs on CPU-only hosts.
"""
