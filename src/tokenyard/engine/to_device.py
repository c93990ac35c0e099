"""Host tensors onto the model's device without making the host wait for it."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU `tensor` on `device`: itself on the CPU; elsewhere a pinned copy sent
    asynchronously. From pageable memory the driver may first wait for the stream's
    work to finish (a step in flight), which pinned memory spares; torch keeps the
    pinned block until the copy is done."""
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
