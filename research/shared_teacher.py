"""Does OAR-G's clean teacher read from another forward's layout change its scores? (issue #45, docs/method.md §14)

OAR-G differentiates the shift of a noisy student's outcome from its clean teacher's. Read from verl's old-log-prob
pass (``SharedTeacher``), the teacher comes from that pass's layout (the rows packed end to end, other rows beside
them) instead of OAR-G's own teacher pass; the two differ by rounding, which adds to the shift OAR-G differentiates.
On a real model's own rows (the long-row study's ``rows.json``, :mod:`research.long_fidelity`), in fp32 (σ = 1e-3) and
in bf16 (the bf16 twin, σ = ``noise_std_low_precision``), per row against OAR-G with its own teacher at the same seed:
the scores with the teacher read from a packed forward of all the rows (in another order), and, for scale, OAR-G with
its own teacher at another seed (the method's own draw-to-draw spread). Per-row Spearman, top-20 % overlap and
relative L2 error, means with prompt-clustered intervals (:func:`research.long_fidelity.agreement`). Every row is
reported. What it cannot show: a GPU's kernels (flash attention over packed rows against OAR-G's padded passes) round
differently from the CPU's, so the bf16 figure there is not measured by this CPU run.

usage:
    OMP_NUM_THREADS=2 python -m research.shared_teacher --model smollm2 --rows 4 --tokens 1024
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from oar_verl.core import OARConfig
from oar_verl.core.backends.budget import PassLimits, row_spans
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.methods.attribution import module_backend, run_attribution, shared_attribution
from research import REPO
from research.common import study_dir
from research.long_fidelity import agreement, load, make_rows, method_config, prepared


def packed_teachers(model: torch.nn.Module, batch, cfg: OARConfig, seeds: torch.Tensor):
    """Every row's clean teacher read from one forward of the rows packed end to end in reverse order, positions
    restarting per row (verl's remove-padding layout of the old-log-prob pass)."""
    start, end = row_spans(batch.attention_mask)
    order = torch.arange(batch.input_ids.shape[0] - 1, -1, -1)
    ids = torch.cat([batch.input_ids[r, start[r]:end[r]] for r in order.tolist()])[None]
    pos = torch.cat([torch.arange(int(end[r] - start[r])) for r in order.tolist()])[None]
    shared = shared_attribution(model, batch, cfg, True, seeds=seeds)
    with torch.no_grad(), shared.forward(ForwardLayout.sequences(order, (end - start)[order], start[order])):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    return shared.teachers()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3", "tiny"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="the most reasoning tokens a row may have")
    ap.add_argument("--max-tokens", type=int, default=8192, help="token budget of one OAR-G pass")
    ap.add_argument("--out", default=str(REPO / "outputs" / "long_fidelity"),
                    help="the long-row studies' directory (its <model>_<tokens> rows)")
    a = ap.parse_args(argv)
    out, log = study_dir(a.out, a.model, a.tokens)
    torch.manual_seed(0)
    m = load(a.model)
    rows = make_rows(m, a.rows, a.tokens, out / "rows.json", log)[:a.rows]
    prep = prepared(m, rows)
    batch, seeds = prep.batch, prep.seeds
    # the shipped σ in both dtypes (the study's "oar_g" entry keeps σ = 1e-3 in bf16 too)
    cfg = dataclasses.replace(method_config(m, "oar_g"), noise_std_low_precision=OARConfig().noise_std_low_precision)
    lines = ["| dtype | against OAR-G's own teacher, same seed | rows | Spearman | top-20 % overlap | "
             "relative L2 error |", "|---|---|---|---|---|---|"]
    for name, model in (("fp32", m.model), ("bf16", m.bf16())):
        backend = module_backend(model, cfg, limits=PassLimits(a.max_tokens))
        mask = batch.reasoning_mask.bool()

        def scores(s, teachers=None):
            imp = run_attribution(backend, batch, cfg, seeds=s, teachers=teachers).importance
            return [imp[b][mask[b]].float().tolist() for b in range(imp.shape[0])]

        own = scores(seeds)
        chunk = {"scores": {"own": own, "shared": scores(seeds, packed_teachers(model, batch, cfg, seeds)),
                            "reseed": scores(seeds + 1)}}
        for other, what in (("shared", "teacher read from the packed forward"),
                            ("reseed", "own teacher, the next seed (draw-to-draw spread)")):
            e = agreement([chunk], other, "own")
            iv = lambda d: f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"  # noqa: E731
            lines.append(f"| {name} | {what} | {len(own)} | {iv(e['spearman'])} | {iv(e['top20_overlap'])} | "
                         f"{iv(e['rel_l2_error'])} |")
        log(lines[-2] + "\n" + lines[-1])
    log("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
