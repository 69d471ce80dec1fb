"""Rows → attribution inputs (oar_verl.core.preprocess) → importance → advantages (oar_verl.core.pipeline): the one way
in that the verl worker, the OpenRLHF adapter and core-only users share, against the hand-rolled steps."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import (OARConfig, RowAttribution, attribute, module_backend, oar_advantages, prepare_attribution,
                           reshape, run_attribution)
from oar_verl.core.preprocess import pad_rows, row_fingerprints
from oar_verl.core.reshaping.reshape import attribution_rows, reshape_advantages
from oar_verl.quickstart.tokenizers import train_tiny_bpe


@pytest.fixture(scope="module")
def tok():
    return train_tiny_bpe(["What is 3 plus 4? 3 plus 4 is 7. The answer is 7.", "#### 12", "so the sum is 9"] * 50,
                          vocab_size=300)


def rows(tok, prompts, responses):
    p = [torch.tensor(tok.encode(t, add_special_tokens=False)) for t in prompts]
    r = [torch.tensor(tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]) for t in responses]
    return p, r


def test_pad_rows_and_fingerprints_ignore_padding():
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8])
    ids, mask = pad_rows([a, b], 0, left=True)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids_r, mask_r = pad_rows([a, b], 0, left=False)
    assert ids_r.tolist() == [[5, 6, 7], [8, 0, 0]]
    wide, wide_mask = pad_rows([a, b, torch.tensor([1, 2, 3, 4, 5])], 0, left=True)
    f1 = row_fingerprints(ids, mask, ids_r, mask_r)
    f2 = row_fingerprints(wide[:2], wide_mask[:2], ids_r, mask_r)
    assert torch.equal(f1, f2) and f1[0] != f1[1]


def test_response_target_layout_and_scores_map_back(tok, make_lm):
    cfg = OARConfig(mode="perturbation", probe="as_mean")
    p, r = rows(tok, ["What is 3 plus 4?", "Add."], ["3 plus 4 is 7. The answer is 7.", "so the sum is 9"])
    prepared = prepare_attribution(p, r, tok, cfg, global_step=0)
    assert prepared.response_lengths == [len(x) for x in r]
    assert prepared.spans.found.tolist() == [True, False]
    # the probe read the answer span where one was found, LT-Logits elsewhere
    assert prepared.answer_probe.tolist() == [True, False]
    model = make_lm(torch.float64, vocab=len(tok))
    importance = run_attribution(module_backend(model, cfg), prepared.batch, cfg,
                                 mask_token_id=prepared.mask_token_id).importance
    per_row = prepared.response_importance(importance)
    assert [len(x) for x in per_row] == prepared.response_lengths
    scores, reasoning = per_row[0], prepared.spans.reasoning_mask[0]
    n = len(scores)
    assert (scores[~reasoning[:n]] == 0).all() and (scores[reasoning[:n]] != 0).any()
    # the row without an answer span has no reasoning token to weight (docs/method.md §2) and no score
    assert not prepared.spans.reasoning_mask[1].any() and (per_row[1] == 0).all()


def test_reference_target_reports_what_the_probe_read(tok):
    """With target=reference the probe reads the ground truth after the conclusion text, whether or not the response
    has an answer span of its own: answer_probe says so (it once reported the response's own span instead)."""
    cfg = OARConfig(mode="gradient", probe="as_mean", target="reference", conclude_text="The answer is ")
    p, r = rows(tok, ["Add.", "Add."], ["so the sum is 9", "3 plus 4 is 7. The answer is 7."])
    prepared = prepare_attribution(p, r, tok, cfg, global_step=0, ground_truths=["9", "7"])
    assert prepared.spans.found.tolist() == [False, True]
    assert prepared.answer_probe.tolist() == [True, True]
    lt = prepare_attribution(p, r, tok, OARConfig(probe="lt_logits", target="reference"), 0, ground_truths=["9", "7"])
    assert lt.answer_probe.tolist() == [False, False]
    with pytest.raises(ValueError, match=r"algorithm\.oar\.target=reference needs a ground-truth answer"):
        prepare_attribution(p, r, tok, cfg, global_step=0, ground_truths=["9"])


def test_seeds_depend_on_content_and_step_not_on_batching(tok):
    cfg = OARConfig()
    p, r = rows(tok, ["What is 3 plus 4?", "Add.", "Add."], ["The answer is 7.", "so the sum is 9", "#### 12"])
    full = prepare_attribution(p, r, tok, cfg, global_step=4)
    alone = prepare_attribution(p[1:2], r[1:2], tok, cfg, global_step=4)
    assert full.seeds[1] == alone.seeds[0]
    assert not torch.equal(prepare_attribution(p, r, tok, cfg, global_step=5).seeds, full.seeds)


@pytest.mark.parametrize("target", ["response", "reference"])
def test_segments_follow_the_responses_reasoning(tok, target):
    """Segment-level OAR-P policies get the responses' reasoning segments in full-sequence coordinates (with
    target=reference too: the attributed reasoning is the response's, position by position); exact gets none."""
    from oar_verl.core.text.segments import reasoning_segments

    kw = {"target": target, "conclude_text": "The answer is "}
    truths = ["7", "9"] if target == "reference" else None
    p, r = rows(tok, ["What is 3 plus 4?", "Add."], ["3 plus 4 is 7. so the sum is 9. The answer is 7.",
                                                     "so the sum is 9. 3 plus 4 is 7. #### 7"])
    exact = prepare_attribution(p, r, tok, OARConfig(mode="perturbation", **kw), 0, ground_truths=truths)
    assert exact.batch.segments is None
    cfg = OARConfig(mode="perturbation", perturbation="hierarchical", segment_min_tokens=1, **kw)
    prepared = prepare_attribution(p, r, tok, cfg, 0, ground_truths=truths)
    seg = prepared.batch.segments
    P = prepared.batch.response_start
    assert seg.shape == prepared.batch.input_ids.shape
    assert ((seg >= 0) == prepared.batch.reasoning_mask).all()
    spans = prepared.spans
    ids = torch.nn.utils.rnn.pad_sequence(r, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in r], batch_first=True)
    want = reasoning_segments(ids, mask, spans.reasoning_mask, tok, "sentence", 1, cfg.segment_max_tokens)
    for b, n in enumerate(prepared.response_lengths):
        got = seg[b, P:P + n]
        assert torch.equal(got[got >= 0], want[b, :n][want[b, :n] >= 0])
        assert int(got.max()) >= 1  # the sentence rule split the reasoning


