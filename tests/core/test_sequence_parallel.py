"""Sequence-sharded attribution (oar_verl.core.backends.ulysses) on 2 gloo ranks equals the unsharded method.

verl's Ulysses path wraps the CUDA flash-attention kernel, which cannot run on CPU; the ranks here use
``devtools.ulysses_attention`` (the same all-to-alls, through verl's own Ulysses utilities, around sdpa), so this
checks the sharding itself: packing, shards, probe positions on either rank, the probe sums over the group, OAR-G's
noise and gradient through the all-to-all (and path's move of each shard's own clean rows), and the gathered scores;
the in-step fidelity metric (its removal sets run as masked copies) on the sharded backend; and fisher and
conservative read from the caller's sharded forwards (verl's old-log-prob pass under Ulysses, docs/method.md §14),
also with verl's bucket padding (shards longer than the forward's tokens); and a forward one rank cannot cover, which
every rank refuses together.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oar_verl.core import module_backend, run_attribution
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.methods.conservative import conservative
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.methods.mask_operator import mask_replacement
from oar_verl.core.methods.path import path_integrated
from oar_helpers import fidelity_of, run_g, run_p

JOB = Path(__file__).with_name("sequence_parallel_job.py")


def load_job():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sequence_parallel_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_two_sequence_parallel_ranks_equal_the_unsharded_method(tmp_path):
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this checkout's oar_verl, not an installed one
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29517", str(JOB), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    job = load_job()
    lm = job.model("sdpa")  # the same weights, unsharded
    for key, got in ranks[0].items():
        if key[2] == "shard_error":  # rank 1's shard was cut short: both ranks raised, rank 0 naming the other
            assert "reached the embedding as (1, 13) on this rank" in ranks[1][key], ranks[1][key]
            assert "in another layout on another rank" in got, got
            continue
        if key[2] == "from_source":  # rank 0's values on both ranks; none: none on both; two sources: both raise
            for got_r in (got, ranks[1][key]):
                values, none, error = got_r
                assert values.dtype == torch.float64 and values.tolist() == torch.tensor(
                    [0.5, 1e-7, 3.25], dtype=torch.float32).double().tolist()
                assert none is None and "has 2 ranks holding the engine's outputs" in error, error
            continue
        if key[2].startswith("rounds"):
            assert got == ranks[1][key] and got >= 2
            continue
        kind, tokens, method = key
        b = job.batch(kind)
        if method.endswith("_logits"):  # the caller's forwards computed their own logits, bitwise
            assert got is True and ranks[1][key] is True, key
            continue
        if method in ("g", "g3"):
            ref = run_g(lm, b, 1e-3, sequence_seeds(3, 7, torch.arange(4)), PassLimits(10**6),
                                   samples=3 if method == "g3" else 1)
        elif method == "f":
            ref = fisher(ModuleBackend(lm, PassLimits(10**6)), b, 0, outcomes=2)[0]
        elif method == "fid":
            ref = fidelity_of(ModuleBackend(lm, PassLimits(10**6)), b)
        elif method == "f_zero":
            whole = ModuleBackend(lm, PassLimits(10**6))
            ref = fisher(whole, b, mask_replacement(whole, b, "zero", None, None), outcomes=2)[0]
        elif method == "path":
            whole = ModuleBackend(lm, PassLimits(10**6))
            ref = path_integrated(whole, b, mask_replacement(whole, b, "mean", None, None), 2)[0]
        elif method == "p_mean":
            ref = run_p(lm, b, None, PassLimits(10**6), prefix_cache=False, mask="mean")
        elif method == "fs":
            ref = fisher(ModuleBackend(lm, PassLimits(10**6)), b, 0, 1, 2, seed=4)[0]
        elif method == "cons":
            ref = conservative(ModuleBackend(lm, PassLimits(10**6)), b)[0]
        elif method.split("@")[0] in job.SHARED:  # the method's own passes on the unsharded model (@bucket: verl's
            cfg = job.SHARED[method.split("@")[0]]  # pad_to_length layout)
            ref = run_attribution(module_backend(lm, cfg), b, cfg, mask_token_id=cfg.mask_token_id).importance
        else:
            ref = run_p(lm, b, 0, PassLimits(10**6), prefix_cache=False)
        # the fidelity ratios are NaN where AS-Joint's signed random shift is not positive
        nan_ok = method == "fid"
        assert ref.abs().nansum() > 0 and (nan_ok or not ref.isnan().any())
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-12, equal_nan=nan_ok, msg=f"{key}")
        torch.testing.assert_close(ranks[1][key], got, rtol=0, atol=0, equal_nan=nan_ok)  # every rank holds the same
