"""GPU figures in one bounded command on a bare machine (torch + transformers + this repository; no verl, vLLM, Ray
or network): what OAR-G and fisher cost against the training step at the Qwen2.5-7B shape (random init, bf16), how
far bf16 moves their scores from fp32, then the lower-value figures (exact OAR-P, long-reasoning policies, 1.5B, 2k).

Parts run most valuable first, each in its own process under a hard time limit; a part starts only if its estimated
time (an H100 cost model, :func:`estimate`) fits what is left of ``--budget-s`` (480 s: one 15-minute GPU slot with
the machine's start-up). Parts that do not fit are reported "not run (budget), rerun to resume"; a second run skips
the parts already written (``parts/<part>.json``) and runs the rest. docs/gpu_check.md: the parts and the cost model.

usage:
    bash scripts/gpu_check.sh                          # CUDA, 480 s; run it again to resume what did not fit
    bash scripts/gpu_check.sh --plan                   # the plan and its estimates, nothing run
    bash scripts/gpu_check.sh --device cpu --tiny      # the CI smoke run (seconds), verl absent
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from research import REPO, common, long_reasoning, scaling, verl_worker
from research.common import (fisher_importance, measure, oar_g_importance, oar_p_importance, path_importance,
                             progress)
from research.worker_report import verl_worker_markdown
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.gradient import sequence_seeds

STARTED = float(os.environ.get("GPU_CHECK_STARTED") or time.time())  # the budget's clock: set by scripts/gpu_check.sh
SPLIT = "sentence:8:64"
SEGMENT_MEAN = 36  # mean tokens of a SPLIT segment (uniform 8..64): the long parts' validation cost
SHARE = 0.1  # the hierarchical policy's refine share reported in the table (all of long_reasoning.SHARES are in JSON)
HEADLINE_METHODS = ("oar_g_k1", "fisher_k1")
MORE_METHODS = ("oar_g_k4", "path_m2", "oar_p_exact")
LABELS = {"oar_g_k1": "OAR-G K=1", "fisher_k1": "fisher", "oar_g_k4": "OAR-G K=4", "path_m2": "path M=2",
          "oar_p_exact": "exact OAR-P"}
NOT_RUN = "not run (budget), rerun to resume"
NO_VERL = ("not run: needs verl and Ray (on a bare machine: `python -m devtools.gpu_bundle build` here, then carry "
           ".gpu_bundle/; scripts/gpu_check.sh installs it)")
RESERVE_S = 10.0  # kept back from the budget for the summary (device metadata, JSON, table)
TINY = {2048: 48, 4096: 64, 16384: 128}  # --tiny: the plan's lengths, scaled down


# ---------------------------------------------------------------------------------------------------------------------
# The plan and its cost model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One process: ``kind`` (attribution / precision / long) on one model ``shape`` at ``lengths``."""

    name: str
    kind: str
    shape: str
    lengths: tuple[int | str, ...]  # response lengths; verl-worker: its variants (FSDP2's parameter dtype)
    methods: tuple[str, ...] = ()
    headline: bool = False
    validate: int = 0  # long: the length at which the segment policy also runs in full (the plan's shortest)


VERL_WORKER = "verl-worker"
VARIANTS = ("bf16", "fp32")  # the verl-worker part's FSDP2 parameter dtypes: what users train with, then exactness


def plan(tiny: bool = False, verl: bool | None = None) -> list[Part]:
    """The parts, most valuable first: verl's worker group with OAR's worker through one training step (needs verl
    and Ray: the offline bundle on a bare machine), the 7B shape's OAR-G / fisher against training at 4k and 16k
    tokens, bf16 vs fp32 agreement, then OAR-G K=4 and exact OAR-P, the long-reasoning policies, the 1.5B shape and
    2k. ``verl`` (default: not ``tiny``) includes the verl-worker part; the tiny plan runs it only when named."""
    big, small = ("tiny", "tiny") if tiny else ("qwen2.5-7b", "qwen2.5-1.5b")
    n = TINY.get if tiny else int
    parts = [Part(VERL_WORKER, VERL_WORKER, "tiny" if tiny else small, VARIANTS, headline=True)] \
        if (not tiny if verl is None else verl) else []
    parts += [Part(f"attribution-{big}-{n(4096)}", "attribution", big, (n(4096),), HEADLINE_METHODS, True),
             Part(f"attribution-{big}-{n(16384)}", "attribution", big, (n(16384),), HEADLINE_METHODS, True),
             Part(f"precision-{small}-{n(2048)}", "precision", small, (n(2048),), HEADLINE_METHODS, True),
             Part(f"oar_p-{big}", "attribution", big, (n(4096), n(16384)), MORE_METHODS),
             Part(f"long-{big}", "long", big, (n(4096), n(16384)), validate=n(4096))]
    if not tiny:
        parts += [Part(f"attribution-{small}", "attribution", small, (2048, 4096, 16384),
                       HEADLINE_METHODS + MORE_METHODS),
                  Part(f"long-{small}", "long", small, (2048, 4096, 16384), validate=2048),
                  Part(f"attribution-{big}-2048", "attribution", big, (2048,), HEADLINE_METHODS + MORE_METHODS)]
    return parts


