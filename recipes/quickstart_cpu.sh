#!/usr/bin/env bash
# CPU quickstart (the README's first command): set up the environment, build a tiny offline model and an arithmetic
# data set, teach the model the answer format (~30 s), run verl's real trainer with OAR for a few steps and print a
# summary. Writes outputs/quickstart/{heatmap.html,curves.png,metrics/,oar_dumps/,main_ppo.log}.
#
# usage: bash recipes/quickstart_cpu.sh [--mode gradient|perturbation] [--task arith|credit] [--steps N] [--out DIR]
#          [Hydra overrides...]
#   --task credit                the last-digit credit task: a warm start (~1 min), verl validation before and
#                                after training (its success rate is the summary's last line); try --steps 30
#   OAR_QUICKSTART_STEPS=N       default of --steps (5); CI uses 3
#   OAR_QUICKSTART_SFT_STEPS=N   answer-format warm-up steps (300; 0 = keep the random model)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m oar_verl.cpu.quickstart "$@"
