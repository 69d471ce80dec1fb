"""The tests' shorthands over the public API (:func:`oar_verl.core.run_attribution` on :func:`module_backend`), and
pass counts from the methods' own plans (what a run must issue), for the core, integration and multi-rank tests; and
a tiny sliding-window Gemma 3. tests/conftest.py puts this folder on sys.path."""

from __future__ import annotations

import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.base import plan_draws
from oar_verl.core.backends.hf import ModuleBackend
from oar_verl.core.backends.rules import conservative_rules
from oar_verl.core.methods.fisher import fisher_plan
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.methods.perturbation import mask_blocks, oar_p_passes


def run_p(model, batch, mask_token_id: int, limits, *, prefix_cache: bool = True, mask_span: int = 1,
          align_to: int = 0, **options) -> torch.Tensor:
    """(B, L) OAR-P importance (exact unless ``options`` say otherwise) through run_attribution; ``align_to``: run at
    least that many passes (the data-parallel alignment of a rank with less to do). The mask is the token
    ``mask_token_id`` (``mask=pad``, the run-time token) unless ``options`` name another operator."""
    options.setdefault("mask", "pad")
    cfg = OARConfig(mode="perturbation", prefix_cache=prefix_cache, mask_span=mask_span, **options)
    backend = module_backend(model, cfg, limits=limits, align=lambda n: max(n, align_to))
    return run_attribution(backend, batch, cfg, mask_token_id=mask_token_id).importance


def run_g(model, batch, noise_std: float, seeds: torch.Tensor, limits, *, samples: int = 1,
          checkpointing: bool = False, align_to: int = 0) -> torch.Tensor:
    """(B, L) OAR-G importance with ``samples`` noise draws through run_attribution."""
    cfg = OARConfig(mode="gradient", noise_std=noise_std, noise_samples=samples)
    backend = module_backend(model, cfg, limits=limits, checkpointing=checkpointing, align=lambda n: max(n, align_to))
    return run_attribution(backend, batch, cfg, seeds=seeds).importance


def count_p(batch, limits, prefix_cache: bool = True, mask_span: int = 1) -> int:
    """Passes exact OAR-P plans on ``batch`` with a plain module (each a collective pass under sharding)."""
    backend = ModuleBackend(None, limits, prefix_cache=prefix_cache)
    return len(oar_p_passes(backend, batch, mask_blocks(batch.reasoning_mask, mask_span), 0))


def count_g(batch, limits, samples: int = 1) -> int:
    """Student passes OAR-G (or fisher, with ``samples`` outcomes) plans on ``batch`` with a plain module."""
    return len(plan_draws(ModuleBackend(None, limits), batch, samples, PassKind.INPUT_GRADIENT)[1])


def count_passes(batch, cfg: OARConfig, limits, shards=None) -> int:
    """Passes the configured exact method plans on ``batch`` with a module backend (sharded with ``shards``)."""
    backend = module_backend(None, cfg, limits=limits, shards=shards)
    if cfg.mode == "perturbation":
        return len(oar_p_passes(backend, batch, mask_blocks(batch.reasoning_mask, cfg.mask_span), 0))
    if cfg.mode == "fisher":
        return len(fisher_plan(backend, batch, cfg.fisher_outcomes, cfg.fisher_sketches)[3])
    return len(plan_draws(backend, batch, cfg.noise_samples, PassKind.INPUT_GRADIENT)[1])


def fidelity_of(backend, batch, mask_token_id: int = 0) -> torch.Tensor:
    """(4, B) :data:`oar_verl.core.fidelity.step.FIELDS` of the in-step fidelity metric of a fixed random ranking (a
    function of the local row index and the columns) on any backend, its removal sets run as masked copies."""
    from oar_verl.core.backends.base import Replacement
    from oar_verl.core.fidelity.step import FIELDS, deletion_metrics

    scores = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = deletion_metrics(backend, batch, scores, replacement=Replacement(token=mask_token_id), fractions=(0.2, 0.5),
                           random_rankings=2, seed=4)
    return torch.stack([got[k].cpu() for k in FIELDS])


def tiny_sliding_window_lm(window: int, layer_types: tuple[str, ...] | None = ("sliding_attention", "full_attention"),
                           **config) -> torch.nn.Module:
    """A tiny Gemma 3 in float64 (hidden 32, vocab 128, seed 0) with a sliding window of ``window`` tokens.

    Args:
        window: Gemma's ``sliding_window`` (a query attends to the ``window`` positions up to itself).
        layer_types: the layers, each ``"sliding_attention"`` or ``"full_attention"``; None: Gemma's own rule from
            ``num_hidden_layers`` and ``sliding_window_pattern`` in ``config`` (every pattern-th layer full).
        config: more Gemma3TextConfig keys.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if layer_types is not None:
        config = {"num_hidden_layers": len(layer_types), "layer_types": list(layer_types), **config}
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, sliding_window=window, max_position_embeddings=128,
                           **config)
    return Gemma3ForCausalLM(cfg).double().eval()


def text_lm(texts: list[str], vocab_size: int = 300):
    """(tokenizer, model): a byte-level BPE trained on ``texts`` and a float64 tiny Qwen2 over its vocabulary (seed 0,
    sdpa), its embeddings scaled up so that outcome shifts are not all ~0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oar_verl.quickstart.tokenizers import train_tiny_bpe

    tok = train_tiny_bpe(texts, vocab_size=vocab_size)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
    return tok, model


def relevance_and_target(model, ids: torch.Tensor, position: int, token: int, attention_rule: str = "values"):
    """Σ_t ⟨∂ℓ/∂e_t, e_t⟩ over every input token, the bias terms' share Σ_b ⟨∂ℓ/∂b, b⟩ and ℓ's linear part
    z_token − E_p[z] for ℓ = log p(token) at ``position``, under the rules (float64)."""
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    e = model.get_input_embeddings()(ids[None]).detach().requires_grad_(True)
    for b in biases:
        b.requires_grad_(True)
    try:
        with conservative_rules(model, attention_rule):
            z = model(inputs_embeds=e).logits[0, position]
            grads = torch.autograd.grad(torch.log_softmax(z, -1)[token], [e, *biases], allow_unused=True)
    finally:
        for b in biases:
            b.requires_grad_(False)
    share = sum(float((g * b).sum()) for g, b in zip(grads[1:], biases) if g is not None)
    z = z.detach()
    return float((grads[0] * e).sum()), share, float(z[token] - (z.softmax(-1) * z).sum())
