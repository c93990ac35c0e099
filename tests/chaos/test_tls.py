"""TLS: `tokenyard serve --tls-cert/--tls-key` serves HTTPS that the official SDKs connect
to when they trust its issuer (a completion, streamed completions and a message), and
that plain HTTP and untrusting clients cannot use; every call that produced tokens is in
the ledger once, and the server ends quiescent. A certificate setting it cannot use stops
it at start with its reason.

The certificate authority and the server's certificate (for 127.0.0.1 and localhost)
are made by `trustme` for this test."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
import trustme
from openai.types.chat import ChatCompletionMessageParam

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import check_quiescent, ledger_exactly_once
from tests.e2e.conftest import running_server


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _pem_files(ca: trustme.CA, where: Path) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key = where / "server.pem", where / "server.key"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    return chain, key


def _trusting(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.mark.slow
def test_the_sdks_talk_https_to_a_server_with_a_certificate(
    ca: trustme.CA, tmp_path: Path, scale: Scale, record: Recorder,
) -> None:
    streams = 8 if scale == "full" else 2
    chain, key = _pem_files(ca, tmp_path)
    with running_server("--tls-cert", str(chain), "--tls-key", str(key)) as (srv, _):
        assert srv.base_url.startswith("https://127.0.0.1:"), srv.base_url
        trust = _trusting(ca)
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key,
                               http_client=openai.DefaultHttpxClient(verify=trust))
        hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi."}]
        raw = client.chat.completions.with_raw_response.create(
            model=srv.model, max_tokens=3, messages=hi)
        chat = raw.parse()
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        ids = {raw.headers["x-request-id"]}
        chunks = streamed_tokens = 0
        for _ in range(streams):
            raw_stream = client.chat.completions.with_raw_response.create(
                model=srv.model, max_tokens=8, messages=hi, stream=True,
                stream_options={"include_usage": True})
            ids.add(raw_stream.headers["x-request-id"])
            with raw_stream.parse() as stream:
                for chunk in stream:
                    chunks += 1
                    if chunk.usage is not None:
                        streamed_tokens += chunk.usage.completion_tokens
        assert chunks > 2 * streams and streamed_tokens > 0, (chunks, streamed_tokens)
        claude = anthropic.Anthropic(base_url=srv.base_url, api_key=srv.api_key or "",
                                     http_client=anthropic.DefaultHttpxClient(verify=trust))
        raw_message = claude.messages.with_raw_response.create(
            model=srv.model, max_tokens=3, messages=[{"role": "user", "content": "Hi."}])
        assert raw_message.parse().usage.output_tokens > 0
        ids.add(raw_message.headers["x-request-id"])

        # A client that does not trust the issuer refuses the connection ...
        stranger = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key,
                                 max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            stranger.models.list()
        # ... and plain HTTP on the HTTPS port gets no HTTP answer.
        plain = openai.OpenAI(base_url=srv.base_url.replace("https", "http") + "/v1",
                              api_key=srv.api_key, max_retries=0)
        with pytest.raises((openai.APIConnectionError, openai.APIStatusError)) as refused:
            plain.models.list()
        assert not isinstance(refused.value, openai.APIStatusError) or \
            refused.value.status_code >= 400
        assert srv.state_dir is not None
        ledger = ledger_exactly_once(srv.state_dir, ids)
        quiet = check_quiescent(srv, state_dir=srv.state_dir, context=trust)
    record("TLS", command="tokenyard serve --tls-cert <trustme cert> --tls-key <its key>",
           sent={"openai_completions": 1, "openai_streams": streams, "anthropic_messages": 1,
                 "untrusting_client_calls": 1, "plain_http_calls": 1},
           held={"stream_chunks": chunks, "streamed_completion_tokens": streamed_tokens,
                 "untrusting_client_refused": True, "plain_http_refused": True,
                 **ledger, **quiet})


@pytest.mark.parametrize("flags", [
    ["--tls-cert", "{chain}"],  # a certificate without its key
    ["--tls-cert", "{chain}", "--tls-key", "{tmp}/missing.key"],
    ["--tls-cert", "{chain}", "--tls-key", "{other_key}"],  # a key of another certificate
], ids=["no-key", "missing-key", "wrong-key"])
def test_a_bad_certificate_setting_fails_at_start_with_its_reason(
    ca: trustme.CA, tmp_path: Path, flags: list[str],
) -> None:
    chain, _ = _pem_files(ca, tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = _pem_files(ca, other)
    args = [f.format(chain=chain, tmp=tmp_path, other_key=other_key) for f in flags]
    done = subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "serve", "--port", "0", "--no-embeddings",
         *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "error:" in done.stderr and ("TLS" in done.stderr or "certificate" in
                                        done.stderr), done.stderr
