"""compute_token_importance on a real Ray worker group (FSDP2, gloo) equals the core functions on the same model.

Two data-parallel ranks hold sequences of different lengths (so they need different numbers of forwards): the call
must finish (no collective hang) and agree with the single-rank group and with the core reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oar_verl.core.attribution import response_importance
from oar_verl.core.config import OARConfig
from oar_verl.core.gradient import sequence_seeds
from oar_verl.core.layout import build_reference_responses
from oar_verl.core.spans import locate_answer_spans
from oar_verl.cpu.launcher import cpu_env, new_ray_temp_dir
from oar_verl.integration.worker import pad_rows, row_fingerprints

JOB = Path(__file__).with_name("worker_group_job.py")


def run_job(model_dir, tmp_path, n_ranks, mode, target="response"):
    out = tmp_path / f"imp_{mode}_{n_ranks}_{target}.pt"
    env = {**os.environ, **cpu_env(), "VERL_USE_EXTERNAL_PLUGINS": "none"}
    proc = subprocess.run([sys.executable, str(JOB), str(model_dir), str(out), str(n_ranks), mode,
                           new_ray_temp_dir(), target], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def core_reference(model_dir, res):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = OARConfig.from_mapping(res["config"])
    prompts, prompt_mask = pad_rows(res["prompts"], tok.pad_token_id, left=True)
    responses, response_mask = pad_rows(res["responses"], tok.pad_token_id, left=False)
    spans = locate_answer_spans(responses, response_mask, tok, cfg.answer_patterns)
    seeds = sequence_seeds(cfg.seed, 3, row_fingerprints(prompts, prompt_mask, responses, response_mask))
    attr = (responses, response_mask, spans.reasoning_mask, spans.answer_mask)
    if cfg.target == "reference":
        attr = build_reference_responses(responses, response_mask, spans.reasoning_mask,
                                         tok.encode(cfg.conclude_text, add_special_tokens=False),
                                         [tok.encode(t, add_special_tokens=False) for t in res["truths"]],
                                         tok.pad_token_id)
    imp = response_importance(model, prompts, prompt_mask, *attr, cfg, global_step=3,
                              mask_token_id=tok.pad_token_id, seeds=seeds)
    T = responses.shape[1]
    imp = torch.nn.functional.pad(imp, (0, max(0, T - imp.shape[1])))[:, :T]  # reasoning is a prefix of both
    return imp * response_mask, spans


def padded(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged).to_padded_tensor(0.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode,target", [("gradient", "response"), ("perturbation", "response"),
                                         ("perturbation", "reference")])
def test_two_ranks_equal_one_rank_and_core(tiny_assets, tmp_path, mode, target):
    two = run_job(tiny_assets.model_dir, tmp_path, 2, mode, target)
    ref, spans = core_reference(tiny_assets.model_dir, two)
    got = padded(two["token_importance"])
    assert got.shape == ref.shape
    assert (ref != 0).sum() > 10  # not vacuous
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(padded(two["reasoning"]).bool(), spans.reasoning_mask)
    assert two["span_found"].bool().tolist() == spans.found.tolist() == [True, True, True, True]
    # attribution leaves the policy as it was: the engine's log-probs are bit-identical before and after
    for a, b in zip(two["log_probs_before"], two["log_probs_after"]):
        assert torch.equal(a, b)
    if mode == "gradient":  # one rank: same result (noise is seeded per sequence, not per rank)
        one = run_job(tiny_assets.model_dir, tmp_path, 1, mode)
        torch.testing.assert_close(padded(one["token_importance"]), got, rtol=2e-3,
                                   atol=1e-6 * float(ref.abs().max()))
