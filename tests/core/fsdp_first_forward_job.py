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
from transformers import Qwen2Config, Qwen2ForCausalLM

from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.methods.fisher import fisher


def main() -> None:
    dist.init_process_group("gloo")
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    g = torch.Generator().manual_seed(1)
    B, P, T = 2, 3, 8
    prompts, responses = torch.randint(1, 97, (B, P), generator=g), torch.randint(1, 97, (B, T), generator=g)
    ones_p, ones_r = torch.ones(B, P, dtype=torch.long), torch.ones(B, T, dtype=torch.long)
    reasoning = torch.arange(T)[None].expand(B, T) < T - 2
    batch = build_attribution_batch(prompts, ones_p, responses, ones_r, reasoning, ~reasoning, torch.zeros(B))
    scores = fisher(ModuleBackend(model, PassLimits(10**6)), batch, 0, outcomes=2)[0]  # the model's first forward
    loss = model(torch.cat([prompts, responses], 1)).logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.save({"grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
                "scores": scores.detach().float()}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
