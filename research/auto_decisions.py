"""What ``mode=auto`` would decide on the long-row study's rows (issues #36, #37): every cached comparison of
:mod:`research.long_fidelity` on one model is merged by row (each method's per-row AOPC is a function of its own
ranking and the row only, and the controls are the same seeded rankings in every comparison), and the product's rule
:func:`oar_verl.core.auto.decide` is run on them with each method's measured cost, per band of the model's sliding
window where it has one. So the choice printed is, by construction, the study's best affordable method under the
candidate-independent statistic.

usage: python -m research.auto_decisions [--out DIR] [--model smollm2] [--tokens 1024] [--max-cost 2.0]
                                         [--operators mean] [--window W] [--methods a,b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oar_verl.core.auto import Evidence, bands_of, decide
from research import REPO

CONTROLS = ("random", "position", "entropy")


def merged(folder: Path, setting: str, methods: tuple[str, ...] = ()
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, float], list[int]]:
    """(name -> (N,) KL AOPC of every method and control, (N,) static, method -> cost × train fwd+bwd, row lengths)
    over the cached comparisons with this ``setting`` suffix: every method measured on every row, or, with
    ``methods``, these methods on the rows where all of them were measured."""
    chunks: dict[int, dict] = {}  # first row -> {method -> (chunk, its method list)}
    for path in sorted(folder.glob(f"chunk_*{setting}.json")):
        first = int(path.name.split("_")[1])
        chunk = json.loads(path.read_text())
        chunks.setdefault(first, {}).update({m: chunk for m in chunk["aopc"]})
    if methods:
        chunks = {k: v for k, v in chunks.items() if set(methods) <= set(v)}
    methods = sorted(methods or (set.intersection(*(set(c) for c in chunks.values())) if chunks else []))
    aopc: dict[str, list[float]] = {m: [] for m in (*methods, *CONTROLS)}
    static, lengths, seconds, train = [], [], {m: 0.0 for m in methods}, {m: 0.0 for m in methods}
    for first in sorted(chunks):
        by = chunks[first]
        ref = by[methods[0]]
        for m in methods:
            aopc[m] += by[m]["aopc"][m][0]
            seconds[m] += by[m]["seconds"][m]
            train[m] += by[m]["train_s"]
        for k in CONTROLS:
            aopc[k] += ref["control_aopc"][k][0]
        static += ref["static"][0]
        lengths += ref["reasoning"]
    cost = {m: seconds[m] / train[m] for m in methods}
    return ({k: torch.tensor(v, dtype=torch.float64) for k, v in aopc.items()},
            torch.tensor(static, dtype=torch.float64), cost, lengths)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "long_fidelity"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--operators", default="mean", help="the comparisons' --operators (their cache suffix)")
    ap.add_argument("--fractions", default="", help="the comparisons' --fractions ('' = the default)")
    ap.add_argument("--max-cost", type=float, default=2.0, help="auto_max_cost")
    ap.add_argument("--window", type=int, default=None, help="the model's sliding window (bands inside / past; a "
                    "row's length here is its reasoning tokens)")
    ap.add_argument("--methods", default="", help="these methods, on the rows where all were measured ('' = every "
                    "method measured on every row)")
    a = ap.parse_args(argv)
    setting = "_" + a.operators.replace(",", "-") + "_" + (a.fractions.replace(",", "-") if a.fractions else
                                                          "0.01-0.02-0.05-0.1-0.2")
    methods = tuple(m for m in a.methods.split(",") if m)
    aopc, static, cost, lengths = merged(Path(a.out) / f"{a.model}_{a.tokens}", setting, methods)
    if not cost:
        print("no cached comparison")
        return 0
    bands = bands_of(torch.tensor(lengths), a.window)
    ev = Evidence(aopc, static, torch.arange(len(lengths)), bands)  # one sampled row per problem: a row, a cluster
    for band in dict.fromkeys(bands):
        d = decide(ev.band(band), cost, max_cost=a.max_cost, controls=CONTROLS)
        print(f"{a.model} {a.tokens} [{band}]: {d.choice or 'no candidate'} — {d.reason}")
        for c, per in d.gains.items():
            print(f"  {c} (cost {cost[c]:.2f}): " + ", ".join(f"over {k} {iv.mean:+.2f} [{iv.lo:+.2f}, {iv.hi:+.2f}]"
                                                            for k, iv in per.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
