"""Every method on a model wrapped by torch's FSDP1 (verl's ``strategy=fsdp``, its default), for test_fsdp1.py.

usage: python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp1_job.py OUT_DIR {fp32,bf16}
Wraps a tiny Qwen2 as verl's FSDP1 engine does (one unit per decoder layer, the root holding the embedding, the final
norm and the head; full sharding over the 2 gloo ranks; bf16: mixed precision with fp32 reductions), runs each method
through the core's module backend and the clean-point methods through a forward the caller runs (the shared pass) --
attribution is the wrapped model's first forward -- then one training backward. Rank R writes OUT_DIR/rank{R}.pt: the
scores by method, the same methods on the unwrapped fp32 model, and the gradients' dtypes.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.methods.attribution import shared_attribution

# each method with its default mask operator (the embeddings' mean), and fisher with a token's embedding
MODES = {"conservative": {}, "gradient": {}, "fisher": {}, "path": {}, "perturbation": {},
         "fisher_token": {"mode": "fisher", "mask": "token", "mask_token_id": 3}}


def tiny_model() -> Qwen2ForCausalLM:
    """The jobs' tiny fp32 Qwen2 (random weights, seed 0), in eval mode."""
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def batch():
    """4 rows of 3 prompt and 10 response tokens, 7 of reasoning and 2 of answer, one probe kind after another."""
    g = torch.Generator().manual_seed(1)
    B, P, T = 4, 3, 10
    prompts, responses = torch.randint(1, 97, (B, P), generator=g), torch.randint(1, 97, (B, T), generator=g)
    reasoning = torch.arange(T)[None].expand(B, T) < T - 3
    answer = torch.arange(T)[None].expand(B, T) >= T - 2
    kinds = torch.tensor([ProbeKind.AS_MEAN, ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN])
    return build_attribution_batch(prompts, torch.ones(B, P, dtype=torch.long), responses,
                                   torch.ones(B, T, dtype=torch.long), reasoning, answer, kinds)


def scores(model, b) -> dict[str, torch.Tensor]:
    out = {}
    for name, extra in MODES.items():
        cfg = OARConfig(**{"mode": name, **extra})
        out[name] = run_attribution(module_backend(model, cfg), b, cfg, mask_token_id=cfg.mask_token_id,
                                    seeds=torch.arange(4)).importance.detach().float()
    for name in ("conservative", "fisher"):  # read from forwards the caller runs, two rows a forward (recomputed: one)
        cfg = OARConfig(mode=name)
        shared = shared_attribution(model, b, cfg, name == "conservative")
        for r in torch.arange(4).split(2):
            inputs = b.model_inputs(r)
            with torch.no_grad(), shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
                model(**inputs, use_cache=False)
        out[f"{name}_shared"] = shared.result().float()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    plain = tiny_model()
    b = batch()
    reference = scores(plain, b)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if sys.argv[2] == "bf16" else None
    model = FSDP(copy.deepcopy(plain), device_id=torch.device("cpu"), mixed_precision=mp,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={Qwen2DecoderLayer}))
    got = scores(model, b)
    model.train()
    model(b.input_ids).logits.logsumexp(-1).mean().backward()
    grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    torch.save({"got": got, "reference": reference, "grads": grads}, f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
