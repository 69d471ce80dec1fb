"""What attribution adds to the old-log-prob pass when it reads its scores from that pass (issue #45), measured side
by side in one process on the same model and rows.

For each response length (one row of 128 prompt + T response tokens, random weights at the shape asked for):

* **log_prob**: verl's old-log-prob pass alone: a forward without grad, full logits, fp32 log-softmax of the response;
* **shared <method> recompute / keep / auto**: the same pass with the method read from it
  (:mod:`oar_verl.core.backends.shared`), the backward recomputing each layer, keeping every layer's activations, or
  keeping as many as ``algorithm.oar.recompute=auto`` keeps in verl (the product's rule: under verl's update at these
  tokens, the pass's own logits counted; where that is neither);
* **separate <method>** (fisher, conservative): its own forward + recomputed input-gradient pass, after the log-prob
  pass (``shared_forward=false``);
* **gradient own / from pass** (``--modes`` with ``gradient``): OAR-G after the log-prob pass, with its own clean
  teacher pass, or with the teachers read from the pass (``SharedTeacher``); its noisy pass recomputing, keeping or
  ``auto`` as above;
* **peer OAR-G** (``--peer``): OAR-G built the way GRAIL's is, full logits and no recompute (:func:`peer_oar_g`);
* **train**: the actor's training forward + backward with gradient checkpointing (parameter gradients).

Reported: (pass with attribution − pass alone) ÷ train, with the cost model's prediction in forward units (train
4F: forward, recompute, two backward matmuls; a shared backward adds F, its recompute another F for the share of
layers recomputed; OAR-G's noisy pass a forward and a backward, its own teacher pass another F), and each peak
(allocator peak over the state before on CUDA, resident-memory rise on CPU) ÷ train's.

usage:
    python -m research.shared_forward                                   # CPU: cpu-quick shape, 1k and 2k tokens
    python -m research.shared_forward --device cuda --shape qwen2.5-7b --lengths 4096,16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import date

import torch

from oar_verl.core import OARConfig
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.memory import (ModelShape, PassKind, attribution_need, free_accelerator_bytes,
                                           recompute_policy)
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.methods.attribution import METHODS, run_attribution, shared_attribution
from research.common import measure
from research.scaling import PROMPT, build_model, make_rows, train_step

MASK = 7


def log_prob_pass(model, batch) -> torch.Tensor:
    """verl's old-log-prob pass on the rows: no grad, full logits, fp32 log-softmax of the taken response tokens."""
    with torch.no_grad():
        logits = model(**batch.model_inputs(), use_cache=False).logits
        start = batch.response_start
        logp = torch.log_softmax(logits[:, start - 1:-1].float(), -1)
        return logp.gather(-1, batch.input_ids[:, start:, None]).squeeze(-1)


def shared_pass(model, batch, cfg, recompute: float) -> torch.Tensor:
    """The old-log-prob pass with ``cfg.mode`` read from it; returns the log-probs (the scores stay in ``shared``)."""
    shared = shared_attribution(model, batch, cfg, lambda tokens: recompute, mask_token_id=MASK)
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
    with shared.forward(ForwardLayout.padded(rows, batch.attention_mask, 0)):
        out = log_prob_pass(model, batch)
    shared.result()
    return out


def oar_g_after_pass(model, batch, cfg, share: float, from_pass: bool) -> torch.Tensor:
    """The old-log-prob pass, then OAR-G on the same rows (its noisy passes recomputing ``share`` of the layers), with
    its clean teachers read from the pass (``from_pass``) or from its own teacher passes; returns the log-probs."""
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
    seeds = rows * 7919 + 1
    teachers = None
    if from_pass:
        shared = shared_attribution(model, batch, cfg, True, seeds=seeds)
        with shared.forward(ForwardLayout.padded(rows, batch.attention_mask, 0)):
            out = log_prob_pass(model, batch)
        teachers = shared.teachers()
    else:
        out = log_prob_pass(model, batch)
    backend = ModuleBackend(model, PassLimits(int(batch.attention_mask.sum())), checkpointing=lambda tokens: share)
    run_attribution(backend, batch, cfg, seeds=seeds, teachers=teachers)
    return out


