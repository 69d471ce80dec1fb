"""The learning question under a protocol fixed before the run (issue #57 item 3; research/docs/evidence.md §9).

Everything the protocol fixes lives here as data, read by both the runs and the analysis, so neither can drift from
what was written down: the tasks, the methods, each method's learning rate (chosen on the tuning seeds 0–9 of
evidence §6–8, never on the seeds below), the fresh seeds, the one primary test per task and the secondary tests
(Holm-adjusted together). Runs go through :mod:`research.credit`'s loop, unchanged; every run is kept in the committed
results file ``research/results/learning_protocol.json`` (per-run validation curves, AUC, final success, the mean
weight on the decisive token, wall time), and the tables in evidence §9 are generated from that file
(``python -m research.tables``).

usage: python -m research.learning_protocol [--workers N/J] [--out DIR] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from research import REPO, credit
from research.credit_lr import paired

TASKS = ("first", "middle", "last")
METHODS = ("grpo", "conservative", "fisher", "oar_g", "position", "entropy")
# each method's rate on each task, chosen by mean AUC on the tuning seeds 0–9 (evidence §6–8's tables)
RATES = {task: {m: 6e-4 for m in METHODS} for task in TASKS}
RATES["middle"]["position"] = 1.2e-3
SEEDS = tuple(range(10, 20))  # fresh: no rate was chosen on them
PRIMARY = ("conservative", "grpo")
SECONDARY = (("fisher", "grpo"), ("oar_g", "grpo"), ("position", "grpo"), ("entropy", "grpo"),
             ("conservative", "position"), ("conservative", "entropy"), ("conservative", "fisher"),
             ("conservative", "oar_g"))
ALPHA = 0.05
RESULTS = REPO / "research" / "results" / "learning_protocol.json"


def units() -> list[tuple[str, int, float, tuple[str, ...]]]:
    """(task, seed, rate, methods at that rate) in run order: a seed's methods together, so a stopped study is paired."""
    out = []
    for task in TASKS:
        for seed in SEEDS:
            for lr in sorted(set(RATES[task].values())):
                out.append((task, seed, lr, tuple(m for m in METHODS if RATES[task][m] == lr)))
    return out


def run_dir(out: Path, task: str, lr: float, seed: int) -> Path:
    return out / task / f"lr{lr:g}" / f"seed{seed}"


def run(out: Path, worker: int, workers: int) -> int:
    """This worker's share of the units (every ``workers``-th (task, seed) from ``worker``); resumable."""
    pairs = sorted({(t, s) for t, s, _, _ in units()}, key=lambda p: (TASKS.index(p[0]), p[1]))
    mine = set(pairs[worker::workers])
    for task, seed, lr, methods in units():
        if (task, seed) in mine:
            args = ["--task", task, "--lr", f"{lr:g}", "--seeds", "1", "--first-seed", str(seed), "--methods",
                    ",".join(methods), "--out", str(run_dir(out, task, lr, seed))]
            if credit.main(args) != 0:
                return 1
    return 0


def collect(out: Path) -> list[dict]:
    """Every run of the plan found under ``out``: one record each (none dropped; a missing run is reported missing)."""
    records = []
    for task, seed, lr, methods in units():
        d = run_dir(out, task, lr, seed)
        runs = {r["method"]: r for f in sorted(d.glob("runs_*.json")) for r in json.loads(f.read_text())["runs"]
                if r["seed"] == seed}
        for m in methods:
            r = runs.get(m)
            if r is None:
                continue
            steps, values = r["val"]["steps"], r["val"]["values"]
            w = [t["w_decisive"] for t in r["train"] if np.isfinite(t["w_decisive"])]
            records.append({"task": task, "method": m, "seed": seed, "lr": lr, "steps": steps,
                            "values": [round(float(v), 6) for v in values], "auc": round(credit.auc(steps, values), 6),
                            "final": round(float(values[-1]), 6),
                            "w_decisive": round(float(np.mean(w)), 4) if w else None,
                            "wall_s": round(float(r["wall_s"]), 1)})
    return records


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (family-wise error at most α over the family)."""
    order = np.argsort(ps, kind="stable")
    adj, running = np.empty(len(ps)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return [float(x) for x in adj]


def analyse(records: list[dict]) -> dict:
    """Per task and method mean ± sd; the primary test per task; the secondary tests with Holm over all of them."""
    by = {}
    for r in records:
        by.setdefault(r["task"], {}).setdefault(r["method"], {})[r["seed"]] = r
    summary = {t: {m: {"seeds": len(v), "lr": RATES[t][m],
                       "auc": float(np.mean([x["auc"] for x in v.values()])),
                       "auc_sd": float(np.std([x["auc"] for x in v.values()], ddof=1)) if len(v) > 1 else 0.0,
                       "final": float(np.mean([x["final"] for x in v.values()])),
                       "w_decisive": (float(np.mean([x["w_decisive"] for x in v.values()]))
                                      if all(x["w_decisive"] is not None for x in v.values()) else None)}
                   for m, v in ms.items()} for t, ms in by.items()}

    def test(task: str, a: str, b: str) -> dict:
        ms = by.get(task, {})
        if a not in ms or b not in ms:
            return {"task": task, "a": a, "b": b, "diff": None, "ci95": None, "p": None, "seeds": 0}
        auc = paired({s: r["auc"] for s, r in ms[a].items()}, {s: r["auc"] for s, r in ms[b].items()})
        final = paired({s: r["final"] for s, r in ms[a].items()}, {s: r["final"] for s, r in ms[b].items()})
        return {"task": task, "a": a, "b": b, **auc, "final": final}

    primary = [test(t, *PRIMARY) for t in TASKS]
    for p in primary:
        p["passes"] = bool(p["p"] is not None and p["p"] < ALPHA and p["diff"] > 0)
    ps = [p["p"] for p in primary if p["p"] is not None]
    for p, h in zip([p for p in primary if p["p"] is not None], holm(ps) if ps else []):
        p["p_holm_over_tasks"] = h
    secondary = [test(t, a, b) for t in TASKS for a, b in SECONDARY]
    done = [s for s in secondary if s["p"] is not None]
    for s, h in zip(done, holm([s["p"] for s in done]) if done else []):
        s["p_holm"] = h
    planned = sum(len(m) for _, _, _, m in units())
    return {"summary": summary, "primary": primary, "secondary": secondary, "runs": len(records),
            "planned_runs": planned}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1/0", help="N/J: run every N-th (task, seed) from J (N processes)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "learning_protocol")
    ap.add_argument("--report-only", action="store_true", help="collect the runs into the results file, no new run")
    a = ap.parse_args(argv)
    n, j = (int(x) for x in a.workers.split("/"))
    if not a.report_only and run(a.out, j, n) != 0:
        return 1
    records = collect(a.out)
    result = {"protocol": {"tasks": TASKS, "methods": METHODS, "rates": RATES, "seeds": SEEDS, "primary": PRIMARY,
                           "secondary": SECONDARY, "alpha": ALPHA, "section": "research/docs/evidence.md §9"},
              "analysis": analyse(records), "records": records}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    a_ = result["analysis"]
    print(f"{a_['runs']} of {a_['planned_runs']} planned runs in {RESULTS}")
    for p in a_["primary"]:
        print(f"primary {p['task']}: {p['a']} - {p['b']} {p['diff']} {p['ci95']} p {p['p']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
