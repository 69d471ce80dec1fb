#!/usr/bin/env bash
# CPU quickstart (the README's first command): set up the environment, build a tiny offline model and the last-digit
# credit task, warm-start the model (~1 min), run verl's real trainer with OAR for 40 steps, print a summary ending
# with verl's validation success before -> after. Writes outputs/quickstart/{heatmap.html,curves.png,metrics/,
# oar_dumps/,main_ppo.log}.
#
# usage: bash recipes/quickstart_cpu.sh [--mode conservative|gradient|perturbation|fisher|path] [--task arith|credit]
#          [--steps N] [--out DIR] [Hydra overrides...]
#   --task arith                 the earlier arithmetic task (answer-format warm-up, a noisy reward, no validation)
#   OAR_QUICKSTART_STEPS=N       default of --steps (40 for credit, 5 for arith); CI uses 3
#   OAR_QUICKSTART_SFT_STEPS=N   arith's answer-format warm-up steps (300; 0 = keep the random model)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m oar_verl.quickstart "$@"
