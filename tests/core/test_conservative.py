"""``mode=conservative`` (oar_verl.core.methods.conservative, oar_verl.core.backends.rules) against the float64
reference of its own definition (devtools/reference.py: a hand-written Qwen2 forward with the rules in it), the
conservation it is named for, and the rules' contract (values unchanged, everything restored, no silent fallback)."""

from __future__ import annotations

import pytest
import torch

from devtools import reference
from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.rules import conservative_rules
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.methods.conservative import conservative
from oar_helpers import relevance_and_target


def with_biases(model):
    """The model with random q/k/v biases (a random init has zero ones): the value path's bias must be the
    reference's too, the query and key biases must not matter."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


@pytest.fixture(scope="module")
def lm(make_lm):
    return with_biases(make_lm(torch.float64, seed=4))


def answered_rows(make_batch, seed: int):
    """A batch whose every row has reasoning and an answer (the target is the answer's log-probability)."""
    rows = make_batch(B=6, P=4, T=12, seed=seed)
    keep = rows[4].any(-1) & rows[5].any(-1)
    assert int(keep.sum()) >= 3
    return tuple(t[keep] for t in rows)


@pytest.mark.parametrize("kind", [ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT])
@pytest.mark.parametrize("tokens,checkpointing", [(10**6, True), (16, False)])  # one pass; a pass per row
def test_matches_the_float64_reference_of_its_definition(lm, make_batch, kind, tokens, checkpointing):
    rows = answered_rows(make_batch, seed=5)
    batch = build_attribution_batch(*rows, torch.full((rows[0].shape[0],), int(kind)))
    got, passes = conservative(ModuleBackend(lm, PassLimits(tokens), checkpointing=checkpointing), batch)
    ref = reference.batch_conservative(lm, *rows, kind)
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    assert int((ref != 0).sum()) > 10 and (ref < 0).any() and (ref > 0).any()  # signed relevance
    assert bool((got[~batch.reasoning_mask] == 0).all())
    assert (passes == 1) == (tokens > 10**5)


@pytest.mark.parametrize("kind", [ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN])
def test_uniform_attention_matches_the_float64_reference_of_its_definition(lm, make_batch, kind):
    """``attention_rule=uniform`` (AttnLRP's half rule on q·k and P·V, the softmax plain) on sdpa through gradient
    scaling against the reference's explicit half-sums of one-factor-detached products; and it is another ranking."""
    rows = answered_rows(make_batch, seed=5)
    batch = build_attribution_batch(*rows, torch.full((rows[0].shape[0],), int(kind)))
    got, _ = conservative(ModuleBackend(lm, PassLimits(10**6), checkpointing=True), batch, "uniform")
    ref = reference.batch_conservative(lm, *rows, kind, attention_rule="uniform")
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    values = reference.batch_conservative(lm, *rows, kind)
    assert float((ref - values).abs().max()) > 1e-3 * float(values.abs().max())


def test_through_the_registry_with_any_probe_and_budget_invariant(lm, make_batch):
    rows = answered_rows(make_batch, seed=8)
    kinds = torch.tensor([ProbeKind.AS_MEAN, ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT][: rows[0].shape[0]]
                         + [ProbeKind.AS_MEAN] * max(0, rows[0].shape[0] - 3))
    batch = build_attribution_batch(*rows, kinds)
    cfg = OARConfig(mode="conservative")
    big = run_attribution(module_backend(lm, cfg, limits=PassLimits(10**6)), batch, cfg).importance
    small = run_attribution(module_backend(lm, cfg, limits=PassLimits(12)), batch, cfg).importance
    torch.testing.assert_close(big, small, rtol=1e-9, atol=1e-12)


def gemma3(seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).double().eval()
    with torch.no_grad():  # Gemma's norms scale by (1 + w): random w, so the rule sees a real scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("family,attention", [("qwen2", "sdpa"), ("qwen2", "eager"), ("gemma3", "sdpa"),
                                              ("gemma3", "eager")])
def test_relevance_is_conserved(make_lm, family, attention):
    """Under the rules the network is linear in its input embeddings and biases: the relevance of every input token
    plus the biases' share is the target's linear part, z_a − E_p[z] (the log-softmax's own normaliser, the only
    non-linearity left, contributes −E_p[z]). Qwen2 (attention biases) and Gemma 3 (scaled embeddings, (1 + w) norms,
    query/key norms, GELU, a sliding window shorter than the row)."""
    model = with_biases(make_lm(torch.float64, seed=2)) if family == "qwen2" else gemma3()
    model.set_attn_implementation(attention)
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(1, 50, (14,), generator=torch.Generator().manual_seed(3))
    relevance, share, target = relevance_and_target(model, ids, 11, int(ids[12]))
    assert relevance + share == pytest.approx(target, rel=1e-9, abs=1e-12)
    assert abs(relevance) > 1e-3 and (family == "gemma3" or abs(share) > 1e-6)  # the biases do carry some
    # without the rules the same sum is not conserved (the check can fail)
    e = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
    z = model(inputs_embeds=e).logits[0, 11]
    (g,) = torch.autograd.grad(torch.log_softmax(z, -1)[int(ids[12])], e)
    assert abs(float((g * e).sum()) + share - target) > 1e-3


