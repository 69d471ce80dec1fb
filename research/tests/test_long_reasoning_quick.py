"""The long-reasoning benchmark's quick mode: every OAR-P policy on GSM-style text through the real Qwen2.5
vocabulary's segments, and the cost table at two lengths. Structure and counts are checked, times only reported."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_reasoning_benchmark_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "research.long_reasoning", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-4000:])
    res = json.loads((tmp_path / "long_reasoning.json").read_text())
    real = res["real"]
    table = real["table"]
    assert set(table) == {"exact", "segment", "hierarchical 0.05", "hierarchical 0.1", "hierarchical 0.2"}
    assert min(real["reasoning_tokens"]) >= 100  # long reasoning, as the issue asks
    assert table["exact"]["copies"] == sum(real["reasoning_tokens"])
    assert table["segment"]["copies"] == sum(real["segments"]["sentence:8:64"])
    assert table["segment"]["refined_share"] == 0
    assert table["exact"]["top20_recall_vs_exact"] == 1.0
    for name in ("hierarchical 0.05", "hierarchical 0.1", "hierarchical 0.2"):
        e = table[name]
        assert table["segment"]["copies"] < e["copies"] < table["exact"]["copies"]
        assert 0 < e["refined_share"] < 1
    for point in res["cost"]:
        exact = point["policies"]["exact"]
        for name, e in point["policies"].items():
            assert math.isfinite(e["seconds"]) and e["vs_train"] > 0
            if name != "exact":
                assert e["recomputed_tokens"] < exact["recomputed_tokens"], name
    assert res["cost"][0]["segment_measured_seconds"] > 0
