"""OAR-G: gradient x input saliency of the outcome (docs/method.md §4, with the official code's gradient leak and
LT-Logits position fixed, §7).

Per micro-batch: a clean no-grad pass gives the teacher p0 (or φ0); the student pass adds seeded Gaussian noise of std σ
to the reasoning-token embeddings, J = KL(p0 ‖ p_noisy) (or φ0 − φ_noisy), and the score is |⟨∂J/∂e_t, e_t⟩| with the
clean embedding e_t.

The noise is what makes the gradient non-zero: at p_noisy = p0 the KL sits at its minimum. Gradients are taken with
respect to the embedding output only: the embedding module's forward hook returns a detached leaf, and every model
parameter is frozen for the pass, so no parameter gradient is created (no leak into the policy update, no optimizer
or FSDP reduce-scatter work) and the backward skips all weight-gradient matmuls.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch

from oar_verl.core.layout import AttributionBatch
from oar_verl.core.perturbation import column_window
from oar_verl.core.probes import logits_at, outcome_shift, probe_forward, probe_from_logits, probe_keep_positions

_SEED_MOD = 2**63 - 1
_MIX = tuple(c - 2**64 if c >= 2**63 else c for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def sequence_seeds(seed: int, step: int, sequence_ids: torch.Tensor) -> torch.Tensor:
    """(B,) int64 per-sequence noise seeds from (seed, step, sequence id), independent of batching and DP layout.

    Args:
        seed, step: the configured base seed and the global training step.
        sequence_ids: (B,) int64 stable ids of the responses (e.g. a hash of verl's uid and the sample index).
    """
    # splitmix64-style mixing in wrapping int64 arithmetic, vectorised over the batch
    base = _s64(((seed * 1_000_003 + step) * _MIX[1]) % 2**64)
    x = sequence_ids.long() * _MIX[0] + base
    x = x ^ (x >> 31)
    x = x * _MIX[2]
    x = x ^ (x >> 29)
    return x.remainder(_SEED_MOD)


def _s64(c: int) -> int:
    """The signed int64 with the same bits as the unsigned 64-bit ``c``."""
    return c - 2**64 if c >= 2**63 else c


def reasoning_noise(reasoning_mask: torch.Tensor, hidden_size: int, noise_std: float, seeds: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """(b, L, H) noise: the k-th reasoning token of row i gets draw k of a generator seeded with ``seeds[i]``.

    Noise therefore depends only on (seed, the row's reasoning tokens), not on padding, micro-batch or rank.
    """
    b, L = reasoning_mask.shape
    device = reasoning_mask.device
    noise = torch.zeros(b, L, hidden_size, device=device, dtype=torch.float32)
    counts = reasoning_mask.sum(-1).tolist()  # host metadata, once per micro-batch
    seed_list = seeds.tolist()
    for i in range(b):  # one generator per sequence (per row, not per token)
        if counts[i]:
            gen = torch.Generator(device=device).manual_seed(int(seed_list[i]))
            noise[i][reasoning_mask[i]] = torch.randn(counts[i], hidden_size, generator=gen, device=device)
    return (noise * noise_std).to(dtype)


@contextlib.contextmanager
def frozen_parameters(params: torch.nn.Module | Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Set requires_grad=False on every parameter (of a module, or given) for the duration; restore the flags after."""
    params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)


def collective_rounds(batch: AttributionBatch, micro_batch_size: int) -> int:
    """Micro-batch rounds (clean forward + noisy forward/backward) :func:`oar_g_importance` runs on this batch.

    Data-parallel ranks must run equally many rounds (sharded parameters are all-gathered in the forward and again
    in the backward); the worker all-reduces the max of this number and passes it as ``min_rounds``.
    """
    return math.ceil(batch.input_ids.shape[0] / micro_batch_size)


def oar_g_importance(model: torch.nn.Module, batch: AttributionBatch, noise_std: float, seeds: torch.Tensor,
                     micro_batch_size: int = 8, min_rounds: int = 0) -> torch.Tensor:
    """OAR-G importance of every reasoning token.

    Args:
        model: Hugging Face causal LM (or a sharded wrapper) with ``get_input_embeddings()``, in eval mode.
        batch: AttributionBatch (B, L), B >= 1 when ``min_rounds`` > 0.
        noise_std: σ of the Gaussian embedding noise (absolute).
        seeds: (B,) int64 per-sequence seeds (see :func:`sequence_seeds`).
        micro_batch_size: rows per forward/backward.
        min_rounds: run at least this many rounds (the max of :func:`collective_rounds` over data-parallel ranks, so
            that every rank issues the same collectives); extra rounds repeat the first row's and are discarded.

    Returns:
        (B, L) float32 |⟨∂J/∂e_t, e_t⟩| at reasoning positions, 0 elsewhere. No parameter of ``model`` has a
        gradient or a changed requires_grad flag afterwards.
    """
    device = batch.input_ids.device
    B = batch.input_ids.shape[0]
    scores = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    n_rounds = collective_rounds(batch, micro_batch_size)
    if min_rounds > n_rounds and B == 0:
        raise ValueError("min_rounds needs at least one local row to repeat")
    with frozen_parameters(model):
        for r in range(max(n_rounds, min_rounds)):
            s = r * micro_batch_size if r < n_rounds else 0
            e = min(s + micro_batch_size, B) if r < n_rounds else 1
            rows = torch.arange(s, e, device=device)
            lo, hi, sal = _saliency_round(model, batch, rows, noise_std, seeds)
            if r < n_rounds:
                scores[rows, lo:hi] = sal
    return scores


def _saliency_round(model: torch.nn.Module, batch: AttributionBatch, rows: torch.Tensor, noise_std: float,
                    seeds: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """One micro-batch: returns the column window [lo, hi) and the (b, hi - lo) saliency (0 off reasoning)."""
    lo, hi = column_window(batch.attention_mask, rows)
    inputs = batch.model_inputs(rows, lo, hi)
    spec = batch.probe.index(rows).columns(lo, hi)
    mask = batch.reasoning_mask[rows, lo:hi]
    with torch.no_grad():
        teacher = probe_forward(model, spec, **inputs)
    captured: dict[str, torch.Tensor] = {}

    def add_noise(module, args, out):
        clean = out.detach()
        leaf = (clean + reasoning_noise(mask, clean.shape[-1], noise_std, seeds[rows], clean.dtype))
        leaf.requires_grad_(True)
        captured["clean"], captured["leaf"] = clean, leaf
        return leaf

    handle = model.get_input_embeddings().register_forward_hook(add_noise)
    try:
        with torch.enable_grad():
            keep = probe_keep_positions(spec)
            logits = logits_at(model, keep, **inputs)
            student = probe_from_logits(logits, spec.logit_weight[:, keep], spec.target_ids[:, keep], spec.joint)
            # rows are independent in a forward pass, so the sum gives each row its own gradient
            J = outcome_shift(teacher, student, spec.joint).sum()
            # plain backward works with every gradient-checkpointing mode (autograd.grad does not with reentrant
            # checkpoints); the leaf is the only tensor that requires grad, so only it receives .grad
            J.backward()
    finally:
        handle.remove()
    leaf, clean = captured["leaf"], captured["clean"]
    acc = torch.promote_types(clean.dtype, torch.float32)  # bf16 products would cancel badly in the sum
    sal = (leaf.grad.to(acc) * clean.to(acc)).sum(-1).abs().float()
    return lo, hi, torch.where(mask, sal, 0.0)
