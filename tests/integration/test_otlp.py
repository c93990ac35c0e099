"""OpenTelemetry traces end to end: `tokenyard serve` with OTEL_EXPORTER_OTLP_ENDPOINT
pointing at a real OTLP/HTTP receiver in this test, which decodes the protobuf
`ExportTraceServiceRequest`s the gateway and its replica send.

One trace must hold the gateway's request span, its stage spans and the replica's
spans; a caller's ``traceparent`` is continued; the GenAI attributes are there."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.e2e.conftest import running_server

pytestmark = pytest.mark.slow


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it received, with its
    service name, as plain dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def add(self, export: ExportTraceServiceRequest) -> None:
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append({
                            "service": resource.get("service.name"), "name": span.name,
                            "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(), "kind": span.kind,
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        })

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.http.shutdown()


def _wait_for(receiver: Receiver, trace_id: str, names: set[str]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {s["name"] for s in spans}:
            return spans
        time.sleep(0.1)
    pytest.fail(f"spans {names} of trace {trace_id} not received; got "
                f"{[(s['service'], s['name']) for s in receiver.trace(trace_id)]}")


def test_one_trace_holds_the_gateways_and_the_replicas_spans(receiver: Receiver) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_SERVICE_NAME": ""}
    with running_server(env=env) as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key)
        trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
        raw = client.chat.completions.with_raw_response.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            temperature=0.5, extra_headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
        request_id, reply = raw.headers["x-request-id"], raw.parse()
        # Without a traceparent the request starts a trace of its own.
        untraced = client.chat.completions.with_raw_response.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        other_id = untraced.headers["x-request-id"]
        spans = _wait_for(receiver, trace_id, {
            "POST /v1/chat/completions", "tokenize", "prefill", "decode",
            "POST /v1/engine/generate", "queue"})

        gateway = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
        assert len(gateway) == 1
        root = gateway[0]
        assert root["parent"] == caller_span  # the caller's trace, continued
        assert root["kind"] == 2  # SPAN_KIND_SERVER
        assert root["service"] == "tokenyard"
        attrs = root["attributes"]
        assert attrs["tokenyard.request_id"] == request_id
        assert reply.usage is not None
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "tokenyard"
        assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == server.model
        assert attrs["gen_ai.request.max_tokens"] == 3
        assert attrs["gen_ai.request.temperature"] == 0.5
        assert attrs["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
        assert attrs["gen_ai.response.finish_reasons"] == [reply.choices[0].finish_reason]
        assert attrs["gen_ai.response.id"] == reply.id
        assert attrs["http.response.status_code"] == 200
        assert attrs["tokenyard.org_id"] and attrs["tokenyard.replica"].startswith("http://")
        assert attrs["tokenyard.cost"] == "0.000000"

        # The gateway's stages, children of its span, inside it and in order.
        stages = {s["name"]: s for s in spans
                  if s["parent"] == root["span_id"] and s["service"] == "tokenyard"}
        assert {"auth", "parse", "template", "tokenize", "queue", "prefill", "decode"} <= set(
            stages)
        for stage in stages.values():
            assert root["start"] <= stage["start"] <= stage["end"] <= root["end"]
        assert stages["tokenize"]["end"] <= stages["prefill"]["start"]

        # The replica's own spans, under its server span, under the gateway's span.
        replica = [s for s in spans if s["service"] == "tokenyard-replica"]
        generate = [s for s in replica if s["name"] == "POST /v1/engine/generate"]
        assert len(generate) == 1 and generate[0]["parent"] == root["span_id"]
        assert generate[0]["attributes"]["tokenyard.request_id"] == request_id
        children = {s["name"]: s for s in replica if s["parent"] == generate[0]["span_id"]}
        assert set(children) == {"queue", "prefill", "decode"}
        assert (children["queue"]["end"] == children["prefill"]["start"]
                and children["prefill"]["end"] == children["decode"]["start"])

        def own_trace() -> list[dict[str, Any]]:
            with receiver.lock:
                return [s for s in receiver.spans
                        if s["attributes"].get("tokenyard.request_id") == other_id]

        deadline = time.monotonic() + 10
        while len(own_trace()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = own_trace()
        assert len({s["trace_id"] for s in found}) == 1 and found[0]["trace_id"] != trace_id
        top = [s for s in found if s["name"] == "POST /v1/chat/completions"]
        assert len(top) == 1 and top[0]["parent"] == ""  # a new trace: no parent
