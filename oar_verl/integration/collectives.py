"""Keeping data-parallel ranks in step: every rank must issue the same number of collective passes, or they hang."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: int, device: torch.device | str | int | None = None) -> int:
    """Max of ``value`` over every rank of the default process group (``value`` itself without one).

    Ranks holding fewer or shorter sequences pad their pass count to the max, so that sharded-parameter collectives
    stay matched. The reduction runs on CPU under gloo, else on ``device`` (default: verl's current device).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    if dist.get_backend() == "gloo":
        device = "cpu"
    elif device is None:
        from verl.utils.device import get_device_id

        device = get_device_id()
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
