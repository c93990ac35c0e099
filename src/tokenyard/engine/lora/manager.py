"""The replica's adapters: every registered one read into host memory, `max_loras` of them
resident in the bank's slots, and which slot each running request holds.

The scheduler asks for a request's slot when it starts the request (`acquire`) and gives
it back when the request finishes or is preempted (`release`); a request whose adapter
finds no slot (all held by running requests) waits, passed over by those behind it. A
slot taken over by another adapter is only reserved then: its weights are written by the
runner on the kernel thread (`take_writes`, `apply`) just before the first step that reads
it, so a step still in flight that read the slot's old adapter (for a request since
finished) computes with the weights it was planned with.

Adapters may be registered and forgotten while the engine runs (the replica's HTTP
thread, `POST /v1/engine/loras`): the bookkeeping is under one lock, and an adapter
forgotten while requests still wait for it stays in host memory (unlisted) for them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from tokenyard.engine.lora.adapter import AdapterError, LoraAdapter, load_adapter
from tokenyard.engine.lora.bank import LoraBank, out_sizes
from tokenyard.engine.request import Request
from tokenyard.lora_spec import valid_lora_name


class UnknownAdapter(ValueError):
    """A request names an adapter this replica does not serve."""


class LoraManager:
    def __init__(self, model: Any, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.max_rank = max_rank
        self.bank = LoraBank(model, max_loras, max_rank, device, dtype)
        self.adapters: dict[str, LoraAdapter] = {}
        self._gone: dict[str, LoraAdapter] = {}  # forgotten, for requests still waiting
        self._versions: dict[str, int] = {}  # registrations per name
        self._writes: list[tuple[int, LoraAdapter]] = []
        self._lock = threading.Lock()

    @property
    def rows(self) -> Any:
        return self.bank.rows

    @property
    def in_use(self) -> bool:
        """Whether a running request holds a slot (else no step row is adapted)."""
        return self.bank.num_users > 0

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the adapter at `path` as `name` (replacing one of that name that no
        request holds); AdapterError if it cannot be served on this model."""
        if not valid_lora_name(name):
            raise AdapterError(f"adapter name {name!r}: up to 64 letters, digits, '.', '_' "
                               "and '-'")
        adapter = load_adapter(path, name, self.max_rank)
        self._check_shapes(adapter)
        with self._lock:
            self.bank.evict(name)  # its slot (if any) holds the weights it replaces
            self._gone.pop(name, None)
            self.adapters[name] = adapter
            self._versions[name] = self._versions.get(name, 0) + 1
        return adapter

    def cache_name(self, name: str) -> str:
        """What salts the prefix cache of adapter `name`'s requests: its name, and after a
        second registration of the name its version too, so KV computed with the weights
        it replaced is never read with the new ones. (The gateway salts its affinity
        hashes by the name alone: a replaced adapter's hints only miss.)"""
        version = self._versions.get(name, 1)
        return name if version <= 1 else f"{name}@{version}"

    def unregister(self, name: str) -> bool:
        """Forget adapter `name`; False if unknown. Requests holding it keep its slot's
        weights until they end."""
        with self._lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                return False
            self._gone[name] = adapter
            self.bank.evict(name)
        return True

    def check(self, name: str) -> None:
        if name not in self.adapters:
            raise UnknownAdapter(f"this replica serves no LoRA adapter {name!r}")

    def ready(self, request: Request) -> bool:
        """Whether the request can hold its adapter's slot now."""
        if request.lora is None or request.lora_slot > 0:
            return True
        with self._lock:
            return self.bank.can_reserve(request.lora)

    def acquire(self, request: Request) -> None:
        """Give a starting request its adapter's slot (`ready` said there is one)."""
        name = request.lora
        if name is None or request.lora_slot:
            return
        with self._lock:
            slot, fresh = self.bank.reserve(name)
            if fresh:
                self._writes.append((slot, self.adapters.get(name) or self._gone[name]))
            self.bank.acquire(slot)
        request.lora_slot = slot

    def release(self, request: Request) -> None:
        if request.lora_slot:
            with self._lock:
                self.bank.release(request.lora_slot)
            request.lora_slot = 0

    def take_writes(self) -> list[tuple[int, LoraAdapter]]:
        """The slot writes reserved since the last call, for the next step to apply."""
        with self._lock:
            writes, self._writes = self._writes, []
        return writes

    def apply(self, writes: list[tuple[int, LoraAdapter]]) -> None:
        """Write `take_writes`' adapters into their slots (on the kernel thread)."""
        for slot, adapter in writes:
            self.bank.write(slot, adapter)

    def _check_shapes(self, adapter: LoraAdapter) -> None:
        layers = getattr(self.model, "layers", None)
        if layers is None:
            raise AdapterError("this model takes no LoRA adapters")
        for (index, fused), parts in adapter.parts.items():
            if index >= len(layers):
                raise AdapterError(f"{adapter.path}: layer {index}; the model has "
                                   f"{len(layers)}")
            layer = layers[index]
            linear = getattr(layer, fused)
            sizes = out_sizes(layer, fused, linear.out_features)
            for part in parts:
                if (part.a.shape[1] != linear.in_features
                        or part.b.shape[0] != sizes[part.slice]):
                    raise AdapterError(f"{adapter.path}: layer {index} {fused}: the "
                                       "adapter's shapes do not fit this model")
