"""Reasoning segments ("steps") of responses, as per-token segment ids.

Segment-level attribution perturbs or scores whole steps of the reasoning instead of single tokens. Steps are found the
same way as answer spans (:mod:`oar_verl.core.text.spans`): the reasoning tokens' bytes are joined, a split regex is run on
those bytes, and the byte boundaries are mapped back to token positions through per-token byte offsets computed from
the token ids (:mod:`oar_verl.core.text.token_bytes`). Nothing is ever re-tokenised: re-tokenising decoded text can merge
or split tokens differently from what the policy sampled, which would shift every segment.

Split rules are compiled on UTF-8 **bytes**, like the answer regexes (:mod:`oar_verl.core.text.answer_patterns`): ``\\d``,
``\\w`` and ``\\s`` match ASCII only, ``.`` matches one byte, ``(?u)`` is an error; a literal non-ASCII character in the
pattern matches its UTF-8 bytes.
"""

from __future__ import annotations

import functools
import re
from numbers import Integral

import torch

from oar_verl.core.text.token_bytes import selected_byte_lengths


__all__ = ["SEGMENT_SPLITS", "compile_segment_split", "reasoning_segments", "segment_boundaries"]

SEGMENT_SPLITS = ("line", "sentence")

# Runs of line breaks ("\n", "\r\n"); the boundary is after the whole run.
_LINE = rb"(?:\r?\n)+"
# Sentence ends: ".", "!", "?" followed by whitespace or the end of the text (a lookahead, so "3.5" and "e.g.x" do not
# split), and the full-width "。", "！", "？" (CJK text has no space after them).  Line breaks right after the
# punctuation are taken into the match, so ".\n\n" yields one boundary after the line breaks (where the `line` rule
# puts it) rather than a second one that would leave the bare "\n\n" as a segment of its own.
_SENTENCE = (
    rb"[.!?](?:(?:\r?\n)+|(?=\s|\Z))"
    + rb"|(?:" + "。|！|？".encode("utf-8") + rb")(?:\r?\n)*"
    + rb"|" + _LINE
)
_BUILTIN = {"line": re.compile(_LINE), "sentence": re.compile(_SENTENCE)}


@functools.lru_cache(maxsize=256)
def compile_segment_split(split: str) -> re.Pattern[bytes]:
    """The bytes regex of a split rule: a built-in name (:data:`SEGMENT_SPLITS`) or a user regex.

    Built-ins:
        ``line``: runs of line breaks (``\\n``, ``\\r\\n``); a new segment starts after the run.
        ``sentence``: everything ``line`` splits at, plus ``.``, ``!``, ``?`` followed by whitespace or the end of the
        text (boundary right after the punctuation, or after the line breaks that directly follow it), plus the
        full-width ``。``, ``！``, ``？`` (boundary after the character and any line breaks right after it).
    Any other string is a Python regex compiled on UTF-8 bytes (see the module docstring); a new segment may start at
    the end of every match, so zero-width patterns such as ``(?=Step \\d)`` split right before the lookahead text.

    Start-up validation and every attribution step call this one function, so a rule that passes validation cannot
    fail later.

    Raises:
        ValueError: ``split`` is not a non-empty string, does not compile as a bytes regex, or matches the empty text
            (e.g. ``""``, ``\\n*``: it would match the empty string at every byte and split every token apart;
            lookaheads that need some text, like ``(?=Step)``, are fine).
    """
    if not isinstance(split, str) or not split:
        raise ValueError(f"segment split {split!r} must be one of {SEGMENT_SPLITS} or a non-empty regex string")
    if split in _BUILTIN:
        return _BUILTIN[split]
    try:
        compiled = re.compile(split.encode("utf-8"))
    except re.error as exc:
        raise ValueError(f"segment split {split!r} is neither one of {SEGMENT_SPLITS} nor a valid regex on response "
                         f"bytes: {exc} (split regexes are compiled on UTF-8 bytes: \\d, \\w and \\s match ASCII only "
                         "and (?u) is not allowed)") from exc
    if compiled.search(b"") is not None:
        raise ValueError(f"segment split {split!r} matches the empty text, so it would split at every byte; use a "
                         "pattern that needs some text (e.g. \\n+ instead of \\n*) or a lookahead such as (?=Step)")
    return compiled


