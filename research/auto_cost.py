"""``mode=auto``'s calibration cost measured side by side with a training step (docs/auto.md §6), in one process on
the same rows of one model: one rank's calibration share (candidates ``gradient`` and ``fisher`` on ``fidelity_rows``
rows, then :func:`oar_verl.core.auto.candidate_metrics`: J = 4 random rankings, position, F = 5) against one training
forward+backward over the rank's ``--rows`` rows (full logits, parameter gradients); best of 2 after a warm-up.

usage: python -m research.auto_cost [--rows 32] [--reasoning 96] [--fidelity-rows 4] [--checks 10] [--steps 200]
                                    [--shape cpu-small] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from oar_verl.core.auto import candidate_metrics
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.shifts import rows_of
from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.methods.mask_operator import mask_replacement
from research.attribution import build_model, make_batch, timed


def measure(args) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.shape, args.device, dtype)
    _, batch = make_batch(args.rows, 64, args.reasoning, 8, model.config.vocab_size, args.device)
    limits = PassLimits(16384)
    micro = max(1, 16384 // batch.input_ids.shape[1])

    def train_step():  # the actor update's compute on the rank's rows
        for s in range(0, args.rows, micro):
            out = model(input_ids=batch.input_ids[s:s + micro], attention_mask=batch.attention_mask[s:s + micro])
            torch.log_softmax(out.logits.float(), -1).mean().backward()
        model.zero_grad(set_to_none=True)

    for p in model.parameters():
        p.requires_grad_(True)
    cfg = OARConfig(mode="gradient", fidelity_rows=args.fidelity_rows)
    sub = rows_of(batch, torch.arange(args.fidelity_rows, device=batch.input_ids.device))
    seeds = sequence_seeds(0, 0, torch.arange(args.fidelity_rows)).to(args.device)

    def calibration():  # what measure_candidates runs on a rank, on rows already prepared
        imps = {}
        for mode in ("gradient", "fisher"):
            c = dataclasses.replace(cfg, mode=mode)
            imps[mode] = run_attribution(module_backend(model, c, limits=limits), sub, c, seeds=seeds).importance
        with torch.no_grad():
            backend = module_backend(model, cfg, limits=limits)
            return candidate_metrics(backend, sub, imps, replacement=mask_replacement(backend, sub, cfg.mask, None,
                                                                                       seeds))

    t_train = min(timed(train_step, args.device) for _ in range(2))
    t_cal = min(timed(calibration, args.device) for _ in range(2))
    return {"device": args.device, "shape": args.shape, "rows_per_rank": args.rows,
            "L": int(batch.input_ids.shape[1]), "R": args.reasoning, "fidelity_rows": args.fidelity_rows,
            "train_fwd_bwd_s": t_train, "calibration_s": t_cal, "calibration_over_train": t_cal / t_train,
            f"share_{args.checks}_checks_in_{args.steps}_steps": args.checks * t_cal / (args.steps * t_train)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="cpu-small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reasoning", type=int, default=96)
    ap.add_argument("--fidelity-rows", type=int, default=4)
    ap.add_argument("--checks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    print(json.dumps(measure(ap.parse_args())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
