"""Token budgets: how many tokens one attribution pass may hold, and how rows and masked copies are packed under it.

verl sizes every pass by tokens (``*_max_token_len_per_gpu``) so that the training step fits; attribution passes are
packed the same way. A pass holds ``rows × window`` token positions, the window being the columns its rows span (the
padded area, which is what activations and key/value caches are allocated for). Rows are packed longest first, so a
pass's rows have similar lengths and little padding; a row wider than the budget runs alone (it is never dropped).

An optional ``fits`` callback (the memory guard, :mod:`oar_verl.core.backends.memory`) may veto a pass that is within the
budget but would not fit the accelerator's free memory: the pack is then split further.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("oar_verl")

Fits = Callable[[str, int, int], bool]  # (pass kind, rows, window) -> whether such a pass fits


@dataclass(frozen=True)
class PassLimits:
    """What one attribution pass may hold.

    Attributes:
        tokens: token budget of one forward (or forward/backward) pass: rows × window ≤ tokens, >= 1.
        rows: optional cap on the rows (sequences) of one pass.
        copies: optional cap on OAR-P's masked copies of one pass.
        fits: optional memory guard, ``fits(kind, rows, window)`` (kind: a :class:`oar_verl.core.backends.memory.PassKind`);
            a pack it refuses is split further.
        key: the config key that sets ``tokens`` (named in warnings and errors).
    """

    tokens: int
    rows: int | None = None
    copies: int | None = None
    fits: Fits | None = None
    key: str = "algorithm.oar.max_token_len_per_gpu"

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"a token budget must be >= 1, got {self.tokens}")


class AttributionMemoryError(RuntimeError):
    """Even one sequence alone would not fit the accelerator's free memory."""


_warned_alone = False


def _single(kind: str, width: int, limits: PassLimits) -> None:
    """A pass of one ``width``-token row: logged once when over the budget, an error when it cannot fit at all."""
    global _warned_alone
    if limits.fits is not None and not limits.fits(kind, 1, width):
        raise AttributionMemoryError(
            f"oar: one sequence of {width} tokens does not fit the free accelerator memory even alone ({limits.key}="
            f"{limits.tokens}); shorten data.max_response_length, enable gradient checkpointing "
            "(actor_rollout_ref.model.enable_gradient_checkpointing) or shard sequences (Ulysses sequence "
            "parallelism)")
    if width > limits.tokens and not _warned_alone:
        logger.warning("oar: a sequence of %d tokens exceeds the attribution token budget %s=%d; it is attributed "
                       "alone (logged once per process)", width, limits.key, limits.tokens)
        _warned_alone = True


def row_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) first and one-past-last column holding a real token of each row (0, 0 for empty rows)."""
    real = attention_mask.bool()
    B, L = real.shape
    cols = torch.arange(L, device=real.device)
    start = torch.where(real, cols, L).amin(-1).clamp(max=L)
    end = torch.where(real, cols + 1, 0).amax(-1)
    start = torch.where(end > 0, start, torch.zeros_like(start))
    return start, end


def pack_rows(attention_mask: torch.Tensor, limits: PassLimits, kind: str,
              rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Pack rows into passes under the token budget.

    Args:
        attention_mask: (B, L) 0/1 of the batch.
        limits: the budget (``limits.rows`` caps rows per pass).
        kind: the pass kind (for the memory guard).
        rows: (N,) the rows to pack (default: every row); empty rows are skipped.

    Returns:
        Passes, each a (n,) long tensor of row indices; every non-empty row is in exactly one pass. Deterministic.
    """
    start, end = (t.tolist() for t in row_spans(attention_mask.cpu()))  # host metadata, once per batch
    order = range(attention_mask.shape[0]) if rows is None else rows.tolist()
    order = sorted((b for b in order if end[b] > start[b]), key=lambda b: (start[b] - end[b], b))  # longest first
    packs, current, lo, hi = [], [], 0, 0
    for b in order:
        if current:
            n_lo, n_hi = min(lo, start[b]), max(hi, end[b])
            n_rows = len(current) + 1
            ok = n_rows * (n_hi - n_lo) <= limits.tokens and (limits.rows is None or n_rows <= limits.rows)
            if ok and (limits.fits is None or limits.fits(kind, n_rows, n_hi - n_lo)):
                current.append(b)
                lo, hi = n_lo, n_hi
                continue
            packs.append(current)
        current, lo, hi = [b], start[b], end[b]
        _single(kind, hi - lo, limits)
    if current:
        packs.append(current)
    return [torch.tensor(sorted(p), dtype=torch.long, device=attention_mask.device) for p in packs]


