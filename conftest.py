"""One warm-start cache per test session, for both suites (tests/ and research/tests/): the quickstart test, the
research quick modes and the subprocesses they start (which inherit the environment) train each warm-started model
once per session, not once per test."""

from __future__ import annotations

import os

import pytest

from oar_verl.cpu import warm_cache


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
