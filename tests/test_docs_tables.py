"""Every generated figure in the docs equals what its committed results file renders (issue #57 item 1)."""

from __future__ import annotations

import pytest

from research import tables


def test_every_generated_piece_matches_its_results_file():
    stale = []
    for doc in tables.DOCS:
        _, changed = tables.render(doc.read_text(), str(doc))
        stale += [f"{doc.name}: {name}" for name in changed]
    assert not stale, f"stale generated pieces (run `{tables.COMMAND}`): {stale}"


def test_a_changed_figure_is_caught_and_an_unknown_piece_named():
    doc = "<!-- gen:no_span_rows -->\n| edited |\n<!-- /gen:no_span_rows -->"
    new, changed = tables.render(doc)
    assert changed == ["no_span_rows"] and "−0.24 [−0.59, +0.19]" in new
    assert tables.render(new)[1] == []
    with pytest.raises(KeyError, match="unknown generated piece 'nope'"):
        tables.render("<!-- gen:nope -->x<!-- /gen:nope -->", "README.md")


def test_holm_adjustment():
    from research.learning_protocol import holm

    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


@pytest.mark.parametrize("study", sorted(tables.ATTENTION_RULE_STUDIES))
def test_the_attention_rule_comparison_ran_on_its_fidelity_studys_rows(study):
    """The rule comparison reran the default beside AttnLRP's rule: its per-row AOPCs and the free controls' equal the
    kept study's (float summation aside), so both files describe one set of rows and one set of removals."""
    kept = tables.load(tables.FIDELITY_STUDIES[study][0])["rows"]
    rerun = tables.load(tables.ATTENTION_RULE_STUDIES[study])["rows"]
    assert [r["reasoning_tokens"] for r in rerun] == [r["reasoning_tokens"] for r in kept]
    for a, b in zip(kept, rerun):
        assert b["aopc"]["conservative"] == pytest.approx(a["aopc"]["conservative"], rel=1e-4, abs=1e-6)
        for control, values in a["control_aopc"].items():
            assert b["control_aopc"][control] == pytest.approx(values, rel=1e-4, abs=1e-6)
