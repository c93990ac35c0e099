"""Failed authentications, counted per client address: a brute-force guard.

Every failed key costs a store query (an unknown key is cached for a second only), and a
caller guessing keys should get nowhere fast. After `max_failures` failed
authentications from one address within a window of `window_s`, every authentication
from that address — with a good key too, else a guess would still tell a hit from a
miss — is refused with 429 and `retry-after` until the window ends. Successes do not
reset the count: an attacker holding one valid key must not wash its guesses with it.

The counts live in this process (per HTTP worker), in a bounded table; an address is the
TCP peer, never a header the client could set. Behind a proxy every client shares the
proxy's address, so raise the figure there (or set it to 0 to turn the guard off).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from tokenyard.errors import rate_limited


class FailedAuthThrottle:
    """Per address: (window start, failures in it)."""

    def __init__(
        self, max_failures: int, window_s: float = 60.0, *, max_addresses: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._max_addresses = max_addresses
        self._clock = clock
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def _window(self, address: str) -> tuple[float, int] | None:
        entry = self._windows.get(address)
        if entry is not None and self._clock() - entry[0] >= self.window_s:
            del self._windows[address]
            return None
        return entry

    def check(self, address: str | None) -> None:
        """Raise 429 if `address` has used up its failures in this window."""
        if not self.max_failures or address is None:
            return
        entry = self._window(address)
        if entry is not None and entry[1] >= self.max_failures:
            wait = max(entry[0] + self.window_s - self._clock(), 0.001)
            raise rate_limited(
                f"Too many failed authentication attempts from this address; retry in "
                f"{math.ceil(wait)} s.", retry_after_s=wait)

    def failed(self, address: str | None) -> None:
        """Count one failed authentication from `address`."""
        if not self.max_failures or address is None:
            return
        entry = self._window(address)
        start, count = entry if entry is not None else (self._clock(), 0)
        self._windows[address] = (start, count + 1)
        self._windows.move_to_end(address)
        while len(self._windows) > self._max_addresses:
            self._windows.popitem(last=False)
