"""What the gate does to signed credit (issue #57 item 5; docs/method.md §5): each ``algorithm.oar.signed_scores``
treatment on the default mode's own scores.

Rows. (a) The learning study's three tasks (research/credit.py; the decisive token first, in the middle, last): the
warm-started policy's own rollouts (8 steps × 8 prompts × 8 samples per task, sampler seeds 100–107, not the
protocol's), scored by ``conservative`` exactly as the loop scores them; the task labels each token (decisive, decoy,
filler), so where a treatment puts the weight can be read against the token that decided the reward. (b) SmolLM2's own
1,024-token rows (research/long_fidelity.py's cache of the same rows as ``research/results/fidelity_smollm2_1024.json``):
no token labels; what is measured there is how many rows lose suppression and where counter-evidence lands.

Per treatment, over the rows the estimator reshapes (non-zero advantage, ≥ 2 reasoning tokens, non-constant
scores): the share of rows with ≥ τ of their tokens at or below 0 (the cause, treatment-free); the share where the gate
suppresses no token (θ at the bottom: every token at weight ≥ 1 before renormalisation); the mean final weight of
tokens with a negative score, of the decisive token, of the decoys and filler; and the share of rows where the
decisive token has the row's largest weight. Every row counted; intervals are 95 % bootstraps clustered by prompt.

usage: python -m research.signed_gate [--steps 8] [--long-fidelity DIR] [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from oar_verl.core.reshaping.gating import SIGNED_SCORES, masked_quantile, oar_token_weights
from research import REPO, credit, digit_task
from research.common import command_line, write_results

TASKS = ("first", "middle", "last")
TAU, BETA, FLOOR = 0.4, 2.0, 0.1  # the shipped gate (preset `paper`)


def row_stats(importance: torch.Tensor, reasoning: torch.Tensor, rows: torch.Tensor, signed: str) -> dict:
    """Per reshaped row (B,): whether the gate suppressed no token, and the final (B, T) weights.

    Args:
        importance: (B, T) signed scores. reasoning: (B, T) bool. rows: (B,) bool rows to reshape.
    """
    tw = oar_token_weights(importance, reasoning, reasoning.long(), TAU, BETA, FLOOR, reshape_rows=rows,
                           signed=signed)
    n = SIGNED_SCORES[signed](torch.where(reasoning, importance.double(), 0.0), reasoning)
    theta = masked_quantile(n, reasoning, TAU)[:, None]
    suppressed = (reasoning & (n < theta)).any(-1)
    return {"no_suppression": ~suppressed, "weights": tw.weights.double()}


def eligible(importance: torch.Tensor, reasoning: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B,) rows the estimator reshapes that have ≥ 2 reasoning tokens and scores that are not all equal."""
    big = torch.where(reasoning, importance, float("-inf")).amax(-1)
    small = torch.where(reasoning, importance, float("inf")).amin(-1)
    return rows & (reasoning.sum(-1) >= 2) & (big > small)


def cluster_ci(values: np.ndarray, groups: np.ndarray, resamples: int = 2000, seed: int = 0) -> dict:
    """Mean of per-row ``values`` (NaN rows skipped, counted) with a 95 % bootstrap interval clustered by ``groups``."""
    ok = ~np.isnan(values)
    v, g = values[ok], groups[ok]
    if len(v) == 0:
        return {"mean": None, "lo": None, "hi": None, "rows": 0}
    ids, inv = np.unique(g, return_inverse=True)
    sums, counts = np.bincount(inv, v), np.bincount(inv)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(ids), (resamples, len(ids)))
    boots = sums[pick].sum(1) / counts[pick].sum(1)
    return {"mean": float(v.mean()), "lo": float(np.quantile(boots, 0.025)), "hi": float(np.quantile(boots, 0.975)),
            "rows": int(len(v))}


def measure(importance: torch.Tensor, reasoning: torch.Tensor, rows: torch.Tensor, groups: np.ndarray,
            roles: dict[str, torch.Tensor] | None = None) -> dict:
    """Every treatment's statistics on one set of rows (see the module docstring)."""
    keep = eligible(importance, reasoning, rows)
    neg = reasoning & (importance < 0)
    at_or_below = (reasoning & (importance <= 0)).sum(-1).double() / reasoning.sum(-1).clamp(min=1)
    k = keep.numpy()
    out = {"rows": int(k.sum()), "rows_offered": int(rows.sum()),
           "cause": cluster_ci((at_or_below >= TAU).double().numpy()[k], groups[k]),
           "negative_token_share": cluster_ci(np.where(k, (neg.sum(-1) / reasoning.sum(-1).clamp(min=1)).numpy(),
                                                       np.nan)[k], groups[k]), "treatments": {}}
    dec_clamp = None
    for name in SIGNED_SCORES:
        st = row_stats(importance, reasoning, keep, name)
        w = st["weights"]

        def mean_on(m: torch.Tensor) -> np.ndarray:
            c = m.sum(-1)
            return torch.where(c > 0, (w * m).sum(-1) / c.clamp(min=1), float("nan")).numpy()

        e = {"no_suppression": cluster_ci(st["no_suppression"].double().numpy()[k], groups[k]),
             "w_negative": cluster_ci(mean_on(neg & keep[:, None])[k], groups[k])}
        if roles is not None:
            for role in ("decisive", "decoy", "filler"):
                e[f"w_{role}"] = cluster_ci(mean_on(roles[role] & reasoning & keep[:, None])[k], groups[k])
            dec_w = mean_on(roles["decisive"] & reasoning & keep[:, None])
            dec_clamp = dec_w if name == "clamp" else dec_clamp
            e["w_decisive_minus_clamp"] = cluster_ci((dec_w - dec_clamp)[k], groups[k])  # paired on the same rows
            dec = roles["decisive"] & reasoning
            top = torch.where(reasoning, w, float("-inf")).amax(-1)
            has = dec.any(-1)
            hit = torch.where(has, ((w >= top[:, None] - 1e-12) & dec).any(-1).double(), float("nan"))
            e["decisive_top"] = cluster_ci(hit.numpy()[k], groups[k])
        out["treatments"][name] = e
    return out


