"""Headless Chromium for the heatmap tests (Debian: ``apt-get install -y chromium``); tests skip without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """``run(page, *args) -> CompletedProcess``: headless Chromium on a local file with a private profile."""
    binary = _find_chromium()
    if binary is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install -y chromium)")
    profile = tmp_path_factory.mktemp("chromium-profile")

    def run(page: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout)

    return run
