#!/usr/bin/env bash
# MATH (train: MATH train, 7.5k; validate: MATH-500 and GSM8K test)
# OAR, the default mode (conservative): GRPO advantages reshaped token by token by gradient x input of the
# answer with relevance conserved through attention, norms and the gated MLP (docs/method.md §13, §15).
# The mode oar_verl runs when none is named, set here explicitly so the command shows it.
# Shares every other setting with the sibling run_*.sh scripts (recipes/common.sh), so the comparison is fair.
#
# usage: [MODEL=qwen2.5-1.5b|qwen2.5-7b|qwen2.5-math-7b] [VAR=value ...] \
#        bash recipes/math/run_oar_conservative.sh [Hydra overrides]
#        DRY_RUN=1 bash recipes/math/run_oar_conservative.sh   # print the command only
# data, once (DATA_DIR defaults to ~/data/oar):
#   python -m oar_verl.data.prepare math --out "$DATA_DIR/math"
#   python -m oar_verl.data.prepare math500 --out "$DATA_DIR/math500"
#   python -m oar_verl.data.prepare gsm8k --out "$DATA_DIR/gsm8k"
set -euo pipefail

TASK=math
ALGO=oar_conservative
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-3072}
# shellcheck source-path=SCRIPTDIR/.. source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TRAIN_FILES=${TRAIN_FILES:-$DATA_DIR/math/train.parquet}
VAL_FILES=${VAL_FILES:-[$DATA_DIR/math500/test.parquet,$DATA_DIR/gsm8k/test.parquet]}
oar_args

launch \
  algorithm.adv_estimator=oar \
  algorithm.oar.mode=conservative \
  "${OAR_ARGS[@]}" \
  "$@"
