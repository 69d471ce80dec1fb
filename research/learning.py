"""Learning study: GRPO vs OAR-G vs OAR-P through verl's real trainer on CPU, several seeds each.

One tiny Qwen2 is warm-started in plain torch on the digit-sum task of :mod:`research.task` (a brief supervised run:
it learns the answer format and gets part of the sums right, so GRPO groups have mixed rewards). Every run starts from
that same checkpoint and trains with ``python -m oar_verl.main`` (verl 0.9.1's V1 trainer, FSDP2 actor, vLLM-CPU
rollouts, launched by :func:`oar_verl.quickstart.launcher.run_main_ppo`):

* ``grpo``:  ``algorithm.adv_estimator=grpo`` (plain verl on the same entry point),
* ``oar_g``: ``algorithm.adv_estimator=oar algorithm.oar.mode=gradient``,
* ``oar_p``: ``algorithm.adv_estimator=oar algorithm.oar.mode=perturbation``,

with the loss set-up OAR was published with (no KL, no entropy bonus, no dual-clip, ``seq-mean-token-mean``) for all
three. verl's own validation (``trainer.test_freq``, ``val_before_train``) samples ``val_n`` responses at temperature 1
for each validation prompt; the curves are ``val-core/digit_sum/acc/mean@N`` (the policy's success rate) from the
file-logger JSONL, plus the training reward and ``actor/entropy`` of every step. The task uses the ``spaced`` text style
(see :mod:`research.task`).

usage: python -m research.learning [--quick] [--seeds N] [--steps N] [--lr LR] [--methods grpo,oar_g,oar_p]
                                     [--out DIR] [--docs] [--report-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from research import REPO, digit_sum_reward, task
from research.common import finish_figure, nanmean, permutation_p
from research.common import progress
from oar_verl.quickstart.launcher import (cpu_env, main_ppo_overrides, new_ray_temp_dir, read_metrics,
                                          run_main_ppo)

PROJECT = "oar_learning"
# verl names the core validation variable "acc" when the reward loop reports one (it does for a float reward), else
# "reward": val-core/<data_source>/<acc|reward>/mean@<n>
VAL_KEY = re.compile(rf"^val-core/{task.DATA_SOURCE}/(acc|reward)/mean@\d+$")

METHODS = {
    "grpo": ("grpo", []),
    "oar_g": ("oar", ["algorithm.oar.mode=gradient"]),
    "oar_p": ("oar", ["algorithm.oar.mode=perturbation", "algorithm.oar.chunk_size=64"]),
}
LABELS = {"grpo": "GRPO", "oar_g": "OAR-G", "oar_p": "OAR-P"}
COLORS = {"grpo": "tab:gray", "oar_g": "tab:orange", "oar_p": "tab:blue"}

# The loss set-up OAR was published with (README), for every method alike.
PUBLISHED_LOSS = [
    "actor_rollout_ref.actor.use_kl_loss=False",
    "algorithm.use_kl_in_reward=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.clip_ratio_c=1e9",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
]


@dataclass
class Settings:
    seeds: int
    steps: int
    test_freq: int
    train_batch_size: int  # prompts per step
    rollout_n: int  # responses per prompt (GRPO group size)
    val_rows: int  # validation prompts (the 30 distinct prompts, cycled)
    val_n: int  # samples per validation prompt
    lr: float
    warm_steps: int  # supervised warm-start steps
    timeout_s: float  # per verl run


QUICK = Settings(seeds=1, steps=4, test_freq=2, train_batch_size=8, rollout_n=8, val_rows=30, val_n=2, lr=1e-4,
                 warm_steps=400, timeout_s=900)
FULL = Settings(seeds=3, steps=16, test_freq=4, train_batch_size=8, rollout_n=8, val_rows=30, val_n=4, lr=1e-4,
                warm_steps=400, timeout_s=1500)


# ---------------------------------------------------------------------------------------------------------------------
# Assets
# ---------------------------------------------------------------------------------------------------------------------


def build_assets(root: Path, s: Settings, *, log) -> dict:
    """Warm-started model (:func:`research.task.warm_start`) + parquet data under ``root``; returns paths and the
    warm-start accuracies."""
    model_dir, data_dir = root / "model", root / "data"
    info_file = root / "warm_start.json"
    if info_file.exists():
        log(f"[learning] reusing the warm-started model in {model_dir}")
        return json.loads(info_file.read_text())
    hit = task.warm_start(model_dir, warm_steps=s.warm_steps, log=log)
    train_file, val_file = task.write_parquet(data_dir, n_train=max(512, s.steps * s.train_batch_size),
                                              n_val=s.val_rows)
    info = {"model_dir": str(model_dir), "train_file": str(train_file), "val_file": str(val_file),
            **json.loads((model_dir / task.WARM_INFO).read_text()), "from_cache": hit}
    log(f"[learning] warm-started in {info['sft_seconds']:.0f} s{' (earlier, cached)' if hit else ''}: success rate "
        f"at T=1 {info['sampled_accuracy_t1']:.3f} (HF sampling, 120 samples), greedy {info['greedy_accuracy']:.3f} "
        "(30 prompts)")
    info_file.write_text(json.dumps(info, indent=1))
    return info


# ---------------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------------


def run_one(assets: dict, s: Settings, method: str, seed: int, out: Path, *, log) -> dict:
    estimator, method_extra = METHODS[method]
    experiment = f"{method}_seed{seed}"
    run_dir = out / "runs" / experiment
    if run_dir.exists():
        shutil.rmtree(run_dir)
    ray_tmp = new_ray_temp_dir()
    extra = [
        *PUBLISHED_LOSS,
        *method_extra,
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"trainer.test_freq={s.test_freq}",
        "trainer.val_before_train=True",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.rollout.val_kwargs.n={s.val_n}",
        "data.val_batch_size=1024",
    ]
    if estimator == "oar":
        extra.append(f"algorithm.oar.seed={seed}")
    overrides = main_ppo_overrides(
        model_dir=assets["model_dir"], train_file=assets["train_file"], val_file=assets["val_file"],
        reward_file=digit_sum_reward.__file__, output_dir=run_dir, ray_temp_dir=ray_tmp, adv_estimator=estimator,
        steps=s.steps, train_batch_size=s.train_batch_size, rollout_n=s.rollout_n,
        ppo_mini_batch_size=s.train_batch_size, micro_batch_size_per_gpu=16, max_prompt_length=32,
        max_response_length=48, lr=s.lr, project=PROJECT, experiment=experiment, extra=extra)
    log(f"[learning] {LABELS[method]} seed {seed}: {s.steps} steps (log: {run_dir / 'main_ppo.log'})")
    try:
        run = run_main_ppo(overrides, output_dir=run_dir, env=cpu_env(file_logger_root=run_dir / "metrics"),
                           project=PROJECT, experiment=experiment, timeout_s=s.timeout_s, module="oar_verl.main")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    result = {"method": method, "seed": seed, "returncode": run.returncode, "wall_s": run.wall_s,
              "log": str(run.log_file), "metrics_file": str(run.metrics_file), **curves(run.metrics)}
    if run.returncode != 0:
        log(f"[learning] {experiment} FAILED (rc={run.returncode}); log tail:\n{run.log_tail(3000)}")
    else:
        val = result["val"]
        log(f"[learning] {experiment}: {run.wall_s:.0f} s; val success "
            + ", ".join(f"{st}:{v:.3f}" for st, v in zip(val["steps"], val["values"])))
    return result


def curves(metrics: list[dict]) -> dict:
    """Validation, training reward, entropy and timing series from verl's file-logger rows."""
    val_steps, val_values = [], []
    for m in metrics:
        key = min((k for k in m if VAL_KEY.match(k)), default=None)  # "acc" sorts before "reward"
        if key is not None:
            val_steps.append(m["step"])
            val_values.append(float(m[key]))
    train = [m for m in metrics if "critic/score/mean" in m]

    def series(key):
        return [float(m.get(key, float("nan"))) for m in train]

    return {"val": {"steps": val_steps, "values": val_values},
            "train": {"steps": [m["step"] for m in train], "reward": series("critic/score/mean"),
                      "entropy": series("actor/entropy"), "step_s": series("timing_s/step"),
                      "oar_s": series("timing_s/oar"), "ess_ratio": series("oar/ess_ratio"),
                      "weight_std": series("oar/weight_std")}}


