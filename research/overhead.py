"""OAR's overhead in verl's real trainer on CPU: GRPO vs OAR-G vs OAR-P, same data, same seed, one invocation.

Each method runs ``python -m oar_verl.main`` (V1 trainer, FSDP2 actor, vLLM-CPU rollout) on the tiny offline model
for ``--steps`` steps. Reported per method, from verl's file-logger metrics: the median step time after the first
step (the first includes lazy start-up), its ratio to GRPO, and ``timing_s/oar`` as a share of the step and of the
training compute (old log-prob + actor update). Also the share of sequences attributed (zero-advantage groups are
skipped).

usage: python -m research.overhead [--steps 8] [--rollout-n 4] [--batch 8] [--trainer-mode sync|colocate_async]
                                    [--out outputs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path

from oar_verl.cpu.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo
from oar_verl.cpu import arith_reward
from oar_verl.cpu.tiny_assets import build_tiny_assets

METHODS = {
    "GRPO": ["algorithm.adv_estimator=grpo"],
    "OAR-G": ["algorithm.oar.mode=gradient"],
    "OAR-P": ["algorithm.oar.mode=perturbation"],
}


def median_after_first(metrics: list[dict], key: str) -> float:
    values = [m.get(key, 0.0) for m in metrics[1:]]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rollout-n", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=48)
    ap.add_argument("--out", default="outputs/benchmarks")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--trainer-mode", default="sync", choices=["sync", "colocate_async"],
                    help="verl's V1 trainer mode, for GRPO and OAR alike (separate_async needs a GPU weight-sync "
                         "backend: see README)")
    args = ap.parse_args()

    out = Path(args.out).resolve() / ("overhead" if args.trainer_mode == "sync" else f"overhead_{args.trainer_mode}")
    shutil.rmtree(out, ignore_errors=True)
    assets = build_tiny_assets(out / "assets", seed=0)
    rows = []
    for name in args.methods.split(","):
        run_dir = out / name
        ray_tmp = new_ray_temp_dir()
        try:
            overrides = main_ppo_overrides(
                model_dir=assets.model_dir, train_file=assets.train_file, val_file=assets.test_file,
                reward_file=arith_reward.__file__, output_dir=run_dir, ray_temp_dir=ray_tmp, adv_estimator="oar",
                steps=args.steps, train_batch_size=args.batch, rollout_n=args.rollout_n, max_prompt_length=32,
                max_response_length=args.response_length, project="overhead", experiment=name,
                extra=[*METHODS[name], f"trainer.v1.trainer_mode={args.trainer_mode}"])
            print(f"[overhead] {name}: running {args.steps} steps ...", flush=True)
            run = run_main_ppo(overrides, output_dir=run_dir, env=cpu_env(file_logger_root=run_dir / "metrics"),
                               project="overhead", experiment=name, timeout_s=3600, module="oar_verl.main")
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if run.returncode != 0:
            print(run.log_tail(), file=sys.stderr)
            return 1
        m = run.metrics
        step = median_after_first(m, "timing_s/step")
        oar = median_after_first(m, "timing_s/oar")
        # attribution runs inside the old-log-prob step (timing_s/oar is part of timing_s/old_log_prob)
        train = median_after_first(m, "timing_s/old_log_prob") + median_after_first(m, "timing_s/update_actor") - oar
        rows.append({"method": name, "step_s": step, "oar_s": oar, "oar_share_of_step": oar / step,
                     "oar_share_of_training": oar / train if train else float("nan"), "train_s": train,
                     "attributed_frac": median_after_first(m, "oar/attributed_seq_frac") if name != "GRPO" else 0.0,
                     "peak_used_gib": run.peak_used_gib})
    base = next((r["step_s"] for r in rows if r["method"] == "GRPO"), None)
    for r in rows:
        r["ratio_to_grpo"] = r["step_s"] / base if base else float("nan")
    print(f"\n# overhead — {date.today()} — CPU, trainer mode {args.trainer_mode}, tiny Qwen2 (head_dim 32), batch "
          f"{args.batch} x n {args.rollout_n}, response <= {args.response_length}, median of steps 2..{args.steps}")
    keys = ["method", "step_s", "ratio_to_grpo", "oar_s", "oar_share_of_step", "train_s", "oar_share_of_training",
            "attributed_frac"]
    print(" | ".join(f"{k:>21}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>21.3f}" if isinstance(r[k], float) else f"{r[k]:>21}" for k in keys))
    (out / "overhead.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out / "overhead.png")
    print(f"\nwrote {out / 'overhead.json'} and overhead.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["method"] for r in rows]
    other = [r["step_s"] - r["oar_s"] for r in rows]
    ax.bar(names, other, label="rest of the step")
    ax.bar(names, [r["oar_s"] for r in rows], bottom=other, label="timing_s/oar")
    ax.set_ylabel("median step time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
