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
import statistics
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

from research import REPO
from research.row_stats import RowStats, ratio_row_stats
from research.verdict import DROPPED_SHARE, LOO_SHARE, verdict
from research.worker_report import steady_peak_ratio, verl_worker_markdown

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


def dropped_note(x: dict | None) -> str:
    """``, 31 % of resamples undefined``: a ratio-of-sums record's share of bootstrap resamples left out of its
    percentiles (``dropped``, :class:`oar_verl.core.fidelity.summary.Interval`); empty where it is 0 or absent."""
    d = (x or {}).get("dropped") or 0.0
    return "" if not d > 0 else f", {'< 1' if d < 0.01 else f'{100 * d:.0f}'} % of resamples undefined"


def iv(x: dict | None, digits: int = 3, key: str = "diff") -> str:
    """``+0.058 [+0.020, +0.107]`` from a ``{diff|mean, ci95|lo/hi}`` record, with :func:`dropped_note`."""
    if x is None or x.get(key, x.get("mean")) is None:
        return "–"
    m = x.get(key, x.get("mean"))
    if m != m:  # NaN: a ratio whose denominator's sum is not above 0 (bootstrap_ratio leaves it undefined)
        return "undefined"
    lo, hi = (x["ci95"] if "ci95" in x and x["ci95"] else (x.get("lo"), x.get("hi")))
    return (num(m, digits) if lo is None else f"{num(m, digits)} [{num(lo, digits)}, {num(hi, digits)}]"
            + dropped_note(x))


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


def _learning_verdict(p: dict, with_p: bool = False) -> str:
    """A primary test's word from its interval (:func:`research.verdict.verdict`: "faster" / "slower" / "not shown"),
    with the protocol's own decision where it differs (it tests with the Holm-adjusted p)."""
    word = verdict(*p["ci95"], p=p["p"] if with_p else None, n=p["seeds"], above="faster", below="slower",
                   level="not shown")
    if p["passes"] != word.startswith("faster"):
        word += f" (the protocol's test: {'passed' if p['passes'] else 'not passed'})"
    return word


def learning_primary(name: str = "learning_protocol") -> str:
    r = load(name)
    lines = [f"| primary test: the default{_gate(r)} − GRPO, Δ AUC | Δ [95 % paired bootstrap] | p (exact sign-flip) | "
             "Holm over the 3 tasks | Δ final [95 %] | verdict |", "|---|---|---|---|---|---|"]
    for p in r["analysis"]["primary"]:
        lines.append(f"| {p['task']} ({p['seeds']} seeds) | {iv(p)} | {pval(p['p'])} | "
                     f"{pval(p.get('p_holm_over_tasks'))} | {iv(p.get('final'))} | {_learning_verdict(p)} |")
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


def learning_verdicts(name: str = "learning_protocol") -> str:
    """Each task's primary verdict, in a few words: "first not shown / middle not shown / last faster (p 0.002)"."""
    return " / ".join(f"{p['task']} {_learning_verdict(p, with_p=True)}" for p in load(name)["analysis"]["primary"])


def learning_final_verdicts(name: str = "learning_protocol") -> str:
    """Each task's final success against GRPO's (the primary test's ``final``), judged from its interval."""
    return " / ".join(f"{p['task']} {iv(p['final'])}: {verdict(*p['final']['ci95'], p=p['final']['p'])}"
                      for p in load(name)["analysis"]["primary"])


def learning_wall(name: str = "learning_protocol_11") -> str:
    """The range of one run's wall time over a protocol's runs."""
    s = [x["wall_s"] for x in load(name)["records"] if "wall_s" in x]
    return f"{min(s):.0f}–{max(s):.0f} s"


def oar_p_scaling() -> str:
    """Exact OAR-P's time × a training step over the measured lengths (docs/scaling.md's table)."""
    xs = [x["time_ratio"] for x in load("scaling_cpu")["ratios"] if x["method"] == "oar_p"]
    return f"{min(xs):,.0f}×–{max(xs):,.0f}×"


def learning_headline(name: str = "learning_protocol") -> str:
    """The README's one line: the primary result per task, and how many of the protocol's runs it rests on."""
    r = load(name)
    a = r["analysis"]
    parts = [f"{p['task']} {iv(p)} (p {pval(p['p'])})" for p in a["primary"]]
    faster = [p["task"] for p in a["primary"] if _learning_verdict(p) == "faster"]
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
    # non-inferiority at margin m: verdict's rule on the interval shifted by m (above 0 = lower bound above −m)
    lo, hi, m = *g["pooled"]["ci95"], g["margin"]
    word = verdict(lo + m, hi + m, n=g["pooled"]["seeds"], above=f"non-inferior (lower bound above −{m:g})",
                   below=f"inferior (upper bound below −{m:g})",
                   level=f"not shown non-inferior (lower bound at or below −{m:g})")
    if word.startswith("non-inferior") != bool(g["non_inferior"]):
        raise ValueError(f"learning_protocol.json: gate non_inferior={g['non_inferior']} but the interval "
                         f"[{lo}, {hi}] at margin {m} reads {word!r}")
    return (f"`{g['candidate']}` − `clamp`, Δ AUC over the {g['pooled']['seeds']} (task, seed) pairs "
            f"{iv(g['pooled'])} (sign-flip p {pval(g['pooled']['p'])}): {word}; per task {per}")


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


