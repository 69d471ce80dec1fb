"""OAR-G: gradient x input saliency of the outcome (docs/method.md §4, with the official code's gradient leak and
LT-Logits position fixed, §7), written once over the attribution engine (:mod:`oar_verl.core.engine`).

Per round (rows packed under the token budget by the backend): a clean no-grad pass gives the teacher p0 (or φ0) --
the teacher passes run first, one per round over the round's distinct rows -- and the student pass adds seeded
Gaussian noise of std σ to the reasoning-token embeddings, J = KL(p0 ‖ p_noisy) (or φ0 − φ_noisy), and the score is
|⟨∂J/∂e_t, e_t⟩| with the clean embedding e_t.

With K noise draws (``algorithm.oar.noise_samples``) each row becomes K *draw rows* e = b·K + k (row b, draw k, with
the seed :func:`draw_seeds` gives it) and the score is the mean of the K single-draw scores. Draw rows are packed like
rows, so a row's K draws share a round while the budget allows and spread over more rounds when not (every round stays
within the budget); a round's clean teacher pass runs once per distinct row in it, not once per draw.

The noise is what makes the gradient non-zero: at p_noisy = p0 the KL sits at its minimum. How the gradient is taken
(a detached embedding leaf, frozen parameters, checkpointed layers with eval numerics, logits only at probe positions)
is each backend's job: :mod:`oar_verl.core.backend_hf`, :mod:`oar_verl.core.backend_ulysses`, Megatron's backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from oar_verl.core.engine import AttributionBackend, Pass, first_row, with_fillers
from oar_verl.core.layout import AttributionBatch
from oar_verl.core.memory import PassKind

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


def mask_noise(mask: torch.Tensor, hidden_size: int, noise_std: float, seeds: torch.Tensor) -> torch.Tensor:
    """(n, H) float32 noise of the reasoning tokens of a (b, w) mask whose rows hold their whole reasoning, in
    row-major order (:func:`reasoning_noise_at` with row i seeded by ``seeds[i]``)."""
    slot, col = mask.nonzero().unbind(1)
    rank = (mask.long().cumsum(-1) - 1)[slot, col]
    return reasoning_noise_at(slot, rank, seeds, mask.sum(-1), hidden_size, noise_std)


PROJECTIONS = ("input", "mask")


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


def oar_g(backend: AttributionBackend, batch: AttributionBatch, seeds: torch.Tensor, noise_std: float,
          samples: int = 1, project: str = "input") -> tuple[torch.Tensor, int]:
    """OAR-G importance of every reasoning token, on any backend: the mean over ``samples`` noise draws of the
    single-draw score.

    Args:
        backend: the model runtime.
        batch: AttributionBatch (B, L); B >= 1 when other data-parallel ranks run more rounds.
        seeds: (B,) int64 per-sequence seeds (:func:`sequence_seeds`); draw k of row b uses
            ``draw_seeds(seeds, samples)[b, k]`` (draw 0: ``seeds[b]`` itself).
        noise_std: σ of the Gaussian embedding noise (absolute).
        samples: K >= 1 noise draws per row (``algorithm.oar.noise_samples``); K = 1 is the single-draw method.
        project: ``input`` (gradient × input, OAR-G) or ``mask`` (gradient × (e_mask − e_t): the first-order change of
            J when the token is swapped for the mask token).

    Returns:
        ((B, L) float32 mean over the K draws of |⟨∂J/∂e_t, e_t⟩| at reasoning positions, 0 elsewhere; the rounds this
        rank needed before alignment). No parameter has a gradient or a changed requires_grad flag afterwards.
    """
    B, L = batch.input_ids.shape
    device = batch.input_ids.device
    draw_rows = torch.arange(B, device=device).repeat_interleave(samples)  # draw row e = b·K + k
    draw_seed = draw_seeds(seeds.to(device), samples).reshape(-1)
    packs = backend.plan(batch, draw_rows, PassKind.INPUT_GRADIENT)
    count = backend.align(len(packs))
    row = first_row(batch)
    students = with_fillers([Pass(draw_rows[p], seeds=draw_seed[p]) for p in packs], count,
                            Pass(row, seeds=draw_seed[:1], filler=True), batch)
    # the clean teacher of a round runs once per distinct row in it (not once per draw), before the students
    teachers = with_fillers([Pass(torch.unique_consecutive(draw_rows[p])) for p in packs], count,
                            Pass(row, filler=True), batch)
    table = backend.table(B)
    backend.run(batch, teachers, lambda i, probe: None if teachers[i].filler else table.put(teachers[i].rows, probe))

    def loss(i: int, probe) -> torch.Tensor:
        rows = students[i].rows
        return backend.shift(table.get(rows), probe, batch.probe.joint[rows])

    saliency = backend.run(batch, students, loss, noise_std, project)
    per_draw = torch.zeros(B * samples, L, dtype=torch.float32, device=device)
    for pack, sal in zip(packs, saliency):  # per round
        per_draw[pack] = sal.to(device).abs()
    return per_draw.view(B, samples, L).mean(1), len(packs)


def oar_g_rounds(batch: AttributionBatch, limits, samples: int = 1) -> int:
    """Rounds (clean forward + noisy forward/backward) OAR-G runs on ``batch`` with a plain Hugging Face module and
    ``samples`` noise draws per row; data-parallel ranks run the max."""
    from oar_verl.core.backend_hf import ModuleBackend

    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device).repeat_interleave(samples)
    return len(ModuleBackend(None, limits).plan(batch, rows, PassKind.INPUT_GRADIENT))


def oar_g_importance(model: torch.nn.Module, batch: AttributionBatch, noise_std: float, seeds: torch.Tensor,
                     limits, min_rounds: int = 0, checkpointing: bool = False, samples: int = 1) -> torch.Tensor:
    """OAR-G on a plain Hugging Face causal LM (:class:`oar_verl.core.backend_hf.ModuleBackend`): (B, L) float32.

    Args:
        model: causal LM with ``get_input_embeddings()``, in eval mode. batch: AttributionBatch (B, L).
        noise_std: σ. seeds: (B,) int64 per-sequence seeds. limits: PassLimits of one round.
        min_rounds: rounds to run at least (data-parallel alignment). checkpointing: checkpoint the decoder layers
            in the student pass. samples: K noise draws per row.
    """
    from oar_verl.core.backend_hf import ModuleBackend

    backend = ModuleBackend(model, limits, checkpointing=checkpointing, align=lambda n: max(n, min_rounds))
    return oar_g(backend, batch, seeds, noise_std, samples)[0]
