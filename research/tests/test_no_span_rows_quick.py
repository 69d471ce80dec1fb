"""The no-span rows study's quick mode: a random tiny model samples its rows, each is laid out EOS-ended, truncated and
with the model's (here: the problem's) answer appended; every method scores each layout and the library's fidelity
metric measures them on their own probes and on the answer's, against the free controls. Structure and bounds are
checked, the numbers of a random model mean nothing."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--prompts", "2", "--samples", "2", "--tokens", "24", "--chunk", "2", "--random", "2",
        "--methods", "conservative,fisher"]


def _run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "research.no_span_rows", *ARGS, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_no_span_rows_study_quick(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "tiny_24"
    summary = json.loads((run / "no_span_rows.json").read_text())
    assert summary["rows"] == 4 and summary["clusters"] == 2 and summary["methods"] == ["conservative", "fisher"]
    for layout in ("eos", "truncated"):  # question 1: each no-span layout's scores on its own probe
        assert set(summary["own_probe"][layout]) == {f"conservative:{layout}", f"fisher:{layout}"}
    # questions 2-3: every layout's scores on the answer probe, and their agreement with the answer target's
    assert set(summary["answer_probe"]) == {f"{m}:{lay}" for m in ("conservative", "fisher")
                                            for lay in ("eos", "truncated", "answer")}
    for gains in [*summary["own_probe"]["eos"].values(), *summary["answer_probe"].values()]:
        assert set(gains) == {"random", "position", "entropy"}
        for iv in gains.values():
            assert iv["rows"] + iv["undefined"] == 4
            if iv["rows"] and math.isfinite(iv["mean"]):
                assert iv["lo"] <= iv["mean"] <= iv["hi"]
    for key, agreement in summary["agreement"].items():
        assert -1.0 <= agreement["spearman"]["mean"] <= 1.0 and 0.0 <= agreement["top20_overlap"]["mean"] <= 1.0
    # every row in the CSV: what today's probes read (the EOS, or the token after a truncated row's cut)
    with open(run / "no_span_rows.csv") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4 and [int(x["cluster"]) for x in lines] == [0, 0, 1, 1]
    assert all(x["eos_probe_reads"] for x in lines) and "aopc[answer probe] conservative:eos" in lines[0]
    assert "python -m research.no_span_rows" in summary["command"]
    stamp = [c.stat().st_mtime_ns for c in sorted(run.glob("chunk_*.json"))]
    again = _run(tmp_path)  # resumes from the cached rows and chunks
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [c.stat().st_mtime_ns for c in sorted(run.glob("chunk_*.json"))] == stamp


def test_the_committed_results_refreshed_from_their_rows(tmp_path):
    """``--refresh``: the committed JSON's intervals recomputed from the CSV's rows (no model), each unchanged within
    the CSV's rounding and given its share of undefined resamples; a figure the rows do not give is refused."""
    import shutil

    import pytest

    from research.no_span_rows import refresh_results

    for suffix in (".json", ".csv"):
        shutil.copy(ROOT / "research" / "results" / f"no_span_rows{suffix}", tmp_path / f"r{suffix}")
    src = json.loads((tmp_path / "r.json").read_text())
    assert refresh_results(tmp_path / "r") == []  # no resample undefined: every denominator is a positive AOPC
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["own_probe"]["eos"]["conservative:eos"]["position"]["dropped"] == 0.0
    assert got["own_probe"]["eos"]["conservative:eos"]["position"]["mean"] == pytest.approx(
        src["own_probe"]["eos"]["conservative:eos"]["position"]["mean"], rel=1e-4)
    src["answer_probe"]["fisher:eos"]["random"]["hi"] += 0.01
    (tmp_path / "r.json").write_text(json.dumps(src))
    with pytest.raises(ValueError, match="answer_probe/fisher:eos/random hi"):
        refresh_results(tmp_path / "r")
