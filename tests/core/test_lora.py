"""Attribution on a LoRA (PEFT) policy, as verl's ``lora_rank`` and OpenRLHF's ``--ds.lora.rank`` build it: the
adapter wraps q/k/v/o and the MLP's projections, and the scores equal those of the same function with the adapter
merged into the weights, for every clean-point method (the conservative rules find the wrapped projections) and read
from the caller's forward."""

from __future__ import annotations

import copy

import pytest
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.methods.attribution import shared_attribution

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_and_merged(make_lm):
    base = make_lm(torch.float64, seed=6)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation, which would make it the base model
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    merged = copy.deepcopy(lora).merge_and_unload()
    return lora.eval(), merged.eval(), base


def batch_of(make_batch):
    rows = make_batch(B=4, P=4, T=12, seed=9)
    return build_attribution_batch(*rows, torch.tensor([ProbeKind.AS_MEAN, ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT,
                                                        ProbeKind.AS_MEAN]))


@pytest.mark.parametrize("mode", ["conservative", "fisher", "gradient"])
def test_lora_scores_equal_the_merged_weights(lora_and_merged, make_batch, mode):
    lora, merged, base = lora_and_merged
    batch = batch_of(make_batch)
    cfg = OARConfig(mode=mode, noise_std=1e-3)
    seeds = torch.arange(4)
    got = run_attribution(module_backend(lora, cfg), batch, cfg, seeds=seeds).importance
    want = run_attribution(module_backend(merged, cfg), batch, cfg, seeds=seeds).importance
    plain = run_attribution(module_backend(base, cfg), batch, cfg, seeds=seeds).importance
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    assert not torch.allclose(got, plain)  # the adapter changed the function, and the scores with it
    assert int((got != 0).sum()) > 10


@pytest.mark.parametrize("mode", ["conservative", "fisher"])
def test_lora_shared_forward_equals_its_own_passes(lora_and_merged, make_batch, mode):
    lora = lora_and_merged[0]
    batch = batch_of(make_batch)
    cfg = OARConfig(mode=mode)
    shared = shared_attribution(lora, batch, cfg, False)
    for r in torch.arange(4).split(2):
        inputs = batch.model_inputs(r)
        with torch.no_grad(), shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
            lora(**inputs, use_cache=False)
    own = run_attribution(module_backend(lora, cfg), batch, cfg).importance
    torch.testing.assert_close(shared.result(), own, rtol=1e-6, atol=1e-12)
