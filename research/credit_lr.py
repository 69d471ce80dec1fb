"""Learning at tuned learning rates (issue #36 item 5): GRPO, OAR-G and the free alternatives a user would pick instead
(entropy and position weights), each at its best learning rate of a grid, on the credit-assignment study's task and
minimal loop (:mod:`research.credit`, research/docs/evidence.md §3).

Each learning rate runs credit's loop for every method and seed in its own ``--out`` sub-directory (resumable: a rate's
``runs_*.json`` are reused). The report takes each method's best rate by its mean AUC over the seeds (the same
selection for every method, on the same seeds, so the selection favours no method), then compares the methods at
their best rates: Δ AUC and Δ final validation success with a paired bootstrap interval over seeds (a seed fixes the
warm start, the prompts and the sampler seeds for every method) and an exact sign-flip permutation p. Every rate's
table is printed too, so a reader sees how much the choice of rate matters.

What it cannot show: one synthetic task with one decisive token, a 349k-parameter model, 40 steps; a two- or
three-point grid. The main table chooses each rate on the seeds it is then evaluated on (for every method alike); the
held-out table (``cross_fitted``) evaluates each seed at the rate chosen on the other fold's seeds.

usage: python -m research.credit_lr [--lrs 3e-4,6e-4] [--methods grpo,oar_g,entropy,position] [--seeds 6]
                                    [--first-seed 0] [--out DIR] [--report-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from research import REPO
from research import credit

DEFAULT_LRS = (3e-4, 6e-4)
DEFAULT_METHODS = ("grpo", "oar_g", "entropy", "position")


def lr_dir(out: Path, lr: float) -> Path:
    return out / f"lr{lr:g}"


def load_runs(out: Path, lrs) -> dict[float, list[dict]]:
    """lr -> every run saved under its directory."""
    return {lr: [r for f in sorted(lr_dir(out, lr).glob("runs_*.json")) for r in json.loads(f.read_text())["runs"]]
            for lr in lrs}


def per_seed(runs: list[dict], method: str, metric: str) -> dict[int, float]:
    """seed -> the run's AUC or final validation success."""
    out = {}
    for r in runs:
        if r["method"] != method:
            continue
        steps, vals = r["val"]["steps"], r["val"]["values"]
        out[r["seed"]] = credit.auc(steps, vals) if metric == "auc" else float(vals[-1])
    return out


def paired(a: dict[int, float], b: dict[int, float], resamples: int = 10000, seed: int = 0) -> dict:
    """Mean of a − b over the seeds both ran, a 95 % paired bootstrap interval and an exact sign-flip permutation p."""
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s] - b[s] for s in seeds])
    if len(d) < 2:
        return {"diff": float(d.mean()) if len(d) else float("nan"), "ci95": None, "p": None, "seeds": len(d)}
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, len(d), (resamples, len(d)))].mean(1)
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(d)))) if len(d) <= 16 else \
        rng.choice((1.0, -1.0), (resamples, len(d)))
    p = float((np.abs((flips * d).mean(1)) >= abs(d.mean()) - 1e-12).mean())
    return {"diff": float(d.mean()), "ci95": [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))],
            "p": p, "seeds": len(d)}


def best_rate(auc_by_lr: dict[float, dict[int, float]]) -> float:
    """The rate with the best AUC, each rate judged against the rate run on the most seeds (ties: the higher mean) on
    the seeds both ran: a bracket point run on a few seeds, or still running, is compared on those seeds only, so no
    rate wins or loses by its seeds. Rates that share no seed with it are judged by their own means."""
    runs = {lr: auc for lr, auc in auc_by_lr.items() if auc}
    ref = max(runs, key=lambda lr: (len(runs[lr]), float(np.mean(list(runs[lr].values())))))

    def edge(lr: float) -> float:
        shared = set(runs[lr]) & set(runs[ref])
        if not shared:
            return float(np.mean(list(runs[lr].values()))) - float(np.mean(list(runs[ref].values())))
        return float(np.mean([runs[lr][s] - runs[ref][s] for s in shared]))

    return max(runs, key=lambda lr: (edge(lr), lr == ref))


def summarise(runs_by_lr: dict[float, list[dict]], methods) -> dict:
    """Per method and rate the mean ± sd AUC and final, each method's best rate, and the paired comparisons at the
    best rates: every method against GRPO, and OAR-G against each free alternative."""
    table, best = {}, {}
    for m in methods:
        table[m] = {}
        for lr, runs in runs_by_lr.items():
            auc, final = per_seed(runs, m, "auc"), per_seed(runs, m, "final")
            if auc:
                v, f = np.array(list(auc.values())), np.array(list(final.values()))
                table[m][lr] = {"seeds": len(v), "auc": float(v.mean()), "auc_sd": float(v.std(ddof=1)) if len(v) > 1
                                else 0.0, "final": float(f.mean()), "final_sd": float(f.std(ddof=1)) if len(f) > 1
                                else 0.0}
        if table[m]:
            best[m] = best_rate({lr: per_seed(runs, m, "auc") for lr, runs in runs_by_lr.items()})
    at_best = {m: {k: per_seed(runs_by_lr[best[m]], m, k) for k in ("auc", "final")} for m in best}
    pairs = [(m, "grpo") for m in best if m != "grpo" and "grpo" in best]
    pairs += [(m, c) for m in best for c in ("entropy", "position") if m not in ("grpo", "entropy", "position")
              and c in best]
    comps = {f"{a} - {b}": {k: paired(at_best[a][k], at_best[b][k]) for k in ("auc", "final")} for a, b in pairs}
    held = cross_fitted(runs_by_lr, list(best))
    held_comps = {f"{a} - {b}": {k: paired(held["values"][a][k], held["values"][b][k]) for k in ("auc", "final")}
                  for a, b in pairs}
    return {"table": {m: {f"{lr:g}": v for lr, v in t.items()} for m, t in table.items()},
            "best_lr": {m: f"{lr:g}" for m, lr in best.items()}, "comparisons": comps,
            "held_out": {"chosen_lr": held["chosen_lr"], "comparisons": held_comps}}


