"""Attribution speed and memory: oar_verl's OAR-P / OAR-G against a naive implementation of the same maths.

Three tables, measured side by side in one invocation on one random-initialised model (timings need no weights):

1. speed-up over the naive per-sample implementation (the method's reference, ``devtools.reference``, run with
   the official code's structure and its bugs fixed: one Python loop per sample, all R masked copies of a sample in
   one batch with full [R, L, V] logits; OAR-G with a full backward through the parameters), and the largest relative
   difference between our scores and the reference's;
2. OAR-P time and peak memory as the reasoning length grows (each length in a fresh subprocess, so the peak is its
   own): with chunking and probe-only logits the peak is that of one forward pass over ``chunk`` copies of the
   sequence (it grows with the length L, as any forward does), not of all R copies with [R, L, V] logits (naive);
3. attribution time as a ratio to one training forward+backward over the same tokens (the cost a PPO update pays).

usage:
    python -m research.attribution                       # CPU, a small Qwen2 shape, ~10 min on 2 cores
    python -m research.attribution --quick               # CPU smoke run, ~1 min
    python -m research.attribution --device cuda         # Qwen2.5-1.5B shape in bf16 (config only, no weights)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from research import REPO
from research.common import measure, progress
from devtools import reference
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from research.common import oar_p_importance, oar_g_importance

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "cpu-small": (256, 4, 4, 2, 768, 32000),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
}


def build_model(shape: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, n, heads, kv, inter, vocab = SHAPES[shape]
    cfg = Qwen2Config(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=shape != "qwen2.5-1.5b", attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def make_batch(B: int, prompt: int, reasoning: int, answer: int, vocab: int, device: str, seed: int = 0):
    """Responses = reasoning tokens + 2 marker tokens + answer tokens; equal lengths (worst case for padding).

    Returns:
        (rows, batch): verl's padded layout (prompts, prompt_mask, responses, response_mask, reasoning_mask,
        answer_mask) and the AttributionBatch built from it (AS-Mean probe).
    """
    g = torch.Generator().manual_seed(seed)
    T = reasoning + 2 + answer
    prompts = torch.randint(1, vocab, (B, prompt), generator=g)
    responses = torch.randint(1, vocab, (B, T), generator=g)
    cols = torch.arange(T)[None].expand(B, -1)
    reasoning_mask = cols < reasoning
    answer_mask = cols >= reasoning + 2
    rows = tuple(r.to(device) for r in (prompts, torch.ones_like(prompts), responses, torch.ones_like(responses),
                                        reasoning_mask, answer_mask))
    batch = build_attribution_batch(*rows, torch.full((B,), int(ProbeKind.AS_MEAN), device=device))
    return rows, batch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 1) -> float:
    fn()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeat


# ------------------------------------------------------------------------------------------ naive baseline
# The naive baseline is the method's reference (devtools.reference) run the way the official code runs it: one
# sequence at a time, all R masked copies of a sequence in one batch with full [R, L, V] logits; OAR-G with a full
# J.backward() through every parameter. Its scores are the reference's, so the speed-up table also checks ours.
def naive_oar_p(model, rows, mask_id: int) -> torch.Tensor:
    return reference.batch_oar_p(model, *rows, ProbeKind.AS_MEAN, mask_id, copies_per_forward=None)


def naive_oar_g(model, rows, sigma: float, seeds: torch.Tensor) -> torch.Tensor:
    return reference.batch_oar_g(model, *rows, ProbeKind.AS_MEAN, sigma, seeds.cpu(), parameter_gradients=True)


def counts(copies: int | None, rows: int | None) -> PassLimits:
    """Passes sized by counts (``chunk`` copies, ``micro`` rows), as this benchmark's tables are: no token budget."""
    return PassLimits(2**40, rows=rows, copies=copies)


def max_rel_err(ours: torch.Tensor, naive: torch.Tensor) -> float:
    """max |ours − naive| / max |naive| over the response positions."""
    return float((ours.double().cpu() - naive).abs().max() / naive.abs().max().clamp(min=1e-30))


