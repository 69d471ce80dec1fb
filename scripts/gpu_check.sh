#!/usr/bin/env bash
# GPU figures in one command on a bare machine (Python 3.12, torch + CUDA, transformers; no verl / vLLM / Ray, no
# network): attribution, scaling and long-reasoning costs against the training step in bf16 at Qwen2.5-1.5B and 7B
# shapes (random init) at 2k / 4k / 16k response tokens. Resumable: run it again after an interruption and the parts
# already written are skipped. Results: outputs/gpu_check/gpu_check.{json,md} (see docs/gpu_check.md).
#
#   bash scripts/gpu_check.sh                         # the full check (CUDA)
#   bash scripts/gpu_check.sh --device cpu --tiny     # smoke run on CPU (what CI runs)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh  # another interpreter
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers" 2>/dev/null || {
    echo "gpu_check: needs torch and transformers importable by $PY (set PYTHON=...)" >&2; exit 2; }
# long sequences fragment the caching allocator; expandable segments keep the 16k points within memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m research.gpu_check "$@"
