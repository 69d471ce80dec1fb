"""Attribution against the training step as responses grow: peak memory and time, measured side by side.

For each response length, one measurement per pass, each in a fresh process (so that each peak is its own), on the same
random-initialised model, the same rows and the same token budget (one training micro-step holds all rows):

* **train**: the actor's training forward + backward with gradient checkpointing (full logits over the response,
  fp32 log-softmax, parameter gradients), as verl's update runs one micro-batch;
* **oar_g**: OAR-G with the training step's budget, under the same gradient checkpointing;
* **conservative**: the default mode's one input-gradient pass under its propagation rules, likewise (``--methods``);
* **oar_p**: exact OAR-P (prefix reuse) with the same budget. Where exact OAR-P over every reasoning token would take
  too long (``--oar-p-sample``), it runs a sample of its passes spread over the sequence -- the first, which recomputes
  the longest suffix and so holds the most, one in the middle and the last -- and its total time is extrapolated from
  the measured time per recomputed token times the recomputed tokens of all passes (the peak is measured);
* **model**: what the cost model of ``oar_verl.core.backends.memory`` predicts for each pass, to check it against the points.

CPU memory is the peak resident-memory rise of the process over its state after building the model and inputs
(sampled every 2 ms); on CUDA it is ``max_memory_allocated`` over the same baseline. Parameter gradients are part
of the training step's peak; the table also reports the training peak without them (activations only).

usage:
    python -m research.scaling                          # CPU: 12 layers, hidden 1024, V = 43k; 512 / 2k / 8k tokens
    python -m research.scaling --quick                  # a smaller model and lengths, for CI (minutes)
    python -m research.scaling --device cuda --shape qwen2.5-7b --lengths 4096,16384   # bf16, random init
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from research import REPO
from research.common import command_line, measure, write_results
from research.common import progress
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.backends.memory import ModelShape, PassKind, pass_bytes
from oar_verl.core.batch.probes import ProbeKind
from research.common import conservative_importance, fisher_importance, oar_g_importance, oar_p_importance

SHAPES = {
    # layers, hidden, heads, kv heads, head dim, intermediate, vocab, tied: Qwen2.5's ratios (I ≈ 5.3 H,
    # V ≈ 42 H, 128-wide heads, GQA), scaled down to what 2 CPU cores run in minutes
    "cpu-scaled": (12, 1024, 8, 2, 128, 5504, 43008, False),
    "cpu-quick": (12, 256, 2, 1, 128, 1376, 10752, False),
    "tiny": (2, 64, 2, 1, 32, 176, 1024, False),  # CI smoke runs of the GPU driver (benchmarks.gpu_check --tiny)
    "qwen2.5-1.5b": (28, 1536, 12, 2, 128, 8960, 151936, True),
    "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944, 152064, False),
    "qwen2.5-32b": (64, 5120, 40, 8, 128, 27648, 152064, False),
}
PROMPT, ANSWER = 128, 2


def build_model(shape: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    layers, hidden, heads, kv, head_dim, inter, vocab, tied = SHAPES[shape]
    cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                      max_position_embeddings=32768 + PROMPT, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model never exists in fp32 on the device
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(dtype)
    finally:
        torch.set_default_dtype(default)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.eval()


def make_rows(rows: int, length: int, vocab: int, device: str):
    """verl's layout: ``rows`` sequences of PROMPT prompt tokens and ``length`` response tokens (reasoning, a
    2-token marker, ANSWER answer tokens), all the same length (the budget is then exactly rows × sequence)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (rows, PROMPT), generator=g)
    responses = torch.randint(1, vocab, (rows, length), generator=g)
    cols = torch.arange(length)[None].expand(rows, -1)
    reasoning = cols < length - 2 - ANSWER
    answer = cols >= length - ANSWER
    layout = [t.to(device) for t in (prompts, torch.ones_like(prompts), responses, torch.ones_like(responses),
                                     reasoning, answer)]
    return build_attribution_batch(*layout, torch.full((rows,), int(ProbeKind.AS_MEAN), device=device))


def train_step(model, batch) -> None:
    """One micro-step of the actor update: forward with full logits, fp32 log-probs of the response tokens, backward
    into parameter gradients (under the model's gradient checkpointing)."""
    model.train()
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    start = batch.response_start
    logp = torch.log_softmax(out.logits[:, start - 1:-1].float(), -1)
    taken = logp.gather(-1, batch.input_ids[:, start:, None]).squeeze(-1)
    (-taken.mean()).backward()
    model.eval()


