"""The replica's resident adapters, by slot, and the one op that applies them to a step.

Each adapted projection holds `LoraWeights`: the A matrices of every slot stacked row-wise
(`a` [S*w, in]) and the B matrices transposed, stacked likewise (`bt` [S*w, out]), where `w`
is the projection's width per slot (its output slices times `max_rank`; a smaller rank
leaves zeros). A step's rows name their slot (0: no adapter); the eager delta of a
projection is then

    ((x @ a.T) * mask) @ bt

with `mask` [T, S*w] one over each row's own slot block: two matmuls and a multiply per
projection whatever the mix of adapters, and no gather. A row of no adapter gets a zero
delta; a step with no adapted row skips the op altogether (`LoraRows.slots` is None). The
one-op decode step (kernels/decode_step.cpp) reads the same `a` and `bt`, each row its own
slot's block, only the ranks its adapter has on each slice (`ranks`), and each slice's
ranks only the slice's output columns.

`LoraBank` loads adapters into slots, least recently used out first, never one a running
request holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tokenyard.engine.lora.adapter import SLICES, LoraAdapter


@dataclass
class LoraRows:
    """The step's rows' slots, set by the runner before the forward pass."""

    slots: torch.Tensor | None = None  # [T] int64, 0: no adapter; None: no adapted row
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    num_slots: int = 0
    dtype: torch.dtype = torch.float32  # the model's, which the masks are made in

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots = slots
        self._masks = {}

    def mask(self, width: int) -> torch.Tensor:
        """[T, num_slots * width]: 1 over each row's slot block."""
        mask = self._masks.get(width)
        if mask is None:
            assert self.slots is not None
            cols = torch.arange(self.num_slots * width, device=self.slots.device) // width
            mask = (cols[None, :] == (self.slots - 1)[:, None]).to(self.dtype)
            self._masks[width] = mask
        return mask


class LoraWeights:
    """Every slot's A and B of one fused projection."""

    def __init__(self, rows: LoraRows, num_slots: int, max_rank: int, in_features: int,
                 out_sizes: list[int], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.rows = rows
        self.max_rank = max_rank
        self.width = len(out_sizes) * max_rank
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.a = torch.zeros(num_slots * self.width, in_features, device=device, dtype=dtype)
        self.bt = torch.zeros(num_slots * self.width, sum(out_sizes), device=device,
                              dtype=dtype)
        #: [slots, slices]: the rank each slot's adapter has on each output slice (0: it
        #: leaves the slice alone), where the decode op stops (its ranks above are zero).
        self.ranks = torch.zeros(num_slots, len(out_sizes), dtype=torch.int64)

    def place(self, slot: int, parts: list[Any]) -> None:
        """Write an adapter's parts into `slot` (1-based); parts it lacks stay zero."""
        base = (slot - 1) * self.width
        self.a[base:base + self.width].zero_()
        self.bt[base:base + self.width].zero_()
        self.ranks[slot - 1].zero_()
        for part in parts:
            r = part.a.shape[0]
            col = base + part.slice * self.max_rank
            out = self.offsets[part.slice]
            self.a[col:col + r].copy_(part.a)
            self.bt[col:col + r, out:out + part.b.shape[0]].copy_(part.b.t())
            self.ranks[slot - 1, part.slice] = r

    @property
    def active(self) -> bool:
        """Whether this step has an adapted row."""
        return self.rows.slots is not None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out]: each row's own adapter's update (zero for slot 0)."""
        h = F.linear(x, self.a).mul_(self.rows.mask(self.width))
        return torch.mm(h, self.bt)


class SlotsFull(RuntimeError):
    """Every slot holds an adapter that a running request uses."""


class LoraBank:
    """Up to `max_loras` adapters resident on one model."""

    def __init__(self, model: Any, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.rows = LoraRows(num_slots=max_loras, dtype=dtype)
        self._weights: dict[tuple[int, str], LoraWeights] = {}
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self._users: dict[int, int] = {}  # slot -> running requests using it
        self.num_loads = 0

    @property
    def num_users(self) -> int:
        """Running requests holding a slot."""
        return sum(self._users.values())

    @property
    def resident(self) -> list[str]:
        return [name for name in self._slots if not name.startswith("\x00")]

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def load(self, adapter: LoraAdapter) -> int:
        """The adapter's slot, loading it (over the least recently used idle one)."""
        slot, fresh = self.reserve(adapter.name)
        if fresh:
            self.write(slot, adapter)
        return slot

    def reserve(self, name: str) -> tuple[int, bool]:
        """The slot of adapter `name` and whether its weights are still to be written
        there (`write`): a free slot, else the least recently used idle one's. The engine
        reserves when it schedules and writes on the kernel thread before the step that
        first reads the slot, after every step in flight that read the slot before."""
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
            return slot, False
        used = set(self._slots.values())
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if free:
            slot = free[0]
        else:
            idle = [n for n, s in self._slots.items() if not self._users.get(s)]
            if not idle:
                raise SlotsFull(f"all {self.max_loras} LoRA slots are in use")
            slot = self._slots.pop(idle[0])
        self._slots[name] = slot
        return slot, True

    def can_reserve(self, name: str) -> bool:
        """Whether `reserve(name)` would find a slot."""
        return (name in self._slots or len(self._slots) < self.max_loras
                or any(not self._users.get(s) for s in self._slots.values()))

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Place the adapter's weights in `slot`, zeroing what it leaves alone."""
        for (layer, fused), parts in adapter.parts.items():
            self._projection(layer, fused).place(slot, parts)
        # A projection this adapter leaves alone may hold a previous one's weights.
        for key, weights in self._weights.items():
            if key not in adapter.parts:
                weights.place(slot, [])
        self.num_loads += 1

    def evict(self, name: str) -> None:
        """Forget adapter `name`'s slot. One that running requests hold stays taken, under
        no name, until the last of them releases it (then it is the first reused)."""
        slot = self._slots.pop(name, None)
        if slot is not None and self._users.get(slot):
            retired = f"\x00retired-{slot}"
            self._slots[retired] = slot
            self._slots.move_to_end(retired, last=False)

    def acquire(self, slot: int) -> None:
        self._users[slot] = self._users.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        left = self._users.get(slot, 0) - 1
        if left > 0:
            self._users[slot] = left
        else:
            self._users.pop(slot, None)

    def _projection(self, layer_index: int, fused: str) -> LoraWeights:
        weights = self._weights.get((layer_index, fused))
        if weights is None:
            layer = self.model.layers[layer_index]
            linear = getattr(layer, fused)
            # (A GGUF's block weights or a packed int8 one leave `weight` empty.)
            out_features, in_features = linear.out_features, linear.in_features
            weights = LoraWeights(self.rows, self.max_loras, self.max_rank, in_features,
                                  out_sizes(layer, fused, out_features), self.device,
                                  self.dtype)
            linear.lora = weights
            self._weights[(layer_index, fused)] = weights
        return weights


def out_sizes(layer: Any, fused: str, out_features: int) -> list[int]:
    """The output slices of a fused projection: q/k/v, gate/up, or the whole."""
    if fused == "qkv_proj":
        q = layer.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim
        return [q, kv, kv]
    parts = SLICES[fused]
    return [out_features // parts] * parts
