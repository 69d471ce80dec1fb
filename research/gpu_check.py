"""GPU figures in one command, on a bare machine: torch + transformers and this repository, no verl, vLLM or Ray.

At Qwen2.5-1.5B and Qwen2.5-7B shapes (random init from a ``Qwen2Config``, no downloads), bf16 weights, and response
lengths of 2k / 4k / 16k tokens, it measures, on the same tokens and the same model in one process per part:

* **attribution-<shape>**: the actor's training forward + backward (full response logits, fp32 log-softmax, gradient
  checkpointing, as verl's actor runs a micro-batch; no optimizer: a step's timing and activations do not need one)
  against OAR-G with K = 1 and K = 4 noise draws and exact OAR-P (prefix reuse). Exact OAR-P over every reasoning
  token would take hours at 16k tokens: three of its passes (first, middle, last) are run and its time extrapolated
  from the recomputed tokens of all passes (``oar_p_extrapolated`` says so); its peak is measured.
* **long-<shape>**: the segment and hierarchical OAR-P policies of :mod:`research.long_reasoning` against the
  training step (their times estimated from the measured time per recomputed token; the segment policy is also run in
  full at the first length). Segments follow sentence lengths of 8-64 tokens, drawn with a fixed seed (the bare
  machine has no Qwen2.5 tokenizer; the cost depends only on the layout).

Every figure of a part is a ratio to the training step of the same run. Peaks are ``torch.cuda.max_memory_allocated``
over the allocation before the call (weights, and the inputs); on CPU the resident-memory rise. Each part runs in its
own process under a time limit and writes ``parts/<part>.json``; a part whose JSON exists is skipped (resumable), and a
point that runs out of memory is recorded as such and the part goes on. The summary is ``gpu_check.json`` plus
``gpu_check.md`` (device, torch version, date, command), ready for docs/performance.md.

What it skips: Ulysses / tensor parallelism (one GPU), the optimizer state, the naive-baseline speed-up table of
:mod:`research.attribution` (the one-sequence reference at 7B and 16k tokens would run for hours).

usage:
    bash scripts/gpu_check.sh                              # CUDA, both shapes, 2k / 4k / 16k
    python -m research.gpu_check --device cpu --tiny     # the CI smoke run (seconds), verl absent
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from research import REPO, long_reasoning, scaling
from research.common import measure
from research.common import progress
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.methods.gradient import sequence_seeds
from research.common import oar_p_importance, oar_g_importance, fisher_importance

SHAPES = ("qwen2.5-1.5b", "qwen2.5-7b")
LENGTHS = (2048, 4096, 16384)
NOISE_SAMPLES = (1, 4)
SPLIT = "sentence:8:64"
SHARE = 0.1  # the hierarchical policy's refine share reported in the table (all of long_reasoning.SHARES are in JSON)


# ---------------------------------------------------------------------------------------------------------------------
# One part, in its own process
# ---------------------------------------------------------------------------------------------------------------------


def synthetic_segments(batch, length: int, spec: str) -> torch.Tensor:
    """(B, L) segment ids over each row's reasoning: consecutive segments of min..max tokens (``spec``
    split:min:max), lengths drawn with a fixed seed; -1 outside the reasoning."""
    _, lo, hi = long_reasoning.segmentation(spec)
    reasoning = batch.reasoning_mask.cpu()
    n = int(reasoning[0].sum())
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(lo, hi + 1, (n // lo + 1,), generator=g)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)[:n]
    segments = torch.full(reasoning.shape, -1, dtype=torch.long)
    segments[reasoning] = ids.repeat(reasoning.shape[0])
    return segments


def _release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def warm_up(model, rows: int, device: str) -> None:
    """One untimed training step, OAR-G and OAR-P pass at a short length: the first call on a device pays for the
    CUDA context, cuBLAS handles and kernel selection, which would otherwise land in the first measured figure."""
    length = 64
    batch = scaling.make_rows(rows, length, model.config.vocab_size, device)
    limits = PassLimits(rows * (scaling.PROMPT + length))
    for p in model.parameters():
        p.requires_grad_(True)
    scaling.train_step(model, batch)
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)
    oar_g_importance(model, batch, 1e-3, sequence_seeds(0, 0, torch.arange(rows)).to(device), limits,
                     checkpointing=True)
    oar_p_importance(model, scaling.sample_reasoning(batch, 3, rows)[0], 0, limits, prefix_cache=True)
    _release(device)


def attribution_point(model, length: int, rows: int, device: str) -> dict:
    """Training step vs OAR-G (each K of NOISE_SAMPLES) vs exact OAR-P (three passes, extrapolated) on the same
    rows and token budget (one micro-batch of ``rows`` sequences)."""
    batch = scaling.make_rows(rows, length, model.config.vocab_size, device)
    tokens = rows * (scaling.PROMPT + length)
    limits = PassLimits(tokens)
    point: dict = {"length": length, "rows": rows, "budget": tokens}
    for p in model.parameters():
        p.requires_grad_(True)
    point["train_seconds"], point["train_peak_mib"] = measure(lambda: scaling.train_step(model, batch), device)
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(False)
    seeds = sequence_seeds(0, 0, torch.arange(rows)).to(device)
    for k in NOISE_SAMPLES:
        s, peak = measure(lambda: oar_g_importance(model, batch, 1e-3, seeds, limits, checkpointing=True,
                                                   samples=k), device)
        point[f"oar_g_k{k}"] = {"seconds": s, "peak_mib": peak}
    s, peak = measure(lambda: fisher_importance(model, batch, 0, limits), device)  # the default fisher_outcomes
    point["fisher_k1"] = {"seconds": s, "peak_mib": peak}
    sampled, frac = scaling.sample_reasoning(batch, 3, rows)
    s, peak = measure(lambda: oar_p_importance(model, sampled, 0, limits, prefix_cache=True), device)
    point["oar_p_exact"] = {"seconds": s / frac, "peak_mib": peak, "measured_seconds": s, "sampled_fraction": frac,
                            "copies": int(batch.reasoning_mask.sum()), "extrapolated": True}
    for name in [f"oar_g_k{k}" for k in NOISE_SAMPLES] + ["fisher_k1", "oar_p_exact"]:
        e = point[name]
        e["vs_train_time"] = e["seconds"] / point["train_seconds"]
        e["vs_train_peak"] = e["peak_mib"] / max(point["train_peak_mib"], 1e-9)
    return point


def long_point(model, shape: str, length: int, rows: int, device: str, dtype: torch.dtype, validate: bool,
               log) -> dict:
    """The long-reasoning cost point (segment / hierarchical OAR-P against training) on the part's model."""
    return long_reasoning.cost_point(shape, length, [SPLIT], device, dtype, rows, long_reasoning.SHARES, validate,
                                     log, model=model, segments_of=synthetic_segments)


