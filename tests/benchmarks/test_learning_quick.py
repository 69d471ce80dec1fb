"""The learning study's quick mode, trimmed for CI: GRPO and OAR-G through verl's real trainer (1 seed, 2 steps each)
from a warm-started tiny model, with verl validation at steps 0 and 2. Checks that it runs and logs what the study
reads; the numbers themselves are reported, not asserted. OAR-P through ``python -m oar_verl.main`` is covered by
tests/e2e, and learning-speed evidence comes from the credit-assignment study (test_credit_quick.py)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import learning


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_learning_quick(tmp_path):
    rc = learning.main(["--quick", "--steps", "2", "--methods", "grpo,oar_g", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "learning.json").read_text())
    assert rc == 0, [(r["method"], r["returncode"], r["log"]) for r in res["runs"]]
    s = res["settings"]
    warm = res["assets"]["sampled_accuracy_t1"]
    assert 0.02 < warm < 0.98, f"warm start should give mixed rewards, got success rate {warm}"
    assert {r["method"] for r in res["runs"]} == {"grpo", "oar_g"}
    for r in res["runs"]:
        assert r["val"]["steps"] == list(range(0, s["steps"] + 1, s["test_freq"])), r["val"]
        assert all(0.0 <= v <= 1.0 for v in r["val"]["values"])
        assert r["train"]["steps"] == list(range(1, s["steps"] + 1))
        assert all(math.isfinite(e) and e > 0 for e in r["train"]["entropy"])
        if r["method"] != "grpo":
            assert any(math.isfinite(t) and t > 0 for t in r["train"]["oar_s"]), "OAR attribution never ran"
    summary = res["summary"]["methods"]
    assert set(summary) == {"grpo", "oar_g"}
    assert set(res["summary"]["vs_grpo"]) == {"oar_g"}
    assert (tmp_path / "learning.png").stat().st_size > 10_000
