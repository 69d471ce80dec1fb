"""Every generated figure in the docs, regenerated from the committed results files (issue #57 item 1).

A doc marks a generated piece with ``<!-- gen:NAME -->…<!-- /gen:NAME -->`` (a whole table or one cell's figure);
``NAME`` is a key of :data:`RENDERERS`, whose function renders it from its results file under ``research/results/``.
``python -m research.tables`` rewrites every marked piece in README.md, docs/ and research/docs/; ``--check`` writes
nothing and fails naming each piece that differs from its file (tests/research/test_tables.py runs it), so a table
cannot drift from the numbers it claims.

usage: python -m research.tables [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

from research import REPO
from research.verl_worker import steady_peak_ratio

RESULTS = REPO / "research" / "results"
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "research" / "docs").glob("*.md")))
COMMAND = "python -m research.tables"
_BLOCK = re.compile(r"<!-- gen:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /gen:(?P=name) -->", re.S)


@cache
def load(name: str) -> dict:
    """A committed results file (``research/results/NAME.json``)."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def num(x: float, digits: int = 3) -> str:
    """``+0.058`` / ``−0.024`` (the docs' minus sign)."""
    return f"{x:+.{digits}f}".replace("-", "\u2212")


def iv(x: dict | None, digits: int = 3, key: str = "diff") -> str:
    """``+0.058 [+0.020, +0.107]`` from a ``{diff|mean, ci95|lo/hi}`` record."""
    if x is None or x.get(key, x.get("mean")) is None:
        return "–"
    m = x.get(key, x.get("mean"))
    if m != m:  # NaN: a ratio whose denominator's sum is not above 0 (bootstrap_ratio leaves it undefined)
        return "undefined"
    lo, hi = (x["ci95"] if "ci95" in x and x["ci95"] else (x.get("lo"), x.get("hi")))
    return num(m, digits) if lo is None else f"{num(m, digits)} [{num(lo, digits)}, {num(hi, digits)}]"


def pval(p: float | None) -> str:
    return "–" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")


# ---------------------------------------------------------------------------------------------------------------------
# The learning protocol (research/learning_protocol.py, evidence §9)
# ---------------------------------------------------------------------------------------------------------------------

_LABEL = {"grpo": "GRPO", "conservative": "`conservative` (the default)", "fisher": "`fisher`", "oar_g": "OAR-G",
          "position": "position weights", "entropy": "entropy weights"}


def _short(m: str) -> str:
    return {"conservative": "default"}.get(m, _LABEL.get(m, m))


def learning_methods(name: str = "learning_protocol") -> str:
    r = load(name)
    tasks, s = r["protocol"]["tasks"], r["analysis"]["summary"]
    head = "| method | " + " | ".join(f"{t}: rate, AUC (seeds) | final | w decisive" for t in tasks) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(tasks)]
    for m in r["protocol"]["methods"]:
        cells = []
        for t in tasks:
            x = s.get(t, {}).get(m)
            if x is None:
                cells += ["–", "–", "–"]
                continue
            w = "1" if m == "grpo" else ("–" if x["w_decisive"] is None else f"{x['w_decisive']:.2f}")
            cells += [f"{x['lr']:g}, {x['auc']:.3f} ± {x['auc_sd']:.3f} ({x['seeds']})", f"{x['final']:.3f}", w]
        lines.append(f"| {_LABEL[m]} | " + " | ".join(cells) + " |")
    a = r["analysis"]
    lines += ["", f"{a['runs']} of the {a['planned_runs']} planned runs; mean ± sd over seeds; w decisive: the mean "
              "weight on the decisive token over the run's steps."]
    return "\n".join(lines)


def _gate(r: dict) -> str:
    """`` (`magnitude`)`` where a protocol ran the default with another reading of signed scores than §9's `clamp`."""
    g = r["protocol"].get("signed_scores", "clamp")
    return "" if g == "clamp" else f" (`{g}`)"


def learning_primary(name: str = "learning_protocol") -> str:
    r = load(name)
    lines = [f"| primary test: the default{_gate(r)} − GRPO, Δ AUC | Δ [95 % paired bootstrap] | p (exact sign-flip) | "
             "Holm over the 3 tasks | Δ final [95 %] | verdict |", "|---|---|---|---|---|---|"]
    for p in r["analysis"]["primary"]:
        verdict = "faster" if p["passes"] else "not shown"
        lines.append(f"| {p['task']} ({p['seeds']} seeds) | {iv(p)} | {pval(p['p'])} | "
                     f"{pval(p.get('p_holm_over_tasks'))} | {iv(p.get('final'))} | {verdict} |")
    return "\n".join(lines)


def learning_secondary(name: str = "learning_protocol") -> str:
    r = load(name)
    n = sum(1 for s in r["analysis"]["secondary"] if s["p"] is not None)
    lines = [f"| secondary (Holm over all {n}) | Δ AUC [95 %] | p | Holm p |", "|---|---|---|---|"]
    for s in r["analysis"]["secondary"]:
        lines.append(f"| {s['task']}: {_short(s['a'])} − {_short(s['b'])} | {iv(s)} | {pval(s['p'])} | "
                     f"{pval(s.get('p_holm'))} |")
    return "\n".join(lines)


