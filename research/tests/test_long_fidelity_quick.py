"""The long-row fidelity study's quick mode: a random tiny model samples its rows, every compared method is scored,
timed against the training step and measured by the library's fidelity metric, a positional control beside them; the
cache makes a second run resume without recomputing. Structure and bounds are checked, the numbers of a random model
mean nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--rows", "2", "--tokens", "40", "--chunk", "1", "--methods", "oar_g,fisher_k1",
        "--draws", "2", "--random", "1", "--controls", "recency"]


def _run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "research.long_fidelity", *ARGS, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_long_fidelity_study_quick(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "tiny_40"
    rows = json.loads((run / "rows.json").read_text())
    assert len(rows) == 2 and all(30 <= len(r["response"]) <= 40 for r in rows)  # the model's own 3/4..1 × cap
    summary = json.loads((run / "summary_oar_g-fisher_k1.json").read_text())
    assert summary["rows"] == 2 and set(summary["methods"]) == {"oar_g", "fisher_k1"}
    for name, e in summary["methods"].items():
        assert e["cost"] > 0 and math.isfinite(e["cost"])
        assert 0.0 <= e["mass"]["mean"] <= 1.0
        for stat in ("naopc", "suppression"):
            assert e[stat]["rows"] + e[stat]["undefined"] == 2
            if e[stat]["rows"]:
                assert e[stat]["lo"] <= e[stat]["mean"] <= e[stat]["hi"]
    # the paired NAOPC difference from the first method named
    assert "naopc_minus_first" in summary["methods"]["fisher_k1"] and "naopc_minus_first" not in summary["methods"][
        "oar_g"]
    chunks = sorted(run.glob("chunk_*.json"))
    assert len(chunks) == 2
    for c in map(json.loads, (p.read_text() for p in chunks)):  # scores kept per reasoning token, for later gating
        assert all(len(row) == r for rows_ in c["scores"].values() for row, r in zip(rows_, c["reasoning"]))
        assert set(c["best"]) <= {"oar_g", "fisher_k1"} and len(c["best"]) == 1
    # the gating sweep from the cached scores reproduces the metric's own mass at the paper gate (tau 0.4, beta 2)
    sweep = json.loads((run / "gating_oar_g-fisher_k1.json").read_text())
    assert set(sweep) >= {"tau=0.4,beta=2", "tau=0.8,beta=4"}
    for name, e in summary["methods"].items():
        assert abs(sweep["tau=0.4,beta=2"][name]["mean"] - e["mass"]["mean"]) < 1e-9
    assert all(0.0 <= row[n]["mean"] <= 1.0 for row in sweep.values() for n in ("oar_g", "fisher_k1", "ceiling"))
    # the positional control, normalised by the chunk's own random rankings (recovered from the methods' NAOPC) and
    # best method
    controls = sorted(run.glob("control_*_recency_oar_g-fisher_k1.json"))
    assert len(controls) == 2
    for c in map(json.loads, (p.read_text() for p in controls)):
        assert all(math.isfinite(v) for v in c["aopc"] + c["suppression"])
        for r, r_chunk in zip(c["random_aopc"], c["random_aopc_chunk"]):
            assert math.isnan(r_chunk) or abs(r - r_chunk) <= 1e-6 * max(1.0, abs(r))
        for n, a, r, b in zip(c["naopc"], c["aopc"], c["random_aopc"], c["best_aopc"]):
            assert math.isnan(n) or abs(n - (a - r) / (b - r)) < 1e-9
    assert "| recency |" in proc.stdout + (run / "log.txt").read_text()
    chunks += controls
    stamp = [c.stat().st_mtime_ns for c in chunks]
    again = _run(tmp_path)  # resumes: rows and chunks come from the cache
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [c.stat().st_mtime_ns for c in chunks] == stamp
    assert json.loads((run / "summary_oar_g-fisher_k1.json").read_text()) == summary
