"""Standalone two-rank check of OpenRLHF 0.11.2's ZeRO-3 model load (no OAR code, no Ray): is every parameter, as
gathered, equal to the checkpoint right after ``Actor(path, ds_config=...)`` and after ``strategy.prepare``?

    python -m torch.distributed.run --nproc_per_node 2 tests/openrlhf/zero3_load_repro.py MODEL_DIR [REPEATS] [DTYPE] \
        [sequential]
    python -m torch.distributed.run --nproc_per_node 2 tests/openrlhf/zero3_load_repro.py race [ROUNDS]

OpenRLHF's policy actor loads a path under ZeRO-3 like this (``trainer/ray/ppo_actor.py``): ``Actor(pretrain,
param_dtype=bf16, ds_config=strategy.get_ds_train_config())`` (inside, ``HfDeepSpeedConfig`` makes transformers build
the model under ``deepspeed.zero.Init`` and load the checkpoint into the partitioned parameters), then
``strategy.prepare`` (``deepspeed.initialize``). This script does the same with OpenRLHF's own ``Actor`` and
``DeepspeedStrategy`` on gloo, ``REPEATS`` times per process (default 3), and after each load gathers every parameter
and compares it with the checkpoint tensor cast to the load dtype (``DTYPE``: bf16, the default, or fp16). Tensors the
checkpoint leaves out are named (a tied ``lm_head`` shares the embedding's storage, checked through it).

Prints one line per load and rank: ``LOAD <i> rank <r> <when>: params N, nonfinite K, differ D`` with the names of the
first offenders, and exits 1 when any load was wrong. ``sequential`` sets DeepSpeed's ``allgather_sequential`` (what
the CPU platform does). ``race`` runs the pattern at the root of it alone: DeepSpeed's coalesced gather waits on the
last of its asynchronous all-gathers only, and on gloo the earlier ones may still be running (docs/openrlhf.md).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _strategy(dtype: str):
    """OpenRLHF's own DeepspeedStrategy with the ZeRO-3 settings train_ppo_ray gives the policy actor (its defaults
    otherwise). DeepSpeed's fused Adam is a CUDA kernel: torch's AdamW stands in (``torch_adam``)."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = SimpleNamespace(ds=SimpleNamespace(zero_stage=3, param_dtype=dtype),
                           train=SimpleNamespace(dynamic_batch_enable=False))
    strategy = DeepspeedStrategy(seed=42, max_norm=1.0, micro_train_batch_size=1, train_batch_size=2, zero_stage=3,
                                 args=args)
    config = strategy.get_ds_train_config

    def torch_adam(*a, **k):
        cfg = config(*a, **k)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["torch_adam"] = True
        return cfg

    strategy.get_ds_train_config = torch_adam
    return strategy


TRAIN_CFG = dict(optim="adam", muon={}, adam=dict(lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
                 lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, scheduler_steps=10)


def check(model, ckpt: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[int, list[str], list[str]]:
    """(parameters, names holding a non-finite value, names that differ from the checkpoint) as gathered."""
    import deepspeed

    nonfinite, differ, n = [], [], 0
    for name, param in model.named_parameters():
        n += 1
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            value = param.data.detach().clone()
        key = name
        if not torch.isfinite(value.float()).all():
            nonfinite.append(name)
        ref = ckpt.get(key)
        if ref is None and key == "lm_head.weight":  # tied to the embedding, which the checkpoint holds
            ref = ckpt.get("model.embed_tokens.weight")
        if ref is None:
            differ.append(f"{name} (not in the checkpoint)")
        elif tuple(ref.shape) != tuple(value.shape) or not torch.equal(ref.to(dtype), value.to(dtype)):
            bad = (ref.to(dtype).float() - value.float()).abs()
            differ.append(f"{name} (max abs diff {float(bad.nan_to_num(float('inf')).max()):.3g})")
    return n, nonfinite, differ


def race(rounds: int) -> int:
    """DeepSpeed's coalesced-gather pattern on gloo, alone: one async all-gather per tensor (a Linear's weight, then
    its bias), wait on the last handle only, then read the first buffer. Prints how often it was still unfilled."""
    import deepspeed
    import deepspeed.comm as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    weight, bias = torch.full((1 << 18,), float(rank + 1)), torch.full((64,), float(rank + 1))
    unfilled = 0
    for _ in range(rounds):
        out_w = torch.full((world * weight.numel(),), float("nan"))
        out_b = torch.full((world * bias.numel(),), float("nan"))
        handles = [dist.all_gather_into_tensor(out_w, weight, async_op=True),
                   dist.all_gather_into_tensor(out_b, bias, async_op=True)]
        handles[-1].wait()  # what _allgather_params_coalesced waits on
        unfilled += int(bool(torch.isnan(out_w).any()))
        handles[0].wait()
    print(f"RACE rank {rank}: the first gather unfilled after waiting on the last in {unfilled} of {rounds} rounds",
          flush=True)
    dist.barrier()
    return 0


def main() -> int:
    if sys.argv[1] == "race":
        return race(int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    model_dir = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dtype_name = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    sequential = len(sys.argv) > 4 and sys.argv[4] == "sequential"  # the CPU platform's fix (allgather_sequential)
    import deepspeed
    import torch.distributed as dist
    from openrlhf.models import Actor

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    ckpt = _checkpoint(model_dir)
    strategy = _strategy(dtype_name)
    failed = False

    def report(i: int, when: str, model) -> None:
        nonlocal failed
        n, nonfinite, differ = check(model, ckpt, dtype)
        failed |= bool(nonfinite or differ)
        names = "; ".join((nonfinite + differ)[:6])
        print(f"LOAD {i} rank {rank} {when}: params {n}, nonfinite {len(nonfinite)}, differ {len(differ)} {names}",
              flush=True)

    for i in range(repeats):
        ds_config = strategy.get_ds_train_config()
        ds_config["zero_optimization"]["allgather_sequential"] = sequential
        actor = Actor(model_dir, attn_implementation="eager", param_dtype=dtype_name, ds_config=ds_config)
        report(i, "after-load", actor.model)
        actor, _, _ = strategy.prepare((actor, TRAIN_CFG))
        report(i, "after-prepare", actor.model.module)
        del actor
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