def segment_boundaries(text: bytes, pattern: re.Pattern[bytes]) -> list[int]:
    """Byte offsets at which a new segment may start.

    Args:
        text: one row's reasoning bytes.
        pattern: a compiled bytes regex (:func:`compile_segment_split`).

    Returns:
        Sorted, distinct offsets ``p`` with ``0 < p < len(text)``: the end of every match of ``pattern`` (for a
        zero-width match, its position).  Offsets 0 and ``len(text)`` would only create empty segments and are dropped.
    """
    n = len(text)
    return sorted({end for end in (m.end() for m in pattern.finditer(text)) if 0 < end < n})


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _group_lengths(counts: list[int], min_tokens: int, max_tokens: int | None) -> list[int]:
    """Token counts of one row's final segments from its raw segments' counts: merge short ones, cut long ones."""
    merged: list[int] = []
    pending = 0
    for c in counts:  # a short segment joins the following one (the short run keeps accumulating)
        pending += c
        if pending >= min_tokens:
            merged.append(pending)
            pending = 0
    if pending:  # a short tail joins its predecessor; a row shorter than min_tokens is one segment
        if merged:
            merged[-1] += pending
        else:
            merged.append(pending)
    if max_tokens is None:
        return merged
    out: list[int] = []
    for n in merged:
        if n <= max_tokens:
            out.append(n)
            continue
        k = -(-n // max_tokens)  # ceil(n / max_tokens) near-equal chunks, the first n % k one token longer
        q, r = divmod(n, k)
        out.extend([q + 1] * r + [q] * (k - r))
    return out


def reasoning_segments(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    tokenizer,
    split: str = "sentence",
    min_tokens: int = 1,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Segment id of every reasoning token of a batch of responses.

    Args:
        response_ids: (B, T) long token ids (any padding layout; only the masks count).
        response_mask: (B, T) 0/1, bool or float: which positions are real response tokens.
        reasoning_mask: (B, T) 0/1 or bool: the reasoning tokens (e.g. :attr:`AnswerSpans.reasoning_mask`).
        tokenizer: a transformers tokenizer; its byte table is built once and cached (:func:`token_byte_lengths`).
        split: a split rule for :func:`compile_segment_split`: ``"line"``, ``"sentence"`` or a user regex.
        min_tokens: segments with fewer tokens are merged (>= 1).
        max_tokens: segments with more tokens are cut (None: no limit; else >= ``min_tokens``).

    Returns:
        (B, T) long on ``response_ids.device``: per row the ids 0, 1, ..., S-1 in order of position on the reasoning
        tokens, -1 everywhere else.  Every segment is a contiguous run of the row's reasoning tokens.

    Semantics:
        - Only tokens with ``reasoning_mask & response_mask`` take part.  A row's text is the concatenation of those
          tokens' bytes in order; other tokens (EOS, pad, the answer) contribute no bytes.  The reasoning ends before
          the answer marker, so segments never cross the answer span.
        - Byte offsets: ``start(t)`` = number of bytes of the row's reasoning tokens before ``t``.  Ids beyond the
          tokenizer's vocabulary count as 0 bytes (as in :mod:`oar_verl.core.text.spans`).
        - Raw segment of token ``t`` = number of boundaries (:func:`segment_boundaries`) ``b <= start(t)``: a token
          starts a new segment when it is the first token starting at or after a boundary.  "3." + " Then" (sentence
          rule): " Then" starts one.  "\\n\\n" + "Step": "Step" starts one.  A merged ".\\n\\n" token stays in its
          segment and the token after it starts the next.  A boundary inside a token never splits that token.
        - Merge: a segment with fewer than ``min_tokens`` tokens joins the following segment (repeatedly, until the
          run has ``min_tokens``); a short last segment joins its predecessor; a row whose whole reasoning has fewer
          than ``min_tokens`` tokens is one segment.
        - Cut (after merging): a segment of ``n > max_tokens`` tokens becomes ``k = ceil(n / max_tokens)``
          consecutive chunks of near-equal size (the first ``n % k`` chunks one token longer), so no tiny tail.
          Every chunk then has at least ``min_tokens`` tokens when ``max_tokens >= 2 * min_tokens - 1``; with a
          tighter ``max_tokens`` the cap wins and chunks can be shorter than ``min_tokens``.
        - Rows without reasoning tokens are all -1; an empty batch gives an empty result.

    Raises:
        ValueError: shapes differ or are not 2-D, a reasoning token id is negative, ``min_tokens < 1``,
            ``max_tokens < min_tokens``, or a bad ``split`` (see :func:`compile_segment_split`).
    """
    min_tokens, max_tokens = _check_segment_args(response_ids, response_mask, reasoning_mask, min_tokens, max_tokens)
    pattern = compile_segment_split(split)

    device = response_ids.device
    B, T = response_ids.shape
    if B == 0 or T == 0:
        return torch.full((B, T), -1, dtype=torch.long, device=device)

    ids = response_ids.detach().to("cpu", torch.long)
    sel = (response_mask.detach().to("cpu") != 0) & (reasoning_mask.detach().to("cpu") != 0)
    if not sel.any():
        return torch.full((B, T), -1, dtype=torch.long, device=device)
    n_raw, counts = _raw_segments(ids, sel, tokenizer, pattern)

    # Merge / cut over each row's segments: a host loop over segments (not tokens), which are few.
    offsets_list = (n_raw.cumsum(0) - n_raw).tolist()
    final = [_group_lengths(counts[o: o + n], min_tokens, max_tokens) for o, n in zip(offsets_list, n_raw.tolist())]
    s_max = max(1, max(len(f) for f in final))
    ends = torch.full((B, s_max), T + 1, dtype=torch.long)  # cumulative token ends per final segment, padded
    for b, f in enumerate(final):
        if f:
            ends[b, : len(f)] = torch.tensor(f, dtype=torch.long).cumsum(0)
    rank = sel.long().cumsum(dim=1) - 1  # index of each reasoning token among its row's reasoning tokens
    seg = torch.searchsorted(ends, rank, right=True)
    return torch.where(sel, seg, torch.full((), -1, dtype=torch.long)).to(device)


def _check_segment_args(response_ids: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                        min_tokens, max_tokens) -> tuple[int, int | None]:
    """The validated (min_tokens, max_tokens) of :func:`reasoning_segments`; raises ValueError on bad shapes or counts."""
    shape = response_ids.shape
    if response_ids.dim() != 2 or response_mask.shape != shape or reasoning_mask.shape != shape:
        raise ValueError(
            f"response_ids, response_mask and reasoning_mask must all be (B, T); got {tuple(response_ids.shape)}, "
            f"{tuple(response_mask.shape)} and {tuple(reasoning_mask.shape)}"
        )
    min_tokens = _check_count("min_tokens", min_tokens)
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    if max_tokens is not None:
        max_tokens = _check_count("max_tokens", max_tokens)
        if max_tokens < min_tokens:
            raise ValueError(f"max_tokens must be None or >= min_tokens ({min_tokens}), got {max_tokens}")
    return min_tokens, max_tokens


def _raw_segments(ids: torch.Tensor, sel: torch.Tensor, tokenizer, pattern) -> tuple[torch.Tensor, list[int]]:
    """Raw segments (before merging and cutting) of the selected tokens of (B, T) ``ids``: (B,) segments per row and
    the token count of every segment, rows in order (a host list)."""
    B = ids.shape[0]
    # Byte offsets of every token, batch-wide: tokens off the reasoning get length 0, so they shift nothing.
    table, known, tok_len = selected_byte_lengths(ids, sel, tokenizer, "reasoning")
    starts = tok_len.cumsum(dim=1) - tok_len

    # Boundaries per row: the only per-row Python work is joining the row's bytes and the regex scan.
    rows = [segment_boundaries(b"".join([table[i] for i in ids[b][known[b]].tolist()]), pattern) for b in range(B)]
    width = max(1, max(len(r) for r in rows))
    inf = int(starts.max()) + 1  # beyond every start: padding boundaries count for no token
    bounds = torch.full((B, width), inf, dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            bounds[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    # Raw segment = number of boundaries <= start(t).  Non-decreasing along every row (starts are).
    raw = torch.searchsorted(bounds, starts, right=True)

    # Dense raw segment index among the row's reasoning tokens: a reasoning token starts one when its raw segment is
    # above the previous reasoning token's (the running max of raw over reasoning tokens before it; -1 if none).
    seen = torch.where(sel, raw, torch.full((), -1, dtype=torch.long)).cummax(dim=1).values
    prev = torch.cat([torch.full((B, 1), -1, dtype=torch.long), seen[:, :-1]], dim=1)
    new = sel & (raw > prev)
    n_raw = new.sum(dim=1)
    dense = new.long().cumsum(dim=1) - 1
    offsets = n_raw.cumsum(0) - n_raw
    counts = torch.bincount((offsets[:, None] + dense)[sel], minlength=int(n_raw.sum())).tolist()
    return n_raw, counts
