"""The brute-force guard counts failed authentications per address, per window."""

from __future__ import annotations

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.auth_throttle import FailedAuthThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_refused_after_its_failures_until_the_window_ends() -> None:
    clock = Clock()
    guard = FailedAuthThrottle(3, 60.0, clock=clock)
    for _ in range(3):
        guard.check("10.0.0.1")
        guard.failed("10.0.0.1")
    with pytest.raises(APIError) as refused:
        guard.check("10.0.0.1")
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "60"
    guard.check("10.0.0.2")  # another address is not affected
    clock.now += 45
    with pytest.raises(APIError) as later:
        guard.check("10.0.0.1")
    assert later.value.headers["retry-after"] == "15"
    clock.now += 15
    guard.check("10.0.0.1")  # a new window


def test_zero_turns_it_off_and_the_table_is_bounded() -> None:
    off = FailedAuthThrottle(0)
    for _ in range(100):
        off.failed("10.0.0.1")
    off.check("10.0.0.1")
    guard = FailedAuthThrottle(1, max_addresses=2)
    for address in ("a", "b", "c"):
        guard.failed(address)
    guard.check("a")  # evicted: the oldest address went first
    with pytest.raises(APIError):
        guard.check("c")
