"""Token budgets (oar_verl.core.backends.budget): packing invariants, budget-invariant scores, the memory guard, and OAR-G
under gradient checkpointing with eval numerics."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.core.backends import budget
from oar_verl.core.backends.budget import AttributionMemoryError, PassLimits, pack_copies, pack_rows, row_spans
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.methods.perturbation import masked_copies
from oar_verl.core.batch.probes import ProbeKind
from oar_helpers import run_p, run_g, count_p, count_g

MASK = 0


def spans_of(batch):
    start, end = row_spans(batch.attention_mask)
    return start.tolist(), end.tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 80), st.one_of(st.none(), st.integers(1, 4)))
def test_pack_rows_invariants(make_batch, seed, tokens, rows_cap):
    rows = make_batch(B=7, P=5, T=9, seed=seed)
    batch = build_attribution_batch(*rows, torch.full((7,), int(ProbeKind.AS_MEAN)))
    start, end = spans_of(batch)
    packs = pack_rows(batch.attention_mask, PassLimits(tokens, rows=rows_cap), PassKind.FORWARD)
    flat = sorted(i for p in packs for i in p.tolist())
    assert flat == [b for b in range(7) if end[b] > start[b]]  # every row once
    for p in packs:
        idx = p.tolist()
        window = max(end[i] for i in idx) - min(start[i] for i in idx)
        assert len(idx) == 1 or len(idx) * window <= tokens  # within budget unless alone
        assert rows_cap is None or len(idx) <= rows_cap


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 60), st.one_of(st.none(), st.integers(1, 5)), st.integers(1, 3))
def test_pack_copies_invariants(make_batch, seed, tokens, copies_cap, span):
    rows = make_batch(B=5, P=4, T=10, seed=seed)
    batch = build_attribution_batch(*rows, torch.full((5,), int(ProbeKind.AS_MEAN)))
    src, _, _ = masked_copies(batch.reasoning_mask, span)
    start, end = spans_of(batch)
    packs = pack_copies(src, batch.attention_mask, PassLimits(tokens, copies=copies_cap), PassKind.FORWARD)
    assert [i for s, e in packs for i in range(s, e)] == list(range(len(src)))  # in order, each copy once
    for s, e in packs:
        idx = src[s:e].tolist()
        window = max(end[i] for i in idx) - min(start[i] for i in idx)
        assert e - s == 1 or (e - s) * window <= tokens
        assert copies_cap is None or e - s <= copies_cap


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("kind", [ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT])
def test_oar_p_is_budget_invariant_and_counts_its_rounds(lm64, make_batch, prefix_cache, kind):
    rows = make_batch(B=4, P=5, T=9, seed=int(kind) + 3)
    batch = build_attribution_batch(*rows, torch.full((4,), int(kind)))
    ref = run_p(lm64, batch, MASK, PassLimits(10**6), prefix_cache=prefix_cache)
    calls = []
    h = lm64.register_forward_hook(lambda *a: calls.append(1))
    try:
        for tokens in (1, 7, 15, 40):  # 1: every pass holds one row or one copy, each over the budget
            calls.clear()
            limits = PassLimits(tokens)
            got = run_p(lm64, batch, MASK, limits, prefix_cache=prefix_cache)
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
            assert len(calls) == count_p(batch, limits, prefix_cache)
    finally:
        h.remove()
    assert ref.abs().sum() > 0


def test_oar_g_is_budget_invariant_and_counts_its_rounds(lm64, make_batch):
    rows = make_batch(B=5, P=4, T=8, seed=12)
    batch = build_attribution_batch(*rows, torch.full((5,), int(ProbeKind.AS_MEAN)))
    seeds = sequence_seeds(1, 2, torch.arange(5))
    ref = run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6))
    for tokens in (1, 9, 20):
        limits = PassLimits(tokens)
        torch.testing.assert_close(run_g(lm64, batch, 1e-3, seeds, limits), ref, rtol=1e-7, atol=1e-14)
        assert count_g(batch, limits) == len(pack_rows(batch.attention_mask, limits, PassKind.INPUT_GRADIENT))
    assert count_g(batch, PassLimits(1)) == 5  # one row per round


def test_a_sequence_over_the_budget_runs_alone_and_is_logged_once(lm64, make_batch, caplog, monkeypatch):
    monkeypatch.setattr(budget, "_warned_alone", False)
    rows = make_batch(B=3, P=4, T=8, seed=2)
    batch = build_attribution_batch(*rows, torch.full((3,), int(ProbeKind.AS_MEAN)))
    with caplog.at_level(logging.WARNING, logger="oar_verl"):
        packs = pack_rows(batch.attention_mask, PassLimits(2, key="algorithm.oar.max_token_len_per_gpu"),
                          PassKind.FORWARD)
        pack_rows(batch.attention_mask, PassLimits(2), PassKind.FORWARD)
    assert all(len(p) == 1 for p in packs) and len(packs) == 3
    logged = [r.getMessage() for r in caplog.records if "attributed alone" in r.getMessage()]
    assert len(logged) == 1 and "algorithm.oar.max_token_len_per_gpu=2" in logged[0]


def test_memory_guard_splits_passes_and_names_the_key_when_one_row_cannot_fit(lm64, make_batch):
    rows = make_batch(B=6, P=4, T=8, seed=5)
    batch = build_attribution_batch(*rows, torch.full((6,), int(ProbeKind.AS_MEAN)))
    seen = []

    def fits(kind, n_rows, window):  # a device that holds two rows per pass
        seen.append(kind)
        return n_rows <= 2

    packs = pack_rows(batch.attention_mask, PassLimits(10**6, fits=fits), PassKind.INPUT_GRADIENT)
    assert max(len(p) for p in packs) == 2 and set(seen) == {PassKind.INPUT_GRADIENT}
    seeds = torch.arange(6)
    torch.testing.assert_close(run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6, fits=fits)),
                               run_g(lm64, batch, 1e-3, seeds, PassLimits(10**6)), rtol=1e-7, atol=1e-14)
    with pytest.raises(AttributionMemoryError, match=r"algorithm\.oar\.max_token_len_per_gpu=4096"):
        pack_rows(batch.attention_mask, PassLimits(4096, fits=lambda k, r, w: False), PassKind.FORWARD)
    with pytest.raises(AttributionMemoryError, match="does not fit"):
        run_p(lm64, batch, MASK, PassLimits(4096, fits=lambda k, r, w: k != PassKind.FORWARD_CACHED))


class SavedBytes:
    """Bytes autograd saves for backward while active (what activation memory is made of)."""

    def __enter__(self):
        self.total = 0

        def pack(t):
            self.total += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def dropout_qwen2(dropout: float):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, attention_dropout=dropout, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
    return model


def test_oar_g_checkpointing_keeps_eval_numerics_and_saves_less(make_batch):
    """Checkpointed OAR-G gives the same scores (no dropout although the layers' flags are raised, even with attention
    dropout 0.5 configured), saves a fraction of the activations, and restores every flag."""
    model = dropout_qwen2(0.5)
    rows = make_batch(B=3, P=4, T=10, seed=7)
    batch = build_attribution_batch(*rows, torch.full((3,), int(ProbeKind.AS_MEAN)))
    seeds = torch.arange(3) + 11
    flags = {n: m.training for n, m in model.named_modules()}
    with SavedBytes() as plain:
        a = run_g(model, batch, 1e-3, seeds, PassLimits(10**6))
    with SavedBytes() as ckpt:
        b = run_g(model, batch, 1e-3, seeds, PassLimits(10**6), checkpointing=True)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)
    assert torch.isfinite(a).all() and a.abs().sum() > 0
    assert ckpt.total < 0.5 * plain.total, (ckpt.total, plain.total)
    assert flags == {n: m.training for n, m in model.named_modules()}
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_checkpointing_follows_a_model_that_enabled_it(make_batch):
    model = dropout_qwen2(0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    rows = make_batch(B=2, P=3, T=7, seed=8)
    batch = build_attribution_batch(*rows, torch.full((2,), int(ProbeKind.LT_LOGITS)))
    attention = model.model.layers[0].self_attn
    calls = []
    h = attention.register_forward_hook(lambda *a: calls.append(1))
    try:
        run_g(model, batch, 1e-3, torch.arange(2), PassLimits(10**6), checkpointing=True)
    finally:
        h.remove()
    assert len(calls) == 3  # teacher, student, and the student's recomputation in the backward
    assert model.model.layers[0].gradient_checkpointing and not model.model.layers[0].training


def test_cost_model_orders_the_passes_and_the_guard_is_off_without_an_accelerator(lm64):
    from oar_verl.core.backends.memory import ModelShape, PassKind, memory_guard, model_shape, pass_bytes

    shape = ModelShape(28, 3584, 18944, 28, 4, 128, 152064, 2)  # Qwen2.5-7B, bf16
    n = 16384
    train = pass_bytes(PassKind.TRAINING, n, shape, checkpointing=True)
    g_ckpt = pass_bytes(PassKind.INPUT_GRADIENT, n, shape, checkpointing=True, logit_positions=8)
    g_full = pass_bytes(PassKind.INPUT_GRADIENT, n, shape, checkpointing=False, logit_positions=8)
    p = pass_bytes(PassKind.FORWARD_CACHED, n, shape)
    assert p < g_ckpt < train < g_full  # without checkpointing OAR-G would out-grow the training step
    assert pass_bytes(PassKind.FORWARD, 2 * n, shape) == 2 * pass_bytes(PassKind.FORWARD, n, shape)
    assert model_shape(lm64).layers == 2 and model_shape(lm64).dtype_bytes == 8
    assert memory_guard(torch.device("cpu"), shape) is None
