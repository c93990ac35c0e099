"""The fleet across hosts: a gateway, two engine replicas and Redis, each in a network
namespace of its own on a private /24 (`netns.Network`: veths into a bridge in a fifth
namespace, no default route), so every byte between them crosses a real link and none
leaves those namespaces.

- gateway 10.213.7.1: `tokenyard serve --config fleet.toml --no-embeddings` with a fleet
  file listing the two replicas by URL (their token from `token_env`), SQLite state in a
  temporary directory (PostgreSQL listens on the root namespace's loopback, out of
  reach), limits in Redis on the Redis host;
- replicas 10.213.7.2 and .3: `tokenyard engine --threads 1`, each requiring the token;
- Redis 10.213.7.4: a private `redis-server` (no persistence). Where `redis-server` is not
  installed, the gateway keeps its limits in process instead (nothing is installed).

Requests come from `multihost_client.py` (the official openai SDK) run inside the
gateway's namespace. Checked: requests are spread over both replica hosts; with one
replica host's link down under load, new requests fail over to the other, the gateway
marks that replica unhealthy, and re-admits it once the link is back; every process and
listening socket is inside the test's namespaces, on its private addresses.

Needs root and `ip netns` (CI runs as root): skipped with the reason where a namespace
cannot be created. The namespaces are deleted and the processes killed even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.integration.netns import Network, NetworkUnavailable

pytestmark = pytest.mark.slow

T = TypeVar("T")
DEPLOYMENT = "smollm2-135m-instruct-2026-11-22"
ALIAS = "smollm2"
ENGINE_PORT = 8001
GATEWAY_PORT = 8000
REDIS_PORT = 6379
START_TIMEOUT_S = 180.0
CLIENT = Path(__file__).with_name("multihost_client.py")
HOSTS = ("gw", "r1", "r2", "redis")
CONCURRENCY = 4
#: How long replica r2's link stays down.
OUTAGE_S = 9.0


@dataclass
class Proc:
    """A process in a namespace and its output, read by a thread as it comes."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float, what: str) -> str:
        """The first output line containing `text`; fails with the output if the process
        ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader take the last lines
                break
            time.sleep(0.1)
        pytest.fail(f"{what}: no {text!r} in its output:\n" + "".join(self.lines[-40:]))

    def output(self) -> str:
        return "".join(self.lines)


@dataclass
class Fleet:
    net: Network
    gateway: Proc
    replicas: dict[str, Proc]
    base_url: str
    api_key: str
    token: str
    redis: bool

    def replica_url(self, host: str) -> str:
        return f"http://{self.net.addrs[host]}:{ENGINE_PORT}"

    def client(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.net.run("gw", [sys.executable, str(CLIENT), *args], timeout=timeout)

    def call(self, method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
        """One HTTP call from the gateway's host."""
        args = [] if body is None else [json.dumps(body)]
        done = self.client("call", method, url, token, *args)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        return reply["status"], reply["body"]

    def computed_tokens(self, host: str) -> int:
        status, body = self.call("GET", self.replica_url(host) + "/v1/engine/stats",
                                 self.token)
        assert status == 200, body
        return int(body["num_computed_tokens"])

    def replica_states(self) -> dict[str, str]:
        """The balancer's view of each replica (GET /admin/v1/deployments): host → state."""
        status, body = self.call("GET", self.base_url + "/admin/v1/deployments", self.api_key)
        assert status == 200, body
        (deployment,) = [d for d in body["data"] if d["name"] == DEPLOYMENT]
        hosts = {self.replica_url(h): h for h in ("r1", "r2")}
        return {hosts[r["id"]]: r["state"] for r in deployment["replicas"]}

    def load(self, seconds: float, concurrency: int,
             stop_file: Path | None = None) -> subprocess.Popen[str]:
        env = {**os.environ, **({"STOP_FILE": str(stop_file)} if stop_file else {})}
        return self.net.popen("gw", [sys.executable, str(CLIENT), "load", self.base_url + "/v1",
                                     self.api_key, ALIAS, str(seconds), str(concurrency)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)


def results(proc: subprocess.Popen[str], timeout: float) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def poll(fn: Callable[[], T], done: Callable[[T], bool], timeout: float, what: str) -> T:
    """`fn()` once `done` with it, asked every 0.2 s for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = fn()
    assert done(value), f"{what}: {value!r}"
    return value


def fleet_file(path: Path, net: Network) -> Path:
    urls = ", ".join(f'"http://{net.addrs[h]}:{ENGINE_PORT}"' for h in ("r1", "r2"))
    path.write_text(f"""
[balancer]
policy = "least"
health_interval_s = 0.5
eject_after = 2
eject_base_s = 1.0
queue_timeout_s = 10

[[deployments]]
name = "{DEPLOYMENT}"
urls = [{urls}]
token_env = "MULTIHOST_REPLICA_TOKEN"

[aliases]
{ALIAS} = "{DEPLOYMENT}"
""")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    net = Network(f"tymh{os.getpid()}", HOSTS)
    try:
        net.open()
    except NetworkUnavailable as exc:
        net.close()
        pytest.skip(f"multi-host test: {exc}")
    try:
        yield start_fleet(net, tmp_path_factory.mktemp("multihost"))
    finally:
        net.close()


def start_fleet(net: Network, tmp: Path) -> Fleet:
    token = "multihost-" + os.urandom(12).hex()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOKENYARD_DATABASE_URL", "TOKENYARD_REDIS_URL",
                        "TOKENYARD_REPLICA_TOKEN")}
    env["PYTHONUNBUFFERED"] = "1"
    out: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
                           "text": True}
    replicas = {
        host: Proc(net.popen(host, [
            sys.executable, "-m", "tokenyard.cli", "engine", "--host", net.addrs[host],
            "--port", str(ENGINE_PORT), "--threads", "1", "--drain-timeout", "2",
        ], env={**env, "TOKENYARD_REPLICA_TOKEN": token}, **out))
        for host in ("r1", "r2")
    }
    redis = shutil.which("redis-server") is not None
    gw_env = {**env, "TOKENYARD_STATE_DIR": str(tmp / "state"),
              "MULTIHOST_REPLICA_TOKEN": token}
    if redis:
        server = Proc(net.popen("redis", [
            "redis-server", "--bind", net.addrs["redis"], "--port", str(REDIS_PORT),
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--dir", str(tmp)], **out))
        server.wait_for("Ready to accept connections", 20, "redis-server")
        gw_env["TOKENYARD_REDIS_URL"] = f"redis://{net.addrs['redis']}:{REDIS_PORT}/0"
    for host, replica in replicas.items():
        replica.wait_for("serving at", START_TIMEOUT_S, f"the replica on {host}")
    gateway = Proc(net.popen("gw", [
        sys.executable, "-m", "tokenyard.cli", "serve", "--host", net.addrs["gw"],
        "--port", str(GATEWAY_PORT), "--config", str(fleet_file(tmp / "fleet.toml", net)),
        "--no-embeddings", "--drain-timeout", "2",
    ], env=gw_env, **out))
    gateway.wait_for("tokenyard serving", START_TIMEOUT_S, "tokenyard serve")
    key = (tmp / "state" / "dev-key").read_text().strip()  # its JSON banner masks it
    fleet = Fleet(net, gateway, replicas, f"http://{net.addrs['gw']}:{GATEWAY_PORT}",
                  key, token, redis)
    return fleet


def test_requests_are_served_by_both_replica_hosts(fleet: Fleet) -> None:
    before = {h: fleet.computed_tokens(h) for h in ("r1", "r2")}
    done = results(fleet.load(seconds=4, concurrency=CONCURRENCY), timeout=60)
    failed = [r for r in done if not r["ok"]]
    assert len(done) >= 4 and not failed, failed
    assert {r["model"] for r in done} == {DEPLOYMENT}  # the alias resolved, named in replies
    after = {h: fleet.computed_tokens(h) for h in ("r1", "r2")}
    assert all(after[h] > before[h] for h in after), (before, after)
    assert fleet.replica_states() == {"r1": "healthy", "r2": "healthy"}


def test_limits_are_kept_on_the_redis_host(fleet: Fleet) -> None:
    """A key allowed 2 requests a minute gets 2, then 429; its bucket lives in Redis, on
    its own host (without redis-server: in the gateway's process, and only the 429 is
    checked)."""
    status, key = fleet.call("POST", fleet.base_url + "/admin/v1/keys", fleet.api_key,
                             {"org_id": "org_default", "name": "two-a-minute", "rpm": 2})
    assert status == 201, key
    body = {"model": ALIAS, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi."}]}
    replies = [fleet.call("POST", fleet.base_url + "/v1/chat/completions", key["secret"],
                          body) for _ in range(3)]
    assert [status for status, _ in replies] == [200, 200, 429], replies
    assert replies[2][1]["error"]["type"] == "rate_limit_error", replies[2]
    if fleet.redis:
        keys = fleet.net.run("gw", ["redis-cli", "-h", fleet.net.addrs["redis"], "-p",
                                    str(REDIS_PORT), "--scan"])
        assert keys.returncode == 0, keys.stderr
        assert any(k.endswith(f"key:{key['id']}:rpm") for k in keys.stdout.split()), \
            keys.stdout


def test_a_replica_host_going_down_fails_over_and_comes_back(fleet: Fleet,
                                                             tmp_path: Path) -> None:
    down = f"replica {fleet.replica_url('r2')} of {DEPLOYMENT}"
    stop = tmp_path / "stop"
    load = fleet.load(seconds=40, concurrency=CONCURRENCY, stop_file=stop)
    try:
        poll(lambda: fleet.computed_tokens("r2"), lambda n: n > 0, 15, "load on r2")
        time.sleep(1.0)
        t_down = time.monotonic()
        fleet.net.link("r2", up=False)
        fleet.gateway.wait_for(f"{down} failed its health check", 10,
                               "the gateway noticing the link down")
        detected = time.monotonic() - t_down
        assert fleet.replica_states()["r2"] in ("unhealthy", "ejected")
        fleet.gateway.wait_for(f"{down} does not answer; closing its connections", 10,
                               "the gateway giving up on the replica's open requests")
        t_cut = time.monotonic()
        time.sleep(max(0.0, t_down + OUTAGE_S - time.monotonic()))
        t_up = time.monotonic()
        fleet.net.link("r2", up=True)
        fleet.gateway.wait_for(f"{down} is healthy again", 10,
                               "the gateway re-admitting the replica")
        poll(fleet.replica_states, lambda s: s == {"r1": "healthy", "r2": "healthy"}, 5,
             "both replicas healthy")
        readmitted = fleet.computed_tokens("r2")
        poll(lambda: fleet.computed_tokens("r2"), lambda n: n > readmitted, 15,
             "the re-admitted replica computing tokens again")
    finally:
        stop.touch()
    done = results(load, timeout=60)
    assert done, "no requests ran"
    # The client's times are time.monotonic() too. No request waited out the partition:
    # those on r2 before their first byte failed over once the gateway gave up on it,
    # those mid-answer ended with an error, all well before the link came back.
    stuck = [r for r in done if r["start"] < t_cut and r["end"] >= t_up]
    assert not stuck, (t_down, t_cut, t_up, stuck)
    # Only requests already running when the link went down may fail, with a clean API
    # error, never a timeout.
    failed = [r for r in done if not r["ok"]]
    assert len(failed) <= CONCURRENCY, failed
    assert all(r["start"] < t_down and "Timeout" not in r["error"] for r in failed), failed
    # Requests that began once the gateway knew all succeeded: on r1 alone, then on both.
    late = [r for r in done if r["start"] >= t_down + detected]
    assert late and all(r["ok"] for r in late), [r for r in late if not r["ok"]]
    assert len(late) >= 10, len(late)


def test_traffic_stays_inside_the_namespaces(fleet: Fleet) -> None:
    net = fleet.net
    procs = {"gw": [fleet.gateway.proc], **{h: [p.proc] for h, p in fleet.replicas.items()}}
    root_ns = os.stat("/proc/self/ns/net").st_ino
    for host, plist in procs.items():
        for proc in plist:
            assert proc.poll() is None
            assert net.netns_inode(proc.pid) == net.host_inode(host) != root_ns
    ours = {str(p.pid) for p in net.procs}
    root_listeners = [line for line in net.listening(None)
                      if any(f"pid={pid}," in line for pid in ours)]
    assert not root_listeners, root_listeners
    for host in HOSTS:
        if host == "redis" and not fleet.redis:
            continue
        listeners = net.listening(host)
        assert listeners, f"nothing listens on {host}"
        local = [line.split()[3] for line in listeners]
        assert all(addr.startswith(net.addrs[host] + ":") for addr in local), (host, local)
        assert net.routes(host) == [
            f"{net.prefix}.0/24 dev eth0 proto kernel scope link src {net.addrs[host]}"], host
    banner = next(json.loads(line) for line in fleet.gateway.output().splitlines()
                  if '"event": "banner"' in line)
    assert banner["replica"] == f"{fleet.replica_url('r1')}, {fleet.replica_url('r2')}"
