#!/usr/bin/env bash
# CPU quickstart (the README's first command): set up the environment, then run verl's real trainer with OAR on a
# tiny offline model for a few steps and print a summary.
#
# usage: bash recipes/quickstart_cpu.sh [--mode gradient|perturbation] [--steps N] [--out DIR] [Hydra overrides...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m oar_verl.quickstart "$@"