@dataclass(frozen=True)
class CostModel:
    """Seconds of a part on one device: process start-up (interpreter, torch / transformers imports, CUDA context),
    model build per 10^9 parameters, the warm-up calls, and FLOPs at an effective rate, times a safety factor."""

    bf16_flops: float
    fp32_flops: float
    process_s: float
    build_s_per_gparam: float
    warmup_s: float
    safety: float = 2.0
    label: str = ""
    verl_import_s: float = 20.0  # verl-worker: importing verl, Ray, tensordict, Hydra (16 s seen on an H100 machine)
    group_s: float = 40.0  # verl-worker, each variant: Ray up, the worker spawned, the model loaded and wrapped (36 s
    # for Qwen2.5-1.5B on an H200, 2026-11-26)


# H100 SXM (80 GB): 989 / 67 TFLOP/s dense bf16 / fp32 peak (TF32 off, torch's default). Calibrated on the first
# run on one (2026-11-26, docs/gpu_check.md): the parts took 0.35-0.5x the first model's estimates; the compute ran at
# about 400 TFLOP/s, start-up (interpreter, imports, CUDA context) about 10 s, a 7B build and warm-up about 8 s. The
# compute is planned at 1.5x (``safety``); a slower card scales the later parts' estimates up as it goes
H100 = CostModel(bf16_flops=400e12, fp32_flops=40e12, process_s=10.0, build_s_per_gparam=1.0, warmup_s=5.0,
                 safety=1.5, label="H100 cost model")
CPU = CostModel(bf16_flops=5e9, fp32_flops=20e9, process_s=10.0, build_s_per_gparam=60.0, warmup_s=1.0,
                label="CPU cost model (rough)", verl_import_s=15.0, group_s=25.0)


def _flops(shape: str, length: int, rows: int) -> dict[str, float]:
    """FLOPs of each measured call at one response length (``rows`` sequences of PROMPT + length tokens)."""
    layers, hidden, heads, _, head_dim, _, vocab, _ = scaling.SHAPES[shape]
    n = scaling.PROMPT + length
    tokens = rows * n
    body = scaling._params(shape)[1]
    causal = 2 * body + 2 * layers * heads * head_dim * n  # per token, forward: matmuls + attention over n / 2
    full = 2 * body + 4 * layers * heads * head_dim * n  # a recomputed suffix token attends to (almost) all n
    head = 2 * hidden * vocab
    oar_p = tokens * causal + rows * 1.5 * n * full  # clean pass + the 3 sampled copies' suffixes (~n, n/2, 0)
    reasoning = length - 2 - scaling.ANSWER
    return {"train": tokens * (4 * causal + 3 * head),  # forward, recomputation, backward (inputs and weights)
            "oar_g_k1": tokens * 4 * causal,  # teacher, student, recomputation, backward to the inputs
            "oar_g_k4": tokens * 16 * causal,  # each draw its own pass under the training step's budget
            "fisher_k1": tokens * 3 * causal,  # forward, recomputation, one backward to the inputs
            "path_m2": tokens * 7 * causal,  # teacher, then 2 points of forward, recomputation, backward (OAR-G K=2)
            "oar_p_exact": oar_p,
            "long": tokens * causal + oar_p,  # clean forward + the sampled exact passes
            # the segment policy in full (the first length): one copy per segment, recomputing its suffix
            "validate": tokens * causal + rows * reasoning ** 2 / (2 * SEGMENT_MEAN) * full}


