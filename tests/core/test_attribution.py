"""OAR-P and OAR-G fast paths against a naive per-sequence, per-position reference written plainly here."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig, response_importance
from oar_verl.core.gradient import sequence_seeds
from oar_verl.core.layout import build_attribution_batch
from oar_verl.core.perturbation import oar_p_importance
from oar_verl.core.gradient import oar_g_importance
from oar_verl.core.probes import AS_JOINT, AS_MEAN, LT_LOGITS

MASK = 0


# ----------------------------------------------------------------------------------------------- naive reference
def _unpadded(prompts, prompt_mask, responses, response_mask, reasoning, answer, b):
    """One row without padding: ids, and reasoning / answer positions in its own coordinates."""
    p = prompts[b][prompt_mask[b].bool()]
    r = responses[b][response_mask[b].bool()]
    ids = torch.cat([p, r])
    n_r = int(response_mask[b].sum())
    reas = [len(p) + i for i in range(n_r) if reasoning[b, i]]
    ans = [len(p) + i for i in range(n_r) if answer[b, i]]
    return ids, reas, ans


def _naive_probe(logits, ids, kind, reas, ans):
    """(kind, value): ('dist', logp (V,)) or ('joint', phi) from full logits (L, V) of one unpadded row."""
    if kind == LT_LOGITS or not ans:
        pos = ans[0] - 1 if ans else (reas[-1] if reas else len(ids) - 1)
        return "dist", torch.log_softmax(logits[pos].double(), -1)
    if kind == AS_MEAN:
        z = sum(logits[a - 1].double() for a in ans) / len(ans)
        return "dist", torch.log_softmax(z, -1)
    phi = sum(torch.log_softmax(logits[a - 1].double(), -1)[ids[a]] for a in ans) / len(ans)
    return "joint", phi


def _naive_shift(clean, pert):
    if clean[0] == "joint":
        return clean[1] - pert[1]
    lp, lq = clean[1], pert[1]
    return (lp.exp() * (lp - lq)).sum()


def naive_oar_p(model, rows, kind):
    B, T = rows[2].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        ids, reas, ans = _unpadded(*rows, b)
        n_p = int(rows[1][b].sum())
        with torch.no_grad():
            clean = _naive_probe(model(ids[None]).logits[0], ids, kind, reas, ans)
            for t in reas:
                masked = ids.clone()
                masked[t] = MASK
                pert = _naive_probe(model(masked[None]).logits[0], masked, kind, reas, ans)
                out[b, t - n_p] = _naive_shift(clean, pert)
    return out


def naive_oar_g(model, rows, kind, sigma, seeds):
    B, T = rows[2].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    emb_layer = model.get_input_embeddings()
    for b in range(B):
        ids, reas, ans = _unpadded(*rows, b)
        n_p = int(rows[1][b].sum())
        if not reas:
            continue
        with torch.no_grad():
            clean = _naive_probe(model(ids[None]).logits[0], ids, kind, reas, ans)
            emb = emb_layer(ids[None])
        gen = torch.Generator().manual_seed(int(seeds[b]))
        delta = torch.randn(len(reas), emb.shape[-1], generator=gen, dtype=torch.float32) * sigma
        noisy = emb.clone()
        noisy[0, reas] += delta.to(emb.dtype)
        noisy.requires_grad_(True)
        student = _naive_probe(model(inputs_embeds=noisy).logits[0], ids, kind, reas, ans)
        (g,) = torch.autograd.grad(_naive_shift(clean, student), noisy)
        for t in reas:
            out[b, t - n_p] = (g[0, t] * emb[0, t]).sum().abs()
    return out


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_oar_p_matches_naive(lm64, make_batch, kind, chunk):
    rows = make_batch(B=4, P=5, T=9, seed=kind * 10 + chunk)
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = oar_p_importance(lm64, batch, MASK, chunk_size=chunk, micro_batch_size=3)[:, batch.response_start:]
    ref = naive_oar_p(lm64, rows, kind)
    assert (fast[~rows[4]] == 0).all()
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0  # the comparison is not vacuous


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_oar_p_prefix_cache_matches_naive(lm64, make_batch, kind, chunk):
    rows = make_batch(B=4, P=5, T=9, seed=kind * 10 + chunk + 1)
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = oar_p_importance(lm64, batch, MASK, chunk_size=chunk, prefix_cache=True)[:, batch.response_start:]
    ref = naive_oar_p(lm64, rows, kind)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0


def naive_block_oar_p(model, rows, kind, span):
    """Mask `span` consecutive reasoning tokens at once; each token of the block gets the block's score."""
    B, T = rows[2].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        ids, reas, ans = _unpadded(*rows, b)
        n_p = int(rows[1][b].sum())
        with torch.no_grad():
            clean = _naive_probe(model(ids[None]).logits[0], ids, kind, reas, ans)
            for k in range(0, len(reas), span):
                block = reas[k: k + span]
                masked = ids.clone()
                masked[block] = MASK
                score = _naive_shift(clean, _naive_probe(model(masked[None]).logits[0], masked, kind, reas, ans))
                for t in block:
                    out[b, t - n_p] = score
    return out


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("span", [2, 3])
def test_oar_p_mask_span_matches_naive(lm64, make_batch, prefix_cache, span):
    rows = make_batch(B=4, P=4, T=10, seed=span)
    batch = build_attribution_batch(*rows, torch.full((4,), AS_MEAN))
    fast = oar_p_importance(lm64, batch, MASK, chunk_size=3, prefix_cache=prefix_cache, mask_span=span)
    torch.testing.assert_close(fast[:, batch.response_start:].double(), naive_block_oar_p(lm64, rows, AS_MEAN, span),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_num_forwards_counts_every_forward(lm64, make_batch, prefix_cache):
    from oar_verl.core.perturbation import num_forwards

    rows = make_batch(B=3, P=3, T=7, seed=9)
    batch = build_attribution_batch(*rows, torch.full((3,), LT_LOGITS))
    calls = []
    h = lm64.register_forward_hook(lambda *a: calls.append(1))
    try:
        for span in (1, 2):
            calls.clear()
            oar_p_importance(lm64, batch, MASK, chunk_size=2, micro_batch_size=2, prefix_cache=prefix_cache,
                             mask_span=span)
            assert len(calls) == num_forwards(batch, 2, 2, prefix_cache, span)
    finally:
        h.remove()


@pytest.mark.parametrize("kind", [LT_LOGITS, AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("micro", [1, 3])
def test_oar_g_matches_naive(lm64, make_batch, kind, micro):
    rows = make_batch(B=4, P=5, T=9, seed=100 + kind)
    seeds = sequence_seeds(7, 3, torch.arange(4))
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = oar_g_importance(lm64, batch, 1e-3, seeds, micro_batch_size=micro)[:, batch.response_start:]
    ref = naive_oar_g(lm64, rows, kind, 1e-3, seeds)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-12)
    assert ref.abs().sum() > 0


def test_oar_g_leaves_no_parameter_gradient_and_keeps_flags(make_lm, make_batch):
    model = make_lm(torch.float32, seed=1)
    model.lm_head.weight.requires_grad_(True)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rows = make_batch(B=3, P=4, T=6, seed=3)
    batch = build_attribution_batch(*rows, torch.full((3,), AS_MEAN))
    oar_g_importance(model, batch, 1e-3, torch.arange(3), micro_batch_size=2)
    assert all(p.grad is None for p in model.parameters())
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_oar_g_seeded_noise_is_reproducible_and_batch_independent(lm64, make_batch):
    rows = make_batch(B=5, P=4, T=8, seed=11)
    seeds = sequence_seeds(0, 5, torch.arange(5) * 13)
    batch = build_attribution_batch(*rows, torch.full((5,), LT_LOGITS))
    a = oar_g_importance(lm64, batch, 1e-3, seeds, micro_batch_size=5)
    b = oar_g_importance(lm64, batch, 1e-3, seeds, micro_batch_size=2)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-14)
    # a row attributed alone gets the same scores as inside the batch
    one = [r[2:3] for r in rows]
    alone = oar_g_importance(lm64, build_attribution_batch(*one, torch.full((1,), LT_LOGITS)), 1e-3, seeds[2:3])
    torch.testing.assert_close(alone[:, batch.response_start:], a[2:3, batch.response_start:], rtol=1e-6, atol=1e-14)
    c = oar_g_importance(lm64, batch, 1e-3, seeds + 1, micro_batch_size=5)
    assert not torch.allclose(a, c, rtol=1e-2, atol=0.0)  # other seeds, other noise


def test_oar_p_batch_composition_invariance(lm64, make_batch):
    rows = make_batch(B=5, P=6, T=8, seed=21)
    kinds = torch.full((5,), AS_MEAN)
    full = oar_p_importance(lm64, build_attribution_batch(*rows, kinds), MASK, chunk_size=5)
    for b in range(5):
        one = [r[b: b + 1] for r in rows]
        alone = oar_p_importance(lm64, build_attribution_batch(*one, kinds[:1]), MASK, chunk_size=3)
        torch.testing.assert_close(alone, full[b: b + 1], rtol=1e-6, atol=1e-12)


def test_float32_model_close_to_float64(lm32, lm64, make_batch):
    rows = make_batch(B=3, P=4, T=8, seed=5)
    cfg = OARConfig(mode="perturbation", chunk_size=4, probe="as_mean")
    a = response_importance(lm32, *rows, cfg, mask_token_id=MASK)
    b = response_importance(lm64, *rows, cfg, mask_token_id=MASK)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_response_without_reasoning_or_span(lm64):
    """Empty and one-token responses, a row with no answer span: no crash, zero importance where nothing to score."""
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [3, 4, 5]])
    prompt_mask = (prompts != 0).long()
    responses = torch.tensor([[0, 0, 0], [11, 0, 0], [12, 13, 14]])
    response_mask = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 1]])
    reasoning = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0]]).bool()
    answer = torch.zeros(3, 3, dtype=torch.bool)
    for mode in ("perturbation", "gradient"):
        cfg = OARConfig(mode=mode, probe="as_mean")
        imp = response_importance(lm64, prompts, prompt_mask, responses, response_mask, reasoning, answer, cfg,
                                  mask_token_id=MASK, seeds=torch.arange(3))
        assert imp.shape == (3, 3)
        assert torch.isfinite(imp).all()
        assert (imp[0] == 0).all() and (imp[:, 2] == 0).all()
        assert (imp[2, :2] != 0).any()