# ------------------------------------------------------------------------------------------- the one way in (pipeline)
PROMPTS = ["What is 3 plus 4?", "What is 3 plus 4?", "Add.", "Add.", "Add."]
ANSWERS = ["3 plus 4 is 7. The answer is 7.", "so the sum is 9", "#### 12", "3 plus 4 is 7. so the sum is 9. #### 9",
           "The answer is 7."]


def hand_rolled(model, p, r, tok, cfg, step, **kw):
    """prepare → run → per-row importance, as the worker and the adapter did it before the pipeline."""
    prepared = prepare_attribution(p, r, tok, cfg, step, **kw)
    result = run_attribution(module_backend(model, cfg), prepared.batch, cfg, mask_token_id=prepared.mask_token_id,
                             seeds=prepared.seeds)
    return prepared, result, prepared.response_importance(result.importance)


@pytest.mark.parametrize("mode,target", [("perturbation", "response"), ("gradient", "response"),
                                         ("gradient", "reference")])
def test_attribute_is_prepare_run_and_pad_bit_for_bit(tok, make_lm, mode, target):
    cfg = OARConfig(mode=mode, probe="as_mean", target=target, conclude_text="The answer is ")
    truths = ["7", "9", "12", "9", "7"] if target == "reference" else None
    p, r = rows(tok, PROMPTS, ANSWERS)
    model = make_lm(torch.float64, vocab=len(tok))
    prepared, result, per_row = hand_rolled(model, p, r, tok, cfg, 3, ground_truths=truths)
    att = attribute(model, p, r, tok, cfg, 3, ground_truths=truths)
    T = max(len(x) for x in r)
    assert att.importance.shape == (len(r), T) and att.importance.dtype == torch.float32
    assert att.lengths == [len(x) for x in r] and att.attributed.all()
    for i, n in enumerate(att.lengths):
        assert torch.equal(att.importance[i, :n], per_row[i]) and (att.importance[i, n:] == 0).all()
        assert torch.equal(att.reasoning_mask[i, :n], prepared.spans.reasoning_mask[i, :n].bool())
        assert torch.equal(att.answer_mask[i, :n], prepared.spans.answer_mask[i, :n].bool())
        assert not att.reasoning_mask[i, n:].any() and att.response_mask[i, :n].all()
    assert torch.equal(att.span_found, prepared.spans.found) and torch.equal(att.answer_probe, prepared.answer_probe)
    assert att.passes == result.passes and torch.equal(att.result.importance, result.importance)
    assert (att.copies is None) == (mode == "gradient")
    if att.copies is not None:
        assert torch.equal(att.copies, result.copies.cpu()) and torch.equal(att.refined, result.refined.cpu())
    assert att.importance.abs().sum() > 0  # not vacuous


