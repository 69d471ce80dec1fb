"""``mode=path`` through verl's real Megatron engine on CPU, against the core on the Hugging Face model of the same
checkpoint (the machinery of test_megatron_attribution.py): the hook's displacement α(e_mask − e_t) computed from each
rank's own clean embedding rows, on one rank, under tensor parallelism with sequence parallelism (each rank moves its
own chunk of the sequence) and across two pipeline stages (the first stage's scores broadcast)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _sibling(name: str):
    """The module of a test file beside this one (the suite imports test files by path: --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_engine = _sibling("test_megatron_attribution")
FP32_RTOL, PYTHON, VENV = _engine.FP32_RTOL, _engine.PYTHON, _engine.VENV
check_side_effects, reference, run_layout = _engine.check_side_effects, _engine.reference, _engine.run_layout
assets = _engine.assets  # the shared fixture: the tiny checkpoint and its verl-layout batch

pytestmark = [
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no Megatron environment at {VENV}: build it with "
                                                    "`bash scripts/setup_mcore_env.sh`"),
    pytest.mark.megatron,
    pytest.mark.slow,
]

CASES = [  # micro-batch sizes that do not divide the draw-row counts (4 rows × M points): filler rows exercised
    {"name": "path_mean", "oar": {"mode": "path", "probe": "as_mean", "path_points": 2, "micro_batch_size": 3,
                                  "mask": "mean"}},
    {"name": "path_joint", "oar": {"mode": "path", "probe": "as_joint", "path_points": 3, "mask": "pad"}},
    {"name": "path_lt", "oar": {"mode": "path", "probe": "lt_logits", "path_points": 1, "micro_batch_size": 5,
                                "mask": "zero"}},
]


def compare(assets, ranks, label):
    """The collecting ranks' importance equals the core's (clamped path scores, 0 off the reasoning tokens)."""
    checked = 0
    for res in ranks:
        if not res["src"]:
            continue
        rows = res["rows"].tolist()
        for case in CASES:
            got = res["cases"][case["name"]]
            ref, batch = reference(assets, rows, case)
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert int((ref[batch.reasoning_mask] > 0).sum()) > 8, "too few positive scores: vacuous comparison"
            assert bool((got[~batch.reasoning_mask] == 0).all()) and bool((got >= 0).all())
            rel = float((got - ref).abs().max() / ref.abs().max())
            print(f"[{label}] {case['name']}: max|diff| ÷ max|ref| = {rel:.2e}")
            assert rel < FP32_RTOL, f"{label}/{case['name']}: {rel:.3g} of max|ref|"
            checked += 1
    assert checked == len(CASES)


def test_path_tp1_pp1(assets):
    ranks = run_layout(assets, "path_tp1pp1", cases=CASES)
    compare(assets, ranks, "path TP=1 PP=1 fp32")
    check_side_effects(ranks)


def test_path_tp2_sequence_parallel(assets):
    ranks = run_layout(assets, "path_tp2sp", nproc=2, tp=2, sp=True, cases=CASES)
    assert all(r["checks"]["embedding_chunked"] for r in ranks)  # the embedding really output [s/2, b, h] chunks
    compare(assets, ranks, "path TP=2 SP fp32")
    check_side_effects(ranks)


def test_path_pp2(assets):
    ranks = run_layout(assets, "path_pp2", nproc=2, pp=2, cases=CASES)
    compare(assets, ranks, "path PP=2 fp32")
    check_side_effects(ranks)
