"""Row selection and assembly (oar_verl.integration.rows): which rows go to the workers, and how they come back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.integration.rows import BatchRows, assemble, select_rows


def bools(*xs):
    return torch.tensor(xs, dtype=torch.bool)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_none_wanted_selects_nothing(dp):
    assert select_rows(torch.zeros(16, dtype=torch.bool), torch.ones(16, dtype=torch.bool), dp).numel() == 0


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_all_wanted_selects_all(dp):
    assert select_rows(torch.ones(16, dtype=torch.bool), torch.ones(16, dtype=torch.bool), dp).tolist() == list(
        range(16))


@pytest.mark.parametrize("dp,expect", [(2, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), (8, [0, 1, 2, 3, 4, 5, 6, 7])])
def test_top_up_takes_other_eligible_rows_first(dp, expect):
    wanted = bools(1, 0, 1, 1, 0, 0, 0, 0)
    assert select_rows(wanted, torch.ones(8, dtype=torch.bool), dp).tolist() == expect


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_too_few_eligible_rows_top_up_with_padding_rows(dp):
    """verl's V1 trainer pads the batch with synthetic rows: they fill the selection only when real rows run out."""
    wanted = bools(1, 0, 0, 0, 0, 0, 0, 0)
    eligible = bools(1, 1, 0, 0, 0, 0, 0, 0)  # 2 real rows, 6 padding rows
    sel = select_rows(wanted, eligible, dp)
    assert len(sel) == dp and sel[0] == 0 and 1 in sel.tolist()
    assert sel.tolist() == sorted(set(sel.tolist()))  # no duplicates while rows remain
    # a wanted padding row is never selected for its own sake
    assert select_rows(bools(0, 0, 1, 0), bools(1, 1, 0, 0), 2).numel() == 0


def test_fewer_rows_than_ranks_repeats_a_row():
    sel = select_rows(bools(1, 0, 0), bools(1, 1, 1), 4)
    assert len(sel) == 4 and set(sel.tolist()) == {0, 1, 2}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=24), st.sampled_from([1, 2, 4, 8]))
def test_selection_invariants(flags, dp):
    wanted = torch.tensor([w for w, _ in flags])
    eligible = torch.tensor([e for _, e in flags])
    sel = select_rows(wanted, eligible, dp)
    need = (wanted & eligible).nonzero().squeeze(1).tolist()
    if not need:
        assert sel.numel() == 0
        return
    assert len(sel) % dp == 0 and set(need) <= set(sel.tolist())
    assert sel.tolist() == sorted(sel.tolist())
    assert len(sel) < len(need) + dp  # the top-up is the smallest possible


def test_assemble_scatters_worker_rows_into_the_batch():
    B, T = 4, 5
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    scores = torch.zeros(B, T)
    batch = BatchRows(response_mask, scores, np.array(["a", "a", "b", "b"], dtype=object), torch.ones(B, dtype=bool))
    rows = torch.tensor([1, 2])
    out = {"token_importance": torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 0.0, 0.0, 0.0]]),
           "oar_reasoning_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]).float(),
           "oar_answer_mask": torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]).float(),
           "oar_span_found": torch.tensor([1.0, 0.0]), "oar_answer_probe": torch.tensor([1.0, 0.0])}
    base = (torch.ones(B, T), torch.ones(B, T))
    att = assemble(out, rows, batch, base)
    est = att.estimator_inputs
    assert est.attributed.tolist() == [False, True, True, False]
    assert est.token_importance[1].tolist() == [1, 2, 3, 4, 5] and est.token_importance[0].abs().sum() == 0
    assert est.reasoning_mask[2].tolist() == [True, True, False, False, False]
    assert att.answer[1].tolist() == [False, False, False, True, False]
    assert att.found.tolist() == [False, True, False, False]
    assert att.answer_probe.tolist() == [False, True, False, False]
    assert est.base_advantages is base[0] and est.token_level_rewards is scores
    assert att.fidelity == {}  # no fidelity fields came back
    nan = float("nan")
    fid = {"oar_fidelity_aopc": torch.tensor([0.5, nan]), "oar_fidelity_seconds": torch.tensor([2.0, 2.0])}
    att = assemble({**out, **fid}, rows, batch, base)
    assert set(att.fidelity) == {"aopc", "seconds"} and att.fidelity["aopc"][0] == 0.5
    # nothing attributed: all zeros, no base handed on when there is none
    empty = assemble(None, torch.zeros(0, dtype=torch.long), batch, None)
    assert not empty.estimator_inputs.attributed.any() and empty.estimator_inputs.base_advantages is None