def copies_per_pass(window: int, limits: PassLimits, kind: str) -> int:
    """Masked copies per pass when each holds ``window`` tokens: as many as the budget and caps allow, >= 1."""
    n = max(1, limits.tokens // max(window, 1))
    if limits.copies is not None:
        n = min(n, limits.copies)
    while n > 1 and limits.fits is not None and not limits.fits(kind, n, window):
        n = (n + 1) // 2
    if n == 1:
        _single(kind, window, limits)
    return n


def pack_copies(rows: torch.Tensor, attention_mask: torch.Tensor, limits: PassLimits,
                kind: str) -> list[tuple[int, int]]:
    """Pack OAR-P's masked copies, in the order given, into passes under the token budget.

    A copy holds its whole source row (the masked token changes everything after it), so a pass of c copies whose
    source rows span a ``window`` of columns holds c × window tokens. Consecutive copies share a pass while it fits;
    copies of several short rows can share one.

    Args:
        rows: (N,) the source row of each copy, grouped by row (the order :func:`~oar_verl.core.methods.perturbation.
            masked_copies` gives).
        attention_mask: (B, L) 0/1 of the batch.
        limits: the budget (``limits.copies`` caps copies per pass).
        kind: the pass kind (for the memory guard).

    Returns:
        Passes as [first, last) ranges over the N copies, in order.
    """
    start, end = (t.tolist() for t in row_spans(attention_mask.cpu()))
    src, counts = torch.unique_consecutive(rows.cpu(), return_counts=True)
    packs: list[tuple[int, int]] = []
    first, lo, hi, c = 0, 0, 0, 0  # the open pass: its first copy, window [lo, hi), copies
    i = 0
    for b, n in zip(src.tolist(), counts.tolist()):  # per source row (and per pass), never per copy
        while n:
            n_lo, n_hi = (min(lo, start[b]), max(hi, end[b])) if c else (start[b], end[b])
            cap = copies_per_pass(n_hi - n_lo, limits, kind) if not c else _capacity(n_hi - n_lo, limits, kind)
            take = min(n, cap - c) if cap > c else 0
            if take == 0:  # the open pass is full for this row: close it, open a new one with this row
                packs.append((first, i))
                c = 0
                continue
            if not c:
                first = i
            lo, hi, c, i, n = n_lo, n_hi, c + take, i + take, n - take
            if c == cap:
                packs.append((first, i))
                c = 0
    if c:
        packs.append((first, i))
    return packs


def _capacity(window: int, limits: PassLimits, kind: str) -> int:
    """Copies of ``window`` tokens one pass may hold (0 when not even one fits the guard)."""
    n = limits.tokens // max(window, 1)
    if limits.copies is not None:
        n = min(n, limits.copies)
    while n > 0 and limits.fits is not None and not limits.fits(kind, n, window):
        n //= 2
    return n


def pack_lengths(lengths: list[int], tokens: int, cap: int | None = None) -> list[list[int]]:
    """Greedy packs of item indices, in order, whose lengths sum to at most ``tokens`` (an item over it alone), each
    then split into chunks of at most ``cap`` items: for layouts that pack rows into one sequence without padding
    (Ulysses), where a pass holds the sum of its rows' tokens.

    Args:
        lengths: host list of item lengths (0-length items are kept: the caller drops them first if it wants).
        tokens: the budget of one pack. cap: optional item cap per pack.
    """
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return [g[s:s + (cap or len(g))] for g in groups for s in range(0, len(g), cap or len(g))]