MEASURES = {"kl": ("KL", ""), "logp": ("log p", "_logp")}  # measure -> (label, the summary's gain_over suffix)


def _row_values(name: str, ranking: str, measure: str) -> list[float]:
    """Per row of results file ``name``: ``ranking``'s AOPC (a method, or a free control) on ``measure`` (kl | logp)."""
    i = list(MEASURES).index(measure)
    return [r["aopc"][ranking][i] if ranking in r["aopc"] else r["control_aopc"][ranking][i]
            for r in load(name)["rows"]]


@cache
def fidelity_stats(name: str, ranking: str, against: str, measure: str) -> RowStats:
    """:func:`research.row_stats.ratio_row_stats` of ``ranking`` against ``against`` (a control or a method) on the
    rows of results file ``name``; fails if the rows do not give the file's own summary figure (one set of rows)."""
    st = ratio_row_stats(_row_values(name, ranking, measure), _row_values(name, against, measure))
    s = load(name)["summary"]
    fig = (s["methods"][ranking]["gain_over"].get(against + MEASURES[measure][1]) if against not in s["methods"]
           else s["paired"][f"{ranking} - {against}"][measure])["mean"]
    if not (st.undefined and fig != fig) and abs(st.estimate - fig) > 1e-6 * max(1.0, abs(fig)):
        raise ValueError(f"{name}: {ranking} against {against} ({measure}) gives {st.estimate} from its rows, "
                         f"{fig} in its summary")
    return st


def _interval(x: dict) -> tuple[float | None, float | None]:
    return x.get("lo"), x.get("hi")


def _verdict(x: dict, st: RowStats, unit: str = "row") -> str:
    """A ratio of sums' verdict from its interval, its row statistics and its share of undefined resamples."""
    return verdict(*_interval(x), p=st.p, loo=st.loo, dropped=x.get("dropped"), unit=unit)


def judged(x: dict, st: RowStats) -> str:
    """``+0.83 [+0.12, +2.92], 13/16 rows: above (p 0.003), one row carries 74 %``: a fidelity figure, the rows on its
    side and its verdict (:func:`research.verdict.verdict`)."""
    if st.undefined:
        return f"undefined ({st.rows} rows: the other's deletions, summed, do not lower it)"
    return f"{iv(x, 2, 'mean')}, {st.above}/{st.rows} rows: {_verdict(x, st)}"


def _gain(study: str, method: str, over: str, measure: str = "kl") -> tuple[dict, RowStats]:
    """``method``'s gain over control ``over`` on a study's rows: the summary's interval and the row statistics."""
    name = FIDELITY_STUDIES[study][0]
    return (_study(study)["methods"][method]["gain_over"][over + MEASURES[measure][1]],
            fidelity_stats(name, method, over, measure))


def _pair(study: str, other: str, measure: str = "kl") -> tuple[dict, RowStats]:
    """The study's first method (the default) against ``other`` on the same rows, paired."""
    s, name = _study(study), FIDELITY_STUDIES[study][0]
    first = list(s["methods"])[0]
    return s["paired"][f"{first} - {other}"][measure], fidelity_stats(name, first, other, measure)


def _stat_cells(x: dict, st: RowStats) -> str:
    """Five table cells: the figure, rows above / rows, the sign-flip p, the largest one-row share, the verdict."""
    share = "–" if st.loo != st.loo else f"{num(100 * st.loo, 0)} % (row {st.loo_row})"
    return (f"{iv(x, 2, 'mean')} | {st.above}/{st.rows} | {pval(st.p)} | {share} | "
            f"{_verdict(x, st)}")


