"""CI's entry point fails when pytest collects no test: green must mean that tests ran and passed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_ci_run_fails_when_no_test_is_collected():
    env = {**os.environ, "OAR_SKIP_MCORE": "1"}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "-k", "no_test_has_this_name_x9q"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "collected no tests" in proc.stdout
