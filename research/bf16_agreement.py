"""bf16 against fp32 scores of a method on a model's own rows, without the deletion metric (issue #46's bf16 target,
"the same check for every shipped method"): the long-row study's rows (:mod:`research.long_fidelity`, the same
``rows.json``), each method run on the fp32 model and on its bf16 twin (weights rounded, buffers kept in fp32, as an
actor has them), per row Spearman's rho, the share of fp32's top 20 % in bf16's top 20 % and the relative L2 error,
each a mean over rows with a prompt-clustered interval (:func:`research.long_fidelity.agreement`). Scores are cached
per row and method in the study directory, so a run resumes.

usage:
    OMP_NUM_THREADS=2 python -m research.bf16_agreement --model smollm2 --rows 4 --tokens 1024 \\
        --methods oar_p,path_m2 --out outputs/long_fidelity [--results research/results/bf16_smollm2_1024.json]

``--results`` writes each method's agreement (the mean over rows and its prompt-clustered interval, per measure) to a
committed results file; method §15's bf16 row is generated from it. ``--workers N/J`` splits the rows between
processes side by side (exact OAR-P costs minutes a row); a last run without it writes the file from the caches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.attribution import module_backend, run_attribution
from research import REPO
from research.common import command_line, measure, study_dir, write_results
from research.long_fidelity import METHODS, agreement, load, make_rows, method_config, prepared


def row_scores(m, row: dict, name: str, bf16: bool, limits: PassLimits) -> tuple[list[float], float]:
    """One row's scores on its reasoning tokens by ``name`` on the fp32 model or its bf16 twin, and the seconds."""
    prep = prepared(m, [row])
    cfg = method_config(m, name)
    backend = module_backend(m.bf16() if bf16 else m.model, cfg, limits=limits)
    box = {}
    sec, _ = measure(lambda: box.update(r=run_attribution(backend, prep.batch, cfg, mask_token_id=m.mask_id,
                                                          seeds=prep.seeds)), "cpu")
    return box["r"].importance[0][prep.batch.reasoning_mask[0].bool()].float().tolist(), sec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3", "tiny"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="the most reasoning tokens a row may have")
    ap.add_argument("--methods", default="oar_p,path_m2")
    ap.add_argument("--max-tokens", type=int, default=8192, help="token budget of one pass")
    ap.add_argument("--out", default=str(REPO / "outputs" / "long_fidelity"),
                    help="the long-row studies' directory (its <model>_<tokens> rows)")
    ap.add_argument("--results", type=Path, default=None, help="also write the agreements to this results file")
    ap.add_argument("--workers", default="1/0", help="N/J: compute only the rows i with i %% N == J (run processes "
                    "side by side on one machine's cores); the others are read from the cache where present")
    a = ap.parse_args(argv)
    methods = [x for x in a.methods.split(",") if x]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS)}")
    out, log = study_dir(a.out, a.model, a.tokens)
    torch.manual_seed(0)
    m = load(a.model)
    rows = make_rows(m, a.rows, a.tokens, out / "rows.json", log)[:a.rows]
    limits = PassLimits(a.max_tokens)
    n_workers, worker = (int(x) for x in a.workers.split("/"))
    lines = ["| method | rows | Spearman | top-20 % overlap | relative L2 error | seconds fp32 / bf16 per row |",
             "|---|---|---|---|---|---|"]
    record = {"command": command_line("bf16_agreement", argv),
              "model": m.name, "rows": len(rows), "methods": {}}
    for name in methods:
        chunks = []
        for i, row in enumerate(rows):
            path = out / f"bf16_agreement_{i:04d}_{name}.json"
            if not path.exists() and i % n_workers != worker:  # another process's row, not done yet
                continue
            if not path.exists():
                (fp32, s32), (low, s16) = (row_scores(m, row, name, bf16, limits) for bf16 in (False, True))
                path.write_text(json.dumps({"scores": {name: [fp32], f"{name}_bf16": [low]},
                                            "seconds": {name: s32, f"{name}_bf16": s16}}))
                log(f"  {name} row {i}: fp32 {s32:.1f} s, bf16 {s16:.1f} s")
            chunks.append(json.loads(path.read_text()))
        if len(chunks) < len(rows):
            log(f"  {name}: {len(chunks)} of {len(rows)} rows computed so far; no agreement yet")
            continue
        e = agreement(chunks, f"{name}_bf16", name)
        secs = [sum(c["seconds"][k] for c in chunks) / len(chunks) for k in (name, f"{name}_bf16")]
        iv = lambda d: f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"  # noqa: E731
        lines.append(f"| {name} | {len(chunks)} | {iv(e['spearman'])} | {iv(e['top20_overlap'])} | "
                     f"{iv(e['rel_l2_error'])} | {secs[0]:.0f} / {secs[1]:.0f} |")
        record["methods"][name] = {**e, "seconds_per_row_fp32_bf16": secs}
    log("\n" + "\n".join(lines))
    if a.results and len(record["methods"]) == len(methods):
        write_results(a.results, record)
        log(f"wrote {a.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