def verl_worker_estimate(part: Part, variants, cost: CostModel, repeats: int = 1) -> float:
    """Planned seconds of the verl-worker part running ``variants``: its process, the verl / Ray imports, the model
    built and saved once, then per variant the group's start-up (the model loaded again) and the step's calls on every
    row (log-probs, OAR-G and fisher ``repeats`` times and once more for the warm-up of the log-probs, the segment
    policy twice, the update ``repeats`` times) plus the core's reference (OAR-G, fisher, segment), at the variant's
    rate (fp32 without TF32)."""
    from research import verl_worker

    vp = verl_worker.TINY if part.shape == "tiny" else verl_worker.GPU
    params = scaling._params(vp.shape)[0] / 1e9
    seconds = cost.process_s + cost.verl_import_s + 2 * cost.build_s_per_gparam * params
    for variant in variants:
        work = 0.0
        for n in vp.lengths(variant):
            f = _flops(vp.shape, n, 1)
            forward = f["oar_g_k1"] / 4
            # log-probs (twice more with fisher read from them), OAR-G, fisher and the update, repeats times
            work += (repeats + 1) * forward + repeats * (f["oar_g_k1"] + 2 * f["fisher_k1"] + f["train"])
            work += 3 * f["validate"] + f["oar_g_k1"] + f["fisher_k1"]  # the segment policy twice, the core's
        rate = cost.fp32_flops if variant == "fp32" else cost.bf16_flops
        seconds += cost.group_s + cost.build_s_per_gparam * params + cost.safety * work / rate
    return seconds


def estimate(part: Part, lengths, rows: int, cost: CostModel, repeats: int = 1) -> float:
    """Planned seconds of ``part`` measuring ``lengths`` (its own process, model build and warm-up included; an
    attribution part times each call ``repeats`` times)."""
    if part.kind == VERL_WORKER:
        return verl_worker_estimate(part, lengths, cost, repeats)
    params = scaling._params(part.shape)[0] / 1e9
    seconds = cost.process_s + cost.build_s_per_gparam * params + cost.warmup_s
    for n in lengths:
        f = _flops(part.shape, n, rows)
        if part.kind == "attribution":
            compute = repeats * (f["train"] + sum(f[m] for m in part.methods)) / cost.bf16_flops
        elif part.kind == "long":
            compute = (f["train"] + f["long"] + (f["validate"] if n == part.validate else 0)) / cost.bf16_flops
            seconds += 2.0  # the policies' layouts (segment tables, 20 random rankings per share) on the CPU
        else:  # precision: OAR-G and fisher in fp32, then in bf16 (each dtype's first calls unwarmed)
            work = f["oar_g_k1"] + f["fisher_k1"]
            compute = work / cost.fp32_flops + work / cost.bf16_flops
            seconds += cost.warmup_s
        seconds += cost.safety * compute
    return seconds


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


def _grads(model, on: bool) -> None:
    for p in model.parameters():
        p.requires_grad_(on)
    if not on:
        model.zero_grad(set_to_none=True)


def warm_up(model, rows: int, device: str) -> None:
    """One untimed training step, OAR-G, fisher and OAR-P pass at a short length: the first call on a device pays for
    the CUDA context, cuBLAS handles and kernel selection, which would otherwise land in the first measured figure."""
    batch = scaling.make_rows(rows, 64, model.config.vocab_size, device)
    limits = PassLimits(rows * (scaling.PROMPT + 64))
    _grads(model, True)
    scaling.train_step(model, batch)
    _grads(model, False)
    oar_g_importance(model, batch, 1e-3, sequence_seeds(0, 0, torch.arange(rows)).to(device), limits,
                     checkpointing=True)
    fisher_importance(model, batch, 0, limits)
    oar_p_importance(model, scaling.sample_reasoning(batch, 3, rows)[0], 0, limits, prefix_cache=True)
    _release(device)


def repeated(fn, device: str, repeats: int, before=None) -> tuple[float, float, list[float]]:
    """(median seconds, largest peak MiB, every time) of ``repeats`` calls of ``fn`` (``before()`` untimed ahead of
    each): one call's time on a GPU swings by tens of percent at these sizes, the median of a few does not."""
    runs = []
    for _ in range(max(1, repeats)):
        if before is not None:
            before()
        runs.append(measure(fn, device))
    return float(np.median([s for s, _ in runs])), max(p for _, p in runs), [s for s, _ in runs]


