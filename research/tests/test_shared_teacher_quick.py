"""The shared-teacher study's quick mode: a random tiny model samples its rows; OAR-G with its clean teachers read from
one packed forward of the rows against its own teacher passes, in fp32 and bf16, beside the next seed's spread. The
fp32 teachers differ by rounding only, so the scores agree to the last ranks; the table has every row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shared_teacher_study_quick(tmp_path):
    args = ["--model", "tiny", "--rows", "3", "--tokens", "48", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "research.shared_teacher", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.rindex("| dtype |"):]
    rows = [line for line in table.splitlines() if line.startswith("| fp32") or line.startswith("| bf16")]
    assert len(rows) == 4 and all("| 3 |" in r for r in rows)  # every row counted
    spearman = {(r.split("|")[1].strip(), "packed" in r): float(r.split("|")[4].split()[0]) for r in rows}
    assert spearman[("fp32", True)] >= 0.99 and spearman[("bf16", True)] >= 0.9
    assert all(re.search(r"\[-?\d\.\d{3}, -?\d\.\d{3}\]", r) for r in rows)  # each with its interval
