"""Every method on a model wrapped by torch's FSDP1 (verl's ``strategy=fsdp``, its default) on 2 gloo ranks (the job:
fsdp1_job.py): the mask operators' embedding table is gathered from the unit that holds it (outside a forward FSDP1's
weights are views of freed storage: reading them crashed the process), and the update after attribution is intact.
verl's FSDP1 engine runs in tests/integration/test_worker_group_on_cpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("fsdp1_job.py")


def run_job(tmp_path, dtype: str) -> list[dict]:
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this checkout's oar_verl
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(JOB), str(tmp_path), dtype], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_every_method_on_fsdp1_equals_the_unwrapped_model(tmp_path):
    for res in run_job(tmp_path, "fp32"):
        assert res["grads"] == ["torch.float32"]
        assert set(res["got"]) == set(res["reference"])
        for name, got in res["got"].items():
            ref = res["reference"][name]
            assert int((ref != 0).sum()) > 10, name
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7 * float(ref.abs().max()), msg=name)


@pytest.mark.slow
def test_bf16_fsdp1_attributes_and_keeps_fp32_gradients(tmp_path):
    for res in run_job(tmp_path, "bf16"):
        assert res["grads"] == ["torch.float32"]
        for name in ("conservative", "fisher", "conservative_shared", "fisher_shared"):  # bf16 ≈ fp32 (OAR-G: §4)
            got, ref = res["got"][name].flatten(), res["reference"][name].flatten()
            keep = ref != 0
            assert torch.isfinite(got).all() and torch.corrcoef(torch.stack([got[keep], ref[keep]]))[0, 1] > 0.99, name