def attribution_point(model, length: int, rows: int, device: str, methods, repeats: int = 1) -> dict:
    """The training step against each of ``methods`` (OAR-G K=1 / K=4, fisher K=1, exact OAR-P: three passes,
    extrapolated) on the same rows and token budget (one micro-batch of ``rows`` sequences); each timed ``repeats``
    times, the median kept (every time in ``*_all``)."""
    batch = scaling.make_rows(rows, length, model.config.vocab_size, device)
    tokens = rows * (scaling.PROMPT + length)
    limits = PassLimits(tokens)
    point: dict = {"length": length, "rows": rows, "budget": tokens, "repeats": repeats}
    _grads(model, True)  # each training repeat starts without parameter gradients, as a fresh micro-step does
    point["train_seconds"], point["train_peak_mib"], point["train_seconds_all"] = repeated(
        lambda: scaling.train_step(model, batch), device, repeats, before=lambda: model.zero_grad(set_to_none=True))
    _grads(model, False)
    seeds = sequence_seeds(0, 0, torch.arange(rows)).to(device)
    for name in methods:
        if name.startswith("oar_g_k"):
            k = int(name[len("oar_g_k"):])
            s, peak, every = repeated(lambda: oar_g_importance(model, batch, 1e-3, seeds, limits, checkpointing=True,
                                                               samples=k), device, repeats)
            point[name] = {"seconds": s, "peak_mib": peak, "seconds_all": every}
        elif name == "fisher_k1":  # the default fisher_outcomes (1), no sketches
            s, peak, every = repeated(lambda: fisher_importance(model, batch, 0, limits), device, repeats)
            point[name] = {"seconds": s, "peak_mib": peak, "seconds_all": every}
        elif name == "path_m2":  # mode=path, 2 points, the default mask operator (mean)
            s, peak, every = repeated(lambda: path_importance(model, batch, limits, points=2), device,
                                     repeats)
            point[name] = {"seconds": s, "peak_mib": peak, "seconds_all": every}
        else:
            sampled, frac = scaling.sample_reasoning(batch, 3, rows)
            s, peak, every = repeated(lambda: oar_p_importance(model, sampled, 0, limits, prefix_cache=True), device,
                                     repeats)
            point[name] = {"seconds": s / frac, "peak_mib": peak, "measured_seconds": s, "sampled_fraction": frac,
                           "copies": int(batch.reasoning_mask.sum()), "extrapolated": True}
        e = point[name]
        e["vs_train_time"] = e["seconds"] / point["train_seconds"]
        e["vs_train_peak"] = e["peak_mib"] / max(point["train_peak_mib"], 1e-9)
        _release(device)
    return point


def precision_point(model, length: int, rows: int, device: str) -> dict:
    """OAR-G (K=1) and fisher scores of the same rows with the model in fp32, then rounded to bf16: per method, the
    mean over rows of Spearman's rho and of the top-20 % overlap between the two, and the relative L2 error of bf16."""
    batch = scaling.make_rows(rows, length, model.config.vocab_size, device)
    limits = PassLimits(rows * (scaling.PROMPT + length))
    seeds = sequence_seeds(0, 0, torch.arange(rows)).to(device)
    scores: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        s0 = time.perf_counter()
        scores[dtype] = {"oar_g_k1": oar_g_importance(model, batch, 1e-3, seeds, limits, checkpointing=True),
                         "fisher_k1": fisher_importance(model, batch, 0, limits)}
        scores[dtype]["seconds"] = time.perf_counter() - s0
    point: dict = {"length": length, "rows": rows, "fp32_seconds": scores[torch.float32].pop("seconds"),
                   "bf16_seconds": scores[torch.bfloat16].pop("seconds")}
    rng = np.random.default_rng(0)
    for name in HEADLINE_METHODS:
        ref = common.rows_of(scores[torch.float32][name], batch.reasoning_mask)
        low = common.rows_of(scores[torch.bfloat16][name], batch.reasoning_mask)
        point[name] = {
            "spearman": float(np.nanmean([common.spearman(a, b) for a, b in zip(low, ref)])),
            "top20_overlap": float(common.overlap_top_frac(low, ref, 0.2, rng).mean()),
            "rel_l2_error": float(np.mean([np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
                                           for a, b in zip(low, ref)]))}
    return point