# ---------------------------------------------------------------------------------------------------------------------
# Statistics and report
# ---------------------------------------------------------------------------------------------------------------------


def summarize(runs: list[dict], s: Settings) -> dict:
    ok = [r for r in runs if r["returncode"] == 0 and r["val"]["values"]]
    by_method: dict[str, list[dict]] = {}
    for r in ok:
        by_method.setdefault(r["method"], []).append(r)
    table = {}
    for method, rs in by_method.items():
        steps = rs[0]["val"]["steps"]
        vals = np.array([r["val"]["values"] for r in rs if r["val"]["steps"] == steps])
        last = vals[:, -1]
        # mean over the validation points after step 0 ("area under the curve"), less noisy than the last point
        auc = vals[:, 1:].mean(1) if vals.shape[1] > 1 else last
        ent = np.array([np.nanmean(r["train"]["entropy"][-3:]) for r in rs])
        table[method] = {
            "n_seeds": len(rs), "val_steps": steps, "val_mean": vals.mean(0).tolist(),
            "val_sd": (vals.std(0, ddof=1) if len(rs) > 1 else np.zeros(vals.shape[1])).tolist(),
            "val_min": vals.min(0).tolist(), "val_max": vals.max(0).tolist(),
            "start": float(vals[:, 0].mean()), "final": last.tolist(), "auc": auc.tolist(),
            "final_entropy": ent.tolist(),
            "train_reward_last5": [float(np.nanmean(r["train"]["reward"][-5:])) for r in rs],
            "step_s": float(np.nanmean([np.nanmean(r["train"]["step_s"]) for r in rs])),
            "oar_s": nanmean([nanmean(r["train"]["oar_s"]) for r in rs]),
            "wall_s": float(np.mean([r["wall_s"] for r in rs])),
        }
    comparisons = {}
    if "grpo" in table:
        for method in table:
            if method == "grpo":
                continue
            comp = {}
            for metric in ("final", "auc"):
                a, b = table[method][metric], table["grpo"][metric]
                diff = float(np.mean(a) - np.mean(b))
                se = math.sqrt((np.var(a, ddof=1) / len(a) if len(a) > 1 else 0) +
                               (np.var(b, ddof=1) / len(b) if len(b) > 1 else 0))
                comp[metric] = {"diff": diff, "se": se,
                                "p_perm": permutation_p(list(a), list(b)) if len(a) > 1 and len(b) > 1 else None,
                                "beyond_noise": bool(se > 0 and abs(diff) > 2 * se)}
            comparisons[method] = comp
    return {"methods": table, "vs_grpo": comparisons}