@pytest.mark.parametrize("rule", ["values", "uniform"])
def test_rules_keep_every_value_and_restore_the_model(lm, rule):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.randint(1, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = lm(ids).logits
        with conservative_rules(lm, rule):
            inside = lm(ids).logits
    assert torch.equal(inside, before)
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    with pytest.raises(RuntimeError, match="boom"), conservative_rules(lm, rule):
        raise RuntimeError("boom")
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == local
    assert not any("forward" in m.__dict__ for m in lm.modules())
    assert not any(m._forward_hooks for m in lm.modules())
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, before)


def test_every_configurable_attention_rule_is_implemented():
    """The names `algorithm.oar.attention_rule` accepts (the config's one list) are the rules this module applies, and
    any other is refused before the model is touched."""
    from oar_verl.core.backends import rules
    from oar_verl.core.config import ATTENTION_RULES

    assert set(rules.ATTENTION_RULE_INPUTS) == set(ATTENTION_RULES)
    with pytest.raises(ValueError, match="attention_rule must be one of"), conservative_rules(torch.nn.Linear(2, 2),
                                                                                             "probabilities"):
        pass


def test_a_family_without_the_rules_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40)).eval()
    with pytest.raises(ValueError, match="mode=conservative: GPT2LMHeadModel is not covered by the conservative rules: "
                       "a norm other than RMSNorm: LayerNorm; use mode=fisher"), conservative_rules(model):
        pass


def test_uniform_attention_is_the_same_on_every_attention_implementation():
    """The uniform rule wraps the registered implementation (sdpa) and the modelling module's eager function alike:
    Gemma 3 (query/key norms, a sliding window shorter than the row) gives the same relevance on both (to the eager
    function's float32 softmax, 5e-8 in the logits themselves) and another one than ``values``."""
    ids = torch.randint(1, 50, (14,), generator=torch.Generator().manual_seed(3))
    got = []
    for attention in ("sdpa", "eager"):
        model = gemma3()
        model.set_attn_implementation(attention)
        got.append(reference.conservative(model, ids, list(range(2, 10)), [11, 12], ProbeKind.AS_MEAN, on_module=True,
                                          attention_rule="uniform"))
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-8)
    values = reference.conservative(model, ids, list(range(2, 10)), [11, 12], ProbeKind.AS_MEAN, on_module=True)
    assert float((got[1] - values).abs().max()) > 1e-2 * float(values.abs().max()) > 1e-6


@pytest.mark.parametrize("fused", [False, True])
def test_the_norm_rule_through_a_module_s_output_equals_the_held_scale(fused):
    """Megatron's form of the norm rule (:func:`norm_scale_held`: the module's own backward plus x s² ⟨out − b, g⟩ / H)
    equals holding the scale constant (:func:`linear_rule` on the norm), in float64, for a plain RMSNorm and for one
    fused with the linear after it (TransformerEngine's layout; the bias inside the output), where neither the norm's
    weight nor the linear is read."""
    from oar_verl.core.backends.rules import linear_rule, norm_scale_held

    g = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(16, eps=1e-5, dtype=torch.float64)
    linear = torch.nn.Linear(16, 24, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    after = linear if fused else torch.nn.Identity()
    x = (3 * torch.randn(3, 5, 16, dtype=torch.float64, generator=g)).requires_grad_()
    up = torch.randn(3, 5, 24 if fused else 16, dtype=torch.float64, generator=g)
    (want,) = torch.autograd.grad(after(linear_rule(norm, x)), x, up)
    out = after(norm(x))
    (got,) = torch.autograd.grad(norm_scale_held(x, out, 1e-5, bias=linear.bias if fused else None), x, up)
    (plain,) = torch.autograd.grad(after(norm(x)), x, up)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(plain, want, rtol=1e-3)  # the rule changes the gradient
    assert torch.equal(norm_scale_held(x, out, 1e-5), out)  # and not the value


@pytest.mark.parametrize("act", [torch.nn.functional.silu, torch.nn.functional.gelu])
def test_the_gated_rule_on_a_concatenated_first_layer_equals_the_module_rules(act):
    """Megatron's gated MLP (``linear_fc1`` outputs [gate, up]): :func:`gated_half` gives [gate, up] the gradient of
    the identity rule on act and the half rule on the product, as the Hugging Face rules do, the value untouched."""
    from oar_verl.core.backends.rules import gated_half, linear_rule

    def half_rule(a, u):  # a · u with half the gradient to each factor (the value a · u)
        return 0.5 * (a * u.detach()) + 0.5 * (a.detach() * u)

    y = torch.randn(3, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    gate, up = y.chunk(2, dim=-1)
    h = act(gate) * up
    grad = torch.randn_like(h)
    (want,) = torch.autograd.grad(half_rule(linear_rule(act, gate), up), y, grad)
    (got,) = torch.autograd.grad(gated_half(y, h, act), y, grad)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(gated_half(y, h, act), h)


# ---------------------------------------------------------------------------------------------------------------------
# kernels bound on the instances (Liger), post-head transforms, refusals (issue: the default where users train)
# ---------------------------------------------------------------------------------------------------------------------


def _liger_norm_forward(self, hidden_states):
    """An RMSNorm kernel computing the same function in another order (as Liger's Triton kernel does)."""
    x = hidden_states.to(torch.float64)
    return (self.weight * (x / torch.sqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon))).to(
        hidden_states.dtype)


def _liger_swiglu_forward(self, x):
    """A fused SwiGLU kernel: silu(g)·u as one expression (Liger's ``LigerSiLUMulFunction``)."""
    g = self.gate_proj(x)
    return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))


