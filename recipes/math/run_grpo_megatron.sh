#!/usr/bin/env bash
# MATH, GRPO baseline on the Megatron engine: run_grpo.sh with ENGINE=megatron (Qwen2.5-7B, TP=2 + sequence
# parallelism by default). Every other setting is shared with the FSDP2 scripts (recipes/common.sh).
#
# usage: [MODEL=qwen2.5-7b|qwen2.5-math-7b|qwen2.5-1.5b] [MEGATRON_TP=2] [MEGATRON_PP=1] [VAR=value ...] \
#        bash recipes/math/run_grpo_megatron.sh [Hydra overrides]
set -euo pipefail
export ENGINE=megatron MODEL=${MODEL:-qwen2.5-7b}
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_grpo.sh" "$@"
