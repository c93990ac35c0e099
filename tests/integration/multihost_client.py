"""The multi-host test's client, run inside the gateway's namespace (`ip netns exec`).

    python multihost_client.py load BASE_URL KEY MODEL SECONDS CONCURRENCY
        chat completions through the official openai SDK (no retries), CONCURRENCY at a
        time, until SECONDS have passed or the file named by $STOP_FILE exists; one JSON
        line per request on stdout as it ends: {"n", "start", "end", "ok", "error",
        "model"} (times: time.monotonic(), a clock every process on the machine shares).
    python multihost_client.py call METHOD URL TOKEN [JSON]
        one HTTP call with a bearer token (and a JSON body); prints {"status", "body"}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

#: A request that has not ended by then counts as failed: a hang is a failure.
REQUEST_TIMEOUT_S = 20.0


def load(base_url: str, key: str, model: str, seconds: float, concurrency: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=key, max_retries=0,
                    timeout=REQUEST_TIMEOUT_S)
    stop_file = os.environ.get("STOP_FILE")
    t0 = time.monotonic()
    lock = threading.Lock()
    counter = iter(range(1_000_000))

    def worker() -> None:
        while time.monotonic() - t0 < seconds and not (
                stop_file and os.path.exists(stop_file)):
            with lock:
                n = next(counter)
            record: dict[str, object] = {"n": n, "start": time.monotonic()}
            try:
                reply = client.chat.completions.create(
                    model=model, max_tokens=8, temperature=0,
                    messages=[{"role": "user", "content": f"Request {n}: name a color."}])
                record.update(ok=True, model=reply.model, error=None)
            except Exception as exc:  # every failure is data for the test
                record.update(ok=False, model=None, error=f"{type(exc).__name__}: {exc}")
            record["end"] = time.monotonic()
            with lock:
                print(json.dumps(record), flush=True)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def call(method: str, url: str, token: str, body: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, method=method, headers=headers,
                                     data=body.encode() if body is not None else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    print(json.dumps({"status": status, "body": json.loads(raw or b"null")}))


def main(argv: list[str]) -> None:
    if argv[0] == "load":
        load(argv[1], argv[2], argv[3], float(argv[4]), int(argv[5]))
    elif argv[0] == "call":
        call(*argv[1:5])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