def measured_points(result: dict, keys, measure, partial: Path, on_oom=lambda: None, **error_fields) -> dict:
    """``result`` with a point per key (a length, or a verl-worker variant): ``measure(key)`` each, a point that runs
    out of memory recorded as such (the others' figures stand; ``on_oom`` tidies up), every finished point written to
    ``partial`` at once (a part stopped by its time limit keeps what it measured)."""
    for key in keys:
        start = time.perf_counter()
        try:
            p = measure(key)
        except torch.OutOfMemoryError as e:
            on_oom()
            p = {"length": key, **error_fields, "error": f"out of memory: {str(e).splitlines()[0]}"}
        p["wall_seconds"] = time.perf_counter() - start
        result["points"].append(p)
        partial.write_text(json.dumps(result, indent=1))
    return result


def run_verl_worker(shape: str, variants: list[str], device: str, partial: Path, repeats: int) -> dict:
    """The verl-worker part: :func:`research.verl_worker.run_variant` for each variant, on one model built once (in
    the temp dir, kept for a resumed run)."""
    import tempfile

    if device == "cpu":  # verl's CPU platform, selected before verl is first imported (here and in the Ray workers)
        from oar_verl.quickstart.launcher import cpu_env

        os.environ.update(cpu_env())
    from research import verl_worker

    plan = replace(verl_worker.TINY if shape == "tiny" else verl_worker.GPU, repeats=repeats)
    # the model (3 GB at 1.5B) is kept out of --out (what a GPU slot sends back) and reused by a resumed run
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.gettempdir()) / f"oar-gpu-check-verl-worker-{shape}"
    work.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    return measured_points({"part": VERL_WORKER, "shape": shape, "points": []}, variants,
                           lambda variant: verl_worker.run_variant(plan, variant, device, work, log), partial)


def run_part(kind: str, shape: str, lengths: list, methods: list[str], validate_length: int, rows: int,
             device: str, dtype: torch.dtype, partial: Path, repeats: int = 1) -> dict:
    """Every length of one part on one model (:func:`measured_points`)."""
    if kind == VERL_WORKER:
        return run_verl_worker(shape, lengths, device, partial, repeats)
    model = scaling.build_model(shape, device, torch.float32 if kind == "precision" else dtype)
    if kind != "precision":  # precision compares scores, not times: no warm-up
        warm_up(model, rows, device)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    def measure(n: int) -> dict:
        try:
            if kind == "attribution":
                return attribution_point(model, n, rows, device, methods, repeats)
            if kind == "precision":
                return precision_point(model, n, rows, device)
            return long_reasoning.cost_point(shape, n, [SPLIT], device, dtype, rows, long_reasoning.SHARES,
                                             n == validate_length, log, model=model, segments_of=synthetic_segments)
        finally:
            _release(device)

    result: dict = {"part": kind, "shape": shape, "shape_values": scaling.SHAPES[shape], "points": []}
    return measured_points(result, progress(lengths, desc=f"{kind}-{shape}", unit="length"), measure, partial,
                           on_oom=lambda: _grads(model, False), rows=rows)


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def _verl_importable() -> bool:
    try:
        return importlib.util.find_spec("verl") is not None
    except ImportError:  # an import hook that refuses it
        return False


def _point_key(text: str) -> int | str:
    """A point of a part: a response length, or a verl-worker variant (``bf16``, ``fp32``)."""
    return int(text) if text.isdigit() else text


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def todo_lengths(part: Part, out: Path) -> tuple[list[dict], list[int]]:
    """(the points of ``part`` written by earlier runs, its lengths still to measure)."""
    points: dict = {}
    for f in (f"{part.name}.json", f"{part.name}.partial.json"):  # a finished part's, then a stopped run's
        for p in (_read(out / "parts" / f) or {}).get("points", []):
            if p["length"] in part.lengths:
                points.setdefault(p["length"], p)
    return [points[n] for n in part.lengths if n in points], [n for n in part.lengths if n not in points]


def print_plan(parts: list[Part], estimates: dict[str, float], budget: float, cost: CostModel, out: Path) -> None:
    print(f"gpu_check plan ({cost.label}; budget {budget:.0f} s, {RESERVE_S:.0f} s kept for the summary):")
    total = time.time() - STARTED
    for i, part in enumerate(parts, 1):
        what = {"attribution": "train vs " + ", ".join(LABELS[m] for m in part.methods),
                "precision": "bf16 vs fp32 scores of OAR-G K=1, fisher",
                "long": "train vs segment / hierarchical OAR-P",
                VERL_WORKER: "verl's FSDP2 worker group: one OAR step, = core"}[part.kind]
        todo = todo_lengths(part, out)[1]
        if todo:
            total += estimates[part.name]
            note = f"~{estimates[part.name]:4.0f} s  (cumulative {total:4.0f} s)" + (
                "" if total <= budget - RESERVE_S else "  past the budget: next run")
        else:
            note = "done earlier"
        print(f"  {i}. {part.name:29s} {','.join(map(str, part.lengths)):16s} {what:50s} {note}")
    print(flush=True)


