"""The content-keyed warm-start cache: same settings and code -> built once and copied; anything else -> rebuilt."""

from __future__ import annotations

from oar_verl.quickstart import warm_cache


def test_built_once_then_copied_and_rebuilt_on_any_change(tmp_path, monkeypatch):
    monkeypatch.setenv(warm_cache.ENV, str(tmp_path / "cache"))
    code = tmp_path / "sft.py"
    code.write_text("STEPS = 1\n")
    builds = []

    def build(target):
        target.mkdir(parents=True, exist_ok=True)
        (target / "weights.txt").write_text(f"build {len(builds)}")
        builds.append(target)

    def get(name, settings):
        target = tmp_path / "runs" / name
        hit = warm_cache.materialise(target, name="m", settings=settings, code_files=[code], build=build,
                                     log=lambda _: None)
        return hit, (target / "weights.txt").read_text()

    assert get("a", {"steps": 300}) == (False, "build 0")
    assert get("b", {"steps": 300}) == (True, "build 0")  # a second test asking the same: copied, not trained
    assert get("c", {"steps": 400}) == (False, "build 1")  # other settings
    code.write_text("STEPS = 2\n")
    assert get("d", {"steps": 300}) == (False, "build 2")  # the SFT routine changed
    assert len(builds) == 3 and not list((tmp_path / "cache").glob(".*"))  # no half-written entries left


def test_without_the_variable_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.delenv(warm_cache.ENV, raising=False)
    n = []
    for name in ("a", "b"):
        hit = warm_cache.materialise(tmp_path / name, name="m", settings={}, code_files=[],
                                     build=lambda t: (t.mkdir(), n.append(t)), log=lambda _: None)
        assert not hit
    assert len(n) == 2


def test_concurrent_requests_build_once(tmp_path, monkeypatch):
    """Two runs (test workers) asking for the same entry at once: one trains it, the other waits and copies it."""
    import threading
    import time

    monkeypatch.setenv(warm_cache.ENV, str(tmp_path / "cache"))
    builds, hits = [], {}

    def build(target):
        builds.append(target)
        time.sleep(0.3)  # long enough for the other request to arrive while this one builds
        target.mkdir(parents=True, exist_ok=True)
        (target / "weights.txt").write_text("built")

    def get(name):
        hits[name] = warm_cache.materialise(tmp_path / name, name="m", settings={"steps": 1}, code_files=[],
                                            build=build, log=lambda _: None)

    threads = [threading.Thread(target=get, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and sorted(hits.values()) == [False, True]
    assert all((tmp_path / n / "weights.txt").read_text() == "built" for n in ("a", "b"))
