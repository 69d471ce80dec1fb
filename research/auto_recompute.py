"""What ``algorithm.oar.recompute=auto`` picks for the default and fisher read from verl's old-log-prob pass at
Qwen2.5-7B × 4k response tokens in bf16 on 80 GB GPUs, and the cost model's peak and added time there (docs/scaling.md;
issue #69 item 5). The product's rule: :func:`~oar_verl.core.backends.memory.recompute_choice` of
:func:`~oar_verl.core.backends.memory.attribution_need`, the pass's logits counted, bounded by verl's update at the
micro-batch's tokens plus the rank's parameter gradients, and by 0.9 × the free memory. Two set-ups: FSDP over ``gpus``
GPUs (fp32 parameters, gradients and Adam sharded: 16 bytes a parameter over the GPUs, 4 of them gradients), and one
GPU holding bf16 weights and gradients only (research/shared_forward.py's measurement: 2 + 2 bytes a parameter).

A prediction of the cost model, not a measurement; written to a results file so the docs render without torch, and
held to the model by research/tests/test_gpu_memory_model.py.

usage: python -m research.auto_recompute [--gpu-gib 80] [--gpus 8] [--results research/results/auto_recompute_7b.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from research import REPO
from research.common import command_line, write_results

RESULTS = REPO / "research" / "results" / "auto_recompute_7b.json"


def rows(gpu_gib: float = 80.0, gpus: int = 8) -> list[dict]:
    """One record per (set-up, method): layers recomputed of all, the modelled peak and verl's update bound in GiB,
    and the added time × a training step ((1 + recomputed share) / 4: a backward pass with the share's forwards)."""
    from oar_verl.core.backends.memory import PassKind, attribution_need, pass_bytes, recompute_choice
    from oar_verl.core.methods.attribution import METHODS
    from research.scaling import _params, _shape

    shape, (total, _) = _shape("qwen2.5-7b", 2), _params("qwen2.5-7b")
    gib = 2**30
    setups = ((f"FSDP, {gpus} GPUs, 3 × (1k + 4k)", 3 * 5120, 4 * total / gpus, 16 * total / gpus),
              (f"FSDP, {gpus} GPUs, 1 × (128 + 4k)", 128 + 4096, 4 * total / gpus, 16 * total / gpus),
              ("one GPU, bf16 weights and gradients, 1 × (128 + 4k)", 128 + 4096, 2 * total, 4 * total))
    out = []
    for label, tokens, grads, state in setups:
        update = pass_bytes(PassKind.UPDATE, tokens, shape, checkpointing=True) + int(grads)
        limit = min(update, int(0.9 * (gpu_gib * gib - state)))
        for mode in ("conservative", "fisher"):
            kind = METHODS.get(mode).backward_pass
            share = recompute_choice("auto", attribution_need(kind, shape, host=PassKind.LOG_PROB), limit,
                                     shape.layers)(tokens)
            kept = round(shape.layers * (1 - share))
            peak = attribution_need(kind, shape, host=PassKind.LOG_PROB, margin=1.0)(tokens, kept)
            out.append({"setup": label, "mode": mode, "layers": shape.layers, "recomputed": shape.layers - kept,
                        "peak_gib": round(peak / gib, 3), "update_gib": round(update / gib, 3),
                        "added_time_x_training": round((1 + share) / 4, 4)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    write_results(a.results, {"command": command_line("auto_recompute", argv).strip(), "gpu_gib": a.gpu_gib, "gpus": a.gpus,
                              "rows": rows(a.gpu_gib, a.gpus)})
    print(a.results)


if __name__ == "__main__":
    main()