def test_attribute_takes_a_backend_or_a_function_of_the_prepared_batch(tok, make_lm):
    cfg = OARConfig(mode="gradient", probe="as_mean")
    p, r = rows(tok, PROMPTS[:3], ANSWERS[:3])
    model = make_lm(torch.float64, vocab=len(tok))
    via_module = attribute(model, p, r, tok, cfg)
    backend = module_backend(model, cfg)
    via_backend = attribute(backend, p, r, tok, cfg)
    seen = []
    via_function = attribute(lambda prepared: seen.append(prepared.longest) or backend, p, r, tok, cfg)
    assert via_backend.backend is backend and via_function.backend is backend
    assert seen == [max(len(a) + len(b) for a, b in zip(p, r))]
    assert torch.equal(via_module.importance, via_backend.importance)
    assert torch.equal(via_module.importance, via_function.importance)
    with pytest.raises(TypeError, match="neither a Hugging Face module, an attribution backend"):
        attribute("model", p, r, tok, cfg)


def test_placed_rows_leave_the_others_unattributed(tok, make_lm):
    cfg = OARConfig(mode="perturbation", probe="as_mean")
    p, r = rows(tok, PROMPTS[:2], ANSWERS[:2])
    att = attribute(make_lm(torch.float64, vocab=len(tok)), p, r, tok, cfg)
    mask = torch.arange(att.importance.shape[1] + 3)[None, :] < torch.tensor([4, 9, 2, 30, 5])[:, None]
    big = att.placed(torch.tensor([3, 1]), mask)
    assert big.attributed.tolist() == [False, True, False, True, False]
    assert torch.equal(big.importance[3, :att.importance.shape[1]], att.importance[0])
    assert torch.equal(big.importance[1, :att.importance.shape[1]], att.importance[1])
    assert big.importance[[0, 2, 4]].abs().sum() == 0 and not big.reasoning_mask[[0, 2, 4]].any()
    assert big.copies[[0, 2, 4]].tolist() == [-1, -1, -1] and big.copies[3] == att.copies[0]
    assert big.span_found[3] == att.span_found[0] and torch.equal(big.response_mask, mask)
    with pytest.raises(ValueError, match="tokens wide"):
        att.placed(torch.tensor([0, 1]), mask[:, :2])
    # a second attribution (another mode, as mode=auto runs one per band) placed into the first: each row its own
    grad = attribute(make_lm(torch.float64, vocab=len(tok)), p[:1], r[:1], tok, OARConfig(mode="gradient",
                                                                                          probe="as_mean"))
    both = grad.placed(torch.tensor([0]), mask, into=big)
    assert both.attributed.tolist() == [True, True, False, True, False] and big.attributed[0].item() is False
    assert torch.equal(both.importance[0, :grad.importance.shape[1]], grad.importance[0])
    assert torch.equal(both.importance[[1, 3]], big.importance[[1, 3]])
    assert both.copies.tolist() == big.copies.tolist()  # the gradient method counts no copies; OAR-P's stay


