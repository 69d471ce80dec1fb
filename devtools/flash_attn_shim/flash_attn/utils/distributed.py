"""``flash_attn.utils.distributed.all_gather`` in plain torch.distributed (gloo on CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather"]


def all_gather(input_: torch.Tensor, process_group) -> torch.Tensor:
    """(world * N, ...) the ranks' (N, ...) tensors concatenated along the first axis, in rank order."""
    world = dist.get_world_size(process_group)
    parts = [torch.empty_like(input_) for _ in range(world)]
    dist.all_gather(parts, input_.contiguous(), group=process_group)
    return torch.cat(parts, dim=0)
