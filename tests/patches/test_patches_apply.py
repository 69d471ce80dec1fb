"""patches/: every diff applies cleanly to the installed verl 0.9.1, compiles, and passes its smoke check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / "patches" / "check.sh"


@pytest.mark.skipif(shutil.which("patch") is None, reason="the `patch` program is not installed")
def test_patches_apply_compile_and_smoke():
    proc = subprocess.run(["bash", str(CHECK), sys.executable], capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "SMOKE 0001 OK" in out and "SMOKE 0002/0003 OK" in out and "SMOKE 0004 OK" in out, out[-5000:]