def learning_cell(method: str, name: str = "learning_protocol") -> str:
    """One method's Δ AUC against GRPO per task, for method §15's table: the primary test's p for the default, the
    Holm-adjusted p of the secondary tests for the others."""
    a = load(name)["analysis"]
    tests = a["primary"] if method == "conservative" else [s for s in a["secondary"]
                                                           if s["a"] == method and s["b"] == "grpo"]
    key = "p" if method == "conservative" else "p_holm"
    return " / ".join("–" if t["diff"] is None else f"{num(t['diff'])} (p {pval(t.get(key))})" for t in tests)


def learning_reconcile() -> str:
    """§7 against §8: GRPO on `first` at 1.2e-3 rerun on the seeds both reported."""
    r = load("learning_protocol").get("reconcile")
    if not r:
        return "(not run)"
    per = ", ".join(f"{x['seed']}: {x['auc']:.3f}" for x in sorted(r["records"], key=lambda x: x["seed"]))
    pub = r["published"]
    return (f"GRPO on `{r['task']}` at {r['lr']:g}, today's code, seeds {r['seeds'][0]}–{r['seeds'][-1]}: AUC "
            f"{r['auc']:.3f} ± {r['auc_sd']:.3f} (seeds 0–3: {r['auc_seeds_0_3']:.3f}; per seed {per}); published: "
            f"§7 {pub['§7']['auc']:.3f} ± {pub['§7']['auc_sd']:.3f} (seeds {pub['§7']['seeds']}), §8 "
            f"{pub['§8']['auc']:.3f} (seeds {pub['§8']['seeds']})")


def learning_headline(name: str = "learning_protocol") -> str:
    """The README's one line: the primary result per task, and how many of the protocol's runs it rests on."""
    r = load(name)
    a = r["analysis"]
    parts = [f"{p['task']} {iv(p)} (p {pval(p['p'])})" for p in a["primary"]]
    faster = [p["task"] for p in a["primary"] if p["passes"]]
    verdict = ("faster than GRPO where the decisive token is " + " and ".join(faster)) if faster else \
        "not faster than GRPO on any task"
    seeds = len(r["protocol"]["seeds"])
    gate = r["protocol"].get("signed_scores", "clamp")
    which = ("the default (with the gate's `clamp`; `magnitude` since evidence §10)" if gate == "clamp" else
             f"the default as it ships (the gate's `{gate}`)")
    return (f"{verdict}: {which} − GRPO in AUC at rates fixed on other seeds, {seeds} fresh seeds, "
            + " / ".join(parts))


# ---------------------------------------------------------------------------------------------------------------------
# Rows without an answer span (research/no_span_rows.py, docs/method.md §2)
# ---------------------------------------------------------------------------------------------------------------------