def run_part(kind: str, shape: str, lengths: list[int], rows: int, device: str, dtype: torch.dtype,
             partial: Path) -> dict:
    """Every length of one part on one model; each finished point is written to ``partial`` at once (a part killed
    by its time limit keeps what it measured)."""
    model = scaling.build_model(shape, device, dtype)
    warm_up(model, rows, device)
    result: dict = {"part": f"{kind}-{shape}", "shape": shape, "shape_values": scaling.SHAPES[shape], "points": []}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    for i, n in enumerate(progress(lengths, desc=f"{kind}-{shape}", unit="length")):
        start = time.perf_counter()
        try:
            if kind == "attribution":
                p = attribution_point(model, n, rows, device)
            else:
                p = long_point(model, shape, n, rows, device, dtype, validate=(i == 0), log=log)
        except torch.OutOfMemoryError as e:  # record and go on: the shorter lengths' figures stand
            model.zero_grad(set_to_none=True)
            p = {"length": n, "rows": rows, "error": f"out of memory: {str(e).splitlines()[0]}"}
        _release(device)
        p["wall_seconds"] = time.perf_counter() - start
        result["points"].append(p)
        partial.write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def meta(args, argv: list[str]) -> dict:
    import transformers

    info = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": args.device,
            "dtype": args.dtype, "rows": args.rows, "prompt": scaling.PROMPT, "machine": platform.node(),
            "weights": f"{args.dtype} weights, no autocast; fp32 log-softmax over the training step's logits",
            "command": "bash scripts/gpu_check.sh " + " ".join(argv)}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), device_memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda)
    else:
        info["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return info


def run_all(args, argv: list[str]) -> dict:
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    parts = [(kind, shape) for shape in args.shapes for kind in ("attribution", "long")]
    results, started = {}, time.perf_counter()
    for kind, shape in progress(parts, desc="gpu_check parts", unit="part"):
        name = f"{kind}-{shape}"
        done = out / "parts" / f"{name}.json"
        if done.exists():
            print(f"[gpu_check] {name}: done earlier, skipped ({done})", file=sys.stderr, flush=True)
            results[name] = json.loads(done.read_text())
            continue
        limit = min(args.part_limit_s, args.total_limit_s - (time.perf_counter() - started))
        if limit < 60:  # the run's total limit is spent: what is left runs on the next call (resumable)
            results[name] = {"part": name, "shape": shape, "points": [], "status": "not started (total limit)",
                             "skipped_lengths": list(args.lengths)}
            continue
        partial = out / "parts" / f"{name}.partial.json"
        cmd = [sys.executable, "-m", "research.gpu_check", "--part", kind, "--shapes", shape,
               "--lengths", ",".join(map(str, args.lengths)), "--device", args.device, "--dtype", args.dtype,
               "--rows", str(args.rows), "--partial", str(partial)]
        print(f"[gpu_check] {name}: lengths {args.lengths}, limit {limit:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=limit, stdout=subprocess.PIPE, text=True)
            status = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its {limit:.0f} s limit"
        res = json.loads(partial.read_text()) if partial.exists() else {"part": name, "shape": shape, "points": []}
        res.update(status=status, seconds=time.perf_counter() - t0)
        measured = {p["length"] for p in res["points"]}
        res["skipped_lengths"] = [n for n in args.lengths if n not in measured]
        results[name] = res
        if status == "done":
            done.write_text(json.dumps(res, indent=1))
        print(f"[gpu_check] {name}: {status} in {res['seconds']:.0f} s", file=sys.stderr, flush=True)
    summary = {"meta": {**meta(args, argv), "wall_seconds": time.perf_counter() - started}, "parts": results,
               "table": table_rows(results)}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_check.md").write_text(markdown(summary))
    return summary


def table_rows(results: dict) -> list[dict]:
    """One row per (shape, length): the training step's time and peak, and each method's ratios to them."""
    rows = []
    shapes = list(dict.fromkeys(r["shape"] for r in results.values()))
    for shape in shapes:
        att = {p["length"]: p for p in results.get(f"attribution-{shape}", {}).get("points", [])}
        lon = {p["length"]: p for p in results.get(f"long-{shape}", {}).get("points", [])}
        for n in sorted(set(att) | set(lon)):
            a, lp = att.get(n, {}), lon.get(n, {})
            row = {"shape": shape, "length": n, "errors": [x["error"] for x in (a, lp) if "error" in x]}
            if "train_seconds" in a:
                row.update(train_seconds=a["train_seconds"], train_peak_gib=a["train_peak_mib"] / 1024)
                for k in NOISE_SAMPLES:
                    e = a[f"oar_g_k{k}"]
                    row[f"oar_g_k{k}"] = (e["vs_train_time"], e["vs_train_peak"])
                for name in ("fisher_k1", "oar_p_exact"):
                    e = a[name]
                    row[name] = (e["vs_train_time"], e["vs_train_peak"])
            if "policies" in lp:
                pol = lp["policies"]
                row["segment_time"] = next(v["vs_train"] for k, v in pol.items() if k.startswith("segment"))
                row["hierarchical_time"] = pol[f"hierarchical {SHARE:g}"]["vs_train"]
                row["oar_p_peak_vs_train"] = lp["oar_p_peak_mib"] / max(lp["train_peak_mib"], 1e-9)
            rows.append(row)
    return rows


def markdown(summary: dict) -> str:
    m = summary["meta"]

    def pair(x):
        return f"{x[0]:.2f} / {x[1]:.2f}" if x else "–"

    def one(x):
        return f"{x:.1f}" if x is not None else "–"

    lines = [f"GPU check: {m['device_name']}, torch {m['torch']}, transformers {m['transformers']}, {m['date']}; "
             f"{m['weights']}; {m['rows']} row(s) of {m['prompt']} prompt tokens + the response per micro-batch. "
             f"Command: `{m['command']}`.", "",
             "Times and peaks are ratios to the training forward+backward on the same tokens (gradient "
             "checkpointing), from one run; exact OAR-P's time is extrapolated from three measured passes; segment "
             f"and hierarchical ({SHARE:g} refined) times are estimated from the measured time per recomputed token.",
             "",
             "| model | response tokens | train s | train peak GiB | OAR-G K=1 time / peak | OAR-G K=4 time / peak | "
             "fisher K=1 time / peak | OAR-P exact time (extrap.) / peak | OAR-P segment time | "
             "OAR-P hierarchical time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["table"]:
        lines.append(f"| {r['shape']} | {r['length']} | {one(r.get('train_seconds'))} | "
                     f"{one(r.get('train_peak_gib'))} | {pair(r.get('oar_g_k1'))} | {pair(r.get('oar_g_k4'))} | "
                     f"{pair(r.get('fisher_k1'))} | {pair(r.get('oar_p_exact'))} | {one(r.get('segment_time'))} | "
                     f"{one(r.get('hierarchical_time'))} |" + (f" {'; '.join(r['errors'])}" if r["errors"] else ""))
    skipped = [f"{name}: {p.get('status')} (skipped {p['skipped_lengths']})" for name, p in summary["parts"].items()
               if p.get("skipped_lengths")]
    if skipped:
        lines += ["", "Not measured: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model at 64 / 128 tokens (CI smoke run)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {list(scaling.SHAPES)} (default: {SHAPES})")
    ap.add_argument("--lengths", default=None, help=f"response lengths (default: {LENGTHS})")
    ap.add_argument("--rows", type=int, default=1, help="sequences per micro-batch (the training step's budget)")
    ap.add_argument("--part-limit-s", type=float, default=510.0, help="wall-clock limit of one part's process")
    ap.add_argument("--total-limit-s", type=float, default=1440.0,
                    help="wall-clock limit of the whole run; parts not started by then wait for the next call")
    ap.add_argument("--out", default=str(REPO / "outputs" / "gpu_check"))
    ap.add_argument("--part", default=None, choices=["attribution", "long"], help=argparse.SUPPRESS)
    ap.add_argument("--partial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",") if args.shapes else (["tiny"] if args.tiny else list(SHAPES))
    bad = [s for s in args.shapes if s not in scaling.SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; allowed: {list(scaling.SHAPES)}")
    args.lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
                    [64, 128] if args.tiny else list(LENGTHS))
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible to torch (use --device cpu --tiny for the smoke run)")
    if args.part:
        run_part(args.part, args.shapes[0], args.lengths, args.rows, args.device, getattr(torch, args.dtype),
                 Path(args.partial))
        return 0
    summary = run_all(args, argv)
    print(markdown(summary))
    failed = [name for name, p in summary["parts"].items() if p.get("status", "done") != "done"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
