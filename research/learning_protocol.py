"""The learning question under protocols fixed before the run (issue #57; research/docs/evidence.md §9 and §11).

Everything a protocol fixes lives here as data (:class:`Protocol`), read by both the runs and the analysis, so neither
can drift from what was written down: the tasks, the methods, each method's learning rate (chosen on the tuning seeds
0–9 of evidence §6–8, never on the seeds compared), the fresh seeds, the gate's reading of signed scores, the one
primary test per task and the secondary tests (Holm-adjusted together). Runs go through :mod:`research.credit`'s loop,
unchanged; every run is kept in the protocol's committed results file under ``research/results/`` (per-run validation
curves, AUC, final success, the mean weight on the decisive token, wall time), and the tables in evidence §9–11 are
generated from those files (``python -m research.tables``).

usage: python -m research.learning_protocol [--protocol 9|11] [--workers N/J] [--out DIR] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from research import REPO, credit
from research.common import write_results
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
# evidence §10: the default with the gate's candidate treatment of signed scores (set from the row measurement,
# research/results/signed_gate.json, before the arm runs), paired with the default's runs above on the same seeds
GATE_CANDIDATE: str | None = "magnitude"  # research/results/signed_gate.json, committed before the arm ran
GATE_MARGIN = 0.02  # non-inferiority: the candidate's pooled Δ AUC lower bound must lie above −GATE_MARGIN
RESULTS = REPO / "research" / "results" / "learning_protocol.json"


@dataclass(frozen=True)
class Protocol:
    """One learning protocol as data: what it runs (tasks × seeds × methods at their fixed rates, the gate's reading
    of signed scores for every run) and what it tests (one primary pair per task; secondary pairs, Holm together).
    Methods that appear in no primary pair run after every primary run (a second phase), so a study stopped for
    time keeps its primary tests whole."""

    section: str
    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    rates: dict
    seeds: tuple[int, ...]
    primary: tuple[str, str]
    secondary: tuple[tuple[str, str], ...]
    signed_scores: str
    results: Path
    out_name: str  # the runs' folder under --out


# evidence §9: the six methods, the default with the gate's `clamp` (the default before §10)
SECTION9 = Protocol("research/docs/evidence.md §9", TASKS, METHODS, RATES, SEEDS, PRIMARY, SECONDARY, "clamp", RESULTS,
                    "")
# evidence §11: the default as it ships since §10 (`magnitude`) against GRPO on seeds no study has used, with the
# free alternatives beside it; the rates are §9's (the default's rate was chosen with `clamp`, on seeds 0–9)
SECTION11 = Protocol("research/docs/evidence.md §11", TASKS, ("grpo", "conservative", "position", "entropy"),
                     {t: {m: RATES[t][m] for m in ("grpo", "conservative", "position", "entropy")} for t in TASKS},
                     tuple(range(20, 30)), PRIMARY,
                     (("conservative", "position"), ("conservative", "entropy"), ("position", "grpo"),
                      ("entropy", "grpo")),
                     "magnitude", REPO / "research" / "results" / "learning_protocol_11.json", "protocol_11")
PROTOCOLS = {"9": SECTION9, "11": SECTION11}


def units(proto: Protocol = SECTION9) -> list[tuple[str, int, float, tuple[str, ...]]]:
    """(task, seed, rate, methods at that rate) in run order: a seed's methods together, so a stopped study is paired;
    the primary pair's methods first on every task and seed, then the others (their own phase)."""
    first = [m for m in proto.methods if m in proto.primary]
    phases = [first, [m for m in proto.methods if m not in first]]
    out = []
    for phase in phases:
        for task in proto.tasks:
            for seed in proto.seeds:
                for lr in sorted({proto.rates[task][m] for m in phase}):
                    out.append((task, seed, lr, tuple(m for m in phase if proto.rates[task][m] == lr)))
    return out


def run_dir(out: Path, task: str, lr: float, seed: int, proto: Protocol = SECTION9) -> Path:
    return out / proto.out_name / task / f"lr{lr:g}" / f"seed{seed}"


def run(out: Path, worker: int, workers: int, proto: Protocol = SECTION9) -> int:
    """This worker's share of the units (every ``workers``-th (task, seed) from ``worker``); resumable."""
    pairs = sorted({(t, s) for t, s, _, _ in units(proto)}, key=lambda p: (proto.tasks.index(p[0]), p[1]))
    mine = set(pairs[worker::workers])
    for task, seed, lr, methods in units(proto):
        if (task, seed) in mine:
            args = ["--task", task, "--lr", f"{lr:g}", "--seeds", "1", "--first-seed", str(seed), "--methods",
                    ",".join(methods), "--signed-scores", proto.signed_scores,
                    "--out", str(run_dir(out, task, lr, seed, proto))]
            if credit.main(args) != 0:
                return 1
    return 0


