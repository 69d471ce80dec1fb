"""The default's (``mode=conservative``) rule overhead over ``fisher``: the same old-log-prob pass with each read from
it (:mod:`oar_verl.core.backends.shared`), on the same tokens in the same process, the two run alternately (ABBA) so
that other load on the machine falls on both (issue #69 item 5).

For each dtype and each recompute setting (every layer recomputed / every layer kept), ``--repeats`` rounds (after one
warm-up of each) of the old-log-prob pass alone and, in an order reversed from one round to the next:

* **fisher** (its default K = 1: one plain backward from one outcome);
* **conservative**: the default, one backward from φ under the rules;
* **conservative_earlier** (``--earlier``): the same under the rules' backward as it was before issue #69 item 5
  (:func:`earlier_ratio_times`, :class:`EarlierGatedHalf`: the zeros masked by a bool mask, fresh temporaries), so
  that before and after are measured under the same load; the scores are checked bitwise equal.

Per variant and round, in the process's CPU seconds (one torch thread: the work this process did, not the time it
waited for a core while other jobs ran on the machine; wall seconds for the backward alone):

* **pass**: the old-log-prob pass with the method read from it (forward + the method's backward + probe reads);
* **added**: the pass less the same round's old-log-prob pass alone (what the H200 figures report, ÷ a step);
* **backward**: the method's own wall seconds inside it (:attr:`SharedAttribution.seconds`: its backward and probe
  read), which other load on the machine inflates.

Reported: each median and spread (min–max) in seconds, and conservative ÷ fisher of the medians (the rule overhead:
the rules change the forward's graph and the backward's maths, never the values; fisher at its default K = 1 is one
plain backward from one outcome, the default one backward from φ).

usage:
    python -m research.rule_overhead                                     # cpu-quick, 1,024 tokens, fp32 and bf16
    python -m research.rule_overhead --out research/results/rule_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from oar_verl.core import OARConfig
from oar_verl.core.backends import rules
from oar_verl.core.backends.patching import patched_attributes
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.methods.attribution import shared_attribution
from research import REPO
from research.common import command_line, write_results
from research.scaling import PROMPT, build_model, make_rows
from research.shared_forward import MASK, log_prob_pass

def earlier_ratio_times(grad, out, x):
    """:func:`oar_verl.core.backends.rules.ratio_times` before issue #69 item 5 (the same values)."""
    wide = torch.promote_types(out.dtype, torch.float32)
    xf = x.to(wide, copy=True)
    zero = xf == 0
    ratio = out.to(wide, copy=True).div_(xf.masked_fill_(zero, 1.0))
    del xf
    return ratio.masked_fill_(zero, 0.0).mul_(grad).to(x.dtype)


class EarlierGatedHalf(torch.autograd.Function):
    """The gated MLP rule's function before issue #69 item 5 (the same values)."""

    @staticmethod
    def forward(ctx, g, u, h, act):
        ctx.save_for_backward(g, u)
        ctx.act = act
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        wide = torch.promote_types(g.dtype, torch.float32)
        gw, uw = g.to(wide), u.to(wide)
        a = ctx.act(gw)
        half = 0.5 * grad.to(wide)
        return earlier_ratio_times(half * uw, a, gw).to(g.dtype), (half * a).to(u.dtype), None, None


