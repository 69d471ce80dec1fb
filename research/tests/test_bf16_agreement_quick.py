"""The bf16 agreement study's row split (``--workers N/J``): each process scores only its rows, no agreement or
results file comes from a partial set, and a last run without the split reads every row from the cache and writes the
file. A random tiny model: the numbers mean nothing, the bookkeeping is what is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--rows", "2", "--tokens", "40", "--methods", "conservative"]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "research.bf16_agreement", *ARGS, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_rows_split_between_processes_then_written_from_the_cache(tmp_path):
    results = tmp_path / "agreement.json"
    run = tmp_path / "tiny_40"
    _run(tmp_path, "--workers", "2/1", "--results", str(results))
    assert [p.name for p in sorted(run.glob("bf16_agreement_*"))] == ["bf16_agreement_0001_conservative.json"]
    assert not results.exists()  # one of two rows: no agreement yet
    _run(tmp_path, "--workers", "2/0")
    cached = {p.name: p.stat().st_mtime_ns for p in run.glob("bf16_agreement_*")}
    assert sorted(cached) == ["bf16_agreement_0000_conservative.json", "bf16_agreement_0001_conservative.json"]
    _run(tmp_path, "--results", str(results))
    assert {p.name: p.stat().st_mtime_ns for p in run.glob("bf16_agreement_*")} == cached  # nothing recomputed
    record = json.loads(results.read_text())
    e = record["methods"]["conservative"]
    assert record["rows"] == 2 and e["spearman"]["rows"] + e["spearman"]["undefined"] == 2
    assert -1.0 <= e["spearman"]["mean"] <= 1.0 and len(e["seconds_per_row_fp32_bf16"]) == 2