def fidelity_table(study: str) -> str:
    """Every ranking's gains over the free controls and the paired comparisons on one study's rows, on both deletion
    measures (the probe's KL; the answer's log p), each with its row statistics and verdict (issue #68 item 2)."""
    s = _study(study)
    stat = "Σ/Σ [95 %] | rows above | sign-flip p | largest one-row share | verdict"
    head = " | ".join(f"{label}: {stat}" if k == "kl" else stat.replace("Σ/Σ", f"{label}: Σ/Σ")
                      for k, (label, _) in MEASURES.items())
    lines = [f"| ranking ({FIDELITY_STUDIES[study][1].format(rows=s['rows'])}) | against | {head} |",
             "|---|---|" + "---|" * 10]
    for m in s["methods"]:
        for over in ("random", "position", "entropy"):
            cells = " | ".join(_stat_cells(*_gain(study, m, over, k)) for k in MEASURES)
            lines.append(f"| {m} | {over} | {cells} |")
    for name in s["paired"]:
        other = name.split(" - ")[1]
        cells = " | ".join(_stat_cells(*_pair(study, other, k)) for k in MEASURES)
        lines.append(f"| {name.split(' - ')[0]}, paired | {other} | {cells} |")
    costs = ", ".join(f"{m} {x['cost']:.2f}" for m, x in s["methods"].items())
    lines += ["", f"Cost × a training forward + backward on the same rows: {costs}. Σ/Σ: Σ_rows (AOPC − "
              "AOPC_against) / Σ_rows AOPC_against with its prompt-clustered 95 % bootstrap interval (resamples whose denominator sum "
              "is not above 0 are left out of the percentiles, their share shown where it is not 0); rows above: rows "
              "where the ranking's AOPC exceeds the "
              "other's; sign-flip p: exact, two-sided, of Σ (AOPC − AOPC_against) over rows; largest one-row share: "
              "(Σ/Σ − Σ/Σ without that row) / Σ/Σ; verdict: `research/verdict.py` (above / below only where the "
              f"interval excludes 0; a one-row share past {100 * LOO_SHARE:.0f} % named; not shown past "
              f"{100 * DROPPED_SHARE:.0f} % of resamples undefined)"]
    return "\n".join(lines)


def fidelity_pair(study: str, other: str) -> str:
    """One cell of method §15: the default against ``other`` on the same rows (KL measure), judged."""
    return judged(*_pair(study, other))


def fidelity_gain(study: str, method: str) -> str:
    """One cell of method §15: ``method``'s gain over position (KL measure), judged."""
    return judged(*_gain(study, method, "position"))


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


def _label(study: str) -> str:
    return FIDELITY_STUDIES[study][1].format(rows=_study(study)["rows"]) + " tokens"


def fidelity_position_headline() -> str:
    """The README's answer: the default against position in every study, on both deletion measures, judged."""
    return ". ".join(f"{_label(study)}: " + "; ".join(
        f"{MEASURES[k][0]} {judged(*_gain(study, 'conservative', 'position', k))}" for k in MEASURES)
        for study in FIDELITY_STUDIES)


def fidelity_paired_headline() -> str:
    """Method §15: the default against fisher and OAR-G on the same rows in every study, both measures, judged."""
    parts = []
    for study in FIDELITY_STUDIES:
        others = [k.split(" - ")[1] for k in _study(study)["paired"]]
        parts.append(f"{_label(study)}: " + "; ".join(
            f"against {_STUDY_LABEL.get(o, o)} " + " / ".join(f"{MEASURES[k][0]} {judged(*_pair(study, o, k))}"
                                                               for k in MEASURES) for o in others))
    return ". ".join(parts)


def bf16_headline(method: str = "conservative") -> str:
    """The README's bf16 figure: ``method``'s bf16 against fp32 Spearman in each study that ran it."""
    where = {"smollm2": "SmolLM2", "gemma3": "Gemma 3 inside its window", "gemma3_past": "Gemma 3 past its window"}
    return "bf16 against fp32 scores, Spearman: " + ", ".join(
        f"{label} {bf16_cell(method, study)}" for study, label in where.items()
        if method in load(BF16_STUDIES[study])["methods"])


def mode_row() -> str:
    """The README's `mode` key: the default against position (KL) per study, judged, and its bf16 agreement."""
    pos = "; ".join(f"{FIDELITY_STUDIES[s][1].split(',')[0]} {_verdict(x, st)}"
                    for s in FIDELITY_STUDIES for x, st in [_gain(s, "conservative", "position")])
    return f"against position (KL): {pos}; {bf16_headline()}"


@cache
def _no_span_csv() -> list[dict]:
    import csv
    with open(RESULTS / "no_span_rows.csv", newline="") as f:
        return list(csv.DictReader(f))


def no_span_stats(control: str, key: str = "conservative:eos") -> RowStats:
    """:class:`RowStats` of ``key``'s scores against ``control`` on the probe they explain, over prompt clusters (each
    cluster's rows summed: the summary's bootstrap is clustered by prompt)."""
    by: dict[str, list[float]] = {}
    for r in _no_span_csv():
        a, c = by.setdefault(r["cluster"], [0.0, 0.0]), float(r[f"aopc[eos probe] control:{control}"])
        a[0] += float(r[f"aopc[eos probe] {key}"])
        a[1] += c
    st = ratio_row_stats([v[0] for v in by.values()], [v[1] for v in by.values()])
    fig = load("no_span_rows")["own_probe"]["eos"][key][control]["mean"]
    if abs(st.estimate - fig) > 1e-4 * max(1.0, abs(fig)):  # the CSV keeps 6 significant digits
        raise ValueError(f"no_span_rows.csv gives {st.estimate} for {key} against {control}, its JSON {fig}")
    return st