def no_span_rows() -> str:
    r = load("no_span_rows")
    own, ans, agr = r["own_probe"], r["answer_probe"], r["agreement"]

    def two(d: dict) -> str:
        return f"{iv(d['random'], 2, 'mean')} / {iv(d['position'], 2, 'mean')}"

    rows = [("`conservative` (the default), EOS-ended", "eos", "conservative:eos"),
            ("`conservative`, truncated", "truncated", "conservative:truncated"),
            ("`fisher` (either: the same distribution)", "eos", "fisher:eos"),
            ("`gradient` (OAR-G), EOS-ended", "eos", "oar_g:eos")]
    lines = ["| scores of a row without a span | on the probe they explain: over random / over position | on the "
             "answer it would give: over random / over position | Spearman with the answer target's scores |",
             "|---|---|---|---|"]
    for label, layout, key in rows:
        lines.append(f"| {label} | {two(own[layout][key])} | {two(ans[key])} | "
                     f"{iv(agr[key]['spearman'], 2, 'mean')} |")
    defined = [ans[f"{m}:answer"] for m in ("conservative", "fisher", "oar_g")]
    lines.append("| a defined target instead (the answer it would give): `conservative` / `fisher` / OAR-G | | "
                 + " / ".join(num(d["random"]["mean"], 2) for d in defined) + " over random; "
                 + " / ".join(iv(d["position"], 2, "mean") for d in defined) + " over position | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The gate's treatment of signed scores (research/signed_gate.py, evidence §10, method §5)
# ---------------------------------------------------------------------------------------------------------------------


def _pct(x: dict | None) -> str:
    return "–" if not x or x.get("mean") is None else f"{100 * x['mean']:.0f} %"


def _w(x: dict | None) -> str:
    return "–" if not x or x.get("mean") is None else f"{x['mean']:.2f} [{x['lo']:.2f}, {x['hi']:.2f}]"


def signed_gate_rows() -> str:
    r = load("signed_gate")
    tasks = list(r["synthetic"])
    src = [(t, r["synthetic"][t]) for t in tasks] + ([("SmolLM2", r["smollm2"])] if r["smollm2"].get("rows") else [])
    lines = ["| treatment (`signed_scores`) | rows where the gate suppresses nothing: " + " / ".join(n for n, _ in src)
             + " | weight of negative-score tokens: " + " / ".join(n for n, _ in src)
             + " | weight on the decisive token: " + " / ".join(tasks) + " / pooled | decisive token weighted "
             "highest: " + " / ".join(tasks) + " / pooled |", "|---|---|---|---|---|"]
    for name in r["treatments"]:
        e = [x["treatments"][name] for _, x in src]
        syn = [r["synthetic"][t]["treatments"][name] for t in tasks]
        pooled = r["pooled"]["treatments"][name]
        lines.append(f"| `{name}` | " + " / ".join(_pct(x["no_suppression"]) for x in e) + " | "
                     + " / ".join("–" if x["w_negative"]["mean"] is None else f"{x['w_negative']['mean']:.2f}"
                                  for x in e) + " | "
                     + " / ".join(f"{x['w_decisive']['mean']:.2f}" for x in syn) + f" / **{_w(pooled['w_decisive'])}** | "
                     + " / ".join(_pct(x["decisive_top"]) for x in syn) + f" / {_pct(pooled['decisive_top'])} |")
    paired = "; ".join(f"`{n}` {iv(e['w_decisive_minus_clamp'], 2, 'mean')}" for n, e in
                       r["pooled"]["treatments"].items() if n != "clamp" and "w_decisive_minus_clamp" in e)
    cause = " / ".join(f"{n} {_pct(x['cause'])} ({x['rows']} rows)" for n, x in src)
    lines += ["", f"Rows with at least τ = {r['gate']['tau']:g} of their tokens at or below 0 (where `clamp` loses "
              f"suppression): {cause}. Weight on the decisive token against `clamp`, paired on the same rows (pooled): "
              f"{paired or '–'}. Candidate by the primary row statistic: `{r.get('candidate')}`."]
    return "\n".join(lines)


def gate_learning() -> str:
    """The §10 learning arm: the candidate against `clamp` on §9's seeds, and the decision the protocol fixed."""
    g = load("learning_protocol").get("gate")
    if not g:
        return "(the learning arm has not run)"
    per = "; ".join(f"{t} {iv(x)}" for t, x in g["per_task"].items())
    verdict = (f"non-inferior (lower bound above −{g['margin']:g})" if g["non_inferior"]
               else f"not shown non-inferior (lower bound at or below −{g['margin']:g})")
    return (f"`{g['candidate']}` − `clamp`, Δ AUC over the {g['pooled']['seeds']} (task, seed) pairs "
            f"{iv(g['pooled'])} (sign-flip p {pval(g['pooled']['p'])}): {verdict}; per task {per}")


def gate_against_grpo() -> str:
    """Exploratory (no test the protocol named): the default with the candidate treatment against GRPO, same seeds."""
    g = load("learning_protocol").get("gate")
    if not g or "exploratory_against_grpo" not in g:
        return "(not run)"
    return " / ".join(f"{t} {iv(x)} (p {pval(x['p'])})" for t, x in g["exploratory_against_grpo"].items())


# ---------------------------------------------------------------------------------------------------------------------
# OAR-G's σ against bf16 (research/sigma_sweep.py, faithfulness §17)
# ---------------------------------------------------------------------------------------------------------------------


def sigma_sweep() -> str:
    r = load("sigma_sweep")
    lines = [f"| OAR-G σ | bf16 twin (buffers fp32) vs fp32, Spearman ({r['rows']} rows) | `.to(bfloat16)` vs fp32 |",
             "|---|---|---|"]
    for sigma, e in r["sigmas"].items():
        lines.append(f"| {sigma} | {e['bf16_buffers_fp32']['mean']:.2f} | {e['bf16_to']['mean']:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The default against fisher and OAR-G on the same rows (research/long_fidelity.py --results, method §15)
# ---------------------------------------------------------------------------------------------------------------------


# the long-row fidelity comparisons (research/long_fidelity.py --results): the first method (the default) against
# the others on the same rows; name -> (results file, what the rows are)
FIDELITY_STUDIES = {"smollm2": ("fidelity_smollm2_1024", "SmolLM2, {rows} rows × ≤ 1,024"),
                    "gemma3": ("fidelity_gemma3_400", "Gemma 3 inside its window, {rows} rows × ≤ 400"),
                    "gemma3_past": ("fidelity_gemma3_1024", "Gemma 3 past its window, {rows} rows × ≤ 1,024")}
FIDELITY_METHODS = ("conservative", "fisher_k1_mean", "oar_g")


def _study(study: str) -> dict:
    return load(FIDELITY_STUDIES[study][0])["summary"]


def fidelity_table(study: str) -> str:
    """Every ranking's gains over the free controls and the paired comparisons, on one study's rows."""
    s = _study(study)
    lines = [f"| ranking ({FIDELITY_STUDIES[study][1].format(rows=s['rows'])}) | over random | over position | "
             "over entropy | cost × train |", "|---|---|---|---|---|"]
    for m, x in s["methods"].items():
        g = x["gain_over"]
        lines.append(f"| {m} | {iv(g['random'], 2, 'mean')} | {iv(g['position'], 2, 'mean')} | "
                     f"{iv(g['entropy'], 2, 'mean')} | {x['cost']:.2f} |")
    lines += ["", "| paired on the same rows | KL measure | log p measure |", "|---|---|---|"]
    for name, e in s["paired"].items():
        lines.append(f"| {name.replace(' - ', ' − ')} | {iv(e['kl'], 2, 'mean')} | {iv(e['logp'], 2, 'mean')} |")
    return "\n".join(lines)


def fidelity_pair(study: str, other: str) -> str:
    """One cell of method §15: the default against ``other`` on the same rows (KL measure)."""
    s = _study(study)
    return iv(s["paired"][f"{list(s['methods'])[0]} - {other}"]["kl"], 2, "mean")


def fidelity_gain(study: str, method: str) -> str:
    """One cell of method §15: ``method``'s gain over position (KL measure)."""
    return iv(_study(study)["methods"][method]["gain_over"]["position"], 2, "mean")


def fidelity_cost(study: str, method: str) -> str:
    """One cell of method §15: ``method``'s seconds over one training forward+backward on the same rows."""
    return f"{_study(study)['methods'][method]['cost']:.2f}"


# the attention rule on the same studies' rows (research/long_fidelity.py --methods conservative_uniform,conservative
# --results): AttnLRP's `uniform` first, the default's `values` second; study -> results file
ATTENTION_RULE_STUDIES = {study: f"{FIDELITY_STUDIES[study][0]}_uniform" for study in FIDELITY_STUDIES}
_RULE_PAIR = "conservative_uniform - conservative"


def _rule_pair(summary: dict, measure: str = "kl") -> str:
    """`uniform` against `values` on one rule comparison's rows, paired, on ``measure`` (kl | logp)."""
    return iv(summary["paired"][_RULE_PAIR][measure], 2, "mean")


def attention_rule_cell(study: str) -> str:
    """One figure of method §15: `uniform` against `values` on a study's rows, paired (KL measure)."""
    return _rule_pair(load(ATTENTION_RULE_STUDIES[study])["summary"])


def attention_rule_table() -> str:
    """faithfulness §18: both attention rules over the free controls and against each other, one column a study."""
    studies = {k: load(f)["summary"] for k, f in ATTENTION_RULE_STUDIES.items()}
    head = " | ".join(FIDELITY_STUDIES[k][1].format(rows=s["rows"]) for k, s in studies.items())
    lines = [f"| gain (Σ/Σ, prompt-clustered 95 %) | {head} |", "|---" * (len(studies) + 1) + "|"]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(s) for s in studies.values()) + " |")

    def gain(method: str, over: str):
        return lambda s: iv(s["methods"][method]["gain_over"][over], 2, "mean")

    row("`uniform` over position", gain("conservative_uniform", "position"))
    row("`values` (the default) over position", gain("conservative", "position"))
    row("`uniform` over `values`, paired by row (KL)", _rule_pair)
    row("… paired, log p measure", lambda s: _rule_pair(s, "logp"))
    row("`uniform` over random / entropy", lambda s: " / ".join(
        num(s["methods"]["conservative_uniform"]["gain_over"][c]["mean"], 2) for c in ("random", "entropy")))
    row("cost × train fwd+bwd: `uniform` / `values`", lambda s: " / ".join(
        f"{s['methods'][m]['cost']:.2f}" for m in ("conservative_uniform", "conservative")))
    return "\n".join(lines)


