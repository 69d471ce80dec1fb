"""Keeping ranks in step: every rank must issue the same number of collective passes, or they hang; an object gather
over the ranks, a differentiable sum over a sequence-parallel group, an error flag every rank raises on together, and
a model-parallel group's outputs shared from the one rank that holds them. verl-free, so that both integrations
(verl's workers, OpenRLHF's DeepSpeed actors) share it."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: int, device: torch.device | str | int | None = None) -> int:
    """Max of ``value`` over every rank of the default process group (``value`` itself without one).

    Ranks holding fewer or shorter sequences pad their pass count to the max, so that sharded-parameter collectives
    stay matched. The reduction runs where :func:`collective_device` says (the CPU under gloo, else ``device`` or
    the current accelerator, which NCCL/HCCL need).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=collective_device(device=device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def collective_device(group=None, device: torch.device | str | int | None = None) -> torch.device:
    """Where a small collective over ``group`` (default: the default process group) runs: on the CPU where the group
    has a CPU backend (gloo, or a per-device one such as verl's ``cpu:gloo,cuda:nccl``: no accelerator sync), else on
    ``device`` if it is an accelerator, else on the current accelerator (which NCCL/HCCL need)."""
    backend = str(dist.get_backend(group))
    if backend == "gloo" or "cpu:gloo" in backend:
        return torch.device("cpu")
    if device is not None and torch.device(device).type != "cpu":
        return torch.device(device)
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def any_over_ranks(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of the default process group (``flag`` itself without one): called by every
    rank at the same point, it lets all of them raise together when one finds an error, so that none is left waiting
    in a collective the others never reach."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.long, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def from_source(values: torch.Tensor | None, size: int, *, source: bool, group,
                device: torch.device | str | int | None = None) -> torch.Tensor | None:
    """The ``size`` values of the one source rank of ``group`` (a model-parallel group, whose engine hands its outputs
    to one rank only), as (size,) float64 on the CPU on every rank of the group, or None on every rank when the source
    has none. Every rank of ``group`` calls it together, with the same ``size``; ``source``: this rank is the source
    (the others' ``values`` are ignored). One all-reduce (sum) of ``size + 3`` float64: the sources counted, whether
    the source had values and whether they had ``size`` of them, then the values (the other ranks add zeros: exact).

    Raises:
        RuntimeError: on every rank of the group alike, when it has not exactly one source, or the source's values
            are not ``size`` long.
    """
    if group is None or dist.get_world_size(group) == 1:
        if values is not None and values.numel() != size:
            raise RuntimeError(f"oar: {values.numel()} values where {size} were expected")
        return None if values is None else values.detach().reshape(-1).to("cpu", torch.float64)
    buf = torch.zeros(size + 3, dtype=torch.float64, device=collective_device(group, device))
    if source:
        buf[0] = 1.0
        if values is not None:
            if values.numel() == size:
                buf[1] = 1.0
                buf[3:] = values.detach().reshape(-1).to(buf.device, torch.float64)
            else:
                buf[2] = 1.0
    dist.all_reduce(buf, group=group)
    sources, has, bad = buf[:3].tolist()  # the same on every rank: all raise together
    if sources != 1.0:
        raise RuntimeError(f"oar: a model-parallel group of {dist.get_world_size(group)} ranks has {int(sources)} "
                           "ranks holding the engine's outputs (expected one: engine.is_mp_src_rank_with_outputs())")
    if bad:
        raise RuntimeError(f"oar: the output rank of a model-parallel group holds other than the {size} values every "
                           "rank of it expects")
    return buf[3:].cpu() if has else None


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
