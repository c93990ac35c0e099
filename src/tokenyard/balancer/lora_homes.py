"""Where a pool's LoRA adapters are resident: the replicas each adapter's requests were
sent to last, as this gateway saw it.

A replica holds `--max-loras` adapters and evicts the least recently used; an adapter's
first request there loads it (a copy of its weights into the replica's slots). So a
request of an adapter goes to a replica that served it lately, before one that did not,
unless that replica's outstanding work exceeds the least loaded one's by more than
`LORA_SLACK_TOKENS`: the policy's order stands otherwise (and among the holders). Each
replica remembers at most `MAX_PER_MEMBER` adapters, the most recent first.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenyard.balancer.members import Member

#: Outstanding tokens a replica holding the adapter may carry beyond the least loaded
#: one's and still be preferred.
LORA_SLACK_TOKENS = 4096
#: Adapters remembered per replica (a replica evicts past its own `--max-loras`).
MAX_PER_MEMBER = 16


class LoraHomes:
    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[str, None]] = {}  # member id -> adapters

    def served(self, lora: str, member: Member) -> None:
        """`member` took a request of adapter `lora`: it holds it now."""
        held = self._held.setdefault(member.id, OrderedDict())
        held[lora] = None
        held.move_to_end(lora)
        while len(held) > MAX_PER_MEMBER:
            held.popitem(last=False)

    def holds(self, member: Member, lora: str) -> bool:
        return lora in self._held.get(member.id, ())

    def first(self, order: list[Member], lora: str) -> list[Member]:
        """`order` with the members that hold `lora` (and are not much busier than the
        least loaded) moved to the front, each side in its own order."""
        least = min(m.inflight_tokens for m in order)
        near = [m for m in order if self.holds(m, lora)
                and m.inflight_tokens - least <= LORA_SLACK_TOKENS]
        if not near or near[0] is order[0]:
            return order
        return near + [m for m in order if m not in near]
