"""The fast lane (``bash scripts/test.sh --fast``) leaves out every verl trainer run and the research lane, and keeps
the rest.

The lane is a marker expression in scripts/test.sh; this reads it from there, so the script and the test cannot drift.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fast_markers() -> str:
    match = re.search(r'^FAST_MARKERS="([^"]+)"$', (ROOT / "scripts" / "test.sh").read_text(), re.MULTILINE)
    assert match, "scripts/test.sh no longer defines FAST_MARKERS=\"...\""
    return match.group(1)


def collect(*paths: str) -> tuple[int, list[str]]:
    """(pytest's exit code, the test ids) of collecting ``paths`` under the fast lane's marker expression."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", fast_markers(), *paths], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, [line for line in proc.stdout.splitlines() if "::" in line]


def test_fast_lane_deselects_every_trainer_run_and_keeps_the_unit_tests():
    code, ids = collect("tests/e2e/test_main_ppo_grpo_on_cpu.py", "tests/e2e/test_quickstart_on_cpu.py",
                        "tests/integration/test_startup_on_cpu.py")
    # the two e2e files start verl's trainer: neither is in the lane; the start-up checks (no trainer) are
    assert all(i.startswith("tests/integration/test_startup_on_cpu.py::") for i in ids), ids
    assert code == 0 and ids, "the start-up checks (no trainer) must stay in the fast lane"


def test_research_tests_are_their_own_lane():
    """Every test under research/tests is marked ``research`` (its conftest), so the fast lane selects none of them,
    fast or not; the research lane collects them all."""
    code, ids = collect("research/tests/test_learning_quick.py", "research/tests/test_scaling_quick.py")
    assert code == 5 and not ids, ids  # pytest's "no tests collected"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "research", "research/tests/test_learning_quick.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and any("test_summary_" in line for line in proc.stdout.splitlines()), proc.stdout