def test_reshape_is_the_estimators_reshape_and_takes_sequence_advantages(tok, make_lm):
    cfg = OARConfig(mode="gradient", probe="as_mean")
    p, r = rows(tok, PROMPTS, ANSWERS)
    att = attribute(make_lm(torch.float64, vocab=len(tok)), p, r, tok, cfg)
    seq = torch.tensor([0.5, -0.5, 0.0, 1.0, -1.0])
    per_token = torch.where(att.response_mask, seq[:, None], 0.0)
    out = reshape(seq, att, cfg)
    want = reshape_advantages(per_token, att.importance, att.reasoning_mask, att.response_mask, cfg)
    assert torch.equal(out.advantages, want.advantages) and torch.equal(reshape(per_token, att, cfg).advantages,
                                                                          want.advantages)
    assert torch.equal(out.token_weights.weights, want.token_weights.weights)
    # row 2: zero advantage; row 1 (no answer span: docs/method.md §2) and row 4 ("The answer is 7.") have no
    # reasoning token to reshape and keep their advantage
    assert (out.advantages[2] == 0).all() and out.token_weights.reshaped.any(-1).tolist() == [True, False, False,
                                                                                              True, False]
    assert torch.equal(out.advantages[[1, 4]], per_token[[1, 4]])
    m = out.metrics()
    assert m["oar/span_found_frac"] == float(att.span_found.float().mean())
    assert m["oar/no_reasoning_seq_frac"] == 2 / 5
    with pytest.raises(ValueError, match=r"advantages: shape \(4,\)"):
        reshape(seq[:4], att, cfg)


def test_oar_advantages_attributes_only_the_rows_it_reshapes(tok, make_lm):
    """oar_advantages = attribution_rows → attribute those rows → reshape, bit for bit; zero-advantage rows are never
    attributed and keep A = 0; Σw = R on every reshaped row."""
    cfg = OARConfig(mode="perturbation", probe="as_mean")
    p, r = rows(tok, PROMPTS, ANSWERS)
    model = make_lm(torch.float64, vocab=len(tok))
    seq = torch.tensor([1.0, -1.0, 0.0, 0.7, 0.0])
    out = oar_advantages(model, p, r, seq, tok, cfg, step=2)
    mask = torch.arange(max(map(len, r)))[None, :] < torch.tensor([len(x) for x in r])[:, None]
    base = torch.where(mask, seq[:, None], 0.0)
    sel = attribution_rows(base, mask, cfg).nonzero().flatten()
    assert sel.tolist() == [0, 1, 3]
    att = attribute(model, [p[i] for i in sel], [r[i] for i in sel], tok, cfg, 2)
    importance = torch.zeros(mask.shape)
    importance[sel, :att.importance.shape[1]] = att.importance
    reasoning = torch.zeros(mask.shape, dtype=torch.bool)
    reasoning[sel, :att.importance.shape[1]] = att.reasoning_mask
    attributed = torch.zeros(len(r), dtype=torch.bool)
    attributed[sel] = True
    want = reshape_advantages(base, importance, reasoning, mask, cfg, attributed=attributed)
    assert torch.equal(out.advantages, want.advantages) and out.advantages.shape == mask.shape
    assert (out.advantages[[2, 4]] == 0).all()
    w, gated = out.token_weights.weights.double(), out.token_weights.reshaped
    # row 1 has no answer span: attributed (its advantage is not zero), left at w = 1 (docs/method.md §2)
    assert gated[[0, 3]].any(-1).all() and not gated[[1, 2, 4]].any()
    assert torch.equal(out.advantages[1], base[1]) and out.token_weights.no_reasoning.tolist() == [False, True, False,
                                                                                                 False, False]
    torch.testing.assert_close((w * gated).sum(-1), gated.sum(-1).double(), rtol=0, atol=1e-4)
    empty = oar_advantages(model, p, r, torch.zeros(len(r)), tok, cfg)
    assert (empty.advantages == 0).all() and (empty.token_weights.weights == mask.float()).all()
    assert isinstance(RowAttribution.unattributed(mask), RowAttribution)


