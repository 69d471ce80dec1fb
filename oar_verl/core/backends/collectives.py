"""Keeping data-parallel ranks in step: every rank must issue the same number of collective passes, or they hang;
an object gather over the ranks, and a differentiable sum over a sequence-parallel group. verl-free, so that both
integrations (verl's workers, OpenRLHF's DeepSpeed actors) share it."""

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


def gather_objects(obj) -> list:
    """Every rank's ``obj`` over the default process group, rank by rank (``[obj]`` without one). Every rank calls it
    together."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the group; backward is the identity (each rank's gradient is its own share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Σ of ``x`` over the ranks of ``group``, differentiable: when every rank back-propagates the same loss of the
    sum, each rank's part receives the loss's gradient once (a sequence shard's partial sums of a probe)."""
    return _SumOverGroup.apply(x, group)
