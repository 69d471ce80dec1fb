"""Every test under research/tests carries the ``research`` marker: the research lane (``bash scripts/test.sh
--research``) selects them, the fast lane leaves them out, CI runs them with the rest. Their shared warm-start cache
is the repository root's conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.research)