def commands(*names: str) -> str:
    """The commands that wrote results files ``names`` (their ``command`` field), as code spans."""
    return "; ".join(f"`{load(n).get('command') or load(n)['meta']['command']}`" for n in names)


def no_span_headline() -> str:
    """The README's answer: the default's scores of a row without a span, on the probe they explain (log p(EOS)),
    against random and against position, judged over prompt clusters."""
    r = load("no_span_rows")
    parts = []
    for c in ("random", "position"):
        x, st = r["own_probe"]["eos"]["conservative:eos"][c], no_span_stats(c)
        parts.append(f"against {c} {iv(x, 2, 'mean')}, {st.above}/{st.rows} prompts: "
                     f"{_verdict(x, st, unit='prompt')}")
    return f"SmolLM2, {r['rows']} rows of {r['clusters']} prompts: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# OAR's cost in verl's trainer on CPU (research/overhead.py --results, docs/performance.md, the README's cost row)
# ---------------------------------------------------------------------------------------------------------------------

_OVERHEAD_LABEL = {"GRPO": "GRPO", "OAR-G": "OAR-G (its default: clean teachers read from the pass)",
                   "OAR-P": "OAR-P (prefix reuse)",
                   "conservative-shared": "the default (`conservative`), read from the old-log-prob pass",
                   "conservative-separate": "the default, its own passes", "fisher-shared": "`fisher`, read from the pass",
                   "fisher-separate": "`fisher`, its own passes", "OAR-G-separate": "OAR-G, its own teacher passes"}
# the README cost row's configurations, in its order
_COST_ROW = (("conservative-shared", "the default (read from the pass)"),
             ("conservative-separate", "the default with its own passes"),
             ("OAR-G", "OAR-G"), ("OAR-P", "OAR-P"))
# OAR-G's default reads its clean teachers from the pass: research.overhead runs that configuration under one name only
# (an old results file's second name for it is refused rather than shown as a second configuration)
SAME_CONFIG = {"OAR-G-shared": "OAR-G"}


def _with_grpo(runs: list[dict]) -> list[dict]:
    """Each run with, against GRPO's run in the same round, each × GRPO's training compute (its old log-prob +
    update): ``ratio`` (whole step × GRPO's), ``added`` (this run's old-log-prob timer − GRPO's: what OAR adds to the
    pass wherever it ran in it), ``logged`` (``timing_s/oar_total``) and ``adv_added`` (``timing_s/adv`` − GRPO's,
    None where a run lacks it)."""
    grpo = {r["round"]: r for r in runs if r["method"] == "GRPO"}
    for r in runs:
        if r["method"] in SAME_CONFIG:
            raise ValueError(f"overhead_cpu.json: {r['method']!r} is {SAME_CONFIG[r['method']]!r}'s configuration "
                             "under a second name; run it under one name")
        if r["round"] not in grpo:
            raise ValueError(f"overhead_cpu.json: round {r['round']} has no GRPO run to divide by")
    def against(r: dict) -> dict:
        g = grpo[r["round"]]
        return {"ratio": r["step_s"] / g["step_s"], "added": (r["log_prob_s"] - g["log_prob_s"]) / g["train_s"],
                "logged": r["oar_s"] / g["train_s"],
                # verl's advantage step (OAR's reshaping and oar/* report), outside both figures above
                "adv_added": (r["adv_s"] - g["adv_s"]) / g["train_s"] if "adv_s" in r and "adv_s" in g else None}

    return [{**r, **against(r)} for r in runs]


def _earlier(r: dict) -> dict[str, list[dict]]:
    """The earlier invocation kept in the file (``earlier``: one run per configuration, OAR-G's default twice under
    two names, merged here), each run against that invocation's GRPO run."""
    if "earlier" not in r:
        return {}
    runs = [{**x, "round": -1, "method": SAME_CONFIG.get(x["method"], x["method"])} for x in r["earlier"]["rows"]]
    by: dict[str, list[dict]] = {}
    for x in _with_grpo(runs):
        by.setdefault(x["method"], []).append(x)
    return by


def _overhead_runs() -> tuple[dict, dict[str, list[dict]], dict[str, list[dict]]]:
    """(meta, the rounds' runs by configuration, the rerun rounds' runs by configuration, in the order they ran)."""
    r = load("overhead_cpu")
    by: dict[str, list[dict]] = {}
    for x in _with_grpo(r["runs"]):
        by.setdefault(x["method"], []).append(x)
    again = r.get("reproduction", {}).get("runs", [])
    checked = {x["round"] for x in again if x["method"] == "GRPO"}  # a rerun stopped before its GRPO run checks nothing
    rep: dict[str, list[dict]] = {}
    for x in _with_grpo([x for x in again if x["round"] in checked]):
        rep.setdefault(x["method"], []).append(x)
    return r, by, rep