def one_pass(model, batch, variant: str, recompute: float) -> tuple[float, float, torch.Tensor]:
    """(pass CPU seconds, the method's own wall seconds, (B, L) scores) of the old-log-prob pass with ``variant`` (a
    mode, or ``conservative_earlier``) read from it."""
    mode = variant.removesuffix("_earlier")
    earlier = (patched_attributes(rules, ratio_times=earlier_ratio_times, _GatedHalf=EarlierGatedHalf)
               if variant.endswith("_earlier") else contextlib.nullcontext())
    cfg = OARConfig(mode=mode, mask="token", mask_token_id=MASK)
    rows = torch.arange(batch.input_ids.shape[0])
    start = time.process_time()
    with earlier:
        shared = shared_attribution(model, batch, cfg, lambda tokens: recompute, mask_token_id=MASK)
        with shared.forward(ForwardLayout.padded(rows, batch.attention_mask, 0)):
            log_prob_pass(model, batch)
        scores = shared.result()
    return time.process_time() - start, shared.seconds, scores


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def measure_setting(model, batch, recompute: float, repeats: int, variants: tuple[str, ...]) -> dict:
    """Rounds of every variant's shared pass at one recompute share, the order reversed from one round to the next."""
    got = {m: {"pass": [], "backward": [], "added": []} for m in variants}
    scores = {m: one_pass(model, batch, m, recompute)[2] for m in variants}  # warm-up
    log_prob = []
    for r in range(repeats):
        start = time.process_time()
        log_prob_pass(model, batch)
        log_prob.append(time.process_time() - start)
        for m in variants if r % 2 == 0 else variants[::-1]:
            s, b, _ = one_pass(model, batch, m, recompute)
            got[m]["pass"].append(s)
            got[m]["backward"].append(b)
            got[m]["added"].append(s - log_prob[-1])  # over this round's log-prob pass alone
    out = {m: {k: spread(v) for k, v in got[m].items()} for m in variants} | {"log_prob_pass": spread(log_prob)}
    for m in variants[1:]:
        for k in ("pass", "added", "backward"):
            out[f"{m}_{k}_ratio"] = out[m][k]["median"] / out["fisher"][k]["median"]
            # the ratio within each round (the same load on both), its median and spread
            out[f"{m}_{k}_ratio_rounds"] = spread([c / f for c, f in zip(got[m][k], got["fisher"][k])])
    if "conservative_earlier" in variants:
        out["earlier_scores_bitwise_equal"] = torch.equal(scores["conservative"], scores["conservative_earlier"])
    return out


def save(args, argv, rows: list[dict]) -> None:
    """The results file (``--out``) with the rows measured so far."""
    if args.out:
        write_results(REPO / args.out if not os.path.isabs(args.out) else args.out, {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command_line("rule_overhead", argv), "machine": f"{platform.machine()} CPU, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)",
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()], "shape": args.shape, "rows": rows})


def run(args, argv=None) -> list[dict]:
    variants = ("fisher", "conservative") + (("conservative_earlier",) if args.earlier else ())
    rows = []
    for dtype in args.dtypes:
        model = build_model(args.shape, "cpu", getattr(torch, dtype))
        batch = make_rows(args.rows, args.length, model.config.vocab_size, "cpu")
        for name, share in (("recompute", 1.0), ("keep", 0.0)):
            load = os.getloadavg()[0]
            got = measure_setting(model, batch, share, args.repeats, variants)
            row = {"dtype": dtype, "recompute": name, "tokens": args.rows * (PROMPT + args.length),
                   "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)} | got
            for m in variants[1:]:
                print(f"{dtype} {name} {m} / fisher: added {got[f'{m}_added_ratio']:.3f} (rounds "
                      f"{got[f'{m}_added_ratio_rounds']['min']:.3f}-{got[f'{m}_added_ratio_rounds']['max']:.3f}), "
                      f"pass {got[f'{m}_pass_ratio']:.3f}, backward {got[f'{m}_backward_ratio']:.3f}; "
                      f"{m} pass {got[m]['pass']['median']:.2f} s", flush=True)
            print(f"  fisher pass {got['fisher']['pass']['median']:.2f} s, log-prob pass "
                  f"{got['log_prob_pass']['median']:.2f} s, load {load:.2f}-{os.getloadavg()[0]:.2f}"
                  + (f", earlier scores bitwise equal: {got['earlier_scores_bitwise_equal']}" if args.earlier else ""),
                  flush=True)
            rows.append(row)
            save(args, argv, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-quick")
    ap.add_argument("--length", type=int, default=1024, help="response tokens per row (after 128 prompt tokens)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (each runs every variant once, the order reversed "
                    "from one round to the next)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--earlier", action="store_true", help="also the rules' backward before issue #69 item 5")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    torch.set_num_threads(args.threads)
    run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
