"""The rules' backward as it was before its passes were cut (issue #69 item 5) against the backward now: the same bits.

The reference is the earlier code, kept verbatim in research/rule_overhead.py (which times it): the ratio with its
zeros masked by a bool mask, the gated MLP's gradients formed in fresh tensors. The speed-up divides in place and sets the quotient's non-finite entries to 0
(x = 0 gives ±inf or nan there); every value must be unchanged, the elementwise functions' and the scores'."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core.backends import rules
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.methods.conservative import conservative
# the earlier code, kept once beside the measurement that times it against the present code
from research.rule_overhead import EarlierGatedHalf as ReferenceGatedHalf
from research.rule_overhead import earlier_ratio_times as reference_ratio_times


def with_zeros(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.view(-1)[:: 7] = 0  # exact zeros: the masked entries
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_ratio_is_bitwise_the_masked_one(dtype):
    x, grad = with_zeros((3, 5, 40), dtype, 0), with_zeros((3, 5, 40), dtype, 1)
    for out in (torch.nn.functional.silu(x), torch.tanh(x) * 2, x * 0.5, torch.zeros_like(x)):
        assert torch.equal(rules.ratio_times(grad, out, x), reference_ratio_times(grad, out, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [torch.nn.functional.silu, torch.nn.functional.gelu, lambda t: t])
def test_the_gated_rule_s_gradients_are_bitwise_the_earlier_ones(dtype, act):
    g, u, grad = (with_zeros((2, 6, 48), dtype, s) for s in (2, 3, 4))
    h = (act(g.float()) * u.float()).to(dtype)
    got, want = [], []
    for fn, out in ((rules._GatedHalf.apply, got), (ReferenceGatedHalf.apply, want)):
        gl, ul = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
        out += torch.autograd.grad(fn(gl, ul, h, act), (gl, ul), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(g, with_zeros((2, 6, 48), dtype, 2))  # the saved input left as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["values", "uniform"])
def test_the_default_s_scores_are_bitwise_the_earlier_ones(make_lm, make_batch, monkeypatch, dtype, rule):
    lm = make_lm(dtype, seed=4)
    rows = make_batch(B=4, P=4, T=12, seed=5)
    batch = build_attribution_batch(*rows, torch.full((4,), int(ProbeKind.AS_MEAN)))

    def scores():
        return conservative(ModuleBackend(lm, PassLimits(10**6), checkpointing=True), batch, rule)[0]

    got = scores()
    monkeypatch.setattr(rules, "ratio_times", reference_ratio_times)
    monkeypatch.setattr(rules, "_GatedHalf", ReferenceGatedHalf)
    want = scores()
    assert torch.equal(got, want) and bool((got != 0).any())