def _adv(runs: list[dict]) -> str:
    """The spread of ``adv_added`` over the runs that logged ``timing_s/adv`` ("–" where none did)."""
    xs = [x["adv_added"] for x in runs if x.get("adv_added") is not None]
    return _spread(xs) if xs else "–"


def _spread(xs: list[float], fmt: str = ".2f", unit: str = "") -> str:
    """``1.10 [1.05–1.29]``: the median over runs with its min–max; "0.31 (one run)" for one; a range reaching below 0
    reads ``[−0.01 to 0.03]`` (a minus sign; "−0.00" is 0.00)."""
    def f(x: float) -> str:
        t = f"{x:{fmt}}"
        return t.lstrip("-") if float(t) == 0 else t.replace("-", "\u2212")

    if len(xs) == 1:
        return f"{f(xs[0])}{unit} ({verdict(None, None, n=1)})"
    if f(min(xs)) == f(max(xs)):
        return f"{f(xs[0])}{unit} (each run)"
    sep = " to " if f(min(xs)).startswith("\u2212") else "–"
    return f"{f(statistics.median(xs))}{unit} [{f(min(xs))}{sep}{f(max(xs))}]"


def _steps(runs: list[dict], meta: dict) -> str:
    """The last step the runs logged (the training set's batches cap ``--steps``)."""
    got = sorted({x["steps_logged"] for x in runs if "steps_logged" in x}) or [meta["steps"]]
    return "/".join(str(n) for n in got)


def _busy(loads: list[float], meta: dict) -> str:
    """", more runnable processes than cores: other jobs shared the machine" when the load says so."""
    cores = re.search(r"(\d+) cores", meta["machine"])
    return (", more runnable processes than cores: other jobs shared the machine"
            if cores and max(loads) > int(cores[1]) else "")


def _orders(runs: list[dict]) -> str:
    """Each round's order as the runs ran (the results file keeps them in order)."""
    by: dict[int, list[str]] = {}
    for x in runs:
        by.setdefault(x["round"], []).append(x["method"])
    return "; ".join(" → ".join(o) for o in by.values())


def _inside(x: float, xs: list[float]) -> bool:
    return min(xs) <= x <= max(xs)


def _reproduction(by: dict[str, list[dict]], rep: dict[str, list[dict]]) -> list[tuple[str, str, float, bool]]:
    """(configuration, figure, a rerun round's value, inside the rounds' min–max) for every rerun run of each
    configuration that ran in both (with at least 2 runs in the rounds), on the whole step × GRPO's and the pass's
    added time: every rerun is checked, none picked."""
    out = []
    for k, runs in by.items():
        if k == "GRPO" or k not in rep or len(runs) < 2:
            continue
        for y in rep[k]:
            for key, label in (("ratio", "× GRPO"), ("added", "added")):
                out.append((k, label, y[key], _inside(y[key], [x[key] for x in runs])))
    return out


def _reproduction_sentence(checks: list[tuple[str, str, float, bool]], by: dict[str, list[dict]]) -> str:
    """How many rerun figures lie inside the rounds' min–max, beside how many would by chance alone: a run drawn like a
    configuration's n others lands inside their min–max with probability (n − 1)/(n + 1) (50 % at n = 3), so the
    check can flag a shift, not confirm a figure."""
    out = [f"{dict(_COST_ROW).get(k, k)} {label} {v:.2f}" for k, label, v, ok in checks if not ok]
    expected = sum((len(by[k]) - 1) / (len(by[k]) + 1) for k, *_ in checks)
    return (f"the rerun rounds' figures lie inside their configuration's min–max over the rounds for "
            f"{sum(ok for *_, ok in checks)} of "
            f"{len(checks)}" + (f" (outside: {', '.join(out)})" if out else "")
            + f"; runs drawn like the rounds' would land inside for {expected:.1f} of {len(checks)} on average "
            "(a new run falls inside the min–max of n runs with probability (n − 1)/(n + 1))")