# bf16 against fp32 scores on a long-row study's rows (research/bf16_agreement.py --results): study -> results file
BF16_STUDIES = {"smollm2": "bf16_smollm2_1024", "gemma3": "bf16_gemma3_400", "gemma3_past": "bf16_gemma3_1024",
                "smollm2_path": "bf16_smollm2_1024_path", "smollm2_oar_p": "bf16_smollm2_1024_oar_p"}


def _agreement_iv(x: dict) -> str:
    """``0.62 [0.43, 0.80]``: an agreement measure's mean over rows and its interval (unsigned, unlike :func:`iv`)."""
    return f"{x['mean']:.2f} [{x['lo']:.2f}, {x['hi']:.2f}]"


def bf16_cell(method: str, study: str = "smollm2") -> str:
    """One cell of method §15: ``method``'s bf16 against fp32 scores on a study's rows, Spearman (mean, interval)."""
    return _agreement_iv(load(BF16_STUDIES[study])["methods"][method]["spearman"])


def bf16_table(*studies: str) -> str:
    """Every method's bf16 against fp32 agreement in the named studies: Spearman, top-20 % overlap, relative L2 error
    (mean over rows, prompt-clustered interval) and the seconds a row took in each dtype."""
    lines = ["| method | rows | Spearman, bf16 vs fp32 | top-20 % overlap | relative L2 error | seconds a row, fp32 / bf16 |",
             "|---|---|---|---|---|---|"]
    for study in studies:
        r = load(BF16_STUDIES[study])
        for m, e in r["methods"].items():
            s32, s16 = e["seconds_per_row_fp32_bf16"]
            lines.append(f"| {m} | {r['rows']} | " + " | ".join(_agreement_iv(e[k]) for k in
                         ("spearman", "top20_overlap", "rel_l2_error")) + f" | {s32:.0f} / {s16:.0f} |")
    return "\n".join(lines)


_STUDY_LABEL = {"conservative": "the default", "fisher_k1_mean": "`fisher`", "oar_g": "OAR-G"}


def fidelity_paired_headline(study: str = "smollm2") -> str:
    s = _study(study)
    first = list(s["methods"])[0]
    pos = iv(s["methods"][first]["gain_over"]["position"], 2, "mean")
    pairs = "; ".join(f"against {_STUDY_LABEL.get(k.split(' - ')[1], k.split(' - ')[1])} {iv(e['kl'], 2, 'mean')}"
                      for k, e in s["paired"].items())
    return (f"{FIDELITY_STUDIES[study][1].format(rows=s['rows'])} tokens: over position {pos}; paired on the same rows "
            f"{pairs}")