# evidence §7 and §8 report GRPO on `first` at 1.2e-3 as 0.447 ± 0.236 (seeds 0–5) and 0.685 (seeds 0–3): today's
# code rerun on those seeds says which (if either) reproduces (issue #57 item 3)
RECONCILE = {"task": "first", "method": "grpo", "lr": 1.2e-3, "seeds": tuple(range(6)),
             "published": {"§7": {"seeds": "0-5", "auc": 0.447, "auc_sd": 0.236}, "§8": {"seeds": "0-3", "auc": 0.685}}}


def run_reconcile(out: Path) -> int:
    r = RECONCILE
    return credit.main(["--task", r["task"], "--lr", f"{r['lr']:g}", "--seeds", str(len(r["seeds"])), "--first-seed",
                        str(r["seeds"][0]), "--methods", r["method"], "--out", str(out / "reconcile")])


def collect_reconcile(out: Path) -> dict | None:
    r = RECONCILE
    runs = [x for f in sorted((out / "reconcile").glob("runs_*.json")) for x in json.loads(f.read_text())["runs"]]
    records = [_record(r["task"], x["seed"], r["lr"], r["method"], x) for x in runs if x["seed"] in r["seeds"]]
    if not records:
        return None
    auc = {x["seed"]: x["auc"] for x in records}
    first4 = [auc[s] for s in range(4) if s in auc]
    return {**r, "records": records, "auc": float(np.mean(list(auc.values()))),
            "auc_sd": float(np.std(list(auc.values()), ddof=1)) if len(auc) > 1 else 0.0,
            "auc_seeds_0_3": float(np.mean(first4)) if first4 else None}


def gate_dir(out: Path, task: str, seed: int) -> Path:
    return out / "gate" / task / f"seed{seed}"


def run_gate(out: Path, worker: int, workers: int) -> int:
    """The §10 arm: the default with ``GATE_CANDIDATE`` on every task and seed, at the default's rate."""
    if GATE_CANDIDATE is None:
        raise SystemExit("GATE_CANDIDATE is not set: the row measurement chooses it first (evidence §10)")
    pairs = [(t, s) for t in TASKS for s in SEEDS][worker::workers]
    for task, seed in pairs:
        args = ["--task", task, "--lr", f"{RATES[task]['conservative']:g}", "--seeds", "1", "--first-seed", str(seed),
                "--methods", "conservative", "--signed-scores", GATE_CANDIDATE, "--out", str(gate_dir(out, task, seed))]
        if credit.main(args) != 0:
            return 1
    return 0


def collect_gate(out: Path) -> list[dict]:
    """The §10 arm's runs (records like :func:`collect`'s, with ``signed_scores``)."""
    records = []
    for task in TASKS:
        for seed in SEEDS:
            for f in sorted(gate_dir(out, task, seed).glob("runs_*.json")):
                for r in json.loads(f.read_text())["runs"]:
                    if r["seed"] == seed and r.get("signed_scores") == GATE_CANDIDATE:
                        records.append({**_record(task, seed, RATES[task]["conservative"], "conservative", r),
                                        "signed_scores": GATE_CANDIDATE})
    return records


def analyse_gate(records: list[dict], gate: list[dict]) -> dict | None:
    """The candidate against the default's own runs, paired on (task, seed): pooled and per task."""
    if not gate:
        return None
    base = {(r["task"], r["seed"]): r for r in records if r["method"] == "conservative"}
    cand = {(r["task"], r["seed"]): r for r in gate}
    pooled = paired({k: v["auc"] for k, v in cand.items()}, {k: v["auc"] for k, v in base.items()})
    per_task = {t: paired({k[1]: v["auc"] for k, v in cand.items() if k[0] == t},
                          {k[1]: v["auc"] for k, v in base.items() if k[0] == t}) for t in TASKS}
    lo = pooled["ci95"][0] if pooled["ci95"] else None
    grpo = {(r["task"], r["seed"]): r for r in records if r["method"] == "grpo"}
    # not a test the protocol named (exploratory): the candidate against GRPO on the same seeds, per task
    against_grpo = {t: paired({k[1]: v["auc"] for k, v in cand.items() if k[0] == t},
                              {k[1]: v["auc"] for k, v in grpo.items() if k[0] == t}) for t in TASKS}
    return {"candidate": GATE_CANDIDATE, "margin": GATE_MARGIN, "pooled": pooled, "per_task": per_task,
            "exploratory_against_grpo": against_grpo,
            "non_inferior": bool(lo is not None and lo > -GATE_MARGIN and pooled["seeds"] == len(TASKS) * len(SEEDS))}


