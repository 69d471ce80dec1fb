"""One warm-start cache per test session, for both suites (tests/ and research/tests/): the quickstart test, the
research quick modes and the subprocesses they start (which inherit the environment) train each warm-started model
once per session, not once per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the development tooling (``devtools/``, not in the wheel) is imported by tests, their subprocesses and Ray workers
ROOT = str(Path(__file__).resolve().parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

import pytest

from oar_verl.quickstart import warm_cache


@pytest.fixture(scope="session", autouse=True)
def shared_warm_starts(tmp_path_factory: pytest.TempPathFactory):
    """Points ``$OAR_WARM_CACHE`` at a session directory unless the caller set one (e.g. a cache kept across runs)."""
    if os.environ.get(warm_cache.ENV):
        yield os.environ[warm_cache.ENV]
        return
    path = str(tmp_path_factory.mktemp("warm_cache"))
    os.environ[warm_cache.ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(warm_cache.ENV, None)
