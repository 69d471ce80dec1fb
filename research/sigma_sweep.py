"""OAR-G's bf16 agreement against its noise scale σ (research/docs/faithfulness.md §17; issue #57 item 1).

On SmolLM2's own 1,024-token rows (research/long_fidelity.py's cached rows, the first ``--rows``), OAR-G (K = 1) is
scored at each σ on the fp32 model and on two bf16 twins — the actor's (weights rounded to bf16, buffers such as
RoPE's inverse frequencies kept in fp32, :meth:`research.long_fidelity.Loaded.bf16`) and ``.to(bfloat16)`` (the
buffers rounded too) — with the same noise seeds; per row Spearman's rho of each twin's scores with fp32's. The
question: below which σ does bf16's resolution, not the noise, decide OAR-G's ranking? Every row kept.

usage: python -m research.sigma_sweep [--rows 4] [--sigmas 1e-3,1e-2,5e-2] [--results FILE]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from oar_verl.core import module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from research import REPO, common, long_fidelity
from research.common import command_line, write_results


def scores(model: torch.nn.Module, m, prep, sigma: float) -> list[np.ndarray]:
    """OAR-G's per-row scores on the reasoning tokens (float64 numpy), σ = ``sigma`` in every dtype."""
    cfg = long_fidelity.method_config(m, "oar_g")
    cfg = dataclasses.replace(cfg, noise_std=sigma)
    res = run_attribution(module_backend(model, cfg, limits=PassLimits(8192)), prep.batch, cfg,
                          mask_token_id=m.mask_id, seeds=prep.seeds)
    reasoning = prep.batch.reasoning_mask.bool()
    return [res.importance[i][reasoning[i]].double().numpy() for i in range(len(reasoning))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--sigmas", default="1e-3,1e-2,5e-2")
    ap.add_argument("--run", type=Path, default=REPO / "outputs" / "long_fidelity" / "smollm2_1024",
                    help="the long-fidelity run directory whose rows.json holds the rows")
    ap.add_argument("--results", type=Path, default=REPO / "research" / "results" / "sigma_sweep.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = long_fidelity.load("smollm2")
    rows = json.loads((a.run / "rows.json").read_text())[: a.rows]
    prep = long_fidelity.prepared(m, rows)
    twins = {"bf16_buffers_fp32": m.bf16(), "bf16_to": copy.deepcopy(m.model).to(torch.bfloat16).eval()}
    out = {"command": command_line("sigma_sweep", argv),
           "rows": len(rows), "reasoning_tokens": [int(x) for x in prep.batch.reasoning_mask.sum(-1)], "sigmas": {}}
    for sigma in (float(x) for x in a.sigmas.split(",") if x):
        base = scores(m.model, m, prep, sigma)
        entry = {}
        for name, twin in twins.items():
            low = scores(twin, m, prep, sigma)
            rho = [common.spearman(x, y) for x, y in zip(low, base)]
            entry[name] = {"spearman": [round(r, 6) for r in rho], "mean": float(np.nanmean(rho))}
        out["sigmas"][f"{sigma:g}"] = entry
        print(f"sigma {sigma:g}: " + ", ".join(f"{k} {v['mean']:.3f}" for k, v in entry.items()), flush=True)
    write_results(a.results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
