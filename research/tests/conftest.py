"""Every test under research/tests carries the ``research`` marker: the research lane (``bash scripts/test.sh
--research``) selects them, the fast lane leaves them out, CI runs them with the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.research)


@pytest.fixture(scope="session", autouse=True)
def warm_cache(tmp_path_factory):
    """One content-keyed warm-start cache for the session's research tests (``$OAR_WARM_CACHE``, unless set): the
    faithfulness and learning quick runs warm-start the same digit-sum model (research.task.warm_start), trained once.
    """
    import os

    from oar_verl.quickstart.warm_cache import ENV

    if os.environ.get(ENV):
        yield os.environ[ENV]
        return
    os.environ[ENV] = str(tmp_path_factory.mktemp("warm_cache"))
    try:
        yield os.environ[ENV]
    finally:
        os.environ.pop(ENV, None)
