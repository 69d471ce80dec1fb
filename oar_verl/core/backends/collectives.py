"""Keeping data-parallel ranks in step: every rank must issue the same number of collective passes, or they hang.
verl-free, so that both integrations (verl's workers, OpenRLHF's DeepSpeed actors) share it."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: int, device: torch.device | str | int | None = None) -> int:
    """Max of ``value`` over every rank of the default process group (``value`` itself without one).

    Ranks holding fewer or shorter sequences pad their pass count to the max, so that sharded-parameter collectives
    stay matched. The reduction runs on CPU under gloo, else on ``device`` (default: the current accelerator, which
    NCCL/HCCL need).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    if dist.get_backend() == "gloo":
        device = "cpu"
    elif device is None:
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