def overhead_cpu() -> str:
    """docs/performance.md's table: per configuration, the median over alternating rounds with its min–max (each
    round's run against that round's GRPO), what OAR adds to verl's old-log-prob pass, what the trainer logs, and the
    rerun round's figures checked against the rounds' spread."""
    r, by, rep = _overhead_runs()
    m = r["meta"]
    lines = ["| configuration | runs | step s | whole step × GRPO's | added to the old-log-prob pass × GRPO's training "
             "compute | `timing_s/oar_total` (what the trainer logs) × GRPO's training compute | `timing_s/adv` − "
             "GRPO's × GRPO's training compute | sequences attributed | rerun round: × GRPO's, added |",
             "|---|---|---|---|---|---|---|---|---|"]
    early = _earlier(r)
    order = [*by, *(k for k in rep if k not in by), *(k for k in early if k not in by and k not in rep)]
    for k in order:
        # a configuration only in the rerun rounds: its runs there; only in the earlier invocation: its runs there
        runs = by.get(k) or rep.get(k) or early[k]
        one = k not in by
        n = f"{len(runs)}" + ("" if not one else " (rerun round)" if k in rep else f" ({r['earlier']['meta']['date']})")
        if k == "GRPO":
            again = " / ".join(f"{x['step_s']:.2f} s" for x in rep["GRPO"]) if "GRPO" in rep else "–"
            lines.append(f"| GRPO | {n} | {_spread([x['step_s'] for x in runs])} | 1 | – | – | – | – | {again} |")
            continue
        if one or k not in rep:
            again = "–"
        elif len(runs) < 2:  # one run: no spread to hold the rerun against
            again = "; ".join(", ".join(f"{y[key]:.2f}" for key in ("ratio", "added")) for y in rep[k]) + \
                " (no spread: one run)"
        else:
            again = "; ".join(", ".join(f"{y[key]:.2f} "
                                        f"({'inside' if _inside(y[key], [x[key] for x in runs]) else 'outside'})"
                                        for key in ("ratio", "added")) for y in rep[k])
        lines.append(f"| {_OVERHEAD_LABEL.get(k, k)} | {n} | {_spread([x['step_s'] for x in runs])} | "
                     f"**{_spread([x['ratio'] for x in runs])}** | **{_spread([x['added'] for x in runs])}** | "
                     f"{_spread([x['logged'] for x in runs])} | {_adv(runs)} | "
                     f"{_spread([x['attributed_frac'] for x in runs])} | {again} |")
    every = [*r["runs"], *(r.get("reproduction", {}).get("runs", []))]
    loads = [v for x in every for v in x["load_average_before_after"]]
    updates = [x["update_s"] for x in every]
    rounds = len({x["round"] for x in r["runs"]})
    rm = r.get("reproduction", {}).get("meta", {})
    lines += ["", f"`{m['command']}`, {m['date']}, commit {m['commit'][:7]}"
              + (f" ({m['note']})" if m.get("note") else "")
              + "".join(f"; more rounds `{a['command']}`, {a['date']}, commit {a['commit'][:7]}"
                        for a in m.get("appended", []))
              + (f"; the runs' commits {', '.join(dict.fromkeys(x['commit'][:7] for x in every if 'commit' in x))}"
                 if any("commit" in x for x in every) else "")
              + "".join(f"; rerun round `{a['command']}`, {a['date']}, commit {a['commit'][:7]}"
                        for a in ([rm, *rm.get("appended", [])] if rm else []))
              + f": trainer mode `{m['trainer_mode']}`, {m['batch']} prompts × {m['rollout_n']} responses of ≤ "
              f"{m['response_length']} tokens, each run's median of steps 2–{_steps(every, m)}; {rounds} rounds, each "
              f"running each of its configurations once in a rotated order ({_orders(r['runs'])}); "
              f"the cells: median [min–max] over the rounds, each round's run against that round's GRPO; {m['machine']}; "
              f"one-minute load average {min(loads):.1f}–{max(loads):.1f} around the runs{_busy(loads, m)}. "
              f"The actor update, which OAR does not change, took {min(updates):.2f}–{max(updates):.2f} s "
              "across the runs: this machine's run-to-run spread."]
    # a user's recipe: the pass alone, read from a run with its own passes, beside GRPO's pass in the same invocation
    src, when = ((by, "") if "conservative-separate" in by
                 else (_earlier(r), f" ({r.get('earlier', {}).get('meta', {}).get('date')})"))
    if "conservative-separate" in src:
        alone = [x["log_prob_s"] - x["oar_s"] for x in src["conservative-separate"]]
        same = {x["round"] for x in src["conservative-separate"]}  # GRPO's runs of the same rounds
        lines[-1] += (f" The recipe's two readings of the pass alone{when}: the default with its own passes, "
                      f"`timing_s/old_log_prob` − `timing_s/oar_total`, {_spread(alone, unit=' s')}; GRPO's "
                      f"`timing_s/old_log_prob` in the same rounds "
                      f"{_spread([x['log_prob_s'] for x in src['GRPO'] if x['round'] in same], unit=' s')}.")
    if early:
        em = r["earlier"]["meta"]
        lines[-1] += (f" Rows dated {em['date']}: the earlier invocation `{em['command']}`, each configuration once in "
                      f"one order (OAR-G's default twice, under two names), each against its GRPO run, on the same "
                      f"machine at load average {em['load_average_before_after'][0]}–"
                      f"{em['load_average_before_after'][1]}; not rerun in this session.")
        again = [f"{dict(_COST_ROW).get(k, k)} × GRPO " + " / ".join(f"{x['ratio']:.2f}" for x in early[k])
                 + ", added " + " / ".join(f"{x['added']:.2f}" for x in early[k])
                 + (f" ({len(early[k])} runs)" if len(early[k]) > 1 else f" ({verdict(None, None, n=1)})")
                 for k in by if k != "GRPO" and k in early]
        if again:
            lines[-1] += f" That invocation's runs of the configurations above: {'; '.join(again)}."
    checks = _reproduction(by, rep)
    if checks:
        lines[-1] += (f" Rerun rounds, each checked ({_orders(r['reproduction']['runs'])}): "
                      f"{_reproduction_sentence(checks, by)}.")
    return "\n".join(lines)


