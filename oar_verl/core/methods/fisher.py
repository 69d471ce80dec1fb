"""``mode=fisher``: OAR-P's masking KL to second order, from clean-point gradients, at about OAR-G's cost; written
once over the backend interface (:mod:`oar_verl.core.backends.base`). Derivation, variance and cost: docs/method.md §11.

Token t's swap for the mask is the embedding move δ_t = e_mask − e_t, and I_t ≈ ½ Σ_v p_v ⟨∂ log p_v / ∂e_t, δ_t⟩²:
the top ``fisher_outcomes`` outcomes of each row's probe kept exactly, the rest sketched with ``fisher_sketches``
Rademacher sign vectors (unbiased; :func:`sketch_signs`); AS-Joint rows score −⟨∂φ/∂e_t, δ_t⟩. One clean forward and
K + S backwards per sequence (:func:`fisher_plan`: loss columns of one pass, or draw rows on Megatron).
"""

from __future__ import annotations

import torch

from oar_verl.core.backends.base import (AttributionBackend, EmbeddingHook, Pass, Replacement, collect, first_row,
                                   with_fillers)
from oar_verl.core.methods.gradient import embedding_projection
from oar_verl.core.batch.hashing import _uniform
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.methods.mask_operator import method_replacement, replacement_embedding
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.backends.shared import SharedTarget
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method
from oar_verl.core.methods.perturbation import as_replacement

_STREAM_SKETCH = 0x534B4554  # hash stream of the sketches' signs ("SKET"), apart from the fidelity metric's streams


def sketch_signs(seed: int, sketches: int, vocab_ids: torch.Tensor) -> torch.Tensor:
    """(S, V) float64 Rademacher signs s_{j,v} ∈ {−1, +1} of sketch j and global vocabulary id v (``vocab_ids`` (V,)
    long): a pure function of (seed, j, v), so a sign is the same whatever the vocabulary sharding, batching or rank.

    Args:
        seed: the configuration's ``seed``.
        sketches: S >= 1.
        vocab_ids: (V,) long global ids of the columns whose signs are wanted (a tensor-parallel rank's shard).
    """
    j = torch.arange(sketches, dtype=torch.long, device=vocab_ids.device)
    u = _uniform(seed, _STREAM_SKETCH, j[:, None], vocab_ids.long()[None, :])
    return torch.where(u < 0.5, -1.0, 1.0).double()