def cross_fitted(runs_by_lr: dict[float, list[dict]], methods, folds: int = 2) -> dict:
    """Each seed evaluated at the rate chosen without it: the seeds (sorted) are dealt into ``folds`` folds; for each
    fold and method the rate with the best mean AUC over the *other* folds' seeds is chosen, and the fold's seeds
    contribute their runs at that rate. Removes the optimism of choosing and evaluating on the same seeds.

    Returns ``chosen_lr`` (method -> the rate chosen for each fold, by fold) and ``values`` (method -> auc / final ->
    seed -> value at its held-out rate)."""
    seeds = sorted({r["seed"] for runs in runs_by_lr.values() for r in runs})
    fold_of = {s: i % folds for i, s in enumerate(seeds)}
    chosen, values = {}, {}
    for m in methods:
        by_lr = {lr: {k: per_seed(runs, m, k) for k in ("auc", "final")} for lr, runs in runs_by_lr.items()}
        chosen[m], values[m] = [], {"auc": {}, "final": {}}
        for f in range(folds):
            train = {lr: [v for s, v in d["auc"].items() if fold_of[s] != f] for lr, d in by_lr.items()}
            train = {lr: v for lr, v in train.items() if v}
            if not train:
                chosen[m].append(None)
                continue
            lr = max(train, key=lambda x: float(np.mean(train[x])))
            chosen[m].append(f"{lr:g}")
            for k in ("auc", "final"):
                values[m][k].update({s: v for s, v in by_lr[lr][k].items() if fold_of[s] == f})
    return {"chosen_lr": chosen, "values": values}


def report(summary: dict) -> str:
    lrs = sorted({lr for t in summary["table"].values() for lr in t}, key=float)
    lines = ["| method | " + " | ".join(f"AUC at lr {lr}" for lr in lrs) + " | best lr | final at best |",
             "|---|" + "---|" * len(lrs) + "---|---|"]
    for m, t in summary["table"].items():
        cells = [f"{t[lr]['auc']:.3f} ± {t[lr]['auc_sd']:.3f} ({t[lr]['seeds']})" if lr in t else "–" for lr in lrs]
        b = summary["best_lr"].get(m)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {b} | "
                     + (f"{t[b]['final']:.3f} ± {t[b]['final_sd']:.3f}" if b else "–") + " |")
    lines += ["", "| at each method's best lr | Δ AUC [95 % paired bootstrap] | p | Δ final [95 %] | p | seeds |",
              "|---|---|---|---|---|---|"]

    def cell(c: dict) -> str:
        ci = "" if c["ci95"] is None else f" [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]"
        return f"{c['diff']:+.3f}{ci} | " + ("–" if c["p"] is None else f"{c['p']:.3f}")

    for name, c in summary["comparisons"].items():
        lines.append(f"| {name} | {cell(c['auc'])} | {cell(c['final'])} | {c['auc']['seeds']} |")
    held = summary.get("held_out")
    if held:
        chosen = "; ".join(f"{m} {' / '.join(str(x) for x in lrs)}" for m, lrs in held["chosen_lr"].items())
        lines += ["", f"Each seed at the rate chosen on the other fold's seeds (2 folds; rates by fold: {chosen}):", "",
                  "| held-out rate | Δ AUC [95 % paired bootstrap] | p | Δ final [95 %] | p | seeds |",
                  "|---|---|---|---|---|---|"]
        for name, c in held["comparisons"].items():
            lines.append(f"| {name} | {cell(c['auc'])} | {cell(c['final'])} | {c['auc']['seeds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS))
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the study's 40)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "credit_lr")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--task", default="last", help="which digit decides (research.credit --task): last, first, middle")
    a = ap.parse_args(argv)
    lrs = [float(x) for x in a.lrs.split(",") if x]
    methods = [m for m in a.methods.split(",") if m]
    if not a.report_only:
        for lr in lrs:
            d = lr_dir(a.out, lr)
            done = load_runs(a.out, [lr])[lr]
            have = {(r["method"], r["seed"]) for r in done}
            seeds = range(a.first_seed, a.first_seed + a.seeds)
            if all((m, s) in have for m in methods for s in seeds):
                continue
            args = ["--lr", f"{lr:g}", "--seeds", str(a.seeds), "--first-seed", str(a.first_seed), "--methods",
                    ",".join(methods), "--out", str(d), "--task", a.task]
            args += ["--steps", str(a.steps)] if a.steps else []
            if credit.main(args) != 0:
                return 1
    summary = summarise(load_runs(a.out, lrs), methods)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "credit_lr.json").write_text(json.dumps(summary, indent=1))
    text = report(summary)
    (a.out / "credit_lr.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