def _record(task: str, seed: int, lr: float, method: str, r: dict) -> dict:
    steps, values = r["val"]["steps"], r["val"]["values"]
    w = [t["w_decisive"] for t in r["train"] if np.isfinite(t["w_decisive"])]
    return {"task": task, "method": method, "seed": seed, "lr": lr, "steps": steps,
            "values": [round(float(v), 6) for v in values], "auc": round(credit.auc(steps, values), 6),
            "final": round(float(values[-1]), 6), "w_decisive": round(float(np.mean(w)), 4) if w else None,
            "wall_s": round(float(r["wall_s"]), 1)}


def collect(out: Path, proto: Protocol = SECTION9) -> list[dict]:
    """Every run of the plan found under ``out``: one record each (none dropped; a missing run is reported missing)."""
    records = []
    for task, seed, lr, methods in units(proto):
        d = run_dir(out, task, lr, seed, proto)
        runs = {r["method"]: r for f in sorted(d.glob("runs_*.json")) for r in json.loads(f.read_text())["runs"]
                if r["seed"] == seed and r.get("signed_scores", "clamp") == proto.signed_scores}
        records += [_record(task, seed, lr, m, runs[m]) for m in methods if m in runs]
    return records


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (family-wise error at most α over the family)."""
    order = np.argsort(ps, kind="stable")
    adj, running = np.empty(len(ps)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return [float(x) for x in adj]


def analyse(records: list[dict], proto: Protocol = SECTION9) -> dict:
    """Per task and method mean ± sd; the primary test per task; the secondary tests with Holm over all of them."""
    by = {}
    for r in records:
        by.setdefault(r["task"], {}).setdefault(r["method"], {})[r["seed"]] = r
    summary = {t: {m: {"seeds": len(v), "lr": proto.rates[t][m],
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

    primary = [test(t, *proto.primary) for t in proto.tasks]
    for p in primary:
        p["passes"] = bool(p["p"] is not None and p["p"] < ALPHA and p["diff"] > 0)
    ps = [p["p"] for p in primary if p["p"] is not None]
    for p, h in zip([p for p in primary if p["p"] is not None], holm(ps) if ps else []):
        p["p_holm_over_tasks"] = h
    secondary = [test(t, a, b) for t in proto.tasks for a, b in proto.secondary]
    done = [s for s in secondary if s["p"] is not None]
    for s, h in zip(done, holm([s["p"] for s in done]) if done else []):
        s["p_holm"] = h
    planned = sum(len(m) for _, _, _, m in units(proto))
    return {"summary": summary, "primary": primary, "secondary": secondary, "runs": len(records),
            "planned_runs": planned}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=tuple(PROTOCOLS), default="9",
                    help="which protocol: evidence §9 (and its §10 gate arm, §7/§8 reconciliation) or §11")
    ap.add_argument("--workers", default="1/0", help="N/J: run every N-th (task, seed) from J (N processes)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "learning_protocol")
    ap.add_argument("--report-only", action="store_true", help="collect the runs into the results file, no new run")
    ap.add_argument("--arm", choices=("main", "gate", "reconcile"), default="main",
                    help="which runs to make: the protocol's, or (§9 only) §10's gate arm or the §7/§8 reconciliation")
    a = ap.parse_args(argv)
    proto = PROTOCOLS[a.protocol]
    if a.arm != "main" and proto is not SECTION9:
        ap.error(f"--arm {a.arm} belongs to --protocol 9")
    n, j = (int(x) for x in a.workers.split("/"))
    arms = {"main": lambda: run(a.out, j, n, proto), "gate": lambda: run_gate(a.out, j, n),
            "reconcile": lambda: run_reconcile(a.out)}
    if not a.report_only and arms[a.arm]() != 0:
        return 1
    records = collect(a.out, proto)
    result = {"protocol": {"tasks": proto.tasks, "methods": proto.methods, "rates": proto.rates, "seeds": proto.seeds,
                           "primary": proto.primary, "secondary": proto.secondary, "alpha": ALPHA,
                           "section": proto.section, "signed_scores": proto.signed_scores},
              "analysis": analyse(records, proto), "records": records}
    if proto is SECTION9:
        gate = collect_gate(a.out) if GATE_CANDIDATE else []
        result["protocol"].update(gate_candidate=GATE_CANDIDATE, gate_margin=GATE_MARGIN)
        result.update(gate=analyse_gate(records, gate), gate_records=gate, reconcile=collect_reconcile(a.out))
    write_results(proto.results, result)
    a_ = result["analysis"]
    print(f"{a_['runs']} of {a_['planned_runs']} planned runs in {proto.results}")
    for p in a_["primary"]:
        print(f"primary {p['task']}: {p['a']} - {p['b']} {p['diff']} {p['ci95']} p {p['p']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