def synthetic_rows(task_name: str, steps: int, root: Path) -> dict:
    """The warm-started policy's rollouts on one task, scored by ``conservative`` as the loop scores them."""
    credit.TASK = digit_task.task(task_name)
    assets = credit.build_assets(root / task_name, credit.FULL, log=lambda m: None)
    model, tok = credit.load_model(assets["model_dir"])
    algo = credit.algorithm_config("conservative", 0)
    digits = credit.TASK.digit_token_ids(tok)
    parts: dict[str, list] = {k: [] for k in ("importance", "reasoning", "rows", "groups", *credit.ROLES)}
    s = credit.FULL
    for i in range(steps):
        seed = 100 + i
        torch.manual_seed(seed)
        idx = np.random.default_rng(seed).integers(0, len(credit.TASK.PROMPTS), s.prompts_per_step)
        r = credit.rollout(model, tok, [credit.TASK.PROMPTS[j] for j in idx], s.rollout_n,
                           torch.Generator().manual_seed(1000 + seed), s.max_new_tokens)
        adv = credit.compute_advantages("conservative", model, tok, r, 1, algo)
        roles = credit.TASK.token_roles(r.batch.responses, r.batch.response_mask, adv.reasoning, digits)
        T = 64  # pad every step to one width
        pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))  # noqa: E731
        parts["importance"].append(pad(adv.importance.double()))
        parts["reasoning"].append(pad(adv.reasoning))
        parts["rows"].append(adv.attributed)
        parts["groups"].append(np.array([f"{seed}-{u}" for u in r.uids]))
        for role in credit.ROLES:
            parts[role].append(pad(roles[role].bool()))
    cat = {k: (np.concatenate(v) if k == "groups" else torch.cat(v)) for k, v in parts.items()}
    cat["groups"] = np.array([f"{task_name}-{g}" for g in cat["groups"]])
    return cat | {"warm_start_success": assets["val_success_t1"]}


def measure_rows(cat: dict) -> dict:
    return measure(cat["importance"], cat["reasoning"], cat["rows"], cat["groups"], {r: cat[r] for r in credit.ROLES})


def long_rows(run: Path, methods: str = "conservative-fisher_k1_mean-oar_g") -> dict:
    """SmolLM2's own rows: ``conservative``'s cached scores on each row's reasoning tokens (every row reshaped)."""
    chunks = [json.loads(p.read_text()) for p in sorted(run.glob(f"chunk_*_{methods}_mean*.json"))]
    rows = [torch.tensor(r, dtype=torch.float64) for c in chunks for r in c["scores"]["conservative"]]
    if not rows:
        return {"rows": 0}
    imp = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    reasoning = torch.arange(imp.shape[1])[None] < torch.tensor([len(r) for r in rows])[:, None]
    return measure(imp, reasoning, torch.ones(len(rows), dtype=torch.bool), np.arange(len(rows)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="rollout batches per task (64 rows each)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--long-fidelity", type=Path, default=REPO / "outputs" / "long_fidelity" / "smollm2_1024",
                    help="the SmolLM2 study's run directory (its chunk cache holds the scores)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "signed_gate")
    ap.add_argument("--results", type=Path, default=REPO / "research" / "results" / "signed_gate.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {"command": command_line("signed_gate", argv),
              "gate": {"tau": TAU, "beta": BETA, "floor": FLOOR}, "treatments": list(SIGNED_SCORES),
              "synthetic": {}, "smollm2": long_rows(a.long_fidelity)}
    cats = {t: synthetic_rows(t, a.steps, a.out) for t in a.tasks.split(",") if t}
    for t, cat in cats.items():
        result["synthetic"][t] = {"warm_start_success": cat["warm_start_success"], **measure_rows(cat)}
    if len(cats) > 1:  # the primary row statistic pools the tasks' rows (evidence §10)
        keys = [k for k in next(iter(cats.values())) if k != "warm_start_success"]
        pooled = {k: (np.concatenate if k == "groups" else torch.cat)([c[k] for c in cats.values()]) for k in keys}
        result["pooled"] = measure_rows(pooled)
        w = {n: e["w_decisive"]["mean"] for n, e in result["pooled"]["treatments"].items()}
        result["candidate"] = max((n for n in w if n != "clamp"), key=lambda n: w[n])
    write_results(a.results, result)
    print(f"candidate (largest pooled weight on the decisive token, clamp aside): {result.get('candidate')}")
    for where, r in [*result["synthetic"].items(), ("pooled", result.get("pooled", {})), ("smollm2", result["smollm2"])]:
        if not r.get("rows"):
            continue
        print(f"{where}: {r['rows']} rows; cause {r['cause']['mean']:.2f}")
        for name, e in r["treatments"].items():
            extra = "" if "w_decisive" not in e else \
                f"; w decisive {e['w_decisive']['mean']:.2f} top {e['decisive_top']['mean']:.2f}"
            print(f"  {name}: no suppression {e['no_suppression']['mean']:.2f}; w negative "
                  f"{e['w_negative']['mean'] if e['w_negative']['mean'] is None else round(e['w_negative']['mean'], 2)}"
                  + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