def test_the_attributions_fidelity_is_the_step_metric_on_its_own_batch(tok, make_lm):
    """``RowAttribution.fidelity`` (what the verl worker and the OpenRLHF adapter call) is ``step_fidelity`` on the
    attribution's own backend, batch and importance under the run's mask operator, with the entropies placed at the
    response columns; NaN everywhere on a step not due."""
    from oar_verl.core.fidelity.controls import response_aligned
    from oar_verl.core.fidelity.step import step_fidelity
    from oar_verl.core.methods.mask_operator import mask_replacement

    cfg = OARConfig(mode="gradient", probe="as_mean", fidelity_every=2, fidelity_rows=3)
    p, r = rows(tok, [PROMPTS[i] for i in (0, 1, 3)], [ANSWERS[i] for i in (0, 1, 3)])  # row 1: no span, unmeasured
    model = make_lm(torch.float64, vocab=len(tok))
    att = attribute(model, p, r, tok, cfg, 4)
    entropies = [torch.linspace(0.1, 2.0, len(x), dtype=torch.float64) for x in r]
    got = att.fidelity(cfg, 4, min_gap=1e-9, entropies=entropies)
    batch = att.prepared.batch
    replacement = mask_replacement(att.backend, batch, cfg.mask, att.prepared.mask_token_id, att.prepared.seeds)
    want = step_fidelity(att.backend, batch, att.result.importance, cfg, 4, replacement=replacement, min_gap=1e-9,
                         entropy=response_aligned(entropies, batch))
    for k in want:
        if k != "seconds":
            torch.testing.assert_close(got[k], want[k], equal_nan=True)
    assert not got["aopc_entropy"].isnan().all()  # the entropy control ran
    # entropies as a function of the measured rows (an integration computing only those): the same numbers
    asked = []
    lazy = att.fidelity(cfg, 4, min_gap=1e-9, entropies=lambda idx: asked.append(idx) or [entropies[i] for i in idx])
    measured = batch.reasoning_mask.any(-1).nonzero().flatten()[:cfg.fidelity_rows].tolist()
    assert asked == [measured] and len(measured) >= 2  # once, with the measured rows only
    for k in want:
        if k != "seconds":
            torch.testing.assert_close(lazy[k], want[k], equal_nan=True)
    assert all(v.isnan().all() for v in att.fidelity(cfg, 3).values())  # not due


# ------------------------------------------------------------------------------- rows without an answer span (§2)
@pytest.mark.parametrize("mode", ["conservative", "gradient", "perturbation", "fisher", "path"])
def test_rows_without_an_answer_span_keep_grpo_weights(tok, make_lm, mode):
    """docs/method.md §2, "Rows without an answer span": an EOS-ended row without a span and a truncated one (no EOS)
    get no reasoning token and no score, keep w = 1 and their advantage bit for bit; a row with a span is prepared and
    scored exactly as before the rule (the layout the spans alone give: same batch, same scores, bit for bit); a
    zero-advantage row is untouched; Σw = R on the reshaped row."""
    from oar_verl.core.batch.layout import build_attribution_batch
    from oar_verl.core.methods.attribution import probe_kinds
    from oar_verl.core.text.spans import locate_answer_spans

    cfg = OARConfig(mode=mode, probe="as_mean")
    enc = (lambda t: tok.encode(t, add_special_tokens=False))
    p = [torch.tensor(enc(t)) for t in ("What is 3 plus 4?", "Add.", "Add.", "Add.")]
    r = [torch.tensor(enc(t)) for t in ("3 plus 4 is 7. The answer is 7.", "so the sum is 9", "so the sum is 9 plus",
                                        "3 plus 4 is 7. #### 7")]
    r = [r[0], torch.cat([r[1], torch.tensor([tok.eos_token_id])]), r[2], r[3]]  # rows 1 (EOS) and 2 (truncated)
    prepared = prepare_attribution(p, r, tok, cfg, 20)
    assert prepared.spans.found.tolist() == [True, False, False, True]
    assert prepared.batch.reasoning_mask.any(-1).tolist() == [True, False, False, True]
    # before the rule: the spans' own reasoning (every token but EOS on rows 1, 2) and LT-Logits at its last token
    ids, mask = (torch.nn.utils.rnn.pad_sequence(x, batch_first=True, padding_value=tok.pad_token_id or 0)
                 for x in (r, [torch.ones_like(x) for x in r]))
    spans = locate_answer_spans(ids, mask, tok, cfg.answer_patterns)
    assert spans.reasoning_mask[[1, 2]].any(-1).all()  # what the rule takes away
    old = build_attribution_batch(prepared.batch.input_ids[:, :prepared.batch.response_start],
                                  prepared.batch.attention_mask[:, :prepared.batch.response_start], ids, mask,
                                  spans.reasoning_mask, spans.answer_mask, probe_kinds(cfg, 20, len(r)))
    span_rows = torch.tensor([0, 3])
    for a, b in ((old.input_ids, prepared.batch.input_ids), (old.reasoning_mask, prepared.batch.reasoning_mask),
                 (old.probe.logit_weight, prepared.batch.probe.logit_weight)):
        assert torch.equal(a[span_rows], b[span_rows])
    model = make_lm(torch.float64, vocab=len(tok))
    att = attribute(model, p, r, tok, cfg, 20)
    was = run_attribution(module_backend(model, cfg), old, cfg, mask_token_id=prepared.mask_token_id,
                          seeds=prepared.seeds).importance[:, old.response_start:]
    assert torch.equal(att.importance[span_rows], was[span_rows].float())
    assert (att.importance[[1, 2]] == 0).all() and not att.reasoning_mask[[1, 2]].any()
    seq = torch.tensor([1.0, -1.0, -0.5, 0.0])
    out = reshape(seq, att, cfg)
    base = torch.where(att.response_mask, seq[:, None], 0.0)
    assert torch.equal(out.advantages[1:], base[1:])  # no span (EOS, truncated), zero advantage: untouched
    assert (out.token_weights.weights[1:3][att.response_mask[1:3]] == 1).all()
    w0 = out.token_weights.weights[0][att.reasoning_mask[0]].double()
    assert (w0 > 0).all() and abs(float(w0.sum()) - int(att.reasoning_mask[0].sum())) < 1e-4
    assert out.metrics()["oar/no_reasoning_seq_frac"] == 2 / 4