# ------------------------------------------------------------------------------------------------ tables
def speedup_table(model, device, B, prompt, reasoning, answer, chunk, micro) -> list[dict]:
    """Time of each fast path against the naive baseline, and (on CPU, where both draw the same OAR-G noise) the
    largest relative difference of their scores."""
    vocab = model.config.vocab_size
    inputs, batch = make_batch(B, prompt, reasoning, answer, vocab, device)
    seeds = sequence_seeds(0, 0, torch.arange(B)).to(device)
    P = batch.response_start
    rows = []
    naive_p = naive_oar_p(model, inputs, 0)
    t_naive_p = timed(lambda: naive_oar_p(model, inputs, 0), device)
    # the prefix-cache path recomputes each chunk of copies from its first masked position, so smaller chunks do
    # less recomputation and larger ones batch better: both sizes are shown
    small = max(1, chunk // 4)
    for label, c, kw in [("OAR-P batched", chunk, dict(prefix_cache=False)),
                         ("OAR-P prefix cache", chunk, dict(prefix_cache=True)),
                         ("OAR-P prefix cache", small, dict(prefix_cache=True)),
                         ("OAR-P span 4 (approx.)", chunk, dict(prefix_cache=True, mask_span=4))]:
        t = timed(lambda: oar_p_importance(model, batch, 0, counts(c, micro), **kw), device, repeat=3)
        err = max_rel_err(oar_p_importance(model, batch, 0, counts(c, micro), **kw)[:, P:], naive_p) \
            if kw.get("mask_span", 1) == 1 else float("nan")  # k > 1 approximates k = 1 by design
        rows.append({"method": label, "chunk": c, "naive_s": t_naive_p, "ours_s": t, "speedup": t_naive_p / t,
                     "max_rel_err": err})
    for p in model.parameters():
        p.requires_grad_(True)
    naive_g = naive_oar_g(model, inputs, 1e-3, seeds)
    t_naive_g = timed(lambda: naive_oar_g(model, inputs, 1e-3, seeds), device, repeat=3)
    t_g = timed(lambda: oar_g_importance(model, batch, 1e-3, seeds, counts(None, micro)), device, repeat=3)
    ours_g = oar_g_importance(model, batch, 1e-3, seeds, counts(None, micro))[:, P:]
    # on CUDA the fast path draws its noise on the device, the reference on the CPU: no comparison there
    err = max_rel_err(ours_g, naive_g) if device == "cpu" else float("nan")
    rows.append({"method": "OAR-G", "chunk": "-", "naive_s": t_naive_g, "ours_s": t_g, "speedup": t_naive_g / t_g,
                 "max_rel_err": err})
    return rows


def train_step_ratio(model, device, B, prompt, reasoning, answer, chunk, micro) -> list[dict]:
    """Attribution time / one training forward+backward (full logits, parameter gradients) over the same tokens."""
    _, batch = make_batch(B, prompt, reasoning, answer, model.config.vocab_size, device)
    seeds = sequence_seeds(0, 0, torch.arange(B)).to(device)
    for p in model.parameters():
        p.requires_grad_(True)

    def train_step():
        for s in range(0, B, micro):
            out = model(input_ids=batch.input_ids[s: s + micro], attention_mask=batch.attention_mask[s: s + micro])
            torch.log_softmax(out.logits.float(), -1).mean().backward()
        model.zero_grad(set_to_none=True)

    t_train = timed(train_step, device)
    out = []
    for label, fn in [("OAR-G", lambda: oar_g_importance(model, batch, 1e-3, seeds, counts(None, micro))),
                      ("OAR-P (prefix cache)", lambda: oar_p_importance(model, batch, 0, counts(chunk, micro),
                                                                         prefix_cache=True)),
                      ("OAR-P span 4", lambda: oar_p_importance(model, batch, 0, counts(chunk, micro),
                                                                prefix_cache=True, mask_span=4))]:
        t = timed(fn, device)
        out.append({"method": label, "attribution_s": t, "train_fwd_bwd_s": t_train, "ratio": t / t_train})
    return out


def memory_point(args) -> dict:
    """One (reasoning length, path) point, run in this process: time and peak memory of OAR-P on one sequence."""
    device, dtype = args.device, getattr(torch, args.dtype)
    model = build_model(args.shape, device, dtype)
    inputs, batch = make_batch(1, args.prompt, args.point, args.answer, model.config.vocab_size, device)
    fn = {"ours": lambda: oar_p_importance(model, batch, 0, counts(args.chunk, 1), prefix_cache=True),
          "naive": lambda: naive_oar_p(model, inputs, 0)}[args.path]
    seconds, peak_mib = measure(fn, device)
    return {"reasoning": args.point, "path": args.path, "seconds": seconds, "peak_extra_mib": peak_mib}


def memory_table(args, lengths: list[int]) -> list[dict]:
    rows = []
    for n, path in progress([(n, p) for n in lengths for p in ("ours", "naive")],
                            desc="[attribution] memory points (length x path)", unit="point"):
        # the naive path materialises [R, L, V] logits: skip it where that alone would exceed ~4 GiB
        L = args.prompt + n + 2 + args.answer
        if path == "naive" and n * L * SHAPES[args.shape][5] * 4 > 4 * 2**30:
            rows.append({"reasoning": n, "path": path, "seconds": float("nan"), "peak_extra_mib": float("nan")})
            continue
        cmd = [sys.executable, "-m", "research.attribution", "--memory-point", str(n), "--path", path,
               "--device", args.device, "--dtype", args.dtype, "--shape", args.shape, "--prompt", str(args.prompt),
               "--answer", str(args.answer), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    print(" | ".join(f"{k:>22}" for k in keys))
    for r in rows:
        print(" | ".join(f"{v:>22.4g}" if isinstance(v, float) else f"{v!s:>22}" for v in r.values()))


def plot(mem_rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for path, style in (("ours", "o-"), ("naive", "s--")):
        pts = [r for r in mem_rows if r["path"] == path and r["seconds"] == r["seconds"]]
        axes[0].plot([r["reasoning"] for r in pts], [r["seconds"] for r in pts], style, label=path)
        axes[1].plot([r["reasoning"] for r in pts], [r["peak_extra_mib"] for r in pts], style, label=path)
    for ax, label in zip(axes, ("OAR-P time per sequence (s)", "OAR-P peak extra memory (MiB)")):
        ax.set_xlabel("reasoning tokens R")
        ax.set_title(label)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--shape", default=None, choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--answer", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out", default="outputs/benchmarks")
    ap.add_argument("--memory-point", type=int, dest="point", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="ours", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.shape = args.shape or ("qwen2.5-1.5b" if args.device == "cuda" else "cpu-small")
    if args.point is not None:
        print(json.dumps(memory_point(args)))
        return
    torch.set_num_threads(torch.get_num_threads())
    model = build_model(args.shape, args.device, getattr(torch, args.dtype))
    B, reasoning, micro = (2, 32, 2) if args.quick else (8, 128, 4)
    if args.device == "cuda" and not args.quick:
        B, reasoning, micro = 16, 512, 8
    lengths = [64, 128] if args.quick else [64, 128, 256, 512, 1024]
    print(f"# attribution benchmark — {date.today()} — {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, device={args.device}, dtype={args.dtype}, shape={args.shape}, "
          f"torch {torch.__version__}")
    print(f"# batch: B={B}, prompt={args.prompt}, reasoning={reasoning}, answer={args.answer}, chunk={args.chunk}, "
          f"micro={micro}")
    speed = speedup_table(model, args.device, B, args.prompt, reasoning, args.answer, args.chunk, micro)
    print_table("1. speed-up over the naive per-sample implementation", speed)
    ratio = train_step_ratio(model, args.device, B, args.prompt, reasoning, args.answer, args.chunk, micro)
    print_table("3. attribution time / one training forward+backward over the same tokens", ratio)
    del model
    mem = memory_table(args, lengths)
    print_table("2. OAR-P (one sequence) time and peak extra memory vs reasoning length", mem)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(mem, out / f"attribution_{args.device}.png")
    (out / f"attribution_{args.device}.json").write_text(json.dumps({"speedup": speed, "train_ratio": ratio,
                                                                       "memory": mem}, indent=1))
    print(f"\nwrote {out / f'attribution_{args.device}.png'} and .json")


if __name__ == "__main__":
    main()
