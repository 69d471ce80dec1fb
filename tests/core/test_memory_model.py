"""The memory model's per-layer counts (oar_verl.core.backends.memory) against what autograd actually saves: every
tensor a layer's forward packs for its backward, counted through ``torch.autograd.graph.saved_tensors_hooks`` (once per
storage, parameters excluded), per token and layer as the difference between a 3-layer and a 1-layer model (so the
rotary tables and the final norm, saved once per forward, drop out). Deterministic: no timing, no allocator."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oar_verl.core.backends.memory import ModelShape
from oar_verl.core.backends.rules import conservative_rules

T = 48


def qwen2(layers: int, dtype: torch.dtype) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def saved_bytes(model: torch.nn.Module, *, train: bool, rule: str | None) -> int:
    """Bytes the forward of ``T`` tokens saves for backward (input-embedding gradient; parameter gradients too with
    ``train``), each storage once, the parameters not counted."""
    for p in model.parameters():
        p.requires_grad_(train)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(1, 100, (1, T), generator=torch.Generator().manual_seed(1))
    e = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    rules = conservative_rules(model, rule) if rule else contextlib.nullcontext()
    with rules, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=e)
    return sum(seen.values())


def per_layer(dtype: torch.dtype, *, train: bool = False, rule: str | None = None) -> float:
    """Saved elements (of the model's dtype) per token and decoder layer."""
    one, three = (saved_bytes(qwen2(n, dtype), train=train, rule=rule) for n in (1, 3))
    return (three - one) / 2 / T / (torch.finfo(dtype).bits // 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", [None, "values", "uniform"])
def test_frozen_input_gradient_layer_saves_what_the_model_counts(dtype, rule):
    """Attribution's passes (frozen weights): no linear keeps its input; HF's norms keep fp32 inputs, or under the
    rules their input and output."""
    shape = ModelShape.from_hf_config(qwen2(1, dtype).config, dtype)
    assert per_layer(dtype, rule=rule) == pytest.approx(shape.per_layer_saved_frozen(rules=rule is not None),
                                                        rel=0.005)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_layer_count_is_what_it_saves(dtype):
    """The training step's count (parameter gradients: every linear keeps its input) within 15 % of what it saves,
    and the frozen count well below it: a kept attribution layer is not sized as a training layer."""
    shape = ModelShape.from_hf_config(qwen2(1, dtype).config, dtype)
    measured = per_layer(dtype, train=True)
    assert shape.per_layer_saved() == pytest.approx(measured, rel=0.15)
    assert shape.per_layer_saved_frozen() < 0.8 * measured
