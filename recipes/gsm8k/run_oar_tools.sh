#!/usr/bin/env bash
# GSM8K with a calculator tool, multi-turn (verl's ToolAgentLoop; docs/multi_turn.md): the default OAR mode on
# Qwen2.5-Instruct, which calls `calc` in verl's hermes format (<tool_call>{...}</tool_call>) and reads its result in
# the next turn. OAR credits the model's own tokens of every turn; the tool's outputs stay context (never scored,
# reshaped or counted in the mass) and the answer span is the last `#### N` among the model's own tokens
# (answer_patterns=[gsm8k]). The reward grades the model's own words only, by that same `#### N` on every row, tool
# call or not (gsm8k_fallback=False: docs/verl.md, "The recipes' data and reward").
# Shares every other setting with the sibling run_*.sh scripts (recipes/common.sh).
#
# usage: [MODEL=qwen2.5-1.5b-instruct|qwen2.5-7b-instruct] [MAX_TURNS=4] [VAR=value ...] \
#        bash recipes/gsm8k/run_oar_tools.sh [Hydra overrides]
#        DRY_RUN=1 bash recipes/gsm8k/run_oar_tools.sh   # print the command only
# data, once (DATA_DIR defaults to ~/data/oar): rows with agent_name tool_agent
#   python -m oar_verl.data.prepare gsm8k --tools --out "$DATA_DIR/gsm8k_tools"
set -euo pipefail

TASK=gsm8k
ALGO=oar_tools
MODEL=${MODEL:-qwen2.5-1.5b-instruct}
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}   # Qwen's template puts the tool schema in the system prompt
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-1536}  # every turn, the tool outputs included
MAX_TURNS=${MAX_TURNS:-4}
# shellcheck source-path=SCRIPTDIR/.. source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TRAIN_FILES=${TRAIN_FILES:-$DATA_DIR/gsm8k_tools/train.parquet}
VAL_FILES=${VAL_FILES:-$DATA_DIR/gsm8k_tools/test.parquet}
TOOL_CONFIG=${TOOL_CONFIG:-$RECIPES_DIR/tools/calculator.yaml}
oar_args

launch \
  algorithm.adv_estimator=oar \
  algorithm.oar.mode=conservative \
  "algorithm.oar.answer_patterns=[gsm8k]" \
  "${OAR_ARGS[@]}" \
  actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.multi_turn.format=hermes \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$MAX_TURNS" \
  +reward.custom_reward_function.reward_kwargs.gsm8k_fallback=False \
  "$@"
