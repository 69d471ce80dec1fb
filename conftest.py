"""For both suites (tests/ and research/tests/): one warm-start cache per test session, and the groups that
``scripts/test.sh`` hands to pytest-xdist.

The warm-start cache: the quickstart test, the research quick modes and the subprocesses they start (which inherit the
environment) train each warm-started model once per session, not once per test; under xdist the workers share it.

The work units (``--dist loadgroup``): the verl and OpenRLHF trainer runs are one and the research quick modes another,
each run in order on one worker, while the other worker takes the rest test by test: two trainer runs of one unit never
run side by side, and the research studies share their warm starts in one process. A trainer run beside another test is
slower (GRPO 127 s against 87 s), the suite as a whole 25 % faster (tests/README.md). The minutes-long tests of units of
their own are queued first (``pytest_collection_modifyitems``), so that the workers finish together.
"""

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

# the work units of ``--dist loadgroup`` (test-id prefix -> unit); any other test is a unit of its own
WORK_UNITS = {"research/tests/": "research", "tests/e2e/": "trainers", "tests/openrlhf/": "trainers"}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test id: its group (WORK_UNITS), else the test itself."""
    return next((unit for prefix, unit in WORK_UNITS.items() if nodeid.startswith(prefix)), nodeid)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist, absent from the other venvs
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups named by test path (WORK_UNITS): xdist's own loadgroup reads
    ``xdist_group`` marks by rewriting test ids, which pytest 9.2 no longer allows."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


# a test of its own unit carrying one of these markers takes minutes, not seconds
HEAVY_MARKERS = ("e2e", "slow", "megatron", "trl")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` on workers, the modules holding a heavy test (HEAVY_MARKERS) that is a unit of its
    own are queued first, in collection order, each module whole: the workers then end on tests of seconds and finish
    together, instead of one running a minutes-long test (the TRL environment's, 215 s) while the other waits. The
    order of the tests inside a module and inside a work unit is kept; the order is the same on every worker."""
    if config.getoption("dist", default=None) != "loadgroup" or not config.getoption("numprocesses", default=None):
        return
    heavy = {item.nodeid.split("::")[0] for item in items
             if work_unit(item.nodeid) == item.nodeid and any(item.get_closest_marker(m) for m in HEAVY_MARKERS)}
    items[:] = sorted(items, key=lambda item: item.nodeid.split("::")[0] not in heavy)


@pytest.fixture(scope="session", autouse=True)
def shared_warm_starts(tmp_path_factory: pytest.TempPathFactory):
    """Points ``$OAR_WARM_CACHE`` at a session directory unless the caller set one (e.g. a cache kept across runs);
    under xdist, one directory beside the workers' own, shared by all of them."""
    if os.environ.get(warm_cache.ENV):
        yield os.environ[warm_cache.ENV]
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "warm_cache"
        shared.mkdir(exist_ok=True)
        path = str(shared)
    else:
        path = str(tmp_path_factory.mktemp("warm_cache"))
    os.environ[warm_cache.ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(warm_cache.ENV, None)
