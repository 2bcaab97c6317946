"""Stepping a scheduler on a GPU with torch's sync debug mode set to "error", so that any call that
waits for the stream raises (the overlapped scheduler must never wait for the step it launched)."""

from __future__ import annotations

import torch


def decode_steps_without_waiting(scheduler) -> int:
    """Prefill everything, then step while every request decodes under the sync check, then drain;
    returns how many steps ran under the check."""
    while scheduler.waiting:
        scheduler.step()
    checked = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while scheduler.has_work and not scheduler.waiting:
            scheduler.step()
            checked += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while scheduler.has_work:
        scheduler.step()
    return checked