def cost_row() -> str:
    """The README's cost row: per configuration the median [min–max] over alternating rounds of what OAR adds to
    verl's old-log-prob pass × GRPO's training compute (the pass with attribution − GRPO's in the same round), what
    the trainer logs (``timing_s/oar_total``) for the default, the whole step against GRPO's, and the rerun round's
    check against the spread."""
    r, by, rep = _overhead_runs()
    rounds = len({x["round"] for x in r["runs"]})
    keys = [(k, label) for k, label in _COST_ROW if k in by]
    added = ", ".join(f"{label} {_spread([x['added'] for x in by[k]])}"
                      + (f" ({len(by[k])} runs)" if len(by[k]) > 1 else "") for k, label in keys)
    step = ", ".join(f"{label} {_spread([x['ratio'] for x in by[k]])}" for k, label in keys)
    logged = (f"; what the trainer logs for the default, `timing_s/oar_total` (its own blocks, not the pass's "
              f"slow-down), × the same {_spread([x['logged'] for x in by['conservative-shared']])}; its reshaping, "
              f"in `timing_s/adv` (outside both), adds {_adv(by['conservative-shared'])} more"
              if "conservative-shared" in by else "")
    checks = [c for c in _reproduction(by, rep) if c[0] in dict(keys)]
    early = _earlier(r)
    rest = [(k, label) for k, label in _COST_ROW if k not in by and k in early]
    if rest:
        logged += (". An earlier invocation (performance.md's dated rows), added × GRPO's training compute: "
                   + ", ".join(f"{label} " + " / ".join(f"{x['added']:.2f}" for x in early[k])
                               + f" ({verdict(None, None, n=1) if len(early[k]) == 1 else f'{len(early[k])} runs'})"
                               for k, label in rest))
    return (f"median [min–max] over {rounds} alternating rounds. Added to verl's old-log-prob pass (the pass with "
            f"attribution − GRPO's, same round) × GRPO's training compute: {added}{logged}. Whole step × GRPO's: "
            f"{step} (tiny model, responses ≤ {r['meta']['response_length']} tokens). Rerun rounds, each checked: "
            + (_reproduction_sentence(checks, by) if checks else "not yet run"))


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
    return (f"{lengths[0]}–{lengths[-1]} tokens (fp32, a 12-layer Qwen2 shape, {verdict(None, None, n=1)} per "
            "length): " + "; ".join(parts))


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
        part = f"{label} {_mean(ms[k]['recall']):.2f}" + (f" (mean of {len(ms[k]['recall'])} draws)"
                                                          if len(ms[k]["recall"]) > 1 else "")
        gate = _mean(ms[k].get("recall_gate_reading", ms[k]["recall"]))
        if f"{gate:.2f}" != f"{_mean(ms[k]['recall']):.2f}":
            part += f" (its signed scores as the gate reads them, by magnitude: {gate:.2f})"
        parts.append(part)
    return f"recall@k, {verdict(None, None, n=1)} each unless a mean is named: " + ", ".join(parts)


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
    lines = verl_worker_markdown(load(GPU_WORKER["bf16"])["verl_worker"])
    text = "\n".join(x for x in lines if not x.startswith("Host syncs in attribution"))  # the sites: in its JSON
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def gpu_shared_peaks(variant: str) -> str:
    """method §13: the default's and fisher's shared-pass peaks × the update's (later steps) in one run."""
    w = _worker(variant)["calls"]
    return " / ".join(f"{steady_peak_ratio(w[m + '-shared'], w['update_actor']):.2f}"
                      for m in ("conservative", "fisher"))


def _timings(call: dict) -> list[float]:
    """A worker call's timings after the first (the warm-up), whose median is its ``seconds``."""
    return call["seconds_all"][1:] or call["seconds_all"]


