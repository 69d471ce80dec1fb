#!/usr/bin/env bash
# GSM8K (train: GSM8K train, 7.5k; validate: GSM8K test, 1.3k)
# OAR, the default mode (conservative): GRPO advantages reshaped token by token by gradient x input of the
# answer with relevance conserved through attention, norms and the gated MLP (docs/method.md §13, §15).
# The mode oar_verl runs when none is named, set here explicitly so the command shows it.
# Shares every other setting with the sibling run_*.sh scripts (recipes/common.sh), so the comparison is fair.
#
# usage: [MODEL=qwen2.5-1.5b|qwen2.5-7b|qwen2.5-math-7b] [VAR=value ...] \
#        bash recipes/gsm8k/run_oar_conservative.sh [Hydra overrides]
#        DRY_RUN=1 bash recipes/gsm8k/run_oar_conservative.sh   # print the command only
# data, once (DATA_DIR defaults to ~/data/oar):
#   python -m oar_verl.data.prepare gsm8k --out "$DATA_DIR/gsm8k"
set -euo pipefail

TASK=gsm8k
ALGO=oar_conservative
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-512}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-1024}
# shellcheck source-path=SCRIPTDIR/.. source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TRAIN_FILES=${TRAIN_FILES:-$DATA_DIR/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-$DATA_DIR/gsm8k/test.parquet}
oar_args

launch \
  algorithm.adv_estimator=oar \
  algorithm.oar.mode=conservative \
  "${OAR_ARGS[@]}" \
  "$@"
