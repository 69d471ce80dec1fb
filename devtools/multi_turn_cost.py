"""What OAR costs on verl's multi-turn agent loop, on CPU: GRPO and OAR runs of the same configuration back to back
(the e2e multi-turn run's: the tiny calculator caller of :mod:`devtools.tool_assets`, verl's ToolAgentLoop, the V1
sync trainer), per step ``timing_s/step`` and OAR's ``timing_s/oar_total``, steps after the first.

usage: OMP_NUM_THREADS=1 python -m devtools.multi_turn_cost [--steps 4] [--modes conservative,gradient] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from devtools.tool_assets import build_tool_assets
from oar_verl.quickstart import arith_reward
from oar_verl.quickstart.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo

MULTI_TURN = ["actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.format=hermes",
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "data.max_response_length=64",
              "actor_rollout_ref.rollout.max_model_len=96"]


def run(assets, out: Path, name: str, estimator: str, extra: list[str], steps: int):
    ray_tmp = new_ray_temp_dir()
    try:
        overrides = main_ppo_overrides(
            model_dir=assets.model_dir, train_file=assets.train_file, val_file=assets.test_file,
            reward_file=arith_reward.__file__, output_dir=out / name, ray_temp_dir=ray_tmp, adv_estimator=estimator,
            steps=steps, train_batch_size=4, rollout_n=2, max_prompt_length=32, max_response_length=64,
            project="mt_cost", experiment=name,
            extra=[*MULTI_TURN, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={assets.tool_config}", *extra])
        module = "oar_verl.main" if estimator == "oar" else "verl.trainer.main_ppo"
        return run_main_ppo(overrides, output_dir=out / name, env=cpu_env(file_logger_root=out / name / "metrics"),
                            project="mt_cost", experiment=name, timeout_s=1500, module=module)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default="conservative")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mt_cost-"))
    assets = build_tool_assets(out / "assets")
    rows = {}
    plans = [("grpo", "grpo", [])] + [(m, "oar", [f"algorithm.oar.mode={m}", "algorithm.oar.answer_patterns="
                                                  "['(?P<answer>[0-9]+)']"]) for m in args.modes.split(",")]
    for name, estimator, extra in plans:
        r = run(assets, out, name, estimator, extra, args.steps)
        if r.returncode != 0:
            print(r.log_tail())
            return 1
        later = r.metrics[1:]  # the first step holds the warm-up
        rows[name] = {"wall_s": r.wall_s, "step_s": statistics.mean(m["timing_s/step"] for m in later),
                      "oar_total_s": statistics.mean(m.get("timing_s/oar_total", 0.0) for m in later),
                      "tool_rounds_per_row": statistics.mean(m.get("oar/turns/tool_rounds_per_row", float("nan"))
                                                            for m in later),
                      "num_turns_mean": statistics.mean(m["num_turns/mean"] for m in later)}
    base = rows["grpo"]["step_s"]
    for name, row in rows.items():
        row["step_x_grpo"] = row["step_s"] / base
    print(json.dumps({"machine": f"{os.cpu_count()} CPUs", "steps": args.steps, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
