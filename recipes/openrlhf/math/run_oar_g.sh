#!/usr/bin/env bash
# OpenRLHF 0.11.2, MATH (train: MATH train as JSONL, 7.5k)
# OAR-G: the GRPO advantages reshaped token by token by gradient attribution (gradient x input).
# Shares every other setting with the sibling run_*.sh scripts (recipes/openrlhf/common.sh): only the OAR flags differ.
#
# usage: [MODEL=qwen2.5-1.5b|qwen2.5-7b] [VAR=value ...] bash recipes/openrlhf/math/run_oar_g.sh [OpenRLHF/--oar flags]
#        DRY_RUN=1 bash recipes/openrlhf/math/run_oar_g.sh   # print the command only
# environment: pip install -e ".[openrlhf]" "openrlhf[vllm]==0.11.2" (OpenRLHF 0.11.2 with its pins, vLLM, oar_verl)
set -euo pipefail

TASK=math
ALGO=oar_g
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-3072}
# shellcheck source-path=SCRIPTDIR/.. source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TRAIN_FILE=${TRAIN_FILE:-$DATA_DIR/math/train.jsonl}
openrlhf_args

launch \
  --oar.mode=gradient \
  "$@"
