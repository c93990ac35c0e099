"""The pipeline for POST /v1/embeddings: route and the key's model scope first, then the
dimensions and the inputs (tokenized with the replica's own tokenizer, on a worker thread
when large), then limits and billing for the exact prompt tokens (no output), the call,
and settlement — its prompt tokens if it was embedded, else nothing."""

from __future__ import annotations

import asyncio

from tokenyard.balancer.generation import replica_error
from tokenyard.balancer.replica_client import ReplicaError
from tokenyard.errors import INVALID_VALUE, invalid_request
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.call import Call
from tokenyard.gateway.gate import ABORTED, COMPLETED, FAILED
from tokenyard.gateway.pipeline import OFF_LOOP_BYTES, Pipeline
from tokenyard.wire.embeddings import EmbedResult


async def embed(
    pipeline: Pipeline, call: Call, *, texts: list[str] | None, ids: list[list[int]] | None,
    dimensions: int | None,
) -> EmbedResult:
    """Embed `texts` (or token-id lists `ids`) on the embeddings pool of the deployment
    `call` names."""
    served = pipeline.route(call)
    target = served.pool  # its members are embeddings clients
    timeline = call.timeline
    try:
        model = await target.embeddings_model()
    except ReplicaError as exc:
        raise replica_error(exc) from None
    if dimensions is not None and dimensions != model.dimensions:
        raise invalid_request(
            f"This model only supports {model.dimensions} dimensions; 'dimensions' "
            f"{dimensions} is not supported.", param="dimensions", code=INVALID_VALUE)
    if texts is not None:
        ids = (await asyncio.to_thread(model.tokenize, texts)
               if call.text_size > OFF_LOOP_BYTES else model.tokenize(texts))
    assert ids is not None
    check_inputs(ids, model.max_tokens, model.vocab_size)
    timeline.mark("tokenized")
    gateway = pipeline.fleet.gateway
    ticket = None
    if gateway is not None and call.key is not None:
        assert call.route is not None
        ticket = call.ticket = await gateway.admit(
            call.key, model=served.name, endpoint=call.endpoint, request_id=call.request_id,
            prompt_tokens=sum(len(t) for t in ids), max_tokens=0,
            context_tokens=max(len(t) for t in ids), timeline=timeline,
            alias=call.route.alias, region=call.route.region, batch=call.batch)
    result: EmbedResult | None = None
    failed = False
    try:
        queued = timeline.mark("queued")
        result = await target.call(
            lambda client: client.embed(call.request_id, ids),
            cost=sum(len(t) for t in ids), timeline=timeline,
            priority=ticket.priority if ticket is not None else 0,
        )
        timeline.mark("admitted", queued + int(result.queue_ms * 1e6))
        timeline.add("embed", int(result.forward_ms * 1e6))
    except ReplicaError as exc:
        failed = True
        raise replica_error(exc) from None
    finally:
        if gateway is not None and ticket is not None:
            if result is None:
                gateway.finish(ticket, None, FAILED if failed else ABORTED)
            else:
                gateway.finish(ticket, Usage(prompt_tokens=result.prompt_tokens,
                                             cached_tokens=0, output_tokens=0), COMPLETED)
    return result


def check_inputs(ids: list[list[int]], max_tokens: int, vocab_size: int) -> None:
    """400 naming `input` for an input longer than the model takes or an id outside its
    vocabulary."""
    for i, tokens in enumerate(ids):
        if len(tokens) > max_tokens:
            raise invalid_request(
                f"This model's maximum context length is {max_tokens} tokens, however input "
                f"{i} has {len(tokens)} tokens. Please reduce the length of the input.",
                param="input", code="context_length_exceeded")
        if any(not 0 <= t < vocab_size for t in tokens):
            raise invalid_request(f"Invalid token id in input {i}: ids must be in "
                                  f"[0, {vocab_size}).", param="input", code=INVALID_VALUE)
