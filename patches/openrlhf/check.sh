#!/usr/bin/env bash
# Check each upstream patch of patches/openrlhf/ ON ITS OWN against a pristine OpenRLHF 0.11.2 (a scratch copy of the
# installed package; the installed copy is never touched), then both together:
#   0001-advantage-reshape-hook.patch  dry-run, apply, py_compile, its own test (tests/test_advantage_reshape.py, CPU),
#                                      OpenRLHF's own parser takes --algo.advantage.reshape_func_path, fit() calls the
#                                      function with the global step that ppo_train passes;
#   0002-parser-plugins.patch          dry-run, apply, py_compile, its own test (tests/test_parser_plugins.py), and
#                                      OpenRLHF's own --help lists a plugin's flags (a throwaway distribution whose
#                                      entry point is OAR's add_oar_arguments).
#   usage: patches/openrlhf/check.sh [python]   (default: .venv-openrlhf/bin/python of this repo)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${1:-$ROOT/.venv-openrlhf/bin/python}
SRC=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("openrlhf").origin))')
VERSION=$("$PY" -c 'import importlib.metadata as md; print(md.version("openrlhf"))')
[[ "$VERSION" == 0.11.2 ]] || { echo "check.sh: OpenRLHF $VERSION installed; the patches are against 0.11.2" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false

pristine() {  # a fresh scratch copy of the installed OpenRLHF in $WORK/$1
  rm -rf "${WORK:?}/$1"
  mkdir -p "$WORK/$1"
  cp -r "$SRC" "$WORK/$1/openrlhf"
  find "$WORK/$1/openrlhf" -name __pycache__ -prune -exec rm -rf {} +
}

apply() {  # apply patch $2 to the copy $1
  echo "== $(basename "$2") on $1"
  (cd "$WORK/$1" && patch -p1 --dry-run --quiet < "$2" && patch -p1 --quiet < "$2")
}

BASE=(--actor.model_name_or_path x --algo.kl.init_coef 0 --rollout.n_samples_per_prompt 4
      --algo.advantage.estimator group_norm)

# --- 0001 alone
pristine reshape
apply reshape "$HERE/0001-advantage-reshape-hook.patch"
"$PY" -m py_compile "$WORK"/reshape/openrlhf/{cli/train_ppo_ray.py,trainer/ray/ppo_actor.py,trainer/ppo_trainer.py,trainer/ppo_utils/advantage_reshape.py} "$WORK/reshape/examples/python/reshape_advantages.py"
(cd "$WORK/reshape" && PYTHONPATH="$WORK/reshape" "$PY" -m pytest -q -p no:cacheprovider tests/test_advantage_reshape.py)
# one process (OpenRLHF's imports cost most of it): the patched parser takes the flag; fit() calls the function
# before ppo_train with the global step that ppo_train passes (sync and sleep paths)
(cd "$WORK/reshape" && PYTHONPATH="$WORK/reshape" "$PY" - "$WORK/reshape" "${BASE[@]}" \
    --algo.advantage.reshape_func_path /plugins/f.py <<'PY'
import inspect, runpy, sys
import openrlhf, openrlhf.utils as orl_utils, ray
assert openrlhf.__file__.startswith(sys.argv[1]), openrlhf.__file__
class Parsed(Exception):
    pass
def capture(args):
    raise Parsed(args)
orl_utils.get_strategy, ray.is_initialized = capture, (lambda: True)
sys.argv = ["train_ppo_ray", *sys.argv[2:]]
try:
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    raise SystemExit("the parser did not reach get_strategy")
except Parsed as e:
    assert e.args[0].algo.advantage.reshape_func_path == "/plugins/f.py", vars(e.args[0].algo.advantage)
print("0001: the parser takes --algo.advantage.reshape_func_path")
from openrlhf.trainer.ppo_trainer import BasePPOTrainer
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
fit = inspect.getsource(PolicyModelActor.__ray_actor_class__.fit)
assert "global_step=global_step" in fit and "reduce_metrics(" in fit and "self.reshape_func(" in fit, fit
assert fit.index("self.reshape_func(") < fit.index("ppo_train("), "the hook must run before the PPO update"
assert inspect.getsource(BasePPOTrainer.ppo_train).count("global_step=global_steps") == 2
print("0001: fit calls the function before ppo_train, with the global step ppo_train passes (sync and sleep paths)")
PY
)
echo "SMOKE openrlhf/0001 OK"

# --- 0002 alone
pristine plugins
apply plugins "$HERE/0002-parser-plugins.patch"
"$PY" -m py_compile "$WORK"/plugins/openrlhf/{cli/train_ppo_ray.py,utils/plugins.py}
(cd "$WORK/plugins" && PYTHONPATH="$WORK/plugins" "$PY" -m pytest -q -p no:cacheprovider tests/test_parser_plugins.py)
DIST=$WORK/dist
mkdir -p "$DIST/oar_help-0.1.dist-info"
printf 'Metadata-Version: 2.1\nName: oar-help\nVersion: 0.1\n' > "$DIST/oar_help-0.1.dist-info/METADATA"
printf '[openrlhf.train_ppo_ray.args]\noar = oar_verl.openrlhf.train_ppo_ray:add_oar_arguments\n' \
  > "$DIST/oar_help-0.1.dist-info/entry_points.txt"
HELP=$(cd "$WORK/plugins" && PYTHONPATH="$WORK/plugins:$DIST:$ROOT" "$PY" -m openrlhf.cli.train_ppo_ray --help 2>/dev/null)
grep -q -- "--oar.mode VALUE" <<< "$HELP" || { echo "0002: --help lacks the plugin's flags" >&2; exit 1; }
echo "0002: OpenRLHF's --help lists a plugin's flags (--oar.mode)"
echo "SMOKE openrlhf/0002 OK"

# --- both, in order
pristine both
apply both "$HERE/0001-advantage-reshape-hook.patch"
apply both "$HERE/0002-parser-plugins.patch"
"$PY" -m py_compile "$WORK"/both/openrlhf/cli/train_ppo_ray.py
echo "SMOKE openrlhf patches OK"