def run_all(args, argv: list[str], parts: list[Part], cost: CostModel) -> dict:
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    results, scale, ran_est, ran_took = {}, 1.0, 0.0, 0.0
    for order, part in enumerate(parts, 1):
        name = part.name
        done, partial = out / "parts" / f"{name}.json", out / "parts" / f"{name}.partial.json"
        running = out / "parts" / f"{name}.running.json"  # the part process's own points, merged in afterwards
        earlier = _read(done) or _read(partial) or {}
        points, todo = todo_lengths(part, out)
        res = {"part": name, "kind": part.kind, "shape": part.shape, "order": order, "headline": part.headline,
               "lengths": list(part.lengths), "points": points}
        if not todo:
            results[name] = {**earlier, **res, "status": "done", "this_run": "done earlier, skipped"}
            say(f"{name}: done earlier, skipped ({done})")
            continue
        est = args.estimates.get(name, estimate(part, todo, args.rows, cost, args.repeats)) * scale
        left = args.budget_s - (time.time() - STARTED) - RESERVE_S
        res.update(estimate_s=est, time_left_s=left, todo_lengths=todo)
        if part.kind == VERL_WORKER and not _verl_importable():
            results[name] = {**res, "status": NO_VERL, "this_run": NO_VERL}
            say(f"{name}: {NO_VERL}")
            continue
        if est > left:
            results[name] = {**res, "status": NOT_RUN, "this_run": NOT_RUN}
            say(f"{name}: {NOT_RUN} (estimated {est:.0f} s, {max(left, 0):.0f} s left)")
            continue
        limit = min(args.part_limit_s, max(3 * est, est + 120), left)  # its own hard limit, never past the budget
        cmd = [sys.executable, "-m", "research.gpu_check", "--part", part.kind, "--shapes", part.shape,
               "--lengths", ",".join(map(str, todo)), "--methods", ",".join(part.methods) or "-",
               "--validate-length", str(part.validate), "--device", args.device, "--dtype", args.dtype,
               "--rows", str(args.rows), "--repeats", str(args.repeats), "--partial", str(running)]
        say(f"{name}: lengths {todo}, estimated {est:.0f} s, hard limit {limit:.0f} s ({left:.0f} s left)")
        running.unlink(missing_ok=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=limit, stdout=subprocess.PIPE, text=True)
            status = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its {limit:.0f} s limit"
        took = time.time() - t0
        new = (_read(running) or {}).get("points", [])
        res["points"] = sorted(points + new, key=lambda p: part.lengths.index(p["length"]))
        missing = [n for n in part.lengths if n not in {p["length"] for p in res["points"]}]
        if status == "done" and missing:
            status = f"failed (no point for {missing})"
        res.update(status=status, this_run=status, seconds=took, skipped_lengths=missing)
        results[name] = res
        (done if status == "done" else partial).write_text(json.dumps(res, indent=1))
        running.unlink(missing_ok=True)
        if status == "done":  # what the finished parts took against their estimates scales the rest (never down)
            partial.unlink(missing_ok=True)
            ran_est, ran_took = ran_est + est / scale, ran_took + took
            scale = max(1.0, ran_took / ran_est)
        say(f"{name}: {status} in {took:.0f} s (estimated {est:.0f} s)"
            + (f"; later estimates x{scale:.2f}" if scale > 1 else ""))
    summary = {"meta": {**meta(args, argv), "wall_seconds": time.time() - STARTED, "budget_s": args.budget_s,
                        "cost_model": cost.label},
               "plan": [p.name for p in parts], "parts": results, "table": table_rows(results),
               "precision": precision_rows(results), "verl_worker": verl_worker_rows(results)}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_check.md").write_text(markdown(summary))
    return summary


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


