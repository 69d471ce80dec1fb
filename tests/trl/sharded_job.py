"""The TRL adapter's reshape on a sharded policy on 2 gloo processes: FSDP2 (torch's ``fully_shard``, as
accelerate's FSDP2 wraps TRL's model) or DeepSpeed ZeRO-2/3 (``deepspeed.initialize``, the module TRL's trainer holds
under accelerate's DeepSpeed): under FSDP2 and ZeRO-3 every forward gathers parameters collectively, so the processes
must run aligned passes; rank 1 holds only zero-advantage rows and runs a filler row. Each rank's (B, T) advantages
are compared with the core's ``oar_advantages`` on a plain copy of the same weights; under ZeRO, one update through
the engine on the reshaped advantages follows.

usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/trl/sharded_job.py MODEL_DIR OUT_JSON \
       [MODE] [fsdp2|zero2|zero3]
(accelerate enables FSDP and DeepSpeed on accelerator devices only, so TRL's trainer cannot run them on CPU; this runs
the adapter's part of its step on the sharded module directly.)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(model_dir: str, out: str, mode: str, wrap: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar_verl.core import OARConfig, oar_advantages
    from oar_verl.trl.reshape import reshape_batch

    tok = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = None
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        # allgather_sequential: DeepSpeed 0.19.6's coalesced ZeRO-3 gather is not complete on gloo when it returns
        # (docs/openrlhf.md, "The bf16 ZeRO-3 NaN"); CPU only
        zero = {"stage": int(wrap[-1]), **({"allgather_sequential": True} if wrap == "zero3" else {})}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
                  "zero_optimization": zero, "bf16": {"enabled": False}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        model = engine.module  # what TRL's trainer holds as self.model under DeepSpeed
    rank = dist.get_rank()
    texts = [["I add 3 and 4 to get 7. The answer is 7.", "3 plus 4 is 8. The answer is 8.",
              "First 3, then 4 more. #### 7", "Three and four: 7. The answer is 7."],
             ["12 and 30 make 42. The answer is 42.", "Adding gives 42. The answer is 42."]][rank]
    prompt = ["3 + 4 =", "12 + 30 ="][rank]
    advantages = torch.tensor([[1.2, -0.4, -0.4, -0.4], [0.0, 0.0]][rank])  # rank 1: a zero-advantage group only
    p = torch.tensor(tok(prompt)["input_ids"])
    c = [torch.tensor(tok(t)["input_ids"] + [tok.eos_token_id]) for t in texts]
    B, C = len(c), max(map(len, c)) + 1
    prompt_ids = p[None, :].repeat(B, 1)
    completion_ids = torch.full((B, C), tok.pad_token_id)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, row in enumerate(c):
        completion_ids[i, :len(row)], completion_mask[i, :len(row)] = row, 1
    cfg = OARConfig(mode=mode)
    res = reshape_batch(model, tok, cfg, 1, prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
                        completion_ids=completion_ids, completion_mask=completion_mask, advantages=advantages,
                        max_tokens=2 * (prompt_ids.shape[1] + C), checkpointing=True)
    core = oar_advantages(plain, [p] * B, c, advantages, tok, cfg, 1)
    width = core.advantages.shape[1]
    diff = float((res.advantages[:, :width] - core.advantages.float()).abs().max())
    mask = completion_mask.bool()
    kept = float(((res.advantages * mask).sum(-1) - advantages * mask.sum(-1)).abs().max())
    loss = None
    if engine is not None:  # one policy-gradient update through the engine on the reshaped advantages
        engine.train()
        ids = torch.cat([prompt_ids, completion_ids], 1)
        logits = engine(input_ids=ids, attention_mask=torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)).logits
        logp = torch.log_softmax(logits[:, prompt_ids.shape[1] - 1:-1].float(), -1).gather(
            -1, completion_ids[..., None])[..., 0]
        loss = -(res.advantages * logp * completion_mask).sum() / completion_mask.sum()
        engine.backward(loss)
        engine.step()
        loss = float(loss)
    found = [None, None]
    dist.all_gather_object(found, {"rank": rank, "diff": diff, "mass_diff": kept, "loss": loss,
                                   "attributed": int(res.attribution.attributed.sum()),
                                   "untouched": bool(torch.equal(res.advantages, advantages[:, None] * mask)),
                                   "metrics": res.metrics})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "conservative",
         sys.argv[4] if len(sys.argv) > 4 else "fsdp2")
