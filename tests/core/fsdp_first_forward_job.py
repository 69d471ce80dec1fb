"""Attribution as the first forward of a bf16 FSDP2 model, then a training step (for test_fsdp_first_forward.py).

usage: python -m torch.distributed.run --nproc_per_node 1 fsdp_first_forward_job.py OUT_FILE
FSDP2 fixes each parameter group's gradient dtypes at the root's first forward from the ``requires_grad`` flags it
finds then. Attribution's gradient methods freeze every parameter; run as a process's first forward (verl's bypass
mode, or the shared pass after a resume) they must leave the actor's update as it is: fp32 gradients under a bf16
compute dtype. Writes the gradients' dtypes and the scores (finite, not all zero).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp1_job import batch, tiny_model  # the same tiny model and rows (this folder is the script's sys.path[0])
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.methods.fisher import fisher


def main() -> None:
    dist.init_process_group("gloo")
    model = tiny_model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    b = batch()
    scores = fisher(ModuleBackend(model, PassLimits(10**6)), b, 0, outcomes=2)[0]  # the model's first forward
    model.train()
    loss = model(b.input_ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.save({"grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
                "scores": scores.detach().float()}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
