"""How the fidelity metric removes tokens: one vocabulary with OAR-P (docs/fidelity.md §1).

The removal operators are the mask operators of :data:`oar_verl.core.methods.mask_operator.MASK_OPERATORS` (``mean``,
``zero``, ``resample``, ``pad``, ``token``), each replacing the removed tokens with the
:class:`~oar_verl.core.backends.base.Replacement` OAR-P would build (:func:`~oar_verl.core.methods.mask_operator.
mask_replacement`), plus ``delete``, which only the metric uses: the tokens are dropped from the row. An operator whose
replacement is drawn per token (``resample``: a token of the same row's reasoning) is averaged over D seeded draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oar_verl.core.backends.base import AttributionBackend, Replacement
from oar_verl.core.batch.layout import AttributionBatch, position_ids_from_mask
from oar_verl.core.batch.probes import ProbeSpec
from oar_verl.core.fidelity.curves import row_keys
from oar_verl.core.methods.gradient import draw_seeds, sequence_seeds
from oar_verl.core.methods.mask_operator import MASK_OPERATORS, mask_replacement, resample_ids

__all__ = ["DEFAULT_OPERATORS", "DELETE", "OPERATORS", "RENAMED", "check_operators", "deleted_rows", "operator_draws",
           "resample_seeds", "resample_tokens"]

DELETE = "delete"  # the one removal operator that is no mask operator
OPERATORS = (*MASK_OPERATORS.names(), DELETE)  # every removal operator (the mask operators registered at import)
DEFAULT_OPERATORS = ("mean", "zero", DELETE, "resample")  # no token inserted: no mask token needed
RENAMED = {"mask": "token"}  # the metric's operator names before its operators were OAR-P's -> their names now

# one draw of an operator: the Replacement of the removed tokens; None: the tokens are deleted
Variant = Replacement | None


def _draws_tokens(operator: str) -> bool:
    """Whether ``operator`` draws its replacement per token (averaged over D draws): it moves no token to one
    embedding."""
    return operator != DELETE and not MASK_OPERATORS.get(operator).one_embedding


def check_operators(operators: Sequence[str], token_id: int | None, draws: int) -> tuple[str, ...]:
    """The operators as a tuple, or a ValueError naming the allowed ones (and the new name of a renamed one), the
    inserting operators that lack ``token_id``, or draws < 1 with a drawing operator."""
    ops = tuple(operators)
    allowed = (*MASK_OPERATORS.names(), DELETE)
    if not ops:
        raise ValueError(f"fidelity: no operator given; allowed: {', '.join(allowed)}")
    bad = [o for o in ops if o not in allowed]
    if bad:
        renamed = "".join(f"; {o!r} is now {RENAMED[o]!r} (with mask_token_id), or use 'mean' (inserts no token)"
                          for o in bad if o in RENAMED)
        raise ValueError(f"fidelity: unknown operator(s) {bad}; allowed: {', '.join(allowed)}{renamed}")
    inserting = [o for o in ops if o != DELETE and MASK_OPERATORS.get(o).inserts_token]
    if inserting and token_id is None:
        raise ValueError(f"fidelity: operator(s) {inserting} insert a token and need mask_token_id (e.g. the "
                         "tokenizer's pad token, or PreparedAttribution.mask_token_id); or use "
                         f"{', '.join(o for o in allowed if o == DELETE or not MASK_OPERATORS.get(o).inserts_token)}")
    drawing = [o for o in ops if _draws_tokens(o)]
    if drawing and draws < 1:
        raise ValueError(f"fidelity: operator(s) {drawing} need draws >= 1, got {draws}")
    return ops


def resample_seeds(batch: AttributionBatch, draws: int, seed: int = 0, seeds: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """(B, D) int64 row seeds of the D draws of a drawing operator: draw 0 is the row's seed, ``seeds`` (B,) (e.g. the
    run's :attr:`~oar_verl.core.preprocess.PreparedAttribution.seeds`, so that one draw replaces as the run's OAR-P
    does) or by default one from ``seed`` and the row's content; draw d >= 1 a mix of it and d
    (:func:`~oar_verl.core.methods.gradient.draw_seeds`)."""
    if seeds is None:
        seeds = sequence_seeds(seed, 0, row_keys(batch.input_ids, batch.attention_mask))
    return draw_seeds(seeds.long().to(batch.input_ids.device), draws)


def resample_tokens(batch: AttributionBatch, draws: int = 4, *, seed: int = 0, seeds: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """(B, L, D) long: the tokens the ``resample`` operator puts at every reasoning position in each of D draws, each
    drawn from the same row's reasoning tokens (:func:`~oar_verl.core.methods.mask_operator.resample_ids` with the
    seeds of :func:`resample_seeds`); the row's own tokens elsewhere. No model runs."""
    s = resample_seeds(batch, draws, seed, seeds)
    return torch.stack([resample_ids(batch, s[:, d]) for d in range(draws)], -1)  # per draw, D small


def operator_draws(backend: AttributionBackend, batch: AttributionBatch, operator: str, *, token_id: int | None,
                   seeds: torch.Tensor) -> list[Variant]:
    """The draws of one removal operator on ``batch``: [None] for ``delete``, one
    :func:`~oar_verl.core.methods.mask_operator.mask_replacement` for an operator that moves every token to one
    embedding, one per column of ``seeds`` (B, D) (:func:`resample_seeds`) for a drawing one."""
    if operator == DELETE:
        return [None]
    if not _draws_tokens(operator):
        return [mask_replacement(backend, batch, operator, token_id, None)]
    return [mask_replacement(backend, batch, operator, token_id, seeds[:, d]) for d in range(seeds.shape[1])]


def deleted_rows(batch: AttributionBatch, src: torch.Tensor, removed: torch.Tensor) -> AttributionBatch:
    """The rows ``src`` (n,) with their ``removed`` (n, L) tokens dropped, left-aligned: an AttributionBatch (n, L).

    The attention mask and position ids are rebuilt. A probe weight at logit position j (which predicts token j + 1)
    moves to the position that predicts the same token in the shorter row: (kept tokens in columns ≤ j) − 1; each
    position's target is the shorter row's next token.
    """
    keep = batch.attention_mask[src].bool() & ~removed
    n, L = keep.shape
    ck = keep.long().cumsum(-1)
    dest = torch.where(keep, ck - 1, L)  # dropped tokens go to a dump column

    def moved(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, L + 1, dtype=x.dtype, device=x.device).scatter_(1, dest, x)[:, :L]

    ids = moved(batch.input_ids[src])
    attn = (torch.arange(L, device=keep.device)[None, :] < ck[:, -1:]).long()
    w = batch.probe.logit_weight[src]
    weight = torch.zeros_like(w).scatter_add_(1, (ck - 1).clamp(min=0), w)
    target = torch.zeros_like(ids)
    target[:, :-1] = ids[:, 1:]
    probe = ProbeSpec(weight, target, batch.probe.joint[src], batch.probe.reads_span[src])
    return AttributionBatch(ids, attn, position_ids_from_mask(attn), moved(batch.reasoning_mask[src] & keep), probe,
                            batch.response_start)
