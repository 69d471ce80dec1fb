"""Rows → attribution inputs (oar_verl.core.preprocess): the function the verl worker and the tests share."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig, module_backend, prepare_attribution, run_attribution
from oar_verl.core.preprocess import pad_rows, row_fingerprints
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
    for scores, reasoning in zip(per_row, prepared.spans.reasoning_mask):
        n = len(scores)
        assert (scores[~reasoning[:n]] == 0).all() and (scores[reasoning[:n]] != 0).any()


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
                                                     "so the sum is 9. 3 plus 4 is 7."])
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
