"""OAR-G: gradient × input saliency of the outcome under seeded embedding noise (docs/method.md §4, with the
official code's gradient leak and LT-Logits position fixed, §7), written once over the backend interface
(:mod:`oar_verl.core.backends.base`).

This module owns the noise (:func:`reasoning_noise_at`: a token's draw depends only on its row's seed and its
reasoning rank, so every layout adds the same noise), the seeds (:func:`sequence_seeds`, :func:`draw_seeds`) and the
projection (:func:`embedding_projection`); the backend runs the passes (teacher passes first, then the noisy student
passes, K noise draws per row packed as draw rows: docs/method.md §10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import (AttributionBackend, EmbeddingHook, Pass, ProbeTable, collect, first_row,
                                         plan_draws, with_fillers)
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.backends.memory import PassKind
from oar_verl.core.methods.contract import AttributionResult, MethodInputs, method, require

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


def reasoning_noise_at(slot: torch.Tensor, rank: torch.Tensor, seeds: torch.Tensor, counts: torch.Tensor,
                       hidden_size: int, noise_std: float) -> torch.Tensor:
    """(m, H) float32 noise of m reasoning tokens laid out anyhow (padded rows, a sequence shard, a micro-batch).

    Token j is the ``rank[j]``-th reasoning token of packed row ``slot[j]``, and gets draw ``rank[j]`` of a generator
    seeded with ``seeds[slot[j]]`` that draws the row's whole (``counts[slot[j]]``, H) block (a shorter draw is not a
    prefix of a longer one on every device). So a token's noise depends only on (seed, its rank), never on padding,
    packing, sharding or rank: every backend adds the very same noise.

    Args:
        slot: (m,) long packed row of each token. rank: (m,) long its rank among its row's reasoning tokens.
        seeds: (n,) int64 seed per packed row. counts: (n,) long reasoning tokens per packed row.
        hidden_size: H. noise_std: σ.
    """
    device = slot.device
    out = torch.zeros(slot.shape[0], hidden_size, device=device)
    if noise_std == 0:  # a clean-point backward: no draws to make
        return out
    seed_list, count_list = seeds.tolist(), counts.tolist()  # host metadata, once per pass
    for s in slot.unique().tolist():  # one generator per row, never per token
        gen = torch.Generator(device=device).manual_seed(int(seed_list[s]))
        sel = slot == s
        out[sel] = torch.randn(int(count_list[s]), hidden_size, generator=gen, device=device)[rank[sel]]
    return out * noise_std


def embedding_projection(grad: torch.Tensor, clean: torch.Tensor, mask_embedding: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """(b, s) float32 signed ⟨∂J/∂e_t, v_t⟩ of (b, s, H) embedding gradients: v_t = e_t, the clean embedding
    (gradient × input, OAR-G), or v_t = e_mask − e_t with ``mask_embedding`` (H,) given (the first-order change of J
    when token t is swapped for the mask token). Accumulated in fp32 at least (bf16 products would cancel badly in the
    sum), one row at a time (the fp32 product of a whole pass would be another (b, s, H) buffer)."""
    acc = torch.promote_types(clean.dtype, torch.float32)
    base = None if mask_embedding is None else mask_embedding.to(acc)
    return torch.stack([(g.to(acc) * (c.to(acc) if base is None else base - c.to(acc))).sum(-1)
                        for g, c in zip(grad, clean)]).float()


@dataclass(frozen=True)
class DrawPlan:
    """K draw rows per batch row (draw row e = b·K + k) packed as input-gradient student passes under the backend's
    budget and aligned across ranks, with each row's clean teacher probe already in ``table`` (one teacher pass per
    distinct row of a student pass, run before the students). OAR-G's draws are noise draws, ``path``'s are points.

    Attributes:
        rows: (B·K,) long the batch row of each draw row. packs: index packs into the draw rows, one per real pass.
        students: the passes to run (the real ones, then fillers). table: the clean probes.
    """

    rows: torch.Tensor
    packs: list[torch.Tensor]
    students: list[Pass]
    table: object

    def per_pass(self, values: torch.Tensor) -> list[torch.Tensor]:
        """(B·K, ...) per-draw-row values -> one slice per student pass (a filler's: the first draw row's)."""
        return [values[p] for p in self.packs] + [values[:1]] * (len(self.students) - len(self.packs))

    def loss(self, backend: AttributionBackend, batch: AttributionBatch):
        """The student passes' loss: each row's outcome shift from its clean probe (``backend.shift``)."""
        def loss(i: int, probe) -> torch.Tensor:
            rows = self.students[i].rows
            return backend.shift(self.table.get(rows), probe, batch.probe.joint[rows])
        return loss

    def collect(self, scores, batch: AttributionBatch, draws: int) -> torch.Tensor:
        """(B, K, L) the student passes' per-draw scores in batch order."""
        B, L = batch.input_ids.shape
        return collect(scores, self.packs, (B * draws, L), batch.input_ids.device).view(B, draws, L)