def peer_oar_g(model, batch, noise_std: float = 1e-3) -> torch.Tensor:
    """OAR-G built the way GRAIL's is: full (B, L, V) logits of a clean forward and of a noisy forward with grad, no
    recompute, the answer positions' KL back-propagated to the embeddings; (B, L) |gradient × input|."""
    inputs = batch.model_inputs()
    ids = inputs.pop("input_ids")
    answer = batch.probe.logit_weight != 0
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids).detach()  # (Hugging Face's checkpointing marks it requiring grad)
        clean = torch.log_softmax(model(inputs_embeds=emb, **inputs, use_cache=False).logits.float(), -1)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        g = torch.Generator(device=emb.device).manual_seed(0)
        leaf = (emb + noise_std * torch.randn(emb.shape, generator=g, device=emb.device, dtype=emb.dtype)).detach()
        leaf.requires_grad_(True)
        logp = torch.log_softmax(model(inputs_embeds=leaf, **inputs, use_cache=False).logits.float(), -1)
        kl = (clean.exp() * (clean - logp)).sum(-1)
        (kl * answer).sum().backward()
        return (leaf.grad.float() * emb.float()).sum(-1).abs()
    finally:
        for p in params:
            p.requires_grad_(True)


def timed(fn, device: str, repeats: int) -> tuple[float, float]:
    """(median seconds, max peak MiB) of ``repeats`` calls after one warm-up."""
    fn()
    got = [measure(fn, device) for _ in range(repeats)]
    return statistics.median(s for s, _ in got), max(p for _, p in got)


def predicted(columns: int, recompute: float) -> float:
    """The cost model's added time ÷ train: C backwards of F each (no weight gradients), F more each for the share of
    layers recomputed, against train's 4F."""
    return columns * (1.0 + float(recompute)) / 4.0