def report(summary: dict, s: Settings, assets: dict) -> str:
    t = summary["methods"]
    lines = [f"Validation success rate (verl validation, {s.val_rows} prompts x {s.val_n} samples at T=1, "
             f"val-core/{task.DATA_SOURCE}/acc/mean@{s.val_n}), "
             f"mean ± sd over seeds; warm start: {assets['sampled_accuracy_t1']:.3f} (HF sampling, T=1)", ""]
    steps = next(iter(t.values()))["val_steps"] if t else []
    lines.append("| method | seeds | " + " | ".join(f"step {st}" for st in steps) + " | mean after step 0 | "
                 "entropy (last 3 steps) | s/step | OAR s/step |")
    lines.append("|---|---|" + "---|" * len(steps) + "---|---|---|---|")
    for method, m in t.items():
        cells = [f"{mu:.3f} ± {sd:.3f}" for mu, sd in zip(m["val_mean"], m["val_sd"])]
        lines.append(f"| {LABELS[method]} | {m['n_seeds']} | " + " | ".join(cells) +
                     f" | {np.mean(m['auc']):.3f} ± {np.std(m['auc'], ddof=1) if len(m['auc']) > 1 else 0:.3f} | "
                     f"{np.mean(m['final_entropy']):.3f} | {m['step_s']:.1f} | "
                     + (f"{m['oar_s']:.2f}" if np.isfinite(m["oar_s"]) else "-") + " |")
    if summary["vs_grpo"]:
        lines += ["",
                  "| vs GRPO | Δ final (± SE) | perm. p | Δ mean after step 0 (± SE) | perm. p | beyond 2 SE? |",
                  "|---|---|---|---|---|---|"]
        for method, c in summary["vs_grpo"].items():
            f, a = c["final"], c["auc"]
            fmt_p = lambda p: "n/a" if p is None else f"{p:.2f}"  # noqa: E731
            lines.append(f"| {LABELS[method]} | {f['diff']:+.3f} ± {f['se']:.3f} | {fmt_p(f['p_perm'])} | "
                         f"{a['diff']:+.3f} ± {a['se']:.3f} | {fmt_p(a['p_perm'])} | "
                         f"{'yes' if (f['beyond_noise'] or a['beyond_noise']) else 'no'} |")
    return "\n".join(lines)