def table_rows(results: dict) -> list[dict]:
    """One row per (shape, length), in plan order: the training step's time and peak (from the first part that
    measured it) and each method's (time, peak) ratios to the training step of its own part."""
    rows: dict = {}
    for res in results.values():
        if res["kind"] in ("precision", VERL_WORKER):
            continue
        for p in res["points"]:
            row = rows.setdefault((res["shape"], p["length"]), {"shape": res["shape"], "length": p["length"],
                                                                "errors": []})
            if "error" in p:
                row["errors"].append(f"{res['part']}: {p['error']}")
            if "train_seconds" in p and "train_seconds" not in row:
                row.update(train_seconds=p["train_seconds"], train_peak_gib=p["train_peak_mib"] / 1024)
            for name in HEADLINE_METHODS + MORE_METHODS:
                if name in p:
                    row[name] = (p[name]["vs_train_time"], p[name]["vs_train_peak"])
            if "policies" in p:
                pol = p["policies"]
                row["segment_time"] = next(v["vs_train"] for k, v in pol.items() if k.startswith("segment"))
                row["hierarchical_time"] = pol[f"hierarchical {SHARE:g}"]["vs_train"]
                row["oar_p_peak_vs_train"] = p["oar_p_peak_mib"] / max(p["train_peak_mib"], 1e-9)
    shapes = list(dict.fromkeys(r["shape"] for r in results.values()))
    return sorted(rows.values(), key=lambda r: (shapes.index(r["shape"]), r["length"]))


def verl_worker_rows(results: dict) -> list[dict]:
    """One row per verl-worker variant measured: its calls (time and peak ratios, host syncs), agreement with the
    core and its checks."""
    res = results.get(VERL_WORKER)
    return [] if res is None else list(res["points"])


def failed_checks(summary: dict) -> list[str]:
    """The verl-worker checks that failed, as "variant: check (value)"."""
    return [f"{p['length']}: {k} ({c['value']})" for p in summary.get("verl_worker", []) if "checks" in p
            for k, c in p["checks"].items() if not c["ok"]]


def precision_rows(results: dict) -> list[dict]:
    return [{"shape": res["shape"], "length": p["length"], "method": m, **p[m]}
            for res in results.values() if res["kind"] == "precision"
            for p in res["points"] if "error" not in p for m in HEADLINE_METHODS]


