#!/usr/bin/env bash
# MATH, OAR's default mode (conservative) on the Megatron engine: run_oar_conservative.sh with ENGINE=megatron
# (Qwen2.5-7B, TP=2 + sequence parallelism by default). Every other setting is shared with the FSDP2 scripts
# (recipes/common.sh).
#
# usage: [MODEL=qwen2.5-7b|qwen2.5-math-7b|qwen2.5-1.5b] [MEGATRON_TP=2] [MEGATRON_PP=1] [VAR=value ...] \
#        bash recipes/math/run_oar_conservative_megatron.sh [Hydra overrides]
set -euo pipefail
export ENGINE=megatron MODEL=${MODEL:-qwen2.5-7b}
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_oar_conservative.sh" "$@"
