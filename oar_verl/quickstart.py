"""CPU quickstart: verl's real trainer with OAR on a tiny model, in a few minutes on 2 cores.

Builds a tiny random Qwen2, a byte-level BPE tokenizer and a verifiable arithmetic data set offline, runs
``python -m oar_verl.main`` (V1 trainer, FSDP2 actor, vLLM-CPU rollout) for a few steps and prints a summary of the
reward, the OAR metrics and the share of step time spent on attribution.

usage: python -m oar_verl.quickstart [--mode gradient|perturbation] [--steps N] [--out DIR] [extra Hydra overrides]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from oar_verl.integration.cpu_run import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo
from oar_verl.rewards import arith
from oar_verl.tiny_assets import build_tiny_assets

SUMMARY_KEYS = [
    ("critic/score/mean", "reward"),
    ("actor/grad_norm", "grad norm"),
    ("oar/weight_std", "w std"),
    ("oar/weight_max", "w max"),
    ("oar/frac_floor", "at floor"),
    ("oar/ess_ratio", "ESS ratio"),
    ("oar/top10_mass", "top-10% mass"),
    ("oar/attributed_seq_frac", "attributed"),
    ("timing_s/oar", "oar s"),
    ("timing_s/step", "step s"),
]


def summarize(metrics: list[dict]) -> str:
    """A plain-text table, one row per step, of the metrics users watch first."""
    head = f"{'step':>4} " + " ".join(f"{label:>12}" for _, label in SUMMARY_KEYS) + f" {'oar share':>10}"
    lines = [head, "-" * len(head)]
    for m in metrics:
        cells = [f"{m.get(k, float('nan')):>12.4g}" for k, _ in SUMMARY_KEYS]
        share = m.get("timing_s/oar", 0.0) / max(m.get("timing_s/step", 0.0), 1e-9)
        lines.append(f"{m['step']:>4} " + " ".join(cells) + f" {share:>10.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="gradient", choices=["gradient", "perturbation"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="outputs/quickstart")
    args, extra = parser.parse_known_args(argv)

    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    print(f"[quickstart] building tiny offline assets in {out / 'assets'}", flush=True)
    assets = build_tiny_assets(out / "assets", seed=0)
    ray_tmp = new_ray_temp_dir()
    experiment = f"oar_{args.mode}"
    overrides = main_ppo_overrides(
        model_dir=assets.model_dir, train_file=assets.train_file, val_file=assets.test_file,
        reward_file=arith.__file__, output_dir=out, ray_temp_dir=ray_tmp, adv_estimator="oar", steps=args.steps,
        train_batch_size=4, rollout_n=4, max_prompt_length=32, max_response_length=32, project="oar_quickstart",
        experiment=experiment, extra=[f"algorithm.oar.mode={args.mode}", *extra])
    print(f"[quickstart] running verl with OAR-{args.mode[0].upper()} for {args.steps} steps "
          f"(Ray + vLLM start-up takes ~1.5 min); log: {out / 'main_ppo.log'}", flush=True)
    try:
        run = run_main_ppo(overrides, output_dir=out, env=cpu_env(file_logger_root=out / "metrics"),
                           project="oar_quickstart", experiment=experiment, timeout_s=1800,
                           module="oar_verl.main")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if run.returncode != 0:
        print(run.log_tail(), file=sys.stderr)
        print(f"[quickstart] FAILED (rc={run.returncode}); full log: {run.log_file}", file=sys.stderr)
        return 1
    print()
    print(summarize(run.metrics))
    print()
    print(f"[quickstart] done in {run.wall_s:.0f} s")
    print(f"  metrics (JSONL): {run.metrics_file}")
    print(f"  trainer log:     {run.log_file}")
    print(f"  tiny model:      {assets.model_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
