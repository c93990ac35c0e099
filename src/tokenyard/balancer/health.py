"""A pool's account of its members' health: active probes, passive ejection.

- **Health**: the pool polls every replica's health route (`HealthChecks`, each
  `health_interval_s`); a replica that fails it takes no new work until it passes again.
  One probe without an answer is a busy replica as often as a sick one; a replica silent
  for `SILENT_PROBES_TO_CUT` probes in a row has its connections closed, so its requests
  fail over or end instead of waiting out a partition.
- **Outlier ejection** is passive (`record_failure`): `eject_after` consecutive failures
  (connection errors, 5xx, broken streams) eject a replica for `eject_base_s`, doubled
  for each ejection in a row (capped at a minute; a success ends the row, and failures
  reported while it is ejected do not extend it); it comes back when the time is up and
  its health check passes. A connection refused before the first byte marks the replica
  down at once: the process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from tokenyard.balancer.member_clients import engine_of, has_engine_stats
from tokenyard.balancer.members import Member
from tokenyard.balancer.replica_client import ReplicaConnectionError, ReplicaError
from tokenyard.deployments import BalancerSpec
from tokenyard.wire.outputs import EngineStats

logger = logging.getLogger("tokenyard.balancer")

MAX_EJECTION_S = 60.0
#: Health probes in a row without any answer (a round is the interval plus the probe's
#: timeout: 2 s by default) after which a replica's open connections are closed, so its
#: requests fail over or end instead of waiting out a partition.
SILENT_PROBES_TO_CUT = 3
#: A probe without an answer is a busy replica as often as a sick one (its HTTP loop waits
#: behind a long step on a loaded host); one that refuses or says it drains is out at
#: once, one silent for this many probes in a row is out too.
SILENT_PROBES_TO_UNHEALTHY = 2


class HealthChecks:
    """The probes of one pool's members (`name`): a round now (`check`), or one every
    `spec.health_interval_s` (`start`/`stop`), and a member drained by hand (`drain`).
    `forget(member_id)` drops what the pool remembered of a member that comes back (it
    may have restarted with an empty cache); `wake()` lets a waiting request look again
    after a round."""

    def __init__(self, name: str, spec: BalancerSpec, members: Callable[[], Sequence[Member]],
                 *, forget: Callable[[str], None], wake: Callable[[], None]) -> None:
        self.name, self.spec, self.members = name, spec, members
        self.forget, self.wake = forget, wake
        self._task: asyncio.Task[None] | None = None

    def start(self, with_stats: Callable[[], bool]) -> None:
        """Begin polling (idempotent; no loop when the interval is 0)."""
        if self._task is None and self.spec.health_interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop(with_stats))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def check(self, with_stats: bool) -> None:
        """One round of probes (and of engine figures if `with_stats`)."""
        members = list(self.members())
        results = await asyncio.gather(*(probe(m, self.spec, with_stats) for m in members))
        for member, (ok, stats) in zip(members, results, strict=True):
            if not ok and 0 < member.silent < SILENT_PROBES_TO_UNHEALTHY:
                ok = member.healthy  # one probe without an answer: busy, not yet sick
            if ok and not member.healthy:
                self._log(logging.INFO, "replica %s of %s is healthy again", member,
                          "replica_readmitted")
                self.forget(member.id)  # it may have restarted with an empty cache
            elif not ok and member.healthy:
                self._log(logging.WARNING, "replica %s of %s failed its health check",
                          member, "replica_unhealthy")
            member.healthy = ok
            if stats is not None:
                member.stats = stats
            if member.silent == SILENT_PROBES_TO_CUT:
                # Unreachable (a partition: not a drain, not a refusal). Its open requests
                # would wait for it indefinitely; closing its connections fails over those
                # before their first byte and ends the others with an error.
                self._log(logging.WARNING, "replica %s of %s does not answer; closing its "
                          "connections", member, "replica_silent")
                with contextlib.suppress(Exception):
                    await member.client.close()
        self.wake()

    def drain(self, member_id: str, draining: bool) -> bool:
        """Stop (or resume) sending new work to a member; False: no such member."""
        for member in self.members():
            if member.id == member_id:
                member.draining = draining
                self._log(logging.INFO, "replica %s of %s " + (
                    "draining" if draining else "back in service"), member,
                    "replica_drain" if draining else "replica_undrain")
                return True
        return False

    def _log(self, level: int, message: str, member: Member, event: str) -> None:
        logger.log(level, message, member.id, self.name, extra={
            "event": event, "replica": member.id, "deployment": self.name})

    async def _loop(self, with_stats: Callable[[], bool]) -> None:
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            try:
                await self.check(with_stats())
            except Exception:  # never let the loop die
                logger.exception("health checks of %s failed", self.name)


async def probe(
    member: Member, spec: BalancerSpec, with_stats: bool,
) -> tuple[bool, EngineStats | None]:
    """One health check of `member` (and its stats if `with_stats`: an engine replica);
    counts the probes in a row that got no answer at all."""
    timeout = max(0.5, spec.health_interval_s)
    try:
        async with asyncio.timeout(timeout):
            ok = bool(await member.client.health())
            stats = None
            if ok and with_stats and has_engine_stats(member.client):
                with contextlib.suppress(ReplicaError):
                    stats = await engine_of(member.client).stats()
            member.silent = 0
            return ok, stats
    except TimeoutError:
        member.silent += 1
        return False, None
    except (ReplicaError, OSError):
        return False, None


def record_success(member: Member) -> None:
    """A request reached `member`: its run of failures ends, and so does its run of
    ejections (the next one starts from `eject_base_s` again)."""
    member.failures = 0
    member.ejections = 0
    member.served += 1


def record_failure(
    member: Member, exc: Exception, spec: BalancerSpec, pool: str, *,
    before_first_byte: bool,
) -> None:
    """A request failed on `member` (of the pool named `pool`): marks it down when
    nothing listens, ejects it after `spec.eject_after` failures in a row."""
    member.failed += 1
    member.failures += 1
    if before_first_byte and isinstance(exc, ReplicaConnectionError) and (
            "Connect" in str(exc) or "refused" in str(exc).lower()):
        member.healthy = False  # nothing listens: the process is gone
    now = time.monotonic()
    if now < member.ejected_until:
        # Requests that were already on it when it failed report in after the ejection:
        # one incident, so it must not double the ejection once per batch of them (a
        # killed replica's 16 broken streams took it to the 60 s cap at once).
        member.failures = 0
        return
    if member.failures >= spec.eject_after:
        span = min(MAX_EJECTION_S, spec.eject_base_s * 2 ** member.ejections)
        member.ejected_until = now + span
        member.ejections += 1
        member.failures = 0
        logger.warning("replica %s of %s ejected for %.1f s after %r", member.id,
                       pool, span, exc, extra={
                           "event": "replica_ejected", "replica": member.id, "deployment": pool,
                           "ejected_for_s": span, "error": repr(exc)})


__all__ = ["MAX_EJECTION_S", "SILENT_PROBES_TO_CUT", "SILENT_PROBES_TO_UNHEALTHY",
           "HealthChecks", "probe", "record_failure", "record_success"]