def plot(runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in METHODS:
        rs = [r for r in runs if r["method"] == method and r["returncode"] == 0 and r["val"]["values"]]
        if not rs:
            continue
        c, label = COLORS[method], LABELS[method]
        m = summary["methods"][method]
        ax = axes[0]
        ax.plot(m["val_steps"], m["val_mean"], "-o", color=c, label=f"{label} (n={len(rs)})", ms=4)
        ax.fill_between(m["val_steps"], m["val_min"], m["val_max"], color=c, alpha=0.15)
        for key, ax, smooth in (("reward", axes[1], True), ("entropy", axes[2], False)):
            ys = np.array([r["train"][key] for r in rs if len(r["train"][key]) == len(rs[0]["train"][key])])
            xs = rs[0]["train"]["steps"]
            mu = ys.mean(0)
            ax.plot(xs, mu, color=c, label=label)
            ax.fill_between(xs, ys.min(0), ys.max(0), color=c, alpha=0.15)
    axes[0].set_title("validation success rate (mean, band = min..max over seeds)")
    axes[0].set_xlabel("training step")
    axes[1].set_title("training reward (critic/score/mean)")
    axes[1].set_xlabel("training step")
    axes[2].set_title("policy entropy (actor/entropy)")
    axes[2].set_xlabel("training step")
    finish_figure(fig, axes, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps, 3 methods (CI runs it with --steps 2 "
                        "--warm-steps 250 --methods oar_g)")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--warm-steps", type=int, default=None)
    parser.add_argument("--methods", default="grpo,oar_g,oar_p")
    parser.add_argument("--out", default=str(REPO / "outputs" / "learning"))
    parser.add_argument("--docs", action="store_true", help="also write the figure to research/docs/img/learning.png")
    parser.add_argument("--report-only", action="store_true",
                        help="re-read the runs of an earlier study in --out (runs.json + metrics) and report")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the warm start")
    args = parser.parse_args(argv)

    s = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("seeds", args.seeds), ("steps", args.steps), ("lr", args.lr),
                                   ("warm_steps", args.warm_steps)) if v is not None}
    s = Settings(**{**s.__dict__, **overrides})
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    assets = build_assets(out / f"assets_w{s.warm_steps}", s, log=log)
    if args.report_only:
        runs = []
        for r in json.loads((out / "runs.json").read_text()):
            metrics_path = r.get("metrics_file") or str(out / "runs" / f"{r['method']}_seed{r['seed']}" / "metrics"
                                                        / PROJECT / f"{r['method']}_seed{r['seed']}.jsonl")
            runs.append({**r, **curves(read_metrics(metrics_path))})
    else:
        runs = []
        units = list(itertools.product(range(s.seeds), methods))  # interleaved: load drift hits all alike
        for seed, method in progress(units, desc="[learning] verl runs (seed x method)", unit="run"):
            runs.append(run_one(assets, s, method, seed, out, log=log))
            (out / "runs.json").write_text(json.dumps(runs, indent=1))
    summary = summarize(runs, s)
    total = time.perf_counter() - started
    if args.report_only and (out / "learning.json").exists():  # keep the study's own wall time
        total = json.loads((out / "learning.json").read_text()).get("total_seconds", total)
    results = {"settings": s.__dict__, "quick": args.quick, "methods": methods, "assets": assets, "runs": runs,
               "summary": summary, "total_seconds": total, "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "learning.json").write_text(json.dumps(results, indent=1))
    text = report(summary, s, assets)
    (out / "learning.md").write_text(text + "\n")
    print("\n" + text + "\n")
    plot(runs, summary, out / "learning.png")
    if args.docs:
        plot(runs, summary, REPO / "research" / "docs" / "img" / "learning.png")
    failed = [f"{r['method']}_seed{r['seed']}" for r in runs if r["returncode"] != 0]
    log(f"[learning] done in {total:.0f} s; {len(runs) - len(failed)}/{len(runs)} runs succeeded"
        + (f" (failed: {failed})" if failed else "") + f"; results: {out / 'learning.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
