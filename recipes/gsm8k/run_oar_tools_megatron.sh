#!/usr/bin/env bash
# GSM8K with a calculator tool, multi-turn, on the Megatron engine: run_oar_tools.sh with ENGINE=megatron
# (Qwen2.5-7B-Instruct, TP=2 + sequence parallelism by default). Every other setting is shared (recipes/common.sh).
#
# usage: [MODEL=qwen2.5-7b-instruct|qwen2.5-1.5b-instruct] [MEGATRON_TP=2] [MEGATRON_PP=1] [VAR=value ...] \
#        bash recipes/gsm8k/run_oar_tools_megatron.sh [Hydra overrides]
set -euo pipefail
export ENGINE=megatron MODEL=${MODEL:-qwen2.5-7b-instruct}
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_oar_tools.sh" "$@"