def run(args) -> list[dict]:
    device, dtype = args.device, getattr(torch, args.dtype)
    model = build_model(args.shape, device, dtype)
    shape = ModelShape.from_hf_config(model.config, dtype)
    out = []
    for length in args.lengths:
        batch = make_rows(args.rows, length, model.config.vocab_size, device)
        tokens = args.rows * (PROMPT + length)
        row = {"length": length, "rows": args.rows, "tokens": tokens}

        def train():
            for p in model.parameters():
                p.requires_grad_(True)
            train_step(model, batch)
            model.zero_grad(set_to_none=True)

        row["train_s"], row["train_mib"] = timed(train, device, args.repeats)
        row["log_prob_s"], row["log_prob_mib"] = timed(lambda: log_prob_pass(model, batch), device, args.repeats)
        free = free_accelerator_bytes(torch.device(device))
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        for mode in args.modes:
            cfg = OARConfig(mode=mode, mask="token", mask_token_id=MASK)
            kind = METHODS.get(mode).backward_pass
            # the product's rule (verl's FSDP actor, one rank): bounded by verl's update at these tokens, the pass's
            # own logits counted where attribution is read from it; OAR-G's noisy passes run after the pass
            auto = recompute_policy("auto", shape, kind, torch.device(device), tokens, grad_bytes=grads,
                                    host=None if mode == "gradient" else PassKind.LOG_PROB)(tokens)
            row[f"{mode}_auto_share"] = auto
            need = attribution_need(kind, shape, margin=1.0)
            for name, share in (("recompute", 1.0), ("keep", 0.0), ("auto", auto)):
                if name == "auto" and share in (0.0, 1.0):
                    continue  # the same as one of the two above
                if share < 1 and need(tokens, round(shape.layers * (1 - share))) > (
                        free if free is not None else float("inf")):
                    row[f"{mode}_{name}"] = "skipped: the kept activations exceed the free memory"
                    continue
                # OAR-G: its teachers read from the pass, and (for the comparison) its own teacher passes
                variants = ([(f"{mode}_{name}", lambda: oar_g_after_pass(model, batch, cfg, share, True), 0.0),
                             (f"{mode}_own_{name}", lambda: oar_g_after_pass(model, batch, cfg, share, False), 0.25)]
                            if mode == "gradient" else
                            [(f"{mode}_{name}", lambda: shared_pass(model, batch, cfg, share), None)])
                for key, fn, teacher in variants:
                    s, mib = timed(fn, device, args.repeats)
                    model_x = predicted(1, share) if teacher is None else teacher + (2.0 + share) / 4.0
                    row[key] = {"added_x_train": (s - row["log_prob_s"]) / row["train_s"], "model_x_train": model_x,
                                "peak_x_train": mib / row["train_mib"], "seconds": s, "peak_mib": mib,
                                "recomputed_share": share}
        for mode in (m for m in args.modes if m != "gradient") if args.separate else ():
            cfg = OARConfig(mode=mode, mask="token", mask_token_id=MASK)  # its own passes, after the log-prob pass
            backend = ModuleBackend(model, PassLimits(tokens), checkpointing=True)
            s, mib = timed(lambda: run_attribution(backend, batch, cfg, mask_token_id=MASK), device, args.repeats)
            row[f"{mode}_separate"] = {"added_x_train": s / row["train_s"], "model_x_train": 0.25 + predicted(1, True),
                                       "peak_x_train": mib / row["train_mib"], "seconds": s, "peak_mib": mib}
        if args.peer:  # the GRAIL-structure OAR-G, after the log-prob pass like ours
            s, mib = timed(lambda: peer_oar_g(model, batch), device, args.repeats)
            row["peer_oar_g"] = {"added_x_train": s / row["train_s"], "model_x_train": float("nan"),
                                 "peak_x_train": mib / row["train_mib"], "seconds": s, "peak_mib": mib}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def table(rows: list[dict], modes: list[str]) -> str:
    lines = ["| T | variant | added × train (model) | peak × train's |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['length']} | log-prob pass alone | {r['log_prob_s'] / r['train_s']:.2f} (0.25) | "
                     f"{r['log_prob_mib'] / r['train_mib']:.2f} |")
        variants = [f"{m}{own}_{v}" for m in modes for own in ("", "_own") for v in ("recompute", "keep", "auto")]
        for key in variants + [f"{m}_separate" for m in modes] + ["peer_oar_g"]:
            v = r.get(key)
            if isinstance(v, dict):
                lines.append(f"| {r['length']} | {key.replace('_', ' ')} | {v['added_x_train']:.2f} "
                             f"({v['model_x_train']:.2f}) | {v['peak_x_train']:.2f} |")
            elif v:
                lines.append(f"| {r['length']} | {key.replace('_', ' ')} | {v} | |")
        for m in modes:
            share = r.get(f"{m}_auto_share", r.get("auto_share"))  # (one share for all, before the product's rule)
            lines.append(f"| {r['length']} | {m} `recompute=auto` recomputes | {share:.2f} of the layers | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="cpu-quick")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="fisher,conservative")
    ap.add_argument("--no-separate", dest="separate", action="store_false")
    ap.add_argument("--peer", action="store_true", help="also the GRAIL-structure OAR-G (full logits, no recompute)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here (research/results/shared_forward_cpu.json: "
                    "the README's fits-beside-training row is generated from it)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.modes = args.modes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{date.today()} {device}, {args.shape} {args.dtype}, {args.rows} row(s) of {PROMPT} + T tokens")
    print(table(rows, args.modes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": str(date.today()), "device": device, "shape": args.shape, "dtype": args.dtype,
                       "command": "python -m research.shared_forward " + " ".join(
                           argv if argv is not None else sys.argv[1:]),
                       "load_average": round(os.getloadavg()[0], 2), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
