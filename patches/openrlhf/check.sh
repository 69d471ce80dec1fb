#!/usr/bin/env bash
# Check patches/openrlhf/*.patch on a scratch copy of the installed OpenRLHF 0.11.2 (the installed copy is never
# touched): dry-run, apply, py_compile, then OpenRLHF's own train_ppo_ray parser from the patched copy must accept
# --algo.advantage.reshape_func_path and call the plugin-argument entry points.
#   usage: patches/openrlhf/check.sh [python]   (default: .venv-openrlhf/bin/python of this repo)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-$HERE/../../.venv-openrlhf/bin/python}
SRC=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("openrlhf").origin))')
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r "$SRC" "$WORK/openrlhf"
find "$WORK/openrlhf" -name __pycache__ -prune -exec rm -rf {} +
cd "$WORK"
for p in "$HERE"/0*.patch; do
  echo "== $(basename "$p")"
  patch -p1 --dry-run < "$p"
  patch -p1 --quiet < "$p"
done
"$PY" -m py_compile openrlhf/cli/train_ppo_ray.py openrlhf/trainer/ray/ppo_actor.py
echo "py_compile: ok"
cat > smoke.py <<'PY'
"""The patched parser (imported from the scratch copy) takes the new flag; fit() calls the loaded function."""
import inspect
import runpy
import sys

import openrlhf
import openrlhf.utils as orl_utils
import ray

assert openrlhf.__file__.startswith(sys.argv[1]), openrlhf.__file__


class Parsed(Exception):
    pass


def capture(args):
    raise Parsed(args)


orl_utils.get_strategy, ray.is_initialized = capture, (lambda: True)
sys.argv = ["train_ppo_ray", "--actor.model_name_or_path", "x", "--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "4",
            "--algo.advantage.estimator", "group_norm",
            "--algo.advantage.reshape_func_path", "/plugins/reshape.py"]
try:
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
except Parsed as e:
    args = e.args[0]
assert args.algo.advantage.reshape_func_path == "/plugins/reshape.py", vars(args.algo.advantage)
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

src = inspect.getsource(PolicyModelActor.__ray_actor_class__.fit)
assert "self.reshape_func(self, self.trainer.replay_buffer.items)" in src
print("SMOKE openrlhf/0001 OK")
PY
PYTHONPATH="$WORK" OMP_NUM_THREADS=1 "$PY" smoke.py "$WORK" 2>&1 | grep -v "WARNING\|^\s*$" || true