def no_span_headline() -> str:
    """The README's figure: the default's scores of a row without a span, on the probe they explain, over random."""
    r = load("no_span_rows")
    return f"{r['rows']} rows, {iv(r['own_probe']['eos']['conservative:eos']['random'], 2, 'mean')}"


# ---------------------------------------------------------------------------------------------------------------------
# OAR's cost in verl's trainer on CPU (research/overhead.py --results, docs/performance.md, the README's cost row)
# ---------------------------------------------------------------------------------------------------------------------

_OVERHEAD_LABEL = {"GRPO": "GRPO", "OAR-G": "OAR-G", "OAR-P": "OAR-P (prefix reuse)",
                   "conservative-shared": "the default (`conservative`), read from the old-log-prob pass",
                   "conservative-separate": "the default, its own passes", "fisher-shared": "`fisher`, read from the pass",
                   "fisher-separate": "`fisher`, its own passes", "OAR-G-shared": "OAR-G, teachers read from the pass",
                   "OAR-G-separate": "OAR-G, its own teacher passes"}


def overhead_cpu() -> str:
    """docs/performance.md's table: every method's step time against GRPO's, OAR's cost wherever it ran."""
    r = load("overhead_cpu")
    m = r["meta"]
    lines = ["| method | step s | × GRPO | OAR s (`timing_s/oar_total`) | share of step | OAR / training compute "
             "(old log-prob + update, OAR's part excluded) |"
             " sequences attributed |", "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        if x["method"] == "GRPO":
            lines.append(f"| GRPO | {x['step_s']:.2f} | 1.00 | – | – | – | – |")
            continue
        lines.append(f"| {_OVERHEAD_LABEL.get(x['method'], x['method'])} | {x['step_s']:.2f} | "
                     f"**{x['ratio_to_grpo']:.2f}** | {x['oar_s']:.2f} | {x['oar_share_of_step']:.0%} | "
                     f"{x['oar_share_of_training']:.2f} | {x['attributed_frac']:.2f} |")
    lines += ["", f"`{m['command']}`, {m['date']}: trainer mode `{m['trainer_mode']}`, {m['batch']} prompts × "
              f"{m['rollout_n']} responses of ≤ {m['response_length']} tokens, median of steps 2–{m['steps']}; "
              f"{m['machine']}; load average {m['load_average_before_after'][0]} before, "
              f"{m['load_average_before_after'][1]} after."]
    updates = [x["update_s"] for x in r["rows"]]
    lines[-1] += (f" The actor update, which OAR does not change, took {min(updates):.2f}–{max(updates):.2f} s across "
                  "these runs (this machine's run-to-run spread): the step ratios carry that spread, the column "
                  "against the training compute divides each run by its own.")
    return "\n".join(lines)


def cost_row() -> str:
    """The README's cost row: OAR's time against the training compute of the same run (each run divided by its own),
    the default first, then the whole step against GRPO's."""
    rows = {x["method"]: x for x in load("overhead_cpu")["rows"]}
    share = {k: rows[k]["oar_share_of_training"] for k in rows if k != "GRPO"}
    parts = [f"{label} {share[k]:.2f}" for k, label in
             (("conservative-shared", "the default (read from the old-log-prob pass)"),
              ("conservative-separate", "its own passes"), ("OAR-G", "OAR-G"), ("OAR-P", "OAR-P")) if k in rows]
    steps = [rows[k]["ratio_to_grpo"] for k in ("conservative-shared", "OAR-G", "OAR-P") if k in rows]
    m = load("overhead_cpu")["meta"]
    return (f"OAR's time × the same run's training compute (old log-prob + update): {', '.join(parts)}; the "
            f"whole step × GRPO's {min(steps):.2f}–{max(steps):.2f} (tiny model, responses ≤ {m['response_length']} "
            "tokens, one run each)")


# ---------------------------------------------------------------------------------------------------------------------
# Attribution beside the training step as responses grow (research/scaling.py --results, docs/scaling.md, README)
# ---------------------------------------------------------------------------------------------------------------------

_SCALING_LABEL = {"oar_g": "OAR-G", "conservative": "the default (`conservative`)", "fisher": "`fisher`",
                  "oar_p": "OAR-P (exact)"}


def scaling_cpu() -> str:
    """docs/scaling.md's measured table: each method's peak and time over the training step's, per length."""
    r = load("scaling_cpu")
    lines = ["| response tokens | method | peak MiB | training peak MiB | peak ratio | vs training activations | s | "
             "training s | time ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["ratios"]:
        s = f"{x['seconds']:.0f} (extrap.)" if x["extrapolated"] else f"{x['seconds']:.1f}"
        time = f"{x['time_ratio']:.0f}" if x["extrapolated"] else f"**{x['time_ratio']:.2f}**"
        lines.append(f"| {x['length']} | {_SCALING_LABEL.get(x['method'], x['method'])} | {x['peak_mib']:.0f} | "
                     f"{x['train_peak_mib']:.0f} | **{x['peak_ratio']:.2f}** | {x['peak_ratio_vs_activations']:.2f} | "
                     f"{s} | {x['train_seconds']:.1f} | {time} |")
    m = r["meta"]
    lines += ["", f"`{m['command']}`, {m['date']}: {m['machine']}, {m.get('cores', '?')} cores, torch {m['torch']}, "
              f"{m['dtype']}, shape `{m['shape']}`, {m['rows']} rows of {m['prompt']} prompt + N response tokens; "
              f"{m['wall_s']:.0f} s; load average {m.get('load_average_before', '?')} before, "
              f"{m.get('load_average_after', '?')} after."]
    return "\n".join(lines)


def scaling_model_check() -> str:
    """docs/scaling.md: each measured activation peak over the cost model's prediction, per method and length."""
    points = load("scaling_cpu")["points"]
    lengths = sorted({x["length"] for x in points})
    parts = []
    for m in dict.fromkeys(x["method"] for x in points):
        by = {x["length"]: x for x in points if x["method"] == m}
        ratios = [(by[n]["peak_mib"] - by[n].get("grads_mib", 0.0)) / by[n]["predicted_mib"] for n in lengths]
        parts.append(f"{'training' if m == 'train' else _SCALING_LABEL.get(m, m)} "
                     + " / ".join(f"{r:.2f}" for r in ratios))
    return f"measured / model at {' / '.join(map(str, lengths))} tokens: " + ", ".join(parts)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def scaling_row() -> str:
    """The README's row: the default's and OAR-G's peak and time over the training step, across the lengths."""
    r = load("scaling_cpu")
    lengths = sorted({x["length"] for x in r["ratios"]})
    parts = []
    for m in ("conservative", "oar_g"):
        xs = [x for x in r["ratios"] if x["method"] == m]
        if xs:
            parts.append(f"{_SCALING_LABEL[m]} peak {_span([x['peak_ratio'] for x in xs])}×, time "
                         f"{_span([x['time_ratio'] for x in xs])}× a training step")
    return f"{lengths[0]}–{lengths[-1]} tokens (fp32, a 12-layer Qwen2 shape): " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Planted causal tokens (research/fidelity.py --results, evidence §1, README)
# ---------------------------------------------------------------------------------------------------------------------

_RECALL_LABEL = {"OAR-P": "OAR-P", "fisher": "`fisher`", "conservative": "the default", "OAR-G": "OAR-G",
                 "entropy": "entropy", "random": "random"}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def planted_recall_row() -> str:
    """The README's figure: recall@k of the planted causal tokens, one number per method; for a method with signed
    scores, also the recall of the ranking the gate uses (|score|)."""
    ms = load("planted_recall")["synthetic"]["methods"]
    parts = []
    for k, label in _RECALL_LABEL.items():
        if k not in ms:
            continue
        part = f"{label} {_mean(ms[k]['recall']):.2f}"
        gate = _mean(ms[k].get("recall_gate_reading", ms[k]["recall"]))
        if f"{gate:.2f}" != f"{_mean(ms[k]['recall']):.2f}":
            part += f" (its signed scores as the gate reads them, by magnitude: {gate:.2f})"
        parts.append(part)
    return "recall@k: " + ", ".join(parts)


def planted_recall_table() -> str:
    """Evidence §1's table: every scored method's recall@k and what the gate does with its scores."""
    r = load("planted_recall")
    s, m = r["synthetic"], r["meta"]

    def cell(values: list[float]) -> str:
        if len(values) == 1:
            return f"{values[0]:.3f}".replace("-", "\u2212")
        mean = _mean(values)
        sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return f"{mean:.3f} ± {sd:.3f}".replace("-", "\u2212")

    lines = ["| method | recall@k | recall@k as the gate reads the scores | Spearman vs OAR-P | top-20% overlap with "
             "OAR-P | mean w, causal | mean w, filler | causal share of Σw | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, x in s["methods"].items():
        label = {"conservative": "the default (`conservative`)", "fisher": "`fisher`"}.get(name, name)
        seconds = _mean(x["seconds"])
        lines.append(f"| {label} | {cell(x['recall'])} | {cell(x['recall_gate_reading'])} | {cell(x['spearman_vs_p'])} | "
                     f"{cell(x['top20_overlap_vs_p'])} | {cell(x['w_causal'])} | {cell(x['w_filler'])} | "
                     f"{cell(x['causal_weight_share'])} | {'–' if not seconds else f'{seconds:.1f}'} |")
    lines += ["", f"`{m['command']}`, {m['date']}: {s['n_eval']} held-out responses, {s['mean_reasoning_tokens']:.1f} "
              f"reasoning tokens and {s['mean_causal_tokens']:.2f} causal on average (random expectation "
              f"{s['expected_random_recall']:.3f}); the model: {s['model']['steps']} SFT steps, teacher-forced answer "
              f"accuracy {s['model']['answer_accuracy']:.3f}; ± the sample sd over OAR-G's noise seeds or the random "
              f"draws; {m['machine']}, {m['threads']} torch thread(s)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# On a GPU (research/shared_forward.py --device cuda; scripts/gpu_check.sh --parts verl-worker; docs/gpu_check.md)
# ---------------------------------------------------------------------------------------------------------------------

GPU_SHARED = "shared_forward_h200"
# bf16 after the shared path counted the pass's logits (recompute=auto); "_before": the runs before that fix (the
# fp32 variant was not rerun after it: the slot's device time was spent), whose scores the fix does not touch
GPU_WORKER = {"bf16": "verl_worker_h200_bf16", "bf16_before": "verl_worker_h200_bf16_before",
              "fp32_before": "verl_worker_h200_fp32_before"}


def _gpu_rows() -> dict[int, dict]:
    return {r["length"]: r for r in load(GPU_SHARED)["rows"]}


def gpu_cost_cell(method: str, length: int = 4096) -> str:
    """method §15: what ``method`` adds to the old-log-prob pass × a bare training forward + backward on the same
    tokens, read from the pass (every layer recomputed, then every layer kept) and with its own passes."""
    r = _gpu_rows()[length]
    x = lambda key: f"{r[key]['added_x_train']:.2f}"  # noqa: E731
    if method == "gradient":
        return (f"{x('gradient_own_recompute')}; its teachers read from the pass {x('gradient_recompute')} "
                f"(every layer recomputed) – {x('gradient_keep')} (none)")
    return (f"read from the old-log-prob pass {x(method + '_recompute')} (every layer recomputed) – "
            f"{x(method + '_keep')} (none); own passes {x(method + '_separate')}")


def _worker(variant: str = "bf16") -> dict:
    return load(GPU_WORKER[variant])["verl_worker"][0]


_GPU_LABEL = {"conservative": "the default (`conservative`)", "fisher": "`fisher`", "gradient": "OAR-G"}


def gpu_shared_table() -> str:
    """docs/gpu_check.md: the 7B shape in one process, each method after / inside the old-log-prob pass, × a training
    forward + backward on the same tokens (the cost model's figure in brackets) and peak × the training step's."""
    r = load(GPU_SHARED)
    lines = ["| response tokens | what runs | added time × training (model) | peak × training's |", "|---|---|---|---|"]
    cell = lambda x: f"**{x['added_x_train']:.2f}** ({x['model_x_train']:.2f}) | {x['peak_x_train']:.2f}"  # noqa
    for row in r["rows"]:
        n = row["length"]
        lines.append(f"| {n} | the old-log-prob pass alone | {row['log_prob_s'] / row['train_s']:.2f} (0.25) | "
                     f"{row['log_prob_mib'] / row['train_mib']:.2f} |")
        for m in ("conservative", "fisher", "gradient"):
            own = "gradient_own_recompute" if m == "gradient" else f"{m}_separate"
            inside = "its teachers read from the pass" if m == "gradient" else "read from the pass"
            lines += [f"| {n} | {_GPU_LABEL[m]}, {inside}, every layer recomputed | {cell(row[m + '_recompute'])} |",
                      f"| {n} | … every layer's activations kept | {cell(row[m + '_keep'])} |",
                      f"| {n} | … its own passes after the pass | {cell(row[own])} |"]
    e = r["environment"]
    lines += ["", f"`{r['command']}`, {r['date']}, one {r['device']} (driver {e['driver']}), torch {e['torch']}, "
              f"transformers {e['transformers']}, {r['dtype']}, random weights at the shape, one row of 128 prompt + N "
              "response tokens, each call the median of 3 after a warm-up."]
    return "\n".join(lines)


def gpu_worker_table() -> str:
    """docs/gpu_check.md: verl's worker group on the GPU, bf16, after the fix (the part's own table)."""
    from research.gpu_check import verl_worker_markdown

    lines = verl_worker_markdown(load(GPU_WORKER["bf16"])["verl_worker"])
    text = "\n".join(x for x in lines if not x.startswith("Host syncs in attribution"))  # the sites: in its JSON
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def gpu_shared_peaks(variant: str) -> str:
    """method §13: the default's and fisher's shared-pass peaks × the update's (later steps) in one run."""
    w = _worker(variant)["calls"]
    return " / ".join(f"{steady_peak_ratio(w[m + '-shared'], w['update_actor']):.2f}"
                      for m in ("conservative", "fisher"))


def gpu_row() -> str:
    """The README's GPU row: the 7B shape in one process, then verl's FSDP2 worker group with OAR's worker."""
    rows, meta = _gpu_rows(), load(GPU_SHARED)
    a, b = sorted(rows)[:2]
    both = lambda key: f"{rows[a][key]['added_x_train']:.2f} / {rows[b][key]['added_x_train']:.2f}"  # noqa: E731
    w, w32 = _worker("bf16"), _worker("fp32_before")
    calls, update = w["calls"], w["calls"]["update_actor"]
    lengths = w["response_lengths"]
    peak = max(steady_peak_ratio(calls[m], update) for m in ("gradient", "fisher", "conservative",
                                                            "conservative-shared", "fisher-shared", "gradient-shared"))
    exact = max(max(x["max_rel_diff"]) for m, x in w32["agreement"].items() if m != "segment")
    rho = min(min(x["spearman"]) for m, x in w["agreement"].items() if m != "segment")
    return (f"{meta['device'].replace('NVIDIA ', '')}, {meta['dtype'].replace('bfloat16', 'bf16')}, Qwen2.5-7B × "
            f"{a // 1024}k / {b // 1024}k, × a training forward + backward on the same tokens: the default read from "
            f"the old-log-prob pass adds {both('conservative_recompute')} (every layer recomputed), its own passes "
            f"{both('conservative_separate')}; fisher from the pass {both('fisher_recompute')}, own "
            f"{both('fisher_separate')}; "
            f"OAR-G {both('gradient_own_recompute')}. verl's FSDP2 worker group, Qwen2.5-1.5B, rows of "
            f"{min(lengths) // 1024}k–{max(lengths) // 1024}k: the default {calls['conservative']['vs_update_time']:.2f}×, "
            f"fisher {calls['fisher']['vs_update_time']:.2f}×, OAR-G {calls['gradient']['vs_update_time']:.2f}× "
            f"`update_actor` (the default read from the pass: "
            f"+{calls['conservative-shared']['added_vs_update_time']:.2f}×), peak ≤ {peak:.2f}× the update's; "
            f"scores equal the core's (fp32 ≤ {exact:.0e}".replace("e-0", "e-") + f", bf16 Spearman ≥ {rho:.2f}); "
            "log-probs bitwise unchanged")


RENDERERS: dict[str, Callable[[], str]] = {
    "overhead_cpu": overhead_cpu, "cost_row": cost_row,
    "scaling_cpu": scaling_cpu, "scaling_row": scaling_row, "scaling_model_check": scaling_model_check,
    "planted_recall_row": planted_recall_row, "planted_recall_table": planted_recall_table,
    "no_span_headline": no_span_headline,
    "signed_gate_rows": signed_gate_rows, "gate_learning": gate_learning, "gate_against_grpo": gate_against_grpo, "sigma_sweep": sigma_sweep,
    "fidelity_paired_headline": fidelity_paired_headline,
    **{f"fidelity_{kind}.{study}.{m}": (lambda f, s, m: lambda: f(s, m))(f, study, m)
       for kind, f in (("gain", fidelity_gain), ("cost", fidelity_cost), ("pair", fidelity_pair))
       for study in FIDELITY_STUDIES for m in FIDELITY_METHODS},
    **{f"bf16.{m}": (lambda m: lambda: bf16_cell(m))(m) for m in ("conservative", "fisher_k1_mean", "oar_g_s05")},
    "bf16_rows": lambda: str(load("bf16_smollm2_1024")["rows"]),
    **{f"bf16.{study}.{m}": (lambda s, m: lambda: bf16_cell(m, s))(study, m)
       for study in BF16_STUDIES for m in load(BF16_STUDIES[study])["methods"]},
    **{f"attention_rule.{study}": (lambda s: lambda: attention_rule_cell(s))(study)
       for study in ATTENTION_RULE_STUDIES},
    "attention_rule_table": attention_rule_table,
    "bf16_table.smollm2_4": lambda: bf16_table("smollm2_path", "smollm2_oar_p"),
    **{f"fidelity_rows.{study}": (lambda s: lambda: str(_study(s)["rows"]))(study) for study in FIDELITY_STUDIES},
    **{f"fidelity_table.{study}": (lambda s: lambda: fidelity_table(s))(study) for study in FIDELITY_STUDIES},
    "learning_methods": learning_methods, "learning_primary": learning_primary,
    "learning_secondary": learning_secondary, "learning_headline": learning_headline,
    "learning_reconcile": learning_reconcile,
    "learning11_primary": lambda: learning_primary("learning_protocol_11"),
    "learning11_headline": lambda: learning_headline("learning_protocol_11"),
    "learning11_cell.conservative": lambda: learning_cell("conservative", "learning_protocol_11"),
    "learning11_methods": lambda: learning_methods("learning_protocol_11"),
    "learning11_secondary": lambda: learning_secondary("learning_protocol_11"),
    "learning_cell.conservative": lambda: learning_cell("conservative"),
    "learning_cell.fisher": lambda: learning_cell("fisher"), "learning_cell.oar_g": lambda: learning_cell("oar_g"),
    "no_span_rows": no_span_rows,
    "gpu_row": gpu_row, **{f"gpu_cost.{m}": (lambda m: lambda: gpu_cost_cell(m))(m)
                           for m in ("conservative", "fisher", "gradient")},
    **{f"gpu_shared_peaks.{v}": (lambda v: lambda: gpu_shared_peaks(v))(v) for v in GPU_WORKER},
    "gpu_shared_table": gpu_shared_table, "gpu_worker_table": gpu_worker_table,
}


def render(text: str, where: str = "") -> tuple[str, list[str]]:
    """``text`` with every marked piece regenerated, and the names of the pieces that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        name, body = m["name"], m["body"]
        if name not in RENDERERS:
            raise KeyError(f"{where}: unknown generated piece {name!r}; known: {', '.join(RENDERERS)}")
        new = RENDERERS[name]()
        new = f"\n{new}\n" if body.startswith("\n") else new
        if new != body:
            changed.append(name)
        return f"<!-- gen:{name} -->{new}<!-- /gen:{name} -->"

    return _BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; fail if a piece differs from its file")
    a = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new, changed = render(text, str(doc.relative_to(REPO)))
        stale += [f"{doc.relative_to(REPO)}: {n}" for n in changed]
        if changed and not a.check:
            doc.write_text(new)
    if stale:
        print(("stale (run `" + COMMAND + "`):\n  " if a.check else "regenerated:\n  ") + "\n  ".join(stale))
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
