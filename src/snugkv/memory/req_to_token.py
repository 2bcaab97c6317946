"""The request-to-token table: the first level of the mapping request -> token slots -> KV data.

This module owns the table `req_to_token[req_idx, position] = slot` (int32,
`[max_requests + 1, max_context_len]`) and which of its rows are handed out. Row 0 is the padding
row used by padded decode rows: it is never handed out, never written, and stays all zeros (the
dummy slot). The module never allocates or frees KV slots; that is the slot allocator's job.

The table lives on the device (kernels read it) and has a copy in host memory that every write
updates too. The host reads slots only from its copy (`slots_of`), so reading them never waits
for a step the GPU is still running; `check_host_copy` proves the two agree.
"""

from __future__ import annotations

import bisect

import torch

from snugkv.core.transfer import to_device
from snugkv.memory.moves import PageMoves


class ReqToTokenPool:
    """Rows of the request-to-token table, handed out lowest first.

    `cap_requests(n)` hides rows above n from `alloc` (used when the KV pool turned out smaller
    than `max_requests` implies); rows above n that are in use stay valid until freed.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if max_requests < 1 or max_context_len < 1:
            raise ValueError(
                f"max_requests and max_context_len must be >= 1, got {max_requests} and {max_context_len}"
            )
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (max_requests + 1, max_context_len), dtype=torch.int32, device=self.device
        )
        self.req_to_token_host = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32)
        self._free_rows = list(range(1, max_requests + 1))  # sorted ascending
        self._in_use = [False] * (max_requests + 1)
        self._cap = max_requests

    @property
    def request_cap(self) -> int:
        """Rows 1..request_cap may be handed out."""
        return self._cap

    @property
    def available_requests(self) -> int:
        return bisect.bisect_right(self._free_rows, self._cap)

    def alloc(self) -> int | None:
        """The lowest free row at or below the cap, or None when there is none."""
        if not self._free_rows or self._free_rows[0] > self._cap:
            return None
        row = self._free_rows.pop(0)
        self._in_use[row] = True
        return row

    def free(self, req_idx: int) -> None:
        self._check_in_use(req_idx, "free")
        self._in_use[req_idx] = False
        bisect.insort(self._free_rows, req_idx)

    def cap_requests(self, max_requests: int) -> None:
        """Hand out only rows 1..max_requests from now on (0 <= max_requests <= the table's)."""
        if not 0 <= max_requests <= self.max_requests:
            raise ValueError(
                f"cap_requests takes 0..{self.max_requests} (the table's row count), got {max_requests}"
            )
        self._cap = max_requests

    def write(self, req_idx: int, start: int, slots: torch.Tensor) -> None:
        """Store `slots` at positions `start .. start + len(slots) - 1` of row `req_idx`."""
        self._check_in_use(req_idx, "write")
        slots = slots.reshape(-1)
        end = start + slots.numel()
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"write to request row {req_idx} covers positions {start}..{end - 1}, outside the "
                f"table's 0..{self.max_context_len - 1}; raise max_context_len or shorten the request"
            )
        self.req_to_token_host[req_idx, start:end] = slots.to(device="cpu", dtype=torch.int32)
        self.req_to_token[req_idx, start:end] = to_device(slots, torch.int32, self.device)

    def write_positions(
        self, req_indices: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Store `slots[i]` at position `positions[i]` of row `req_indices[i]` (int64 CPU tensors,
        rows handed out, positions inside the table) and return the slots on the device: one copy
        to the device, queued behind the stream's work."""
        self.req_to_token_host[req_indices, positions] = slots.to(torch.int32)
        packed = to_device(torch.cat([req_indices, positions, slots]), torch.int64, self.device)
        rows, columns, device_slots = packed.view(3, -1)
        self.req_to_token[rows, columns] = device_slots.to(torch.int32)
        return device_slots

    def slots_of(self, req_idx: int, end: int) -> torch.Tensor:
        """Slots of positions `0 .. end - 1` of row `req_idx` as int64, from the host copy."""
        return self.req_to_token_host[req_idx, :end].to(torch.int64)

    def check_host_copy(self) -> None:
        """Raise `RuntimeError` unless the device table and its host copy agree on every row in use
        (a write that went to one only would hand out or free the wrong slots). Reads the device."""
        rows = [row for row in range(1, self.max_requests + 1) if self._in_use[row]]
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64)
        device_rows = self.req_to_token[index.to(self.device)].to("cpu")
        differs = torch.nonzero(device_rows != self.req_to_token_host[index])
        if differs.numel():
            row, position = rows[int(differs[0, 0])], int(differs[0, 1])
            raise RuntimeError(
                f"request-to-token table: row {row} position {position} holds slot "
                f"{int(self.req_to_token[row, position])} on the device but "
                f"{int(self.req_to_token_host[row, position])} in the host copy"
            )

    def remap_slots(self, moves: PageMoves, page_size: int) -> None:
        """Point every handed-out row at the new place of each moved page (a shrink moved them);
        graphs read slots through this table, so they follow without being captured again."""
        rows = [row for row in range(1, self.max_requests + 1) if self._in_use[row]]
        if not rows or not moves.num_pages:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.req_to_token[index] = moves.remap_slots(self.req_to_token[index], page_size)
        host_index = index.cpu()
        self.req_to_token_host[host_index] = moves.remap_slots(self.req_to_token_host[host_index], page_size)

    def _check_in_use(self, req_idx: int, action: str) -> None:
        if req_idx == 0:
            raise ValueError(f"cannot {action} row 0: it is the padding row and is never handed out")
        if not 0 < req_idx <= self.max_requests:
            raise ValueError(f"cannot {action} row {req_idx}: rows are 1..{self.max_requests}")
        if not self._in_use[req_idx]:
            what = "double free of" if action == "free" else "cannot write to free"
            raise ValueError(f"{what} request row {req_idx}: it is not allocated")