def markdown(summary: dict) -> str:
    m = summary["meta"]

    def pair(x):
        return f"{x[0]:.2f} / {x[1]:.2f}" if x else "–"

    def one(x, f=".1f"):
        return format(x, f) if x is not None else "–"

    table = summary["table"]
    lines = [f"GPU check: {m['device_name']}, torch {m['torch']}, transformers {m['transformers']}, {m['date']}; "
             f"{m['weights']}; {m['rows']} row(s) of {m['prompt']} prompt tokens + the response per micro-batch; "
             f"{m['wall_seconds']:.0f} s of a {m['budget_s']:.0f} s budget. Command: `{m['command']}`.", ""]
    rows = [r for r in table if "oar_g_k1" in r or "fisher_k1" in r or r["errors"]]
    if rows:
        lines += ["Times and peaks are ratios to the training forward+backward on the same tokens (gradient "
                  "checkpointing), measured in the same process.", "",
                  "| model | response tokens | train s | train peak GiB | OAR-G K=1 time / peak | fisher K=1 time / peak |",
                  "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['length']} | {one(r.get('train_seconds'))} | {one(r.get('train_peak_gib'))} | "
              f"{pair(r.get('oar_g_k1'))} | {pair(r.get('fisher_k1'))} |" + (" " + "; ".join(r["errors"])
                                                                              if r["errors"] else "")
              for r in rows]
    if summary["precision"]:
        lines += ["", "bf16 against fp32 scores, same model (fp32 weights rounded to bf16) and rows:", "",
                  "| model | response tokens | method | Spearman | top-20 % overlap | relative L2 error |",
                  "|---|---:|---|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['length']} | {r['method']} | {r['spearman']:.3f} | "
                  f"{r['top20_overlap']:.3f} | {r['rel_l2_error']:.3g} |" for r in summary["precision"]]
    lines += verl_worker_markdown(summary.get("verl_worker", []))
    more = [r for r in table if any(k in r for k in MORE_METHODS + ("segment_time",))]
    if more:
        lines += ["", "Exact OAR-P's time is extrapolated from three measured passes; segment and hierarchical "
                  f"({SHARE:g} refined) times are estimated from the measured time per recomputed token.", "",
                  "| model | response tokens | OAR-G K=4 time / peak | path M=2 time / peak | OAR-P exact time "
                  "(extrap.) / peak | OAR-P segment time | OAR-P hierarchical time |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['length']} | {pair(r.get('oar_g_k4'))} | {pair(r.get('path_m2'))} | "
                  f"{pair(r.get('oar_p_exact'))} | {one(r.get('segment_time'))} | {one(r.get('hierarchical_time'))} |"
                  for r in more]
    lines += ["", "| part | this run | estimated s | took s |", "|---|---|---:|---:|"]
    lines += [f"| {p['part']} | {p['this_run']} | {one(p.get('estimate_s'), '.0f')} | {one(p.get('seconds'), '.0f')} |"
              for p in summary["parts"].values()]
    later = [name for name, p in summary["parts"].items() if p["status"] != "done"]
    if later:
        lines += ["", f"Not measured yet: {', '.join(later)}. Run the same command again to resume (parts already "
                      "written are skipped)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="the plan on a 2-layer model at 48-128 tokens (CI smoke run)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall-clock budget of the run from the script's start; a part starts only if its estimate "
                         "fits what is left, the rest waits for the next run")
    ap.add_argument("--part-limit-s", type=float, default=300.0, help="hard limit of any one part's process")
    ap.add_argument("--plan", action="store_true", help="print the plan with its estimated seconds and stop")
    ap.add_argument("--parts", default=None, help="comma list of part names to keep (default: the whole plan)")
    ap.add_argument("--shapes", default=None, help="keep the parts on these shapes (comma list)")
    ap.add_argument("--lengths", default=None, help="keep these response lengths (comma list)")
    ap.add_argument("--rows", type=int, default=1, help="sequences per micro-batch (the training step's budget)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed calls of each measured step, the median kept (default: 3 on CUDA, 1 on CPU)")
    ap.add_argument("--estimate", action="append", default=[], metavar="PART=SECONDS",
                    help="replace a part's estimated seconds (a part known to run longer on this card)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "gpu_check"))
    ap.add_argument("--part", default=None, choices=["attribution", "precision", "long", VERL_WORKER],
                    help=argparse.SUPPRESS)
    ap.add_argument("--methods", default="-", help=argparse.SUPPRESS)
    ap.add_argument("--validate-length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--partial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.device == "cuda" else 1
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.part:
        run_part(args.part, args.shapes, [_point_key(x) for x in args.lengths.split(",")],
                 [m for m in args.methods.split(",") if m != "-"], args.validate_length, args.rows, args.device,
                 getattr(torch, args.dtype), Path(args.partial), args.repeats)
        return 0
    parts = plan(args.tiny, verl=True if args.parts and VERL_WORKER in args.parts.split(",") else None)
    if args.parts:
        keep = args.parts.split(",")
        bad = [k for k in keep if k not in {p.name for p in parts}]
        if bad:
            ap.error(f"--parts: unknown {bad}; the plan has {[p.name for p in parts]}")
        parts = [p for p in parts if p.name in keep]
    if args.shapes:
        parts = [p for p in parts if p.shape in args.shapes.split(",")]
    if args.lengths:
        keep_n = {_point_key(x) for x in args.lengths.split(",")}
        parts = [replace(p, lengths=tuple(n for n in p.lengths if n in keep_n)) for p in parts
                 if keep_n & set(p.lengths)]
    if not parts:
        ap.error("no part of the plan is left after --parts / --shapes / --lengths")
    try:
        args.estimates = {k: float(v) for k, v in (e.split("=", 1) for e in args.estimate)}
    except ValueError:
        ap.error("--estimate takes PART=SECONDS")
    cost = H100 if args.device == "cuda" else CPU
    out = Path(args.out)
    print_plan(parts, {p.name: args.estimates.get(p.name, estimate(p, todo_lengths(p, out)[1] or p.lengths,
                                                                   args.rows, cost, args.repeats)) for p in parts},
               args.budget_s, cost, out)
    if args.plan:
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible to torch (use --device cpu --tiny for the smoke run)")
    summary = run_all(args, argv, parts, cost)
    print(markdown(summary))
    failed = [name for name, p in summary["parts"].items() if p["status"] not in ("done", NOT_RUN, NO_VERL)]
    for check in failed_checks(summary):
        print(f"[gpu_check] verl-worker check failed: {check}", file=sys.stderr)
    return 1 if failed or failed_checks(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