def gpu_row() -> str:
    """The README's GPU row: the 7B shape in one process, then verl's FSDP2 worker group with OAR's worker: each method
    as it runs by default and with its own passes; the worker's agreement with the core over every call, the passes
    read from included; a pass read from given with the range of its timings, not only their median."""
    rows, meta = _gpu_rows(), load(GPU_SHARED)
    a, b = sorted(rows)[:2]
    both = lambda key: f"{rows[a][key]['added_x_train']:.2f} / {rows[b][key]['added_x_train']:.2f}"  # noqa: E731
    w, w32 = _worker("bf16"), _worker("fp32_before")
    calls, update = w["calls"], w["calls"]["update_actor"]
    lengths = w["response_lengths"]
    peak = max(steady_peak_ratio(calls[m], update) for m in ("gradient", "fisher", "conservative",
                                                            "conservative-shared", "fisher-shared", "gradient-shared"))

    def scores(point: dict, key: str) -> list[float]:  # every mode's rows, its own call's and its pass-read's
        return ([v for m, x in point["agreement"].items() if m != "segment" for v in x[key]]
                + [v for x in point["shared"].values() for v in x["agreement"][key]])

    own32 = max(v for m, x in w32["agreement"].items() if m != "segment" for v in x["max_rel_diff"])
    all32, rho = max(scores(w32, "max_rel_diff")), min(scores(w, "spearman"))
    sh = calls["conservative-shared"]
    added = [(s - calls["compute_log_prob"]["seconds"]) / update["seconds"] for s in _timings(sh)]
    e = lambda x: f"{x:.0e}".replace("e-0", "e-")  # noqa: E731
    return (f"{meta['device'].replace('NVIDIA ', '')}, {meta['dtype'].replace('bfloat16', 'bf16')}, Qwen2.5-7B × "
            f"{a // 1024}k / {b // 1024}k, × a training forward + backward on the same tokens: the default read from "
            f"the old-log-prob pass adds {both('conservative_recompute')} (every layer recomputed), its own passes "
            f"{both('conservative_separate')}; fisher from the pass {both('fisher_recompute')}, own "
            f"{both('fisher_separate')}; OAR-G with its teachers read from the pass (its default) "
            f"{both('gradient_recompute')}, its own passes {both('gradient_own_recompute')} "
            f"({verdict(None, None, n=1)} each). verl's FSDP2 worker "
            f"group, Qwen2.5-1.5B, rows of {min(lengths) // 1024}k–{max(lengths) // 1024}k, medians of "
            f"{len(_timings(calls['conservative']))} timings: the default "
            f"{calls['conservative']['vs_update_time']:.2f}×, "
            f"fisher {calls['fisher']['vs_update_time']:.2f}×, OAR-G {calls['gradient']['vs_update_time']:.2f}× "
            f"`update_actor` (the default read from the pass: +{sh['added_vs_update_time']:.2f}×, its "
            f"{len(added)} timings +{min(added):.2f} to +{max(added):.2f}×), peak ≤ {peak:.2f}× the update's; the "
            f"worker's scores against the core's, the passes read from included: bf16 Spearman ≥ {rho:.3f}; fp32 "
            f"(the run before the recompute fix) max relative difference ≤ {e(own32)} in its own calls, ≤ {e(all32)} "
            "read from the pass; log-probs bitwise unchanged")


RENDERERS: dict[str, Callable[[], str]] = {
    "overhead_cpu": overhead_cpu, "cost_row": cost_row,
    "scaling_cpu": scaling_cpu, "scaling_row": scaling_row, "scaling_model_check": scaling_model_check,
    "planted_recall_row": planted_recall_row, "planted_recall_table": planted_recall_table,
    "no_span_headline": no_span_headline,
    "signed_gate_rows": signed_gate_rows, "gate_learning": gate_learning, "gate_against_grpo": gate_against_grpo, "sigma_sweep": sigma_sweep,
    "fidelity_paired_headline": fidelity_paired_headline,
    "fidelity_position_headline": fidelity_position_headline, "bf16_headline": bf16_headline, "mode_row": mode_row,
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
    "commands.fidelity": lambda: commands(*(f for f, _ in FIDELITY_STUDIES.values())),
    "commands.bf16": lambda: commands(*(BF16_STUDIES[s] for s in ("smollm2", "gemma3", "gemma3_past"))), "learning_verdicts": learning_verdicts,
    "learning_final_verdicts": learning_final_verdicts, "learning11_wall": learning_wall, "oar_p_scaling": oar_p_scaling,
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


def auto_recompute_7b() -> str:
    """docs/scaling.md: what ``algorithm.oar.recompute=auto`` picks for the default and fisher read from the old-log-prob
    pass at Qwen2.5-7B × 4k on 80 GB GPUs, the cost model's peak and added time (research/auto_recompute.py's file)."""
    r = load("auto_recompute_7b")
    lines = ["| set-up, micro-batch | method | layers recomputed | peak GiB (model) | verl's update peak + gradients "
             "GiB | added time × training (model) |", "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        name = "the default (`conservative`)" if x["mode"] == "conservative" else x["mode"]
        lines.append(f"| {x['setup']} | {name} | {x['recomputed']} of {x['layers']} | {x['peak_gib']:.1f} | "
                     f"{x['update_gib']:.1f} | {x['added_time_x_training']:.2f} |")
    return "\n".join(lines)


RENDERERS["auto_recompute_7b"] = auto_recompute_7b

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