def draw_plan(backend: AttributionBackend, batch: AttributionBatch, draws: int, teachers: ProbeTable | None = None
              ) -> DrawPlan:
    """:class:`DrawPlan` of ``draws`` K >= 1 draw rows per row; runs the teacher passes, unless ``teachers`` holds
    every row's clean probe already (read from a forward that ran anyway: docs/method.md §14; every rank alike)."""
    B = batch.input_ids.shape[0]
    draw_rows, packs = plan_draws(backend, batch, draws, PassKind.INPUT_GRADIENT)
    count = backend.align(len(packs))
    row = first_row(batch)
    students = with_fillers([Pass(draw_rows[p]) for p in packs], count, Pass(row, filler=True), batch)
    if teachers is not None:
        return DrawPlan(draw_rows, packs, students, teachers)
    clean = with_fillers([Pass(torch.unique_consecutive(draw_rows[p])) for p in packs], count,
                         Pass(row, filler=True), batch)
    table = backend.table(B)
    backend.run(batch, clean, lambda i, probe: None if clean[i].filler else table.put(clean[i].rows, probe))
    return DrawPlan(draw_rows, packs, students, table)


def noise_scale(noise_std: float, low_precision: float | None, dtype: torch.dtype) -> float:
    """σ of OAR-G's noise on embedding outputs of ``dtype``: ``low_precision`` for a 16-bit float (bf16, fp16) when
    given, else ``noise_std`` (docs/method.md §4: below ~1e-2 a 16-bit student-teacher shift is mostly rounding)."""
    low = low_precision is not None and dtype.is_floating_point and torch.finfo(dtype).bits <= 16
    return float(low_precision) if low else float(noise_std)


def oar_g(backend: AttributionBackend, batch: AttributionBatch, seeds: torch.Tensor, noise_std: float,
          samples: int = 1, noise_std_low_precision: float | None = None, teachers: ProbeTable | None = None
          ) -> tuple[torch.Tensor, int]:
    """OAR-G importance of every reasoning token, on any backend: the mean over ``samples`` noise draws of the
    single-draw score |⟨∂J/∂e_t, e_t⟩|.

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more passes.
        seeds: (B,) int64 per-sequence seeds (:func:`sequence_seeds`); draw k of row b uses
            ``draw_seeds(seeds, samples)[b, k]`` (draw 0: ``seeds[b]`` itself).
        noise_std: σ of the Gaussian embedding noise (absolute).
        samples: K >= 1 noise draws per row (``algorithm.oar.noise_samples``); K = 1 is the single-draw method.
        noise_std_low_precision: σ where the embedding output is bf16 or fp16 (:func:`noise_scale`); None: σ.
        teachers: every row's clean probe, read from a forward that ran anyway
            (:class:`~oar_verl.core.backends.shared.SharedTeacher`); None: the teacher passes run here.

    Returns:
        ((B, L) float32 mean over the K draws of |⟨∂J/∂e_t, e_t⟩| at reasoning positions, 0 elsewhere; the student
        passes this rank needed before alignment). No parameter has a gradient or a changed requires_grad flag
        afterwards.
    """
    plan = draw_plan(backend, batch, samples, teachers)
    student_seeds = plan.per_pass(draw_seeds(seeds.to(plan.rows.device), samples).reshape(-1))
    counts = batch.reasoning_mask.sum(-1)

    def noise(i: int, slot: torch.Tensor, rank: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        rows = plan.students[i].rows
        std = noise_scale(noise_std, noise_std_low_precision, clean.dtype)
        return reasoning_noise_at(slot, rank, student_seeds[i], counts[rows], clean.shape[-1], std)

    saliency = backend.run(batch, plan.students, plan.loss(backend, batch), EmbeddingHook(embedding_projection, noise))
    mean = plan.collect(saliency, batch, samples).abs().mean(1)
    return torch.where(batch.reasoning_mask, mean, 0.0), len(plan.packs)


@method("gradient", forward_only=False, reads_gradients=True, uses_mask_token=False, shared_teacher=True)
def run_oar_g(backend: AttributionBackend, batch: AttributionBatch, cfg, inputs: MethodInputs) -> AttributionResult:
    """``mode=gradient``: :func:`oar_g` with ``noise_std``, ``noise_std_low_precision`` and ``noise_samples`` of the
    configuration (and the clean teachers of ``inputs.teachers`` when a shared forward read them)."""
    seeds = require(inputs.seeds, "OAR-G needs per-sequence noise seeds",
                    "see oar_verl.core.methods.gradient.sequence_seeds (prepare_attribution computes them)")
    return AttributionResult(*oar_g(backend, batch, seeds, cfg.noise_std, cfg.noise_samples,
                                    cfg.noise_std_low_precision, inputs.teachers))