def test_nan_logits_propagate_to_a_defined_fallback(make_lm, make_batch):
    """NaN weights give NaN importance, which the gating turns into uniform weights (tested in test_gating)."""
    model = make_lm(torch.float32, seed=2)
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")  # tied: poisons embedding row 3 and logit 3
    rows = make_batch(B=2, P=3, T=5, seed=1)
    cfg = OARConfig(mode="perturbation", probe="lt_logits")
    imp = response_importance(model, *rows, cfg, mask_token_id=MASK)
    assert not torch.isfinite(imp[rows[4]]).all()


def test_pad_to_forwards_runs_extra_forwards(lm64, make_batch):
    rows = make_batch(B=2, P=3, T=4, seed=2)
    batch = build_attribution_batch(*rows, torch.full((2,), LT_LOGITS))
    calls = []
    h = lm64.register_forward_hook(lambda *a: calls.append(1))
    try:
        from oar_verl.core.perturbation import num_forwards
        n = num_forwards(batch, chunk_size=3, micro_batch_size=8)
        oar_p_importance(lm64, batch, MASK, chunk_size=3, micro_batch_size=8)
        assert len(calls) == n
        calls.clear()
        oar_p_importance(lm64, batch, MASK, chunk_size=3, micro_batch_size=8, pad_to_forwards=n + 4)
        assert len(calls) == n + 4
        calls.clear()
        oar_g_importance(lm64, batch, 1e-3, torch.arange(2), micro_batch_size=1, pad_to_rounds=5)
        assert len(calls) == 10  # clean + noisy forward per round
    finally:
        h.remove()


def test_missing_mask_token_and_seeds_are_clear_errors(lm64, make_batch):
    rows = make_batch(B=2, P=3, T=4, seed=4)
    with pytest.raises(ValueError, match="OAR-P needs a mask token: set algorithm.oar.mask_token_id"):
        response_importance(lm64, *rows, OARConfig(mode="perturbation"), mask_token_id=None)
    with pytest.raises(ValueError, match="OAR-G needs per-sequence noise seeds"):
        response_importance(lm64, *rows, OARConfig(mode="gradient"), seeds=None)
