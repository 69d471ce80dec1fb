"""The TRL adapter's tests, run in the separate ``.venv-trl`` environment (TRL 1.16 cannot share the main one: verl
0.9.1's FSDP engine imports a TRL class that TRL 1.16 no longer has; scripts/setup_trl_env.sh).

``bash scripts/setup_trl_env.sh`` builds it (``scripts/test.sh`` does unless ``OAR_SKIP_TRL=1``); ``OAR_TRL_VENV``
points elsewhere. This test runs ``test_trl_adapter.py`` and ``test_trl_trainer.py`` there with pytest (in the main
environment both skip: no TRL), and checks that the environment keeps TRL's pins."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("OAR_TRL_VENV", ROOT / ".venv-trl"))
PYTHON = VENV / "bin" / "python"
SKIP = os.environ.get("OAR_SKIP_TRL", "0") == "1"

pytestmark = [
    pytest.mark.skipif(SKIP, reason="OAR_SKIP_TRL=1: the TRL environment was not built"),
    pytest.mark.skipif(not SKIP and not PYTHON.exists(),
                       reason=f"no TRL environment at {VENV}: build it with `bash scripts/setup_trl_env.sh`"),
    pytest.mark.trl,
    pytest.mark.slow,  # TRL's trainer on 2 gloo processes and more: about 90 s
]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    for key in [k for k in env if k.startswith("PYTEST_")]:  # the outer run's (xdist worker ids) are not the inner's
        env.pop(key)
    return env


def test_the_trl_tests_pass_in_their_environment(tmp_path):
    proc = subprocess.run([str(PYTHON), "-m", "pytest", "tests/trl/test_trl_adapter.py", "tests/trl/test_trl_trainer.py",
                           "tests/trl/test_trl_script.py", "tests/trl/test_trl_tool_rows.py",
                           "-q", "-rs", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "inner"),
                           "--durations=5"], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 65 and "skipped" not in out.splitlines()[-1], out[-3000:]


def test_the_environment_keeps_trls_pins():
    """.venv-trl is `pip install -e ".[trl]"`'s equivalent: TRL 1.16 with every dependency at its declared pins, and
    no verl (whose FSDP engine would import TRL's removed value-head class)."""
    uv = shutil.which("uv") or str(ROOT / ".venv" / "bin" / "uv")
    proc = subprocess.run([uv, "pip", "check", "--python", str(PYTHON)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([str(PYTHON), "-c", "import importlib.util as u, importlib.metadata as md; "
                           "print(md.version('trl'), u.find_spec('verl') is None)"],
                          capture_output=True, text=True, timeout=120, env=_env())
    version, no_verl = proc.stdout.split()
    assert version.startswith("1.16.") and no_verl == "True", proc.stdout + proc.stderr
