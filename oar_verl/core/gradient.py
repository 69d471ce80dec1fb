"""OAR-G: gradient x input saliency of the outcome (docs/method.md §4, with the official code's gradient leak and
LT-Logits position fixed, §7).

Per round (rows packed under the token budget, :mod:`oar_verl.core.budget`): a clean no-grad pass gives the teacher
p0 (or φ0); the student pass adds seeded Gaussian noise of std σ to the reasoning-token embeddings,
J = KL(p0 ‖ p_noisy) (or φ0 − φ_noisy), and the score is |⟨∂J/∂e_t, e_t⟩| with the clean embedding e_t.

With K noise draws (``algorithm.oar.noise_samples``) each row becomes K *draw rows* e = b·K + k (row b, draw k, with
the seed :func:`draw_seeds` gives it) and the score is the mean of the K single-draw scores. Draw rows are packed like
rows, so a row's K draws share a round while the budget allows and spread over more rounds when not (every round stays
within the budget); a round's clean teacher pass runs once per distinct row in it, not once per draw.

The noise is what makes the gradient non-zero: at p_noisy = p0 the KL sits at its minimum. Gradients are taken with
respect to the embedding output only: the embedding module's forward hook returns a detached leaf, and every model
parameter is frozen for the pass, so no parameter gradient is created (no leak into the policy update, no optimizer
or FSDP reduce-scatter work) and the backward skips all weight-gradient matmuls.

Memory: under gradient checkpointing (the actor's setting) the student pass keeps only each layer's input and
recomputes one layer at a time in the backward, like the training step; it still runs with eval numerics (no
dropout), because only the decoder layers' own ``training`` flags are raised, which Hugging Face reads to decide on
checkpointing, not their submodules', which decide on dropout. Logits exist only at probe positions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.utils.checkpoint

from oar_verl.core.budget import PassLimits, pack_rows
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.memory import PassKind
from oar_verl.core.perturbation import column_window
from oar_verl.core.probes import logits_at, outcome_shift, probe_forward, probe_from_logits, probe_keep_positions

logger = logging.getLogger("oar_verl")

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


def draw_seeds(seeds: torch.Tensor, samples: int) -> torch.Tensor:
    """(B, K) int64 seeds of the K noise draws of every row: draw 0 is the row's own seed (K = 1 is the single-draw
    method, unchanged), draw k >= 1 a splitmix64-style mix of (the row's seed, k).

    Args:
        seeds: (B,) int64 per-sequence seeds (:func:`sequence_seeds`).
        samples: K >= 1, the noise draws per row (``algorithm.oar.noise_samples``).
    """
    k = torch.arange(samples, dtype=torch.long, device=seeds.device)
    x = seeds.long()[:, None] * _MIX[2] + k * _MIX[0]
    x = x ^ (x >> 30)
    x = x * _MIX[1]
    x = x ^ (x >> 27)
    return torch.where(k == 0, seeds.long()[:, None], x.remainder(_SEED_MOD))


def _s64(c: int) -> int:
    """The signed int64 with the same bits as the unsigned 64-bit ``c``."""
    return c - 2**64 if c >= 2**63 else c


def _noise_rows(reasoning_mask: torch.Tensor, hidden_size: int, noise_std: float, seeds: torch.Tensor) -> torch.Tensor:
    """(n, H) float32 noise for the n reasoning tokens of a (b, L) mask, in row-major order: the k-th reasoning token of
    row i gets draw k of a generator seeded with ``seeds[i]``."""
    device = reasoning_mask.device
    counts = reasoning_mask.sum(-1).tolist()  # host metadata, once per round
    seed_list = seeds.tolist()
    draws = [torch.randn(n, hidden_size, generator=torch.Generator(device=device).manual_seed(int(seed_list[i])),
                         device=device) for i, n in enumerate(counts) if n]  # one generator per row, not per token
    if not draws:
        return torch.zeros(0, hidden_size, device=device)
    return torch.cat(draws) * noise_std


def reasoning_noise(reasoning_mask: torch.Tensor, hidden_size: int, noise_std: float, seeds: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """(b, L, H) noise: the k-th reasoning token of row i gets draw k of a generator seeded with ``seeds[i]``.

    Noise therefore depends only on (seed, the row's reasoning tokens), not on padding, micro-batch or rank.
    """
    b, L = reasoning_mask.shape
    noise = torch.zeros(b, L, hidden_size, device=reasoning_mask.device, dtype=dtype)
    noise[reasoning_mask] = _noise_rows(reasoning_mask, hidden_size, noise_std, seeds).to(dtype)
    return noise


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


@contextlib.contextmanager
def layer_checkpointing(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Gradient checkpointing of the decoder layers for the duration, with eval numerics.

    Hugging Face decoder layers (``GradientCheckpointingLayer``) checkpoint when their ``gradient_checkpointing`` and
    ``training`` flags are both set; dropout reads the flags of their submodules. So the layers' own ``training`` flags
    are raised (and checkpointing switched on where the model did not enable it), nothing else, and all is restored
    after. Models without such layers run unchanged (logged once).
    """
    if not enabled:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        _warn_once("oar: the model has no Hugging Face checkpointing layers; OAR-G runs without gradient checkpointing")
    saved = [(m, m.training, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    try:
        for m in layers:
            if not m.gradient_checkpointing:
                m.gradient_checkpointing = True
                m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                   use_reentrant=False)
            m.training = True  # this module only: its submodules (dropout) stay in eval
        yield
    finally:
        for m, training, checkpointing, func in saved:
            m.training, m.gradient_checkpointing = training, checkpointing
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def draw_packs(attention_mask: torch.Tensor, limits: PassLimits, samples: int) -> list[torch.Tensor]:
    """Rounds of draw rows under the token budget: draw row e = b·K + k is row b under noise draw k, as wide as row b.

    Args:
        attention_mask: (B, L) 0/1 of the batch.
        limits: the token budget of one round.
        samples: K >= 1 draws per row.

    Returns:
        Rounds, each a sorted (n,) long tensor of draw rows in [0, B·K) (a row's draws are adjacent, so they share a
        round while the budget allows).
    """
    return pack_rows(attention_mask.repeat_interleave(samples, 0), limits, PassKind.INPUT_GRADIENT)


def collective_rounds(batch: AttributionBatch, limits: PassLimits, samples: int = 1) -> int:
    """Rounds (clean forward + noisy forward/backward) :func:`oar_g_importance` runs on this batch with ``samples``
    noise draws per row.

    Data-parallel ranks must run equally many rounds (sharded parameters are all-gathered in the forward and again
    in the backward); the worker all-reduces the max of this number and passes it as ``min_rounds``.
    """
    return len(draw_packs(batch.attention_mask, limits, samples))


def oar_g_importance(model: torch.nn.Module, batch: AttributionBatch, noise_std: float, seeds: torch.Tensor,
                     limits: PassLimits, min_rounds: int = 0, checkpointing: bool = False,
                     samples: int = 1) -> torch.Tensor:
    """OAR-G importance of every reasoning token: the mean over ``samples`` noise draws of the single-draw score.

    Args:
        model: Hugging Face causal LM (or a sharded wrapper) with ``get_input_embeddings()``, in eval mode.
        batch: AttributionBatch (B, L), B >= 1 when ``min_rounds`` > 0.
        noise_std: σ of the Gaussian embedding noise (absolute).
        seeds: (B,) int64 per-sequence seeds (see :func:`sequence_seeds`); draw k of row b uses
            ``draw_seeds(seeds, samples)[b, k]`` (draw 0: ``seeds[b]`` itself).
        limits: the token budget of one round (and optional caps and memory guard); it bounds the draw rows of a round.
        min_rounds: run at least this many rounds (the max of :func:`collective_rounds` over data-parallel ranks, so
            that every rank issues the same collectives); extra rounds repeat the first row's and are discarded.
        checkpointing: checkpoint the decoder layers in the student pass (see :func:`layer_checkpointing`).
        samples: K >= 1 noise draws per row (``algorithm.oar.noise_samples``); K = 1 is the single-draw method.

    Returns:
        (B, L) float32 mean over the K draws of |⟨∂J/∂e_t, e_t⟩| at reasoning positions, 0 elsewhere. No parameter of
        ``model`` has a gradient or a changed requires_grad flag afterwards.
    """
    device = batch.input_ids.device
    B, L = batch.input_ids.shape
    per_draw = torch.zeros(B * samples, L, dtype=torch.float32, device=device)  # (B·K, L): draw row e = b·K + k
    packs = draw_packs(batch.attention_mask, limits, samples)
    if min_rounds > len(packs) and B == 0:
        raise ValueError("min_rounds needs at least one local row to repeat")
    draw_seed = draw_seeds(seeds, samples).reshape(-1)  # (B·K,)
    filler = torch.zeros(1, dtype=torch.long, device=device)
    with frozen_parameters(model), layer_checkpointing(model, checkpointing):
        for r in range(max(len(packs), min_rounds)):
            draws = packs[r] if r < len(packs) else filler
            lo, hi, sal = _saliency_round(model, batch, draws // samples, noise_std, draw_seed[draws])
            if r < len(packs):
                per_draw[draws, lo:hi] = sal
    return per_draw.view(B, samples, L).mean(1)


def _saliency_round(model: torch.nn.Module, batch: AttributionBatch, rows: torch.Tensor, noise_std: float,
                    row_seeds: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """One round over ``rows`` (b,) sorted batch rows, repeats allowed (a row's noise draws), with ``row_seeds`` (b,)
    their noise seeds: returns the column window [lo, hi) and the (b, hi - lo) saliency (0 off reasoning). The clean
    teacher pass runs on the distinct rows only."""
    lo, hi = column_window(batch.attention_mask, rows)
    inputs = batch.model_inputs(rows, lo, hi)
    spec = batch.probe.index(rows).columns(lo, hi)
    mask = batch.reasoning_mask[rows, lo:hi]
    distinct, of_row = torch.unique_consecutive(rows, return_inverse=True)
    with torch.no_grad():
        teacher = probe_forward(model, batch.probe.index(distinct).columns(lo, hi),
                                **batch.model_inputs(distinct, lo, hi)).index(of_row)
    captured: dict[str, torch.Tensor] = {}

    def add_noise(module, args, out):
        clean = out.detach()
        leaf = clean.clone()
        leaf[mask] += _noise_rows(mask, clean.shape[-1], noise_std, row_seeds).to(clean.dtype)
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
    # one row at a time: the fp32 product of a whole round would be another (b, L, H) buffer
    sal = torch.stack([(g.to(acc) * c.to(acc)).sum(-1) for g, c in zip(leaf.grad, clean)]).abs().float()
    return lo, hi, torch.where(mask, sal, 0.0)