def test_reference_target_keeps_rows_without_a_span(tok):
    """With target=reference the probe reads the ground truth after the reasoning on every row, so a row without an
    answer span keeps its reasoning (every token but EOS) and is weighted as before."""
    cfg = OARConfig(mode="conservative", probe="as_mean", target="reference", conclude_text="The answer is ")
    p, r = rows(tok, ["Add.", "Add."], ["so the sum is 9", "3 plus 4 is 7. The answer is 7."])
    prepared = prepare_attribution(p, r, tok, cfg, 20, ground_truths=["9", "7"])
    assert prepared.spans.found.tolist() == [False, True]
    assert int(prepared.spans.reasoning_mask[0].sum()) == len(r[0]) - 1  # every token but EOS
    assert prepared.batch.reasoning_mask.any(-1).all() and prepared.answer_probe.all()


def test_openrlhf_reshape_leaves_rows_without_a_span_and_reports_them(tok, make_lm):
    """The OpenRLHF adapter's reshape (oar_verl.openrlhf.reshape, items read by attribute only) on replay-buffer items,
    one of them EOS-ended without an answer span: that item keeps its advantages bit for bit, the item with a span is
    reshaped, and the adapter's ``oar/*`` metrics count it as verl's step does."""
    from types import SimpleNamespace

    from oar_verl.openrlhf.reshape import reshape_replay_buffer

    cfg = OARConfig(mode="gradient", probe="as_mean")
    enc = (lambda t: tok.encode(t, add_special_tokens=False))
    items = []
    for prompt, response, adv in (("What is 3 plus 4?", "3 plus 4 is 7. The answer is 7.", 1.0),
                                  ("What is 3 plus 4?", "so the sum is 9", -1.0),
                                  ("Add.", "3 plus 4 is 7. #### 7", 0.0)):
        p, r = enc(prompt), enc(response) + [tok.eos_token_id]
        seq = torch.tensor(p + r)
        action = torch.tensor([False] * (len(p) - 1) + [True] * len(r))  # action_mask[j]: sequences[j + 1]
        items.append(SimpleNamespace(sequences=seq[None], action_mask=action[None],
                                     advantages=torch.where(action, adv, 0.0)[None], returns=None, labels=None))
    before = [it.advantages.clone() for it in items]
    res = reshape_replay_buffer(items, make_lm(torch.float64, vocab=len(tok)), tok, cfg, 20, max_tokens=None)
    assert torch.equal(items[1].advantages, before[1]) and torch.equal(items[2].advantages, before[2])
    assert not torch.equal(items[0].advantages, before[0])
    assert res.attributed.tolist() == [True, True, False] and res.weights.no_reasoning.tolist() == [False, True, False]
    assert res.metrics["oar/no_reasoning_seq_frac"] == 1 / 3 and res.metrics["oar/span_found_frac"] == 0.5
    assert res.metrics["oar/reshaped_seq_frac"] == 1 / 3
