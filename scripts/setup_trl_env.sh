#!/usr/bin/env bash
# Create or update the SEPARATE environment of the TRL adapter's tests (tests/trl/): a fresh venv with TRL 1.16
# installed WITH its dependencies and pins through this project's `[trl]` extra, exactly as a user installs it
# (`pip install -e ".[trl]"`), plus peft (the LoRA test), DeepSpeed (the ZeRO test) and pytest. No verl here.
#
# Why its own environment: TRL 1.16 resolves beside verl 0.9.1's pins (`uv pip install --dry-run` installs it alone),
# but verl 0.9.1's FSDP engine imports TRL's AutoModelForCausalLMWithValueHead whenever TRL is importable, and TRL 1.16
# no longer has it: every verl actor then fails in its Ray worker (oar_verl/integration/startup.py refuses that set-up
# in the driver). So TRL stays out of the main .venv.
#
# usage: bash scripts/setup_trl_env.sh [--force]
#   OAR_TRL_VENV  venv directory            (default: .venv-trl, relative to the repository root)
#   PYTHON        interpreter for the venv  (default: python3; 3.10-3.12)
#
# Idempotent: a stamp file in the venv holds a hash of this script, uv_install.sh and pyproject.toml; when it matches,
# the script only prints the installed versions; otherwise, or with --force (OAR_SETUP_FORCE=1), it rebuilds the venv
# from scratch. Installs go through uv (scripts/uv_install.sh). torch: the CPU build 2.13.0+cpu, found through
# pip/uv find-links (PIP_FIND_LINKS) or indexes (else set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${OAR_TRL_VENV:-.venv-trl}
PY=${PYTHON:-python3}
FORCE=${OAR_SETUP_FORCE:-0}
[[ "${1:-}" == "--force" ]] && FORCE=1

TORCH_VERSION=2.13.0+cpu
# peft: the LoRA test's policy; deepspeed (OpenRLHF's pin): the ZeRO-2/3 test; psutil: tests/trl/trl_cost.py's sampler
TEST_PINS=('pytest>=8' 'hypothesis>=6.100' 'pytest-timeout' 'peft>=0.17' 'deepspeed==0.19.6' 'psutil')

say() { printf '[setup_trl_env] %s\n' "$*"; }
run() { say "\$ $*"; "$@"; }

STAMP=$VENV/.oar_trl_setup_stamp
HASH=$(cat scripts/setup_trl_env.sh scripts/uv_install.sh pyproject.toml | sha256sum | cut -d' ' -f1)
VERSIONS='import importlib.metadata as md; print("[setup_trl_env]", *(f"{p} {md.version(p)}" for p in ("torch", "trl", "transformers", "accelerate", "peft")))'

if [[ "$FORCE" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  say "environment $VENV is up to date (stamp matches)"
  "$VENV/bin/python" -c "$VERSIONS"
  exit 0
fi

PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$PYV" in
  3.10|3.11|3.12) ;;
  *) say "error: $PY is Python $PYV; torch $TORCH_VERSION needs 3.10-3.12 (set PYTHON=...)"; exit 1 ;;
esac

# always a fresh venv (what the tests check is what `pip install -e ".[trl]"` gives, nothing left over)
if [[ -d "$VENV" ]]; then
  run rm -rf "$VENV"
fi
run "$PY" -m venv "$VENV"

# shellcheck source=scripts/uv_install.sh
source scripts/uv_install.sh
uv_for "$VENV" "$TORCH_VERSION"

# one resolve: torch (CPU build), this project with its [trl] extra (TRL 1.16 and every dependency it declares, at its
# pins) and the test tools
run "${INSTALL[@]}" "torch==$TORCH_VERSION" -e ".[trl]" "${TEST_PINS[@]}"

say "import check"
"$VENV/bin/python" - <<'PY'
import torch
import trl  # noqa: F401

import oar_verl.trl  # noqa: F401

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the CPU build is required"
PY
"$VENV/bin/python" -c "$VERSIONS"
echo "$HASH" > "$STAMP"
say "done: $VENV/bin/python"
