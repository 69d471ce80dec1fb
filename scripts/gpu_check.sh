#!/usr/bin/env bash
# GPU figures in one bounded run on a bare machine (Python 3.12, torch + CUDA, transformers; no verl / vLLM / Ray, no
# network; verl and Ray from the offline bundle when it is carried): verl's worker group with OAR's worker through
# one training step, OAR-G and fisher against the training step at the Qwen2.5-7B shape (4k, 16k tokens), bf16-vs-fp32 score
# agreement, then the lower-value parts, as long as each fits the 480 s budget (--budget-s). Run it again to resume
# what did not fit. Results: outputs/gpu_check/gpu_check.{json,md}; parts, budget and cost model: docs/gpu_check.md.
#
#   bash scripts/gpu_check.sh                         # CUDA, 480 s; again to resume
#   bash scripts/gpu_check.sh --parts verl-worker     # verl's worker group on the GPU (the bundle in .gpu_bundle/)
#   bash scripts/gpu_check.sh --plan                  # the parts and their estimated seconds, nothing run
#   bash scripts/gpu_check.sh --device cpu --tiny     # smoke run on CPU (what CI runs)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh  # another interpreter
set -euo pipefail
export GPU_CHECK_STARTED=$(date +%s.%N)  # the budget counts from here, interpreter start-up included
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
"$PY" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'transformers'))))" || {
    echo "gpu_check: needs torch and transformers importable by $PY (set PYTHON=...)" >&2; exit 2; }
# long sequences fragment the caching allocator; expandable segments keep the 16k points within memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the verl-worker part needs verl and Ray: on a bare machine, the offline bundle (python -m devtools.gpu_bundle build,
# then carried in .gpu_bundle/) is unpacked and put on PYTHONPATH (Ray's workers inherit it)
BUNDLE=${OAR_GPU_BUNDLE:-.gpu_bundle/oar-gpu-bundle.tar.xz}
if [[ -f "$BUNDLE" ]] && ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('verl') is None)" 2>/dev/null; then
  site=$(PYTHON="$PY" bash scripts/install_gpu_bundle.sh "$BUNDLE")
  export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$PY" -m research.gpu_check "$@"
