"""What runs in which process: `tokenyard serve`'s HTTP process never loads torch (DESIGN
§2: the gateway runs on small CPU-only hosts); its engine replica child does.

Checked on the real processes of the session's server, from the shared libraries mapped
into each (`/proc/PID/maps`), so no import path can hide torch from the test.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from tests.e2e.conftest import Server, child_pids


def _listening_pid(port: int) -> int:
    """The process that listens on 127.0.0.1:`port` (its socket's inode, found in /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{inode}]")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if str(fd.readlink()) in inodes:
                    return int(fd_dir.parent.name)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")


def _loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_http_process_never_loads_torch_and_its_replica_does(server: Server) -> None:
    # A whole request first, so a lazy import on the request path would have happened.
    body = {"model": server.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}
    request = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **server.headers},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    http_pid = _listening_pid(urlsplit(server.base_url).port or 80)
    replica_pid = _listening_pid(urlsplit(server.replica_url).port or 80)
    assert replica_pid in child_pids(http_pid)
    assert _loads_torch(replica_pid)  # the check sees torch where it is
    assert not _loads_torch(http_pid)


def _nice(pid: int, tid: int | None = None) -> int:
    """The nice value of `pid` (or of its thread `tid`): field 19 of its stat line."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    return int(Path(path).read_text().rsplit(")", 1)[1].split()[16])


def test_the_replica_runs_below_the_http_process(server: Server) -> None:
    """Issue 22 item 2: the replica's compute threads never starve the HTTP process: the
    replica child and every thread it started run at a lower priority (a higher nice)."""
    http_pid = _listening_pid(urlsplit(server.base_url).port or 80)
    replica_pid = _listening_pid(urlsplit(server.replica_url).port or 80)
    threads = [int(t.name) for t in Path(f"/proc/{replica_pid}/task").iterdir()]
    assert threads and all(_nice(replica_pid, t) >= _nice(http_pid) + 10 for t in threads)
