"""The memory model that sizes ``recompute=auto`` against what verl's worker group measured on a GPU (the committed
H200 runs, docs/gpu_check.md): verl's update and old-log-prob pass as modelled, and the shared path's peaks under the
update's in the steps after the first since the pass's logits are counted (above it before)."""

import pytest

from oar_verl.core.backends.memory import ModelShape, PassKind, pass_bytes
from research import scaling, tables
from research.worker_report import steady_peak_ratio

RUNS = {"bf16": ("bf16", 2), "bf16_before": ("bf16", 2), "fp32_before": ("fp32", 4)}


def _model(run: str) -> tuple[dict, ModelShape, int]:
    point = tables._worker(run)
    layers, hidden, heads, kv, head_dim, inter, vocab, _ = scaling.SHAPES[point["shape"]]
    shape = ModelShape(layers, hidden, inter, heads, kv, head_dim, vocab, RUNS[run][1])
    grads = int(scaling._params(point["shape"])[0]) * 4  # FSDP2 keeps fp32 parameters, so fp32 gradients
    return point, shape, grads


@pytest.mark.parametrize("run", sorted(RUNS))
def test_update_and_log_prob_pass_as_modelled(run):
    point, shape, grads = _model(run)
    calls, budget = point["calls"], point["budget"]
    update = pass_bytes(PassKind.UPDATE, budget, shape, checkpointing=True) + grads
    assert 0.9 <= update / calls["update_actor"]["peak_bytes"] <= 1.1, update / calls["update_actor"]["peak_bytes"]
    # the pass's own memory beside a shared backward: never far below what it measured (recompute=auto's margin, 1.5,
    # covers the rest); the bare training step's fp32 copy of every logit is well above verl's update
    log_prob = pass_bytes(PassKind.LOG_PROB, budget, shape)
    assert log_prob / calls["compute_log_prob"]["peak_bytes"] >= 0.95
    assert pass_bytes(PassKind.TRAINING, budget, shape, checkpointing=True) + grads > 1.2 * update


@pytest.mark.parametrize("run", sorted(RUNS))
def test_shared_pass_peaks_against_the_update(run):
    point = tables._worker(run)
    calls = point["calls"]
    peaks = [steady_peak_ratio(calls[f"{m}-shared"], calls["update_actor"]) for m in ("conservative", "fisher")]
    if run.endswith("_before"):
        assert min(peaks) > 1.0, peaks  # the logits of the pass were not counted
    else:
        assert max(peaks) < 1.0 and point["checks"]["conservative-shared: peak <= update_actor's"]["ok"], peaks


def test_the_auto_recompute_table_is_the_cost_models_choice_today():
    """docs/scaling.md's `recompute=auto` table renders a committed file (so the docs render without torch); it must be
    what the product's rule picks now: rerun `python -m research.auto_recompute` when the cost model changes."""
    import json

    from research import auto_recompute

    kept = json.loads(auto_recompute.RESULTS.read_text())
    assert kept["rows"] == auto_recompute.rows(kept["gpu_gib"], kept["gpus"])
