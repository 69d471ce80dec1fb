"""patches/: every diff applies cleanly to the installed verl 0.9.1, compiles, and passes its smoke check."""

from __future__ import annotations

import os
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
    assert all(f"SMOKE {p} OK" in out for p in ("0001", "0002/0003", "0004", "0005")), out[-5000:]


OPENRLHF_CHECK = CHECK.parent / "openrlhf" / "check.sh"
OPENRLHF_PYTHON = Path(os.environ.get("OAR_OPENRLHF_VENV", CHECK.parents[1] / ".venv-openrlhf")) / "bin" / "python"


@pytest.mark.skipif(shutil.which("patch") is None, reason="the `patch` program is not installed")
@pytest.mark.skipif(os.environ.get("OAR_SKIP_OPENRLHF", "0") == "1" or not OPENRLHF_PYTHON.exists(),
                    reason="no OpenRLHF environment (OAR_SKIP_OPENRLHF=1, or build it with "
                           "`bash scripts/setup_openrlhf_env.sh`)")
def test_openrlhf_patch_applies_compiles_and_parses():
    """patches/openrlhf/: applies to the installed OpenRLHF 0.11.2, compiles, and its parser takes the new flag."""
    proc = subprocess.run(["bash", str(OPENRLHF_CHECK), str(OPENRLHF_PYTHON)], capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SMOKE openrlhf/0001 OK" in out and "SMOKE openrlhf/0002 OK" in out, out[-5000:]
