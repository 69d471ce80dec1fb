"""What OAR costs in TRL's GRPO step on CPU: TRL's plain ``GRPOTrainer`` and ``OARGRPOTrainer`` (default mode) side by
side on the same small offline Qwen2, data, reward and seeds, in alternating fresh processes; and attribution's peak
memory against the step's (resident set sampled every millisecond, above the level at the window's start).

usage: OMP_NUM_THREADS=1 .venv-trl/bin/python tests/trl/trl_cost.py [OUT_JSON] [--rounds 2] [--steps 8]
       (about 3 minutes on 2 cores at 2 rounds)

Per run: TRL's ``step_time`` (its whole training step: generation, rewards, OAR's reshape, loss, backward, optimiser)
over the steps after the first two, and ``timing/oar``; the ratio OAR / plain of the median step times over every
round, OAR's own seconds (``timing/oar``) against the plain step, and OAR's share of its own step (median over steps:
measured inside one step, the figure a loaded machine moves least) with the ratio it implies, 1 / (1 - share). Not a test: a measurement (docs/trl.md quotes it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 2


class RSSPeak:
    """The resident set's high-water mark above its level at :meth:`start`, sampled every millisecond."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self.base, self._on = psutil.Process(), 0, 0, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            if self._on:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def start(self):
        self.base = self.peak = self.proc.memory_info().rss
        self._on = True

    def stop(self) -> int:
        self._on = False
        return max(self.peak - self.base, 0)


def one_run(model_dir: str, plain: bool, steps: int) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer
    from trl import GRPOConfig, GRPOTrainer

    import oar_verl.trl.trainer as oar_trainer
    from oar_verl.trl import OARGRPOConfig, OARGRPOTrainer

    sys.path.insert(0, str(ROOT / "tests" / "trl"))
    from trl_job import ANSWER, reward

    meter, windows = RSSPeak(), {"attribution": [], "step": []}
    inner = oar_trainer.reshape_batch

    def measured_reshape(*a, **k):
        meter_state = (meter.base, meter.peak)
        meter.start()
        try:
            return inner(*a, **k)
        finally:
            windows["attribution"].append(meter.stop())
            meter.base, meter.peak = meter_state
            meter._on = True  # the step's window goes on

    oar_trainer.reshape_batch = measured_reshape
    step_fn = Trainer.training_step

    def measured_step(self, *a, **k):
        meter.start()
        try:
            return step_fn(self, *a, **k)
        finally:
            windows["step"].append(meter.stop())

    Trainer.training_step = measured_step
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": f"{a} + {b} ="} for a in range(10) for b in range(10)])
    kw = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, per_device_train_batch_size=8,
              num_generations=4, max_completion_length=64, max_steps=steps, logging_steps=1, report_to=[],
              save_strategy="no", seed=0, learning_rate=1e-5, gradient_checkpointing=False)
    if plain:
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=GRPOConfig(**kw), train_dataset=data,
                              processing_class=tok)
    else:
        trainer = OARGRPOTrainer(model=model_dir, reward_funcs=reward, train_dataset=data, processing_class=tok,
                                 args=OARGRPOConfig(**kw, oar_answer_patterns=[ANSWER]))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h][WARMUP:]
    return {"step_time": [h["step_time"] for h in logs], "oar": [h.get("timing/oar", 0.0) for h in logs],
            "attribution_peak": windows["attribution"][WARMUP:], "step_peak": windows["step"][WARMUP:],
            "reshaped": [h.get("oar/reshaped_seq_frac") for h in logs]}


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 2
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 8
    out = next((a for a in args if a.endswith(".json")), None)
    from oar_verl.quickstart.tiny_assets import build_tiny_qwen2, build_tokenizer

    model_dir = tempfile.mkdtemp(prefix="oar_trl_cost_")
    build_tiny_qwen2(model_dir, build_tokenizer(), hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                     intermediate_size=768)
    runs = []
    for r in range(rounds):
        for plain in (True, False):
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests' / 'trl')!r}); import trl_cost; "
                    f"print('RESULT', json.dumps(trl_cost.one_run({model_dir!r}, {plain}, {steps})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(proc.stderr[-3000:])
            res = json.loads(line[7:])
            res.update(round=r, plain=plain)
            runs.append(res)
            print(f"round {r} {'plain' if plain else 'OAR  '}: step {statistics.mean(res['step_time']):.3f} s"
                  + ("" if plain else f", of which OAR {statistics.mean(res['oar']):.3f} s; peak attribution "
                     f"{max(res['attribution_peak']) / 2**20:.1f} MiB vs step {max(res['step_peak']) / 2**20:.1f} MiB"),
                  flush=True)
    # medians over every measured step of every round: robust to the load spikes of a shared machine
    plain_t = statistics.median(t for r in runs if r["plain"] for t in r["step_time"])
    oar_t = statistics.median(t for r in runs if not r["plain"] for t in r["step_time"])
    oar_only = statistics.median(t for r in runs if not r["plain"] for t in r["oar"])
    share = statistics.median(o / t for r in runs if not r["plain"] for o, t in zip(r["oar"], r["step_time"]))
    att = max(p for r in runs if not r["plain"] for p in r["attribution_peak"])
    step = max(p for r in runs if not r["plain"] for p in r["step_peak"])
    summary = {"plain_step_s": plain_t, "oar_step_s": oar_t, "ratio": oar_t / plain_t, "oar_s": oar_only,
               "oar_vs_plain_step": oar_only / plain_t, "oar_share_of_step": share,
               "implied_ratio": 1 / (1 - share), "load_average": os.getloadavg(),
               "attribution_peak_mib": att / 2**20, "step_peak_mib": step / 2**20, "peak_ratio": att / max(step, 1),
               "rounds": rounds, "steps": steps, "warmup": WARMUP, "runs": runs}
    print(f"step time x plain GRPO (medians): {summary['ratio']:.2f} ({oar_t:.3f} s vs {plain_t:.3f} s; OAR itself "
          f"{oar_only:.3f} s = {summary['oar_vs_plain_step']:.2f}x the plain step; OAR's share of its own step "
          f"{share:.2f}, i.e. x{summary['implied_ratio']:.2f} where the rest of the step is unchanged); attribution's extra peak {summary['attribution_peak_mib']:.1f} MiB = "
          f"{summary['peak_ratio']:.2f}x the step's ({summary['step_peak_mib']:.1f} MiB)")
    if out:
        Path(out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
