"""Host <-> device copies that never make the host wait for the GPU's queue.

A plain `.to("cuda")` of a CPU tensor, `torch.tensor(values, device="cuda")` or `.cpu()` of a
device tensor waits until everything already queued on the stream has run: one such copy while a
step runs makes the host wait for that step. Here copies go through pinned host memory with
`non_blocking`: a copy to the device is queued behind the stream's work, and a copy to the host
is readable once the stream passed it (the caller records an event after it and waits on that
event, not on the whole stream). On a CPU device both are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`, queued behind the stream's work (no host wait)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.to(dtype).pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, queued on the stream: read it only after an event recorded after
    this call has completed. A CPU tensor is returned as it is."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