def bind_liger_like(model) -> dict:
    """Bind the kernels on the module instances the way Liger's ``_apply_liger_kernel_to_instance`` does
    (``module.forward = MethodType(kernel, module)``); returns {module: the bound forward}."""
    import types

    bound = {}
    for m in model.modules():
        kernel = (_liger_norm_forward if type(m).__name__.endswith("RMSNorm")
                  else _liger_swiglu_forward if hasattr(m, "gate_proj") else None)
        if kernel is not None:
            m.forward = bound[m] = types.MethodType(kernel, m)
    return bound


def test_kernels_bound_on_the_instances_are_ruled_and_kept(make_lm):
    """With Liger-style kernels bound on the norm and MLP instances, the forward under the rules is those kernels'
    (values bitwise), relevance is conserved through them, and afterwards every instance holds exactly the kernel it
    held before (the update runs Liger's kernels again, not Hugging Face's)."""
    model = with_biases(make_lm(torch.float64, seed=2))
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(1, 50, (14,), generator=torch.Generator().manual_seed(3))
    plain = relevance_and_target(model, ids, 11, int(ids[12]))
    bound = bind_liger_like(model)
    assert len(bound) >= 6
    with torch.no_grad():
        before = model(ids[None]).logits
        with conservative_rules(model):
            inside = model(ids[None]).logits
    assert torch.equal(inside, before)
    relevance, share, target = relevance_and_target(model, ids, 11, int(ids[12]))
    assert relevance + share == pytest.approx(target, rel=1e-9, abs=1e-12)
    assert relevance == pytest.approx(plain[0], rel=1e-6)  # the same function (rounded otherwise): HF kernels' relevance
    assert all(m.__dict__["forward"] is f for m, f in bound.items())  # the very objects, still on the instances
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"), conservative_rules(model):
        raise RuntimeError("boom")
    assert all(m.__dict__["forward"] is f for m, f in bound.items())


def gemma2(seed: int = 0, softcap: float | None = 3.0):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, sliding_window=4, final_logit_softcapping=softcap,
                       attn_logit_softcapping=5.0, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
        model.lm_head.weight.mul_(8.0)  # logits past the cap's linear range: the soft-cap matters
    return model


def test_a_soft_capped_head_is_ruled_and_relevance_conserved():
    """Gemma 2's final soft-cap c·tanh(z/c) after the head: under the rules it is applied at the head by the identity
    rule (the model's own switched off for the duration), so the forward's logits are bitwise the model's and the
    relevance sums to the soft-capped target's linear part; the config is restored after."""
    model = gemma2()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(1, 50, (14,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids[None]).logits
        raw = model.lm_head(model.model(ids[None]).last_hidden_state)
        assert float((before - raw).abs().max()) > 1.0  # the cap bends these logits
        with conservative_rules(model):
            assert model.config.final_logit_softcapping is None
            inside = model(ids[None]).logits
    assert torch.equal(inside, before) and model.config.final_logit_softcapping == 3.0
    relevance, share, target = relevance_and_target(model, ids, 11, int(ids[12]))
    assert relevance + share == pytest.approx(target, rel=1e-9, abs=1e-12)


def test_an_eager_attention_without_its_function_is_refused(lm, monkeypatch):
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    lm.set_attn_implementation("eager")
    try:
        monkeypatch.delattr(qwen2, "eager_attention_forward")
        with pytest.raises(ValueError, match="eager attention of .*modeling_qwen2 has no eager_attention_forward"), \
                conservative_rules(lm):
            pass
    finally:
        lm.set_attn_implementation("sdpa")


def test_an_attention_bypassing_the_interface_fails_instead_of_running_unruled(make_lm):
    """An attention whose forward never calls transformers' attention interface (a custom kernel) would pass plain
    gradients: the forward raises, naming it."""
    import types

    model = make_lm(torch.float64, seed=2)
    attention = next(m for m in model.modules() if type(m).__name__ == "Qwen2Attention")

    def bypass(self, hidden_states, *args, **kwargs):
        return self.o_proj(self.v_proj(hidden_states).repeat(1, 1, 2)), None

    attention.forward = types.MethodType(bypass, attention)
    with pytest.raises(RuntimeError, match="Qwen2Attention ran without transformers' attention interface"):
        with conservative_rules(model), torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))


def test_a_mixture_of_experts_is_refused():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="a mixture of 4 experts: .*use mode=fisher"), conservative_rules(model):
        pass
