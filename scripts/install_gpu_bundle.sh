#!/usr/bin/env bash
# Unpack the offline bundle of verl + Ray (built here by `python -m devtools.gpu_bundle build`) on a GPU machine that
# has torch and transformers but no network, check that it imports, and print the directory to put on PYTHONPATH.
#
#   bash scripts/install_gpu_bundle.sh [ARCHIVE] [DEST]
#     ARCHIVE  default .gpu_bundle/oar-gpu-bundle.tar.xz
#     DEST     default ${TMPDIR:-/tmp}/oar-gpu-bundle (unpacked again only when the archive changed)
#   PYTHON=/path/to/python3.12 selects the interpreter (default python3); it must be the bundle's Python version.
#
# scripts/gpu_check.sh calls it when the archive is there and verl is not importable. Exit status 2: no archive, an
# interpreter of another Python version, or a bundle that does not import (the message says which).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ARCHIVE=${1:-.gpu_bundle/oar-gpu-bundle.tar.xz}
DEST=${2:-${TMPDIR:-/tmp}/oar-gpu-bundle}
PY=${PYTHON:-python3}
say() { printf '[install_gpu_bundle] %s\n' "$*" >&2; }

[[ -f "$ARCHIVE" ]] || { say "no bundle at $ARCHIVE (build it with: python -m devtools.gpu_bundle build)"; exit 2; }
STAMP="$DEST/.archive_stamp"
want=$(stat -c '%s %Y' "$ARCHIVE")
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  say "$DEST is up to date"
else
  rm -rf "$DEST" && mkdir -p "$DEST"
  start=$SECONDS
  # tar with xz where the machine has them, else Python's tarfile (lzma is in the standard library)
  if command -v xz >/dev/null && tar --version >/dev/null 2>&1; then
    tar -xJf "$ARCHIVE" -C "$DEST"
  else
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" "$ARCHIVE" "$DEST"
  fi
  say "unpacked $ARCHIVE into $DEST in $((SECONDS - start)) s"
fi
"$PY" - "$DEST" <<'PY' || exit 2
import json, sys
dest = sys.argv[1]
info = json.load(open(f"{dest}/oar_gpu_bundle.json"))
have = "%d.%d" % sys.version_info[:2]
if have != info["python"]:
    sys.exit(f"[install_gpu_bundle] the bundle is for Python {info['python']}, {sys.executable} is {have}")
sys.path.insert(0, dest)
import importlib.metadata as md
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
bad = {n: version(n) for n, v in info["pins"].items() if version(n) != v}
if bad:
    sys.exit(f"[install_gpu_bundle] versions differ from the manifest: {bad}")
PY
echo "$want" > "$STAMP"
echo "$DEST"
