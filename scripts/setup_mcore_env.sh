#!/usr/bin/env bash
# Create or update the SEPARATE environment of the Megatron CPU tests (tests/megatron/): torch 2.13.0+cpu,
# verl 0.9.1, transformers 5.9.0, megatron-core 0.16.1 and mbridge 0.15.1 (verl's "vanilla mbridge" path; the
# Python 3.11 combination known to run verl's Megatron engine on CPU), plus oar_verl (editable, no deps) and pytest.
# The main environment (.venv, scripts/setup_env.sh) is not touched: no vLLM here, no megatron-core there.
#
# usage: bash scripts/setup_mcore_env.sh [--force]
#   OAR_MCORE_VENV  venv directory            (default: .venv-mcore, relative to the repository root)
#   PYTHON          interpreter for the venv  (default: python3; must be 3.10-3.11: megatron-core 0.16.1 and
#                   mbridge 0.15.1 are the newest that still install on 3.11; >= 0.17 needs 3.12)
#
# Idempotent: a stamp file in the venv holds a hash of this script and pyproject.toml; when it matches, the script
# only re-checks the imports (a few seconds). --force (or OAR_SETUP_FORCE=1) redoes all.
#
# Installs go through uv (scripts/uv_install.sh). torch: the CPU build 2.13.0+cpu, found through PIP_FIND_LINKS or
# PIP_EXTRA_INDEX_URL (if yours have none, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). Every install
# runs under the constraint torch==2.13.0+cpu, so a CUDA torch is never pulled in by megatron-core or mbridge.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${OAR_MCORE_VENV:-.venv-mcore}
PY=${PYTHON:-python3}
FORCE=${OAR_SETUP_FORCE:-0}
[[ "${1:-}" == "--force" ]] && FORCE=1

TORCH_VERSION=2.13.0+cpu
PINS=('verl[verl-core]==0.9.1' 'transformers==5.9.0' 'megatron-core==0.16.1' 'mbridge[megatron]==0.15.1')  # the extra brings einops, imported by mbridge.models
TEST_PINS=('pytest>=8' 'hypothesis>=6.100' 'pytest-timeout')

say() { printf '[setup_mcore_env] %s\n' "$*"; }
run() { say "\$ $*"; "$@"; }

STAMP=$VENV/.oar_mcore_setup_stamp
HASH=$(cat scripts/setup_mcore_env.sh scripts/uv_install.sh pyproject.toml | sha256sum | cut -d' ' -f1)

import_check() {
  say "import check"
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import megatron.core
import mbridge  # noqa: F401
import verl

import oar_verl  # noqa: F401

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the CPU build is required"
print(f"[setup_mcore_env] torch {torch.__version__} | verl {verl.__version__} | megatron-core "
      f"{megatron.core.__version__} | mbridge {md.version('mbridge')} | transformers {md.version('transformers')}")
PY
}

if [[ "$FORCE" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  say "environment $VENV is up to date (stamp matches); checking imports only"
  import_check
  exit 0
fi

PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$PYV" in
  3.10|3.11) ;;
  *) say "error: $PY is Python $PYV; megatron-core 0.16.1 + mbridge 0.15.1 need 3.10-3.11 (set PYTHON=...)"; exit 1 ;;
esac

if [[ ! -x "$VENV/bin/python" ]]; then
  run "$PY" -m venv "$VENV"
else
  say "reusing venv $VENV"
fi
rm -f "$STAMP"
# shellcheck source=scripts/uv_install.sh
source scripts/uv_install.sh
uv_for "$VENV" "$TORCH_VERSION"

# 1. one resolve: torch (CPU build), verl + transformers + megatron-core + mbridge (pinned), test tools
run "${INSTALL[@]}" "torch==$TORCH_VERSION" "${PINS[@]}" "${TEST_PINS[@]}"
# 2. this project, editable, without re-resolving its dependencies (no vLLM in this environment)
run "${INSTALL[@]}" --no-deps -e .
# 3. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports on CPU torch
run "${UNINSTALL[@]}" torchvision torchaudio torchcodec

import_check
echo "$HASH" > "$STAMP"
say "done: $VENV/bin/python"
