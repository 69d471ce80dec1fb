"""TRL's own trainer end to end with OAR (slow: subprocesses, ~20 s each): 2 gloo processes under accelerate's DDP
(``torch.distributed.run``; TRL's Accelerator picks gloo on CPU) with gradient checkpointing, a real tool through
TRL's tool loop on every row, token dumps, checkpoints and a resume from TRL's checkpoint on 2 processes, a PEFT LoRA
policy, and the reshape on an FSDP2 / DeepSpeed ZeRO-3 sharded policy. The tiny offline Qwen2 of the quickstart's
assets, TRL's own ``generate`` path (tests/trl/trl_job.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs TRL 1.16: runs in .venv-trl (tests/trl/test_trl_env.py, "
                                            "scripts/setup_trl_env.sh)")

pytestmark = [pytest.mark.trl, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "trl" / "trl_job.py"


def _run(model_dir, out: Path, overrides: dict, processes: int = 1, timeout: int = 400) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                      "--standalone", "--nproc_per_node", str(processes)]
    proc = subprocess.run([*launch, str(JOB), str(model_dir), str(out), json.dumps(overrides)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "log_history.json").read_text())


def _steps(logs: list[dict]) -> list[dict]:
    return [h for h in logs if "oar/global_step" in h]


def _check_oar(step: dict) -> None:
    assert step["oar/adv_mass_rel_err"] < 1e-6
    assert step["oar/reshaped_seq_frac"] > 0 and step["oar/weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert step["oar/weight_max"] > 1.0 > step["oar/weight_min"], "the weights move credit"
    assert step["timing/oar"] > 0


def _check_tool_rows(out: Path, calls: int) -> None:
    """Every ``reshape_batch`` call of both processes (trl_job.py's spy) had tool outputs, and left them context: no
    advantage (TRL's, which its loss masks), no weight (outside the loss mask, as padding), no score, never reasoning,
    answer or reshaped; Σw = R over each reshaped row's reasoning tokens (the model's)."""
    records = [json.loads(line) for rank in (0, 1) for line in (out / f"tool_rows_rank{rank}.jsonl").read_text()
               .splitlines()]
    assert len(records) == 2 * calls, records
    for r in records:
        assert r["tool_tokens"] > 0 and r["rows_with_tool"] == 4 and r["model_tokens"] > 0, r
        assert r["adv_max_abs"] == 0.0 and r["weight_max_abs"] == 0.0 and r["importance_max_abs"] == 0.0, r
        assert r["reasoning_or_answer"] == 0 and r["mass_rel_err_max"] <= 1e-6, r
    assert any(r["attributed"] > 0 for r in records)


def test_two_gloo_processes_ddp_gradient_checkpointing_dumps_and_resume(tiny_assets, tmp_path):
    """2 steps on 2 processes with checkpoints, then TRL's checkpoint at step 2 resumed to step 3 on 2 processes: OAR's
    step (probe schedule, noise seeds) continues with TRL's. Every completion calls a real tool through TRL's tool loop
    (``tools=[add]``; trl_job.py's ``"tool"`` run): its outputs are context, in the reshape and in the dump."""
    out = tmp_path / "ddp"
    run = {"gradient_checkpointing": True, "oar_dump_every": 2, "save_strategy": "steps", "save_steps": 1,
           "tool": True, "max_completion_length": 136}  # the call, the tool's output and a next turn fit
    logs = _run(tiny_assets.model_dir, out, {**run, "max_steps": 2}, processes=2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["wrapped"] == "DistributedDataParallel", summary
    steps = _steps(logs)
    assert [s["oar/global_step"] for s in steps] == [1.0, 2.0] and [s["step"] for s in steps] == [1, 2]
    for s in steps:
        _check_oar(s)
        assert s["tools/call_frequency"] == 1.0 and s["tools/failure_frequency"] == 0.0  # TRL ran `add` on every row
    _check_tool_rows(out, calls=2)
    # the heatmap dump of step 2, in the core's format, readable by the heatmap page; the tool outputs marked as
    # context (turn -1), never scored
    from oar_verl.viz.heatmap import load_dump

    dump = out / "oar_dumps" / "step_2.jsonl"
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert records and all(len(r["tokens"]) == len(r["weight"]) == len(r["importance"]) for r in records)
    assert all(len(r["turn"]) == len(r["tokens"]) and -1 in r["turn"] and max(r["turn"]) >= 1 for r in records)
    assert all(v == 0 for r in records for v, t in zip(r["importance"], r["turn"]) if t == -1)
    assert load_dump(out / "oar_dumps")
    assert (out / "checkpoint-2").is_dir()
    resumed = _steps(_run(tiny_assets.model_dir, out, {**run, "max_steps": 3, "resume": True}, processes=2))
    assert resumed[-1]["step"] == 3 and resumed[-1]["oar/global_step"] == 3.0
    assert resumed[-1]["oar/adv_mass_rel_err"] < 1e-6
    _check_tool_rows(out, calls=3)


def test_lora_policy(tiny_assets, tmp_path):
    out = tmp_path / "lora"
    logs = _run(tiny_assets.model_dir, out, {"lora": 4, "max_steps": 2})
    assert json.loads((out / "summary.json").read_text())["model"].startswith("Peft")
    for s in _steps(logs):
        _check_oar(s)


# ZeRO-3 (parameters gathered in every forward, as FSDP2's): the stage where the filler and the aligned passes matter;
# ZeRO-2 keeps whole parameters on every rank (the sharded_job.py runs it: `... conservative zero2`)
@pytest.mark.parametrize("wrap,mode", [("fsdp2", "conservative"), ("zero3", "perturbation")])
def test_sharded_policy_with_a_filler_rank(tiny_assets, tmp_path, wrap, mode):
    """The adapter's reshape on a sharded policy on 2 gloo processes (FSDP2's ``fully_shard``; DeepSpeed ZeRO-3's
    module, then one update through the engine): accelerate runs FSDP and DeepSpeed on accelerators only, so not
    through TRL's trainer here. Rank 1 has only a zero-advantage group, runs a filler row so that the collective
    forwards line up, and keeps its advantages; rank 0's equal the core's on a plain copy."""
    out = tmp_path / f"{wrap}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "trl" / "sharded_job.py"), str(tiny_assets.model_dir), str(out), mode,
                           wrap], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    first, second = json.loads(out.read_text())
    assert first["attributed"] == 4 and first["diff"] < 1e-3 and first["mass_diff"] < 1e-4, first
    assert second["attributed"] == 0 and second["untouched"], second
    assert first["metrics"]["oar/adv_mass_rel_err"] < 1e-6
    assert first["metrics"]["oar/reshaped_seq_frac"] == pytest.approx(4 / 6)  # over both ranks' rows
    if wrap != "fsdp2":
        assert first["loss"] is not None and first["loss"] == first["loss"], "the engine's update ran"