def sample_reasoning(batch, passes: int, per_pass: int):
    """The batch with its reasoning restricted to ``passes`` blocks of ``per_pass`` tokens (first, middle, last), and
    the fraction of all recomputed tokens that the sample recomputes (to extrapolate the time)."""
    mask = batch.reasoning_mask.clone()
    cols = mask[0].nonzero().squeeze(1)
    n_copies = len(cols)
    starts = sorted({0, max(0, n_copies // 2 - per_pass // 2), max(0, n_copies - per_pass)})[:passes]
    keep = torch.zeros_like(mask[0])
    for s in starts:
        keep[cols[s:s + per_pass]] = True
    end = int(batch.attention_mask[0].sum())
    firsts_all = cols[::per_pass]
    full = int((end - firsts_all).sum()) * mask.shape[0]  # every pass recomputes from its first masked token
    sample = sum(end - int(cols[s]) for s in starts) * mask.shape[0]
    sampled = type(batch)(batch.input_ids, batch.attention_mask, batch.position_ids, mask & keep[None], batch.probe,
                          batch.response_start)
    return sampled, sample / full


def point(args) -> dict:
    """One (method, length) measurement, in this process."""
    device, dtype = args.device, getattr(torch, args.dtype)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = build_model(args.shape, device, dtype)
    batch = make_rows(args.rows, args.point_length, model.config.vocab_size, device)
    tokens = args.rows * (PROMPT + args.point_length)  # the training micro-step's budget: all rows at once
    limits = PassLimits(tokens)
    info: dict = {"method": args.method, "length": args.point_length, "rows": args.rows, "budget": tokens}
    if args.method == "train":
        for p in model.parameters():
            p.requires_grad_(True)
        seconds, peak = measure(lambda: train_step(model, batch), device)
        info["grads_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    elif args.method == "oar_g":
        seeds = sequence_seeds(0, 0, torch.arange(args.rows)).to(device)
        seconds, peak = measure(lambda: oar_g_importance(model, batch, 1e-3, seeds, limits, checkpointing=True,
                                                         samples=args.noise_samples), device)
        info["noise_samples"] = args.noise_samples
    elif args.method == "fisher":  # OAR-P's masking KL to second order: one gradient pass per outcome and sketch
        seconds, peak = measure(lambda: fisher_importance(model, batch, 0, limits, outcomes=args.fisher_outcomes,
                                                          sketches=args.fisher_sketches), device)
        info.update(fisher_outcomes=args.fisher_outcomes, fisher_sketches=args.fisher_sketches)
    elif args.method == "conservative":  # one clean input-gradient pass per row under the propagation rules
        seconds, peak = measure(lambda: conservative_importance(model, batch, limits), device)
    else:
        per_pass = max(1, tokens // (PROMPT + args.point_length))
        n_copies = int(batch.reasoning_mask[0].sum())
        if args.oar_p_sample and n_copies > 3 * per_pass * args.oar_p_sample:
            sampled, frac = sample_reasoning(batch, 3, per_pass)
            seconds, peak = measure(lambda: oar_p_importance(model, sampled, 0, limits, prefix_cache=True), device)
            info.update(sampled_fraction=frac, sample_seconds=seconds)
            seconds = seconds / frac
        else:
            seconds, peak = measure(lambda: oar_p_importance(model, batch, 0, limits, prefix_cache=True), device)
    info.update(seconds=seconds, peak_mib=peak)
    return info


def predicted(shape: str, dtype: torch.dtype, rows: int, length: int) -> dict:
    """The cost model's peak (MiB) of each pass of one point."""
    layers, hidden, heads, kv, head_dim, inter, vocab, _ = SHAPES[shape]
    s = ModelShape(layers, hidden, inter, heads, kv, head_dim, vocab, torch.finfo(dtype).bits // 8)
    n = PROMPT + length
    mib = 2**20
    train = pass_bytes(PassKind.TRAINING, rows * n, s, checkpointing=True, logit_positions=rows * length)
    return {"train": train / mib,
            "oar_g": max(pass_bytes(PassKind.INPUT_GRADIENT, rows * n, s, checkpointing=True,
                                    logit_positions=rows * ANSWER),
                         pass_bytes(PassKind.FORWARD, rows * n, s, logit_positions=rows * ANSWER)) / mib,
            # one input-gradient pass under the propagation rules, reading the answer positions
            "conservative": pass_bytes(PassKind.RULES_GRADIENT, rows * n, s, checkpointing=True,
                                       logit_positions=rows * ANSWER) / mib,
            "oar_p": (pass_bytes(PassKind.FORWARD_CACHED, n, s) + s.per_layer_transient() * rows * n * s.dtype_bytes
                      + 2 * s.kv_heads * s.head_dim * rows * n * s.dtype_bytes) / mib}


def _shape(name: str, dtype_bytes: int) -> ModelShape:
    layers, hidden, heads, kv, head_dim, inter, vocab, _ = SHAPES[name]
    return ModelShape(layers, hidden, inter, heads, kv, head_dim, vocab, dtype_bytes)


def _params(name: str) -> tuple[float, float]:
    """(all parameters, decoder-layer parameters) of a shape."""
    layers, hidden, heads, kv, head_dim, inter, vocab, tied = SHAPES[name]
    layer = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return layers * layer + vocab * hidden * (1 if tied else 2), layers * layer


def extrapolate(prompt: int = 1024, budget: int = 16384, gpus: int = 8) -> list[dict]:
    """The cost model at real shapes (bf16, gradient checkpointing): per-GPU activation memory of one pass of the
    training step, OAR-G and exact OAR-P at the same token budget, the training state per GPU, and time ratios."""
    rows = []
    for name in ("qwen2.5-7b", "qwen2.5-32b"):
        shape = _shape(name, 2)
        total, body = _params(name)
        for length in (4096, 16384):
            n = prompt + length
            seqs = max(1, budget // n)
            tokens = seqs * n
            gib = 2**30
            train = pass_bytes(PassKind.TRAINING, tokens, shape, checkpointing=True, logit_positions=seqs * length)
            oar_g = pass_bytes(PassKind.INPUT_GRADIENT, tokens, shape, checkpointing=True, logit_positions=seqs * 2)
            oar_p = (pass_bytes(PassKind.FORWARD_CACHED, n, shape) + shape.per_layer_transient() * tokens * 2
                     + 2 * shape.kv_heads * shape.head_dim * tokens * 2)
            # FLOPs per token: decoder body (matmuls + causal attention over half the context on average), LM head
            f_body = 2 * body + 2 * shape.layers * shape.heads * shape.head_dim * n
            f_head = 2 * shape.hidden * shape.vocab
            t_train = 4 * f_body + 3 * f_head  # forward, recomputation, backward (inputs and weights)
            t_oar_g = 4 * f_body  # teacher, student, recomputation, backward to the inputs only
            t_oar_p = (length / 2 + 2) * f_body  # every copy recomputes its suffix: mean length/2 (+ the answer)
            for setup, tp in (("FSDP", 1), ("Megatron TP=4 + SP", 4) if name == "qwen2.5-7b" else
                              ("Megatron TP=8 + SP", 8)):
                # training state: FSDP shards fp32 params, grads and Adam over all GPUs; Megatron keeps bf16 params
                # and fp32 grads per TP shard and shards the optimizer over the data-parallel ranks
                state = 16 * total / gpus if tp == 1 else (6 * total / tp + 12 * total / gpus)
                rows.append({"model": name, "response": length, "sequences_per_pass": seqs, "setup": setup,
                             "state_gib": state / gib, "train_gib": train / tp / gib, "oar_g_gib": oar_g / tp / gib,
                             "oar_p_gib": oar_p / tp / gib, "oar_g_time": t_oar_g / t_train,
                             "oar_p_time": t_oar_p / t_train})
    return rows


def run_points(args, lengths: list[int]) -> list[dict]:
    out = []
    units = [(n, method) for n in lengths for method in ("train", *args.methods.split(","))]
    for n, method in progress(units, desc="[scaling] points (length x method)", unit="point"):
        cmd = [sys.executable, "-m", "research.scaling", "--point", method, "--point-length", str(n),
               "--device", args.device, "--dtype", args.dtype, "--shape", args.shape, "--rows", str(args.rows),
               "--oar-p-sample", str(args.oar_p_sample), "--noise-samples", str(args.noise_samples)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} at {n} tokens failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["predicted_mib"] = predicted(args.shape, getattr(torch, args.dtype), args.rows, n)[method]
        print(f"  {method:6s} {n:6d} tokens: {row['seconds']:9.1f} s  peak {row['peak_mib']:9.0f} MiB  "
              f"(model {row['predicted_mib']:8.0f} MiB; {time.perf_counter() - start:.0f} s wall)", flush=True)
        out.append(row)
    return out


def ratios(points: list[dict]) -> list[dict]:
    """Per length: each attribution method's peak and time over the training step's."""
    table = []
    for n in sorted({p["length"] for p in points}):
        by = {p["method"]: p for p in points if p["length"] == n}
        train = by["train"]
        act = train["peak_mib"] - train.get("grads_mib", 0.0)
        for m, p in by.items():
            if m == "train":
                continue
            table.append({"length": n, "method": m, "peak_mib": p["peak_mib"], "train_peak_mib": train["peak_mib"],
                          "peak_ratio": p["peak_mib"] / train["peak_mib"],
                          "peak_ratio_vs_activations": p["peak_mib"] / max(act, 1e-9),
                          "seconds": p["seconds"], "train_seconds": train["seconds"],
                          "time_ratio": p["seconds"] / train["seconds"],
                          "extrapolated": "sampled_fraction" in p})
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--shape", default=None, choices=list(SHAPES))
    ap.add_argument("--lengths", default=None, help="response lengths, comma-separated")
    ap.add_argument("--rows", type=int, default=2, help="sequences per point (one training micro-step)")
    ap.add_argument("--oar-p-sample", type=int, default=1,
                    help="sample exact OAR-P's passes when it has more than 3 x this many passes per row (0: never)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--noise-samples", type=int, default=1, help="OAR-G noise draws (algorithm.oar.noise_samples)")
    ap.add_argument("--methods", default="oar_g,conservative,oar_p",
                    help="attribution methods measured beside the training step: oar_g, conservative (the default "
                         "mode), fisher, oar_p")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model-only", action="store_true", help="print the cost model at Qwen2.5-7B / 32B shapes")
    ap.add_argument("--out", default="outputs/benchmarks")
    ap.add_argument("--results", type=Path, default=None,
                    help="also write the points and ratios to this committed results file (research/results/"
                         "scaling_cpu.json: the README's row and docs/performance.md's table are generated from it)")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--point-length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fisher-outcomes", type=int, default=None,
                    help="outcomes kept by the fisher point (--point fisher); default: the configuration's")
    ap.add_argument("--fisher-sketches", type=int, default=0, help="Rademacher sketches of the fisher point")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.shape = args.shape or ("cpu-quick" if args.quick else "cpu-scaled" if args.device == "cpu" else
                                "qwen2.5-1.5b")
    if args.point:
        args.method = args.point
        print(json.dumps(point(args)))
        return 0
    if args.model_only:
        print("model | response | seqs/pass | setup | state GiB | train act. GiB | OAR-G GiB | OAR-P GiB | "
              "OAR-G time | OAR-P time (x train)")
        for r in extrapolate():
            print(f"{r['model']} | {r['response']} | {r['sequences_per_pass']} | {r['setup']} | {r['state_gib']:.0f} | "
                  f"{r['train_gib']:.1f} | {r['oar_g_gib']:.1f} | {r['oar_p_gib']:.1f} | {r['oar_g_time']:.2f} | "
                  f"{r['oar_p_time']:.0f}")
        return 0
    lengths = [int(x) for x in (args.lengths or ("256,1024" if args.quick else "512,2048,8192")).split(",")]
    meta = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "device": args.device, "dtype": args.dtype, "shape": args.shape,
            "shape_values": SHAPES[args.shape], "rows": args.rows, "prompt": PROMPT,
            "command": command_line("scaling", argv),
            "cores": os.cpu_count(), "load_average_before": round(os.getloadavg()[0], 2)}
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
    print(f"scaling: {meta}", flush=True)
    start = time.perf_counter()
    points = run_points(args, lengths)
    table = ratios(points)
    meta["wall_s"] = time.perf_counter() - start
    meta["load_average_after"] = round(os.getloadavg()[0], 2)
    print("\nlength | method | peak MiB | train peak MiB | peak ratio | vs train activations | s | train s | "
          "time ratio")
    for r in table:
        print(f"{r['length']:6d} | {r['method']:6s} | {r['peak_mib']:8.0f} | {r['train_peak_mib']:14.0f} | "
              f"{r['peak_ratio']:10.2f} | {r['peak_ratio_vs_activations']:20.2f} | {r['seconds']:8.1f} | "
              f"{r['train_seconds']:7.1f} | {r['time_ratio']:10.2f}{' (extrapolated)' if r['extrapolated'] else ''}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scaling_{args.device}_{args.shape}.json"
    path.write_text(json.dumps({"meta": meta, "points": points, "ratios": table}, indent=1))
    print(f"\nwrote {path} ({meta['wall_s']:.0f} s)")
    if args.results:
        write_results(args.results, {"meta": meta, "points": points, "ratios": table})
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