def fisher_plan(backend: AttributionBackend, batch: AttributionBatch, outcomes: int, sketches: int
                ) -> tuple[int, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The pass items of :func:`fisher` and their packs under the backend's token budget.

    A distribution row has C = K + S loss columns (its K top outcomes, then its S sketches), an AS-Joint row one (φ).
    Where one forward serves several backwards (``shared_backwards``) each row is one item with C columns; elsewhere
    (Megatron's schedule: one backward per micro-batch) each column is a *draw row* of its own, C of them for a
    distribution row and one for an AS-Joint row (no pass whose loss would be zero).

    Returns:
        (columns per item: C or 1; item_rows (N,) long: the batch row of each item; item_column (N,) long: the loss
        column of a one-column item (0 where items have C columns); packs: index packs into the items).
    """
    B = batch.input_ids.shape[0]
    C = outcomes + sketches
    device = batch.input_ids.device
    columns = C if backend.shared_backwards else 1
    joint = batch.probe.joint.to(device)
    draws = torch.where(joint, 1, C) if columns == 1 else torch.ones(B, dtype=torch.long, device=device)
    item_rows = torch.arange(B, device=device).repeat_interleave(draws)
    first = (draws.cumsum(0) - draws)[item_rows]  # each row's first item
    item_column = torch.arange(item_rows.shape[0], device=device) - first
    return columns, item_rows, item_column, backend.plan(batch, item_rows, PassKind.INPUT_GRADIENT)


def fisher_importance(projections: torch.Tensor, weights: torch.Tensor, joint: torch.Tensor) -> torch.Tensor:
    """(B, L) second-order masking scores from per-column first-order projections.

    Args:
        projections: (B, C, L) projection of column c: ⟨∂ log p_k / ∂e_t, δ_t⟩ of outcome k (c = k < K), ⟨∂L_j/∂e_t,
            δ_t⟩ of sketch j (c = K + j); AS-Joint rows: ⟨∂φ/∂e_t, δ_t⟩ at c = 0.
        weights: (B, C) p_k of an outcome column (its clean probability), 1/S of a sketch column.
        joint: (B,) bool AS-Joint rows.

    Returns:
        (B, L) float32: ½ Σ_c weight_c projection_c² (distribution probes), −projection_0 (AS-Joint).
    """
    quadratic = 0.5 * (weights[:, :, None] * projections.square()).sum(1)
    return torch.where(joint[:, None], -projections[:, 0], quadratic).float()


def probe_columns(probe, outcomes: int, sketches: int, signs) -> tuple[torch.Tensor, torch.Tensor]:
    """The C = K + S loss columns of every row of a distribution probe and their weights in the Fisher sum.

    Args:
        probe: the pass rows' probe (``top``, ``log_prob``, ``sketch``).
        outcomes: K >= 0 exact outcomes: log p_k of the clean distribution's top K, weight p_k.
        sketches: S >= 0 Rademacher sketches of the other outcomes: L_j = Σ_{v ∉ top K} s_{j,v} √sg(p_v) log p_v,
            weight 1/S.
        signs: (global vocab ids (V,)) -> (S, V) signs (:func:`sketch_signs`).

    Returns:
        (losses (n, C), weights (n, C) float32, detached).
    """
    logp_top, ids = probe.top(outcomes) if outcomes else (None, None)  # the forward is the clean one
    losses = [probe.log_prob(ids[:, k]) for k in range(outcomes)]  # (n,) each: K at most
    weights = [logp_top.detach().exp().float()] if outcomes else []
    if sketches:
        exclude = ids if outcomes else torch.zeros(probe.phi.shape[0], 0, dtype=torch.long, device=probe.phi.device)
        sketch = probe.sketch(signs, exclude)  # (n, S)
        losses += list(sketch.unbind(1))
        weights.append(sketch.new_full(sketch.shape, 1.0 / sketches, dtype=torch.float32))
    return torch.stack(losses, 1), torch.cat(weights, 1)


def fisher_columns(probe, outcomes: int, sketches: int, signs, joint: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`probe_columns` of every row, with an AS-Joint row's (``joint`` (n,) bool) columns replaced by φ at
    column 0 and nothing else (φ's gradient once): (losses (n, C), weights (n, C) float32)."""
    losses, w = probe_columns(probe, outcomes, sketches, signs)
    phi = torch.zeros_like(losses)
    phi[:, 0] = probe.phi
    return torch.where(joint.to(losses.device)[:, None], phi, losses), w


def cached_signs(seed: int, sketches: int):
    """(global vocab ids (V,)) -> (S, V) :func:`sketch_signs`, hashed once per vocabulary (shard) of a call (keyed
    without reading the ids back from the device: a rank reads the same vocabulary in every pass)."""
    cache: dict[tuple, torch.Tensor] = {}

    def signs(vocab_ids: torch.Tensor) -> torch.Tensor:
        key = (vocab_ids.device, vocab_ids.shape[0])
        if key not in cache:
            cache[key] = sketch_signs(seed, sketches, vocab_ids)
        return cache[key]

    return signs


def fisher(backend: AttributionBackend, batch: AttributionBatch, mask_token_id: int | Replacement, outcomes: int,
           sketches: int = 0, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Second-order masking scores of every reasoning token, on any backend (see the module docstring).

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        mask_token_id: the token whose embedding e_mask the swap moves to, or a
            :class:`~oar_verl.core.backends.base.Replacement` (``algorithm.oar.mask``: e_mask the zero or mean vector).
        outcomes: K >= 0 most likely outcomes of each row's probe kept exactly in the Fisher sum
            (``fisher_outcomes``); K >= 1 when ``sketches`` = 0.
        sketches: S >= 0 Rademacher sketches of the other outcomes (``fisher_sketches``); 0: the truncated sum.
        seed: the sketches' sign seed (the configuration's ``seed``).

    Returns:
        ((B, L) float32 scores at reasoning positions, 0 elsewhere; the passes this rank needed before alignment).
    """
    if outcomes < 0 or sketches < 0 or outcomes + sketches < 1:
        raise ValueError(f"fisher needs outcomes >= 0, sketches >= 0 and one of them >= 1 (got {outcomes}, {sketches})")
    B, L = batch.input_ids.shape
    K, S = outcomes, sketches
    C = K + S
    device = batch.input_ids.device
    columns, item_rows, item_column, packs = fisher_plan(backend, batch, K, S)
    passes = with_fillers([Pass(item_rows[p]) for p in packs], backend.align(len(packs)),
                          Pass(first_row(batch), filler=True), batch)
    weights = torch.zeros(item_rows.shape[0], columns, dtype=torch.float32, device=device)
    signs = cached_signs(seed, S)

    def loss(i: int, probe) -> torch.Tensor:
        p = passes[i]
        losses, w = fisher_columns(probe, K, S, signs, batch.probe.joint[p.rows])  # (n, C)
        if columns == 1:  # one column per item: its own (a filler's: column 0)
            c = (item_column[packs[i]] if not p.filler else torch.zeros(1, dtype=torch.long, device=device))
            c = c.to(losses.device)[:, None]
            losses, w = losses.gather(1, c), w.gather(1, c)
        if not p.filler:
            weights[packs[i]] = w.to(device)
        return losses if columns > 1 else losses[:, 0]  # one loss per row where each column has its own pass

    # (H,); None where no embedding lives (Megatron's later stages)
    mask_embedding = replacement_embedding(backend, as_replacement(mask_token_id))
    hook = EmbeddingHook(lambda grad, clean: embedding_projection(grad, clean, mask_embedding), outputs=columns)
    shape = (item_rows.shape[0], columns, L) if columns > 1 else (item_rows.shape[0], L)
    got = collect(backend.run(batch, passes, loss, hook), packs, shape, device)
    projections = torch.zeros(B, C, L, dtype=torch.float32, device=device)
    weight = torch.zeros(B, C, dtype=torch.float32, device=device)
    if columns > 1:  # one item per row, its C columns
        projections[item_rows], weight[item_rows] = got, weights
    else:  # one item per column
        projections[item_rows, item_column], weight[item_rows, item_column] = got, weights[:, 0]
    scores = fisher_importance(projections, weight, batch.probe.joint)
    # the weights exist where the probe was read (Megatron: the last stage): the scores go from there to every rank
    return backend.share(torch.where(batch.reasoning_mask, scores, 0.0)), len(packs)


def loss_columns(cfg) -> int:
    """C = K + S loss columns of a distribution row (``fisher_outcomes`` + ``fisher_sketches``): backwards per row."""
    return cfg.fisher_outcomes + cfg.fisher_sketches


def fisher_target(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> SharedTarget:
    """``mode=fisher`` read from a shared clean forward (:mod:`oar_verl.core.backends.shared`): the same columns,
    weights, projection and Fisher sum as :func:`fisher`, one forward and C backwards per sequence."""
    K, S = cfg.fisher_outcomes, cfg.fisher_sketches
    mask = method_replacement(backend, batch, cfg, inputs, f"{cfg.prefix}.mode=fisher")
    mask_embedding = replacement_embedding(backend, as_replacement(mask))
    signs = cached_signs(cfg.seed, S)
    joint = batch.probe.joint
    return SharedTarget(batch, loss_columns(cfg), lambda probe, rows: fisher_columns(probe, K, S, signs, joint[rows]),
                        lambda grad, clean: embedding_projection(grad, clean, mask_embedding),
                        lambda projections, weights: fisher_importance(projections, weights, joint))


@method("fisher", forward_only=False, reads_gradients=True, uses_mask_token=True, linearises_mask=True,
        shared=fisher_target, shared_columns=loss_columns)
def run_fisher(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=fisher``: :func:`fisher` with ``mask``, ``fisher_outcomes``, ``fisher_sketches`` and ``seed`` of the
    configuration."""
    mask = method_replacement(backend, batch, cfg, inputs, f"{cfg.prefix}.mode=fisher")
    return AttributionResult(*fisher(backend, batch, mask, cfg.fisher_outcomes, cfg.fisher_sketches, cfg.seed))
