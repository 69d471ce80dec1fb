"""The scaling benchmark's quick mode: attribution against the training step on the same tokens and budget, each
measurement in a fresh process. Its peaks are checked (attribution never needs more memory than the training step
here: a wide margin), its times only reported."""

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
def test_scaling_benchmark_quick(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "research.scaling", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "scaling_cpu_cpu-quick.json").read_text())
    assert {(p["method"], p["length"]) for p in res["points"]} == {(m, n) for m in ("train", "oar_g", "conservative", "oar_p")
                                                                    for n in (256, 1024)}
    for r in res["ratios"]:
        assert r["peak_ratio"] < 1.0, r  # the target: attribution peak <= the training step's
        assert math.isfinite(r["time_ratio"]) and r["time_ratio"] > 0
    assert all(p["predicted_mib"] > 0 for p in res["points"])
    from research.scaling import extrapolate, main

    # the cost model's table (``--model-only``) in this process: no measurement, so no fresh process of its own
    capsys.readouterr()
    assert main(["--model-only"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("model | response |") and len(table) == 1 + len(extrapolate()), table[:3]
    rows = extrapolate()
    assert {(r["model"], r["response"]) for r in rows} == {(m, n) for m in ("qwen2.5-7b", "qwen2.5-32b")
                                                           for n in (4096, 16384)}
    for r in rows:
        # OAR-G back-propagates to the inputs only and keeps logits at the answer: below the training step
        assert r["oar_g_gib"] < r["train_gib"] and r["oar_g_time"] < 1.0 < r["oar_p_time"], r
