#!/usr/bin/env bash
# The SmolLM2 learning study of issue #69 (research/docs/learning_smollm2.md) in one command: GRPO against the default,
# one process per seed side by side, then the analysis; the per-step curves and results.json under OUT. On the GPU
# machine the weights come from .smol_carry/site (python -m devtools.smol_carry assemble); the device calls are in
# docs/gpu_check.md ("SmolLM2 learning (issue #69)").
#
#   bash scripts/smol_learning.sh "$OUT" --device cuda                      # the GPU run (seeds 1-8)
#   bash scripts/smol_learning.sh "$(mktemp -d)" --tiny --device cpu             # its CPU dry run (CI)
#   PYTHON=/path/to/python bash scripts/smol_learning.sh ...                # another interpreter
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash scripts/smol_learning.sh OUT_DIR [--device cuda|cpu] [--tiny] [--seeds 1-8] [--threads N]" >&2
  exit 2
fi
out=$1; shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d .smol_carry/site ]]; then  # the carried GGUF and gguf (devtools.smol_carry assemble)
  export PYTHONPATH="$PYTHONPATH:$PWD/.smol_carry/site"
fi
exec "$PY" -m research.smol_learning run --out "$out" "$@"
