"""The offline verl + Ray bundle for the GPU machine (devtools/gpu_bundle.py, scripts/install_gpu_bundle.sh), without
building the real archive: the pins are the versions CI tests, nothing the machine's image has is bundled, the
unpacking keeps permission bits and strips what it says, the installer unpacks a bundle, refuses another Python and
a damaged manifest, and the blocker hides what the machine lacks. That the pins cover verl's worker path is tested by
the verl-worker part's CPU smoke run under the blocker (tests/integration/test_worker_group_on_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools import gpu_bundle

ROOT = Path(__file__).resolve().parents[2]
HERE = "%d.%d" % sys.version_info[:2]


def test_pins_are_what_ci_tests_and_never_shadow_the_image():
    assert {n: v for n, v in gpu_bundle.installed_versions(gpu_bundle.LOCK).items()
            if v != gpu_bundle.LOCK[n]} == {}  # the CPU environment is its lock (scripts/setup_env.sh installs under it)
    assert not {gpu_bundle.normalise(n) for n in gpu_bundle.PINS} & {gpu_bundle.normalise(n) for n in gpu_bundle.IMAGE}
    assert {"verl", "ray", "tensordict", "hydra-core", "omegaconf"} <= set(gpu_bundle.PINS)
    assert gpu_bundle.SDIST_ONLY <= set(gpu_bundle.PINS)
    assert {"torch", "transformers", "numpy"} <= gpu_bundle.IMAGE


def _wheel(path: Path, files: dict[str, tuple[str, int]]) -> Path:
    """A zip with each file's text and unix mode (as wheels store them)."""
    with zipfile.ZipFile(path, "w") as z:
        for name, (text, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, text)
    return path


def _site(tmp_path: Path, python: str = HERE, version: str = "1.0") -> Path:
    """An unpacked bundle of one distribution, ``oarprobe`` 1.0, with a program in ray/jars (stripped) and an
    executable file (kept executable)."""
    wheel = _wheel(tmp_path / "oarprobe-1.0-py3-none-any.whl", {
        "oarprobe/__init__.py": ("VALUE = 42\n", 0o644),
        "oarprobe/bin/tool": ("#!/bin/sh\necho hi\n", 0o755),
        "oarprobe-1.0.dist-info/METADATA": ("Metadata-Version: 2.1\nName: oarprobe\nVersion: 1.0\n", 0o644),
        "oarprobe-1.0.dist-info/RECORD": ("", 0o644),
        "ray/jars/big.jar": ("java", 0o644),
    })
    site = tmp_path / "site"
    gpu_bundle.unpack([wheel], site)
    assert os.access(site / "oarprobe" / "bin" / "tool", os.X_OK)  # Ray's raylet and GCS server must stay runnable
    assert gpu_bundle.strip(site) == ["ray/jars"] and not (site / "ray" / "jars").exists()
    info = {**gpu_bundle.manifest(["ray/jars"]), "python": python, "pins": {"oarprobe": version}}
    (site / gpu_bundle.MANIFEST_NAME).write_text(json.dumps(info))
    return site


def _install(archive: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/install_gpu_bundle.sh", str(archive), str(dest)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)


def test_installer_unpacks_a_bundle_that_imports(tmp_path):
    archive = gpu_bundle.archive(_site(tmp_path), tmp_path / "bundle.tar.xz")
    dest = tmp_path / "installed"
    proc = _install(archive, dest)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest) and "unpacked" in proc.stderr
    probe = subprocess.run([sys.executable, "-c", "import oarprobe; print(oarprobe.VALUE)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": proc.stdout.strip()})
    assert probe.stdout.strip() == "42", probe.stderr
    assert os.access(dest / "oarprobe" / "bin" / "tool", os.X_OK)
    again = _install(archive, dest)  # the same archive again: nothing to unpack
    assert again.returncode == 0 and "up to date" in again.stderr


@pytest.mark.parametrize("python,version,message", [("2.7", "1.0", "the bundle is for Python 2.7"),
                                                    (HERE, "9.9", "versions differ from the manifest")])
def test_installer_refuses_another_python_and_a_wrong_manifest(tmp_path, python, version, message):
    archive = gpu_bundle.archive(_site(tmp_path, python, version), tmp_path / "bundle.tar.xz")
    proc = _install(archive, tmp_path / "installed")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_installer_without_an_archive_says_how_to_build_it(tmp_path):
    proc = _install(tmp_path / "absent.tar.xz", tmp_path / "installed")
    assert proc.returncode == 2 and "python -m devtools.gpu_bundle build" in proc.stderr


def test_archive_refuses_more_than_a_call_carries(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_bundle, "MAX_BYTES", 10)
    with pytest.raises(RuntimeError, match="MiB, above"):
        gpu_bundle.archive(_site(tmp_path), tmp_path / "bundle.tar.xz")


def test_blocker_hides_what_the_machine_lacks(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(gpu_bundle.blocker())
    code = ("import importlib.util as u\n"
            "print(u.find_spec('wandb') is None, u.find_spec('ray.tune') is None, u.find_spec('verl') is not None,"
            " u.find_spec('json') is not None)\n"
            "try:\n    import wandb\nexcept ModuleNotFoundError:\n    print('refused')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.stdout.split() == ["True", "True", "True", "True", "refused"], proc.stdout + proc.stderr
