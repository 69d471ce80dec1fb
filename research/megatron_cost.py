"""What ``fisher`` or ``conservative`` read from verl's Megatron old-log-prob pass adds (issue #45), measured side by
side in one process on verl 0.9.1's real Megatron engine (CPU, gloo, one rank; the tests' CPU shims), on the same
model and rows.

For each response length (one row of 128 prompt + T response tokens, random weights at the shape asked for, fp32):

* **train**: the engine's training micro-step: ``forward_backward_batch`` with a log-prob loss, parameter gradients
  (the engine's recompute settings);
* **log_prob**: verl's old-log-prob call alone (``infer_batch``, no entropies);
* **shared**: the same call with the method read from it (:mod:`oar_verl.integration.megatron.shared`;
  conservative under its rules' hooks, :mod:`oar_verl.integration.megatron.rules`);
* **own**: the method's own passes (the Megatron backend), the fallback after the call.

Reported per method (``--modes``): (call with the method − call alone) ÷ train and own ÷ train, each call's peak
(resident-memory rise) ÷ train's, with the cost model in forward units (train 4F with recompute, 3F without; the
shared backward F, its recompute another F; own passes forward + backward (+ recompute)). Each ``--recompute`` setting is the engine's own (``none``: activations kept; ``full``: every layer
recomputed) and runs in its own process.

usage (the Megatron environment ``.venv-mcore`` must exist: ``bash scripts/setup_mcore_env.sh``):
    python -m research.megatron_cost --lengths 1024,2048 --recompute none,full --modes fisher,conservative
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MASK = 7


def job(spec_path: str) -> None:
    """One engine, every variant, every length (runs under torchrun in the Megatron environment)."""
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    sys.path.insert(0, str(ROOT / "tests" / "megatron"))
    import torch
    import torch.distributed as dist

    import cpu_shims  # test tooling: verl's Megatron engine on a CPU-only torch
    from engine_job import log_prob_batch  # the tests' verl compute_log_prob inputs

    import oar_verl.quickstart.platform  # noqa: F401  (verl "cpu" platform, gloo)

    cpu_shims.install()
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(spec["threads"])
    from types import SimpleNamespace

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from oar_verl.core.config import OARConfig
    from oar_verl.core.methods.attribution import pass_limits, run_attribution
    from oar_verl.integration.backends import ENGINE_BACKENDS
    from oar_verl.integration.megatron.backend import MegatronBackend
    from research.common import measure
    from research.scaling import make_rows

    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if spec["recompute"] == "full" else {}
    mc = HFModelConfig(path=spec["model_dir"], use_remove_padding=False)
    ec = McoreEngineConfig(dtype="bfloat16", use_mbridge=True, vanilla_mbridge=True, forward_only=False,
                           use_dynamic_bsz=False, micro_batch_size_per_gpu=1, infer_micro_batch_size_per_gpu=1,
                           use_remove_padding=False,
                           override_transformer_config={"use_cpu_initialization": True, **recompute})
    cpu_shims.float32_engine_config(ec)
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=mc, engine_config=ec,
                                optimizer_config=McoreOptimizerConfig(lr=1e-5, total_training_steps=10),
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    configs = {m: OARConfig(mode=m, mask="token", mask_token_id=MASK) for m in spec["modes"]}
    out = []
    for length in spec["lengths"]:
        batch = make_rows(1, length, spec["vocab"], "cpu")
        ids = [batch.input_ids[0]]

        def td(attributed=False):
            return log_prob_batch(ids, micro_batch_size=1, rows=attributed)

        def loss(model_output, data, dp_group):
            lp = model_output["log_probs"]
            return -(lp.values() if lp.is_nested else lp).mean(), {}

        def train():
            with engine.train_mode():
                engine.forward_backward_batch(td(), loss, forward_only=False)
            engine.optimizer_zero_grad()

        def log_prob():
            with engine.eval_mode():
                engine.infer_batch(td())

        def shared(cfg):
            prepared = SimpleNamespace(batch=batch, mask_token_id=MASK, seeds=None)
            with ENGINE_BACKENDS.get("megatron").shared_pass(engine, cfg, prepared, None, False) as made:
                with engine.eval_mode():
                    engine.infer_batch(td(attributed=True))
            made[0].result()

        def own(cfg):
            with engine.eval_mode():
                run_attribution(MegatronBackend(engine, pass_limits(cfg, 1 + length + 128)), batch, cfg,
                                mask_token_id=MASK)

        row = {"length": length, "tokens": int(batch.input_ids.shape[1]), "recompute": spec["recompute"]}
        variants = [("train", train), ("log_prob", log_prob)]
        for mode, cfg in configs.items():
            variants += [(f"shared_{mode}", lambda cfg=cfg: shared(cfg)), (f"own_{mode}", lambda cfg=cfg: own(cfg))]
        for name, fn in variants:
            fn()  # warm-up
            got = [measure(fn, "cpu") for _ in range(spec["repeats"])]
            row[f"{name}_s"] = statistics.median(s for s, _ in got)
            row[f"{name}_mib"] = max(m for _, m in got)  # resident-memory rise over the state before
        out.append(row)
        print(json.dumps(row), flush=True)
    Path(spec["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def model_x_train(variant: str, recompute: bool) -> float:
    """The cost model's time ÷ train in forward units: train 4F with recompute (forward, recompute, two backward
    matmuls), 3F without; the shared pass adds a backward F (+ F recompute); the own passes forward + backward
    (+ recompute)."""
    train = 4.0 if recompute else 3.0
    return {"shared": 1.0 + recompute, "own": 2.0 + recompute}[variant] / train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="cpu-quick")
    ap.add_argument("--lengths", default="1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--recompute", default="none,full", type=lambda s: s.split(","))
    ap.add_argument("--modes", default="fisher", type=lambda s: s.split(","))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job(args.job)
        return 0
    import torch

    from oar_verl.quickstart.tiny_assets import build_tokenizer
    from research.scaling import SHAPES, build_model

    venv = Path(os.environ.get("OAR_MCORE_VENV", ROOT / ".venv-mcore"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_tokenizer(model_dir, seed=0)
        model = build_model(args.shape, "cpu", torch.float32)
        model.config.max_position_embeddings = max(args.lengths) + 256
        model.save_pretrained(model_dir)
        for recompute in args.recompute:
            spec = {"model_dir": str(model_dir), "lengths": args.lengths, "recompute": recompute,
                    "repeats": args.repeats, "threads": args.threads, "modes": args.modes,
                    "vocab": SHAPES[args.shape][6],
                    "out": str(Path(tmp) / f"{recompute}.json")}
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_PLATFORM": "cpu", "OAR_TEST_SP": "0",
                   "OMP_NUM_THREADS": str(args.threads), "TORCH_COMPILE_DISABLE": "1", "PYTHONWARNINGS": "ignore",
                   "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
            env.pop("VIRTUAL_ENV", None)
            cmd = [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node", "1",
                   "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "research.megatron_cost",
                   "--job", str(Path(tmp) / "spec.json")]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
                return proc.returncode
            rows += json.loads(Path(spec["out"]).read_text())
    print(f"\n{', '.join(args.modes)} and verl's Megatron old-log-prob pass, {args.shape}, fp32, CPU ({args.threads} "
          f"threads), {date.today()}: time ÷ the engine's training micro-step on the same tokens (cost model)")
    print("| T | engine recompute | method | the pass itself | read from it adds | its own passes | peak × train's: "
          "pass / pass with the method / own |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        full = r["recompute"] == "full"
        for mode in args.modes:
            added = (r[f"shared_{mode}_s"] - r["log_prob_s"]) / r["train_s"]
            print(f"| {r['length']} | {r['recompute']} | {mode} | {r['log_prob_s'] / r['train_s']:.2f} "
                  f"({1 / (4 if full else 3):.2f}) | {added:.2f} ({model_x_train('shared', full):.2f}) | "
                  f"{r[f'own_{mode}_s'] / r['train_s']:.2f} ({model_x_train('own', full):.2f}) | "
                  + " / ".join(f"{r[k + '_mib'] / r['train_mib']:.2f}"
                               for k in ("log_prob", f"shared_{mode}", f"own_{mode}")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
