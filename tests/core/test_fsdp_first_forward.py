"""A gradient method as a bf16 FSDP2 model's first forward leaves the training step's gradients fp32
(:func:`~oar_verl.core.backends.base.fsdp_initialised`; the job: fsdp_first_forward_job.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

JOB = Path(__file__).with_name("fsdp_first_forward_job.py")


def test_attribution_first_keeps_the_updates_gradient_dtype(tmp_path):
    root = str(Path(__file__).resolve().parents[2])  # the rank imports this checkout's oar_verl
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(JOB), str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = torch.load(out)
    assert res["grad_dtypes"] == ["torch.float32"]
    scores = res["scores"]
    assert torch.isfinite(scores).all() and scores.abs().sum() > 0
