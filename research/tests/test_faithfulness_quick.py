"""Quick faithfulness benchmark (issue #21): directions on the tiny digit-sum model warm-started for 250 steps
(research.task.warm_start; the session trains it once, for this test and the learning quick run), not timings."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_faithfulness_quick(tmp_path):
    from research import faithfulness

    assert faithfulness.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    check = res["synthetic_core_check"]
    # the prototype's exact mask-token swap is oar_verl's OAR-P on the same rows
    assert check["max_abs_diff_core_oarp_vs_prototype_pad"] <= 1e-4 * max(check["max_abs_core_oarp"], 1e-6)
    rows = {r["method"]: r for r in res["synthetic"]["table"]}
    rand = rows["random"]
    # exact masking finds the planted digits far above chance; the cheap estimators rank above chance against it
    assert rows["exact: pad"]["planted_recall"] > rand["planted_recall"] + 0.2
    for name in ("IG-KL S=4", "random-ablation K=64", "core fisher (K=1)"):
        assert rows[name]["top20_recall"] > rand["top20_recall"], name
    # the refinement ranks exact's values on its candidates: never below its cheap ranking's recall of exact's top
    assert rows["IG-KL S=4 + exact on its top 25 %"]["top20_recall"] >= rows["IG-KL S=4"]["top20_recall"] - 1e-9
    # exact-vs-exact agreement is reported for every pair of the four variants
    assert len(res["synthetic"]["agreement"]) == 6
    # against the consensus of the swaps, each swap is judged by the consensus of the other three: a reference it is
    # not part of, so the recall is below 1 and above chance
    cons = {r["method"]: r for r in res["synthetic"]["table_vs_consensus"]}
    for v in ("pad", "zero", "delete", "sample"):
        assert cons["random"]["top20_recall"] < cons[f"exact: {v}"]["top20_recall"] < 1.0, v
    assert "exact: consensus" not in cons
