"""A private network of Linux network namespaces for multi-host tests.

`Network` builds one namespace per host, each with an `eth0` veth whose peer is a port of
a bridge living in a namespace of its own, all on one private /24 and with no default
route: nothing in these namespaces can reach (or be reached from) the root namespace or
the outside. Processes run in a host with `Network.popen` (`ip netns exec`); `close`
kills them (by pid, the ones started here) and deletes the namespaces. Needs root and
iproute2; `NetworkUnavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BRIDGE = "br0"
IFACE = "eth0"


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no netns support)."""


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, ["ip", *args], proc.stdout,
                                            proc.stderr)
    return proc.stdout


class Network:
    """Hosts on `<prefix>.0/24`: host i (0-based) is `<prefix>.<i + 1>`."""

    def __init__(self, tag: str, hosts: Sequence[str], prefix: str = "10.213.7") -> None:
        self.tag = tag
        self.prefix = prefix
        self.bridge_ns = f"{tag}-br"
        self.hosts = {name: f"{tag}-{name}" for name in hosts}
        self.addrs = {name: f"{prefix}.{i + 1}" for i, name in enumerate(hosts)}
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    # ------------------------------------------------------------------ building

    def open(self) -> Network:
        """Create the namespaces, the bridge and the links; NetworkUnavailable if the
        first namespace cannot be created (anything later failing is a real error)."""
        if shutil.which("ip") is None:
            raise NetworkUnavailable("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise NetworkUnavailable("creating network namespaces needs root")
        try:
            self._add_ns(self.bridge_ns)
        except subprocess.CalledProcessError as exc:
            raise NetworkUnavailable(f"`ip netns add` failed: {exc.stderr.strip()}") from None
        _ip("-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", BRIDGE, "up")
        for i, (name, ns) in enumerate(self.hosts.items()):
            self._add_ns(ns)
            port = f"p{i}"
            _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[name]}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", IFACE, "up")
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ using

    def cmd(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run in `host`'s namespace (ip netns exec execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in `host`; `close` kills it."""
        proc = subprocess.Popen(self.cmd(host, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host` to its end; its output as text."""
        return subprocess.run(self.cmd(host, argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def link(self, host: str, up: bool) -> None:
        """Bring `host`'s only link down or up (from inside its namespace)."""
        _ip("-n", self.hosts[host], "link", "set", IFACE, "up" if up else "down")

    def routes(self, host: str) -> list[str]:
        return [line.strip() for line in
                _ip("-n", self.hosts[host], "-4", "route", "show").splitlines()]

    def listening(self, host: str | None) -> list[str]:
        """Listening TCP sockets (local address:port) of `host`, or of the root
        namespace (None), with their processes."""
        argv = ["ss", "-Hltnp"]
        out = subprocess.run(self.cmd(host, argv) if host else argv, capture_output=True,
                             text=True, timeout=10, check=True).stdout
        return [line for line in out.splitlines() if line.strip()]

    def netns_inode(self, pid: int) -> int:
        return os.stat(f"/proc/{pid}/ns/net").st_ino

    def host_inode(self, host: str) -> int:
        return os.stat(Path("/run/netns") / self.hosts[host]).st_ino

    # ------------------------------------------------------------------ tearing down

    def close(self) -> None:
        """SIGTERM then SIGKILL every process started here, then delete the namespaces
        (a namespace outlives its deletion while a process is still in it)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for ns in reversed(self._made):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns)
        self._made.clear()
