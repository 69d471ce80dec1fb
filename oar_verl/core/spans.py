"""Final-answer spans of responses, as token masks.

OAR's outcome target is the response's own final answer (``\\boxed{…}``, GSM8K ``#### N``, "The answer is N", or a
user regex).  The answer is found in the response *bytes*, and byte spans are mapped back to token positions through
per-token byte offsets computed from the token ids themselves.  Nothing is ever re-tokenised: re-tokenising decoded
text can merge or split tokens differently from what the policy sampled, which would shift every position.

verl-free on purpose (torch and transformers tokenizer objects only), so the maths and its tests run without verl.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.config import BUILTIN_PATTERNS

logger = logging.getLogger("oar_verl")
_warned_beyond_vocab = False

__all__ = [
    "BUILTIN_PATTERNS",
    "AnswerSpans",
    "token_byte_table",
    "find_answer_span",
    "locate_answer_spans",
]


@dataclass(frozen=True)
class AnswerSpans:
    """Per-token masks of the reasoning and answer parts of a batch of responses.

    Attributes:
        reasoning_mask: (B, T) bool. Valid response tokens whose bytes end at or before the answer marker (without a
            found answer: every valid token except EOS / pad tokens).
        answer_mask: (B, T) bool. Valid tokens overlapping the answer value (e.g. the ``42`` of ``\\boxed{42}``).
        found: (B,) bool. Whether some pattern matched the row.
        pattern_index: (B,) long. Index into the ``patterns`` tuple of the pattern that matched, -1 if none.

    Marker tokens (``\\boxed{``, ``#### ``, "The answer is "), tokens after the value and EOS are in neither mask.
    """

    reasoning_mask: torch.Tensor
    answer_mask: torch.Tensor
    found: torch.Tensor
    pattern_index: torch.Tensor


# --------------------------------------------------------------------------------------------------------------------
# Token -> bytes table
# --------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> tuple[dict[int, int], re.Pattern[str]]:
    """(str.translate table unicode -> byte value, regex finding any character outside the byte-level alphabet)."""
    b2u = _bytes_to_unicode()
    translate = {ord(u): b for b, u in b2u.items()}
    outside = re.compile("[^" + "".join(re.escape(u) for u in b2u.values()) + "]")
    return translate, outside


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_bytes(token: str) -> bytes:
    """Bytes of a byte-level BPE token string (GPT-2 / Qwen vocabularies)."""
    translate, outside = _byte_level_decoder()
    if outside.search(token) is None:
        # Every character stands for one byte: latin-1 encodes code points 0..255 as exactly those bytes.
        return token.translate(translate).encode("latin-1")
    # A stray character outside the alphabet is taken literally (UTF-8), the rest are decoded as bytes.
    return b"".join(bytes([translate[ord(c)]]) if ord(c) in translate else c.encode("utf-8") for c in token)


def _sentencepiece_bytes(token: str) -> bytes:
    """Bytes of a SentencePiece token: ``▁`` is a space, ``<0xNN>`` byte-fallback pieces are that byte."""
    m = _SP_BYTE.fullmatch(token)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _component_json(backend, component: str) -> str:
    """JSON state of a ``tokenizers`` component (``decoder``, ``pre_tokenizer``) as text, "" if absent."""
    obj = getattr(backend, component, None)
    if obj is None:
        return ""
    try:
        state = obj.__getstate__()
    except Exception:  # noqa: BLE001 - a component without a JSON state just gives no hint
        return ""
    return state.decode("utf-8") if isinstance(state, bytes) else str(state)


def _tokenizer_style(tokenizer) -> str:
    """``byte_level``, ``sentencepiece`` or ``decode`` (unknown: fall back to decoding each id alone)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Components serialise to JSON (bytes); a Sequence lists its children, so a substring test finds them.
        decoder_state, pre_state = (_component_json(backend, c) for c in ("decoder", "pre_tokenizer"))
        # The decoder decides how ids become text; the pre-tokenizer is a second hint for decoders we don't know.
        if '"ByteLevel"' in decoder_state:
            return "byte_level"
        if any(k in decoder_state for k in ('"ByteFallback"', '"Metaspace"', "\u2581")):
            return "sentencepiece"
        if '"ByteLevel"' in pre_state:
            return "byte_level"
    if hasattr(tokenizer, "byte_decoder"):  # slow GPT-2-style tokenizers
        return "byte_level"
    if hasattr(tokenizer, "sp_model"):  # slow SentencePiece tokenizers
        return "sentencepiece"
    return "decode"


def _build_table(tokenizer) -> list[bytes]:
    """Bytes of every id in ``range(len(tokenizer))``; see :func:`token_byte_table`."""
    n = len(tokenizer)
    style = _tokenizer_style(tokenizer)
    table: list[bytes | None] = [None] * n
    if style != "decode":
        convert = _byte_level_bytes if style == "byte_level" else _sentencepiece_bytes
        for token, idx in tokenizer.get_vocab().items():
            if 0 <= idx < n:
                table[idx] = convert(token)
    # Added / special tokens are stored verbatim (not byte-level encoded): their content is their text.
    for idx, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if 0 <= idx < n:
            table[idx] = str(getattr(added, "content", added)).encode("utf-8")
    missing = [i for i, b in enumerate(table) if b is None]
    if missing:
        # Documented fallback (unknown tokenizer styles, or holes in the vocabulary): decode each id alone.  Exact for
        # whole-character tokens; a token holding part of a UTF-8 character decodes to U+FFFD and its length is off.
        texts = tokenizer.batch_decode(
            [[i] for i in missing], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for i, text in zip(missing, texts):
            table[i] = text.encode("utf-8")
    return table  # type: ignore[return-value]


def _table_signature(tokenizer) -> tuple[int, ...]:
    """Cheap fingerprint of a tokenizer's id space, to notice tokens added after its table was built.

    ``len(tokenizer)`` would do, but on a fast tokenizer it rebuilds the whole vocabulary map (~80 ms for Qwen's
    151k tokens), far too slow for every batch; the base vocabulary size and the added-token ids are O(#added).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            added = backend.get_added_tokens_decoder()
            return backend.get_vocab_size(with_added_tokens=False), len(added), max(added, default=-1)
        except (AttributeError, TypeError):
            pass
    return (len(tokenizer),)


# Keyed weakly by the tokenizer object so a dropped tokenizer frees its table.
_TABLES: "weakref.WeakKeyDictionary[object, tuple[tuple[int, ...], list[bytes], torch.Tensor]]" = (
    weakref.WeakKeyDictionary()
)
_TABLES_BY_ID: dict[int, tuple[object, tuple[int, ...], list[bytes], torch.Tensor]] = {}


def _cached_table(tokenizer) -> tuple[list[bytes], torch.Tensor]:
    """(byte table, (V,) long tensor of byte lengths), built once per tokenizer object (rebuilt if tokens are added)."""
    signature = _table_signature(tokenizer)
    try:
        entry = _TABLES.get(tokenizer)
    except TypeError:  # not weak-referenceable: key by id and keep the object alive with the entry
        hit = _TABLES_BY_ID.get(id(tokenizer))
        entry = hit[1:] if hit is not None and hit[0] is tokenizer else None
    if entry is not None and entry[0] == signature:
        return entry[1], entry[2]
    table = _build_table(tokenizer)
    lengths = torch.tensor([len(b) for b in table], dtype=torch.long)
    try:
        _TABLES[tokenizer] = (signature, table, lengths)
    except TypeError:
        _TABLES_BY_ID[id(tokenizer)] = (tokenizer, signature, table, lengths)
    return table, lengths


def token_byte_table(tokenizer) -> list[bytes]:
    """Bytes of every token id, ``len == len(tokenizer)``, cached per tokenizer object.

    - Byte-level BPE (GPT-2 / Qwen: the backend decoder is ``ByteLevel``): the token string is mapped back through
      the inverse of GPT-2's ``bytes_to_unicode``, so a token holding half of a UTF-8 character gets exactly its bytes.
    - SentencePiece style (``▁`` word marker, ``<0xNN>`` byte-fallback pieces): ``▁`` -> ``b" "``, ``<0xNN>`` -> that
      byte.  A leading ``▁`` is kept as a space even where the decoder would strip it: offsets only need to be
      self-consistent.
    - Added / special tokens: their content as UTF-8 (e.g. ``b"<|im_end|>"``).
    - Anything else: ``tokenizer.decode([id])`` as UTF-8 (fallback; inexact for tokens that split a character).
    """
    return _cached_table(tokenizer)[0]


# --------------------------------------------------------------------------------------------------------------------
# Answer patterns on bytes
# --------------------------------------------------------------------------------------------------------------------

# A number: sign, thousands commas (only in complete groups of three), decimals.
_NUM = rb"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+"
# Optional separators between marker and value are each introduced by a distinct literal (":" or "$"), so the regex
# cannot split one run of spaces several ways: no polynomial backtracking on long whitespace.
_GSM8K = re.compile(rb"####[ \t]*(?:\$[ \t]*)?(?P<answer>" + _NUM + rb")")
_ANSWER_IS = re.compile(
    rb"(?i)\b(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t]*(?::[ \t]*)?(?:\$[ \t]*)?"
    rb"(?P<answer>(?:" + _NUM + rb")(?:[ \t]*/[ \t]*\d+(?!\d))?)"
)
# Box scanner lexemes, tried left to right: a box opener (``\boxed{`` / ``\fbox{``, spaces allowed before the brace),
# an escaped pair (``\\``, ``\{``, ``\}``: literal characters, not groups), or a bare brace.
_BOX_LEXEME = re.compile(rb"(?P<box>\\(?:boxed|fbox)[ \t]*\{)|(?P<esc>\\[\\{}])|(?P<open>\{)|(?P<close>\})")
_BOX_START = re.compile(rb"\\(?:boxed|fbox)[ \t]*\{")
_WS = b" \t\r\n\f\v"


def _find_boxed(text: bytes) -> tuple[int, int, int] | None:
    """Last complete, non-empty ``\\boxed{…}`` / ``\\fbox{…}``: (marker_start, value_start, value_end) byte offsets.

    One left-to-right pass with a brace stack (linear in len(text), whatever the nesting).  "Last" means the box whose
    closing brace comes last: of nested boxes the outer one wins; an unclosed outer box leaves its complete inner box.
    """
    first = _BOX_START.search(text)
    if first is None:
        return None
    # Braces before the first opener cannot change which later braces pair up: the opener's "{" sits above them on
    # the stack.  So the scan starts there, backed up to the start of the backslash run before it, so that escape
    # pairs are read as in the full text (\\boxed{ is a line break and a plain brace, not a box).
    start = first.start()
    while start > 0 and text[start - 1] == 0x5C:  # backslash
        start -= 1
    stack: list[tuple[int, int] | None] = []  # (marker_start, value_start) for box braces, None for plain braces
    complete: list[tuple[int, int, int]] = []
    for m in _BOX_LEXEME.finditer(text, start):
        kind = m.lastgroup
        if kind == "open":
            stack.append(None)
        elif kind == "close":
            if stack:  # an unmatched "}" closes nothing
                opened = stack.pop()
                if opened is not None:
                    complete.append((opened[0], opened[1], m.start()))
        elif kind == "box":
            stack.append((m.start(), m.end()))
        # kind == "esc": a literal character, not a group
    for marker_start, inner_start, inner_end in reversed(complete):
        value = text[inner_start:inner_end]
        stripped = value.strip(_WS)
        if stripped:
            value_start = inner_start + (len(value) - len(value.lstrip(_WS)))
            return marker_start, value_start, value_start + len(stripped)
    return None


def _find_last_regex(pattern: re.Pattern[bytes], text: bytes) -> tuple[int, int, int] | None:
    """Last match of ``pattern`` whose ``answer`` group is non-empty: (match_start, answer_start, answer_end)."""
    best = None
    for m in pattern.finditer(text):
        start, end = m.span("answer")
        if start >= 0 and end > start:
            best = (m.start(), start, end)
    return best


@functools.lru_cache(maxsize=256)
def _compile_custom(pattern: str | bytes) -> re.Pattern[bytes]:
    """Compile a user regex on bytes; it must define a named group ``answer``."""
    raw = pattern.encode("utf-8") if isinstance(pattern, str) else pattern
    try:
        compiled = re.compile(raw)
    except re.error as exc:
        raise ValueError(
            f"answer pattern {pattern!r} is neither a built-in {BUILTIN_PATTERNS} nor a valid regex: {exc}"
        ) from exc
    if "answer" not in compiled.groupindex:
        raise ValueError(f"answer regex {pattern!r} must define a named group 'answer', e.g. (?P<answer>...)")
    return compiled


def _find_one(text: bytes, pattern: str | bytes) -> tuple[int, int, int] | None:
    """(marker_start, value_start, value_end) of one pattern's last occurrence in ``text``, or None."""
    if pattern == "boxed":
        return _find_boxed(text)
    if pattern == "gsm8k":
        return _find_last_regex(_GSM8K, text)
    if pattern == "answer_is":
        return _find_last_regex(_ANSWER_IS, text)
    return _find_last_regex(_compile_custom(pattern), text)


def find_answer_span(
    text: bytes | str, patterns: Sequence[str] = BUILTIN_PATTERNS
) -> tuple[int, int, int, int] | None:
    """Find the final answer in one response.

    Args:
        text: the response as UTF-8 bytes (a ``str`` is encoded to UTF-8 first; offsets are then still byte offsets).
        patterns: tried in order; the first that matches wins.  Built-ins:
            ``boxed``: last complete ``\\boxed{…}`` / ``\\fbox{…}`` with balanced braces; the value is the inside,
            whitespace-stripped; empty or unclosed boxes don't count.  Marker = backslash .. ``{``.
            ``gsm8k``: ``#### N`` (optional ``$``); N a number with sign, thousands commas, decimals.
            ``answer_is``: case-insensitive "[the] [final] answer is[:] [$]N"; N a number or a fraction ``a/b``.
            Any other string is a Python regex (compiled on the UTF-8 bytes) with a named group ``answer``; the marker
            starts at the match start.  Within a pattern the last occurrence wins; empty values are skipped.

    Returns:
        ``(marker_start, value_start, value_end, pattern_index)`` as byte offsets into ``text``, or None.

    Runs in time linear in ``len(text)`` for the built-ins (no catastrophic backtracking, whatever the input).
    """
    if isinstance(text, str):
        text = text.encode("utf-8")
    if isinstance(patterns, (str, bytes)):
        patterns = (patterns,)
    for index, pattern in enumerate(patterns):
        span = _find_one(text, pattern)
        if span is not None:
            return span[0], span[1], span[2], index
    return None


# --------------------------------------------------------------------------------------------------------------------
# Batch: byte spans -> token masks
# --------------------------------------------------------------------------------------------------------------------


def _as_id_list(ids: int | Iterable[int] | None) -> list[int]:
    """An int, an iterable of ints (Nones dropped) or None as a list of ints."""
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids if i is not None]


def locate_answer_spans(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer,
    patterns: Sequence[str] = BUILTIN_PATTERNS,
    eos_token_ids: int | Iterable[int] | None = None,
) -> AnswerSpans:
    """Reasoning and answer token masks of a batch of responses.

    Args:
        response_ids: (B, T) long token ids (right-padded; any layout works, only ``response_mask`` counts).
        response_mask: (B, T) 0/1, bool or float: which positions are real response tokens.
        tokenizer: a transformers tokenizer; its byte table is built once and cached (:func:`token_byte_table`).
        patterns: answer patterns, see :func:`find_answer_span`.
        eos_token_ids: int or ids never counted as reasoning; default ``tokenizer.eos_token_id``.  Positions holding
            ``tokenizer.pad_token_id`` (if the tokenizer has one) are never reasoning either.

    Returns:
        :class:`AnswerSpans` with (B, T) bool masks and (B,) ``found`` / ``pattern_index``, on ``response_ids.device``.
        Found: reasoning = valid tokens ending at or before the marker start (EOS / pad excluded); answer = valid
        tokens overlapping [value_start, value_end).  Not found: reasoning = valid tokens except EOS / pad; answer
        empty.  Rows with no valid token: all False, not found.

    Raises:
        ValueError: shapes differ, or a valid token id is negative. Ids beyond the tokenizer's vocabulary (unused
        embedding rows a model may still sample) count as empty text, with one warning per process.
    """
    if response_ids.dim() != 2 or response_mask.shape != response_ids.shape:
        raise ValueError(
            f"response_ids and response_mask must both be (B, T); got {tuple(response_ids.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    device = response_ids.device
    B, T = response_ids.shape
    if B == 0 or T == 0:
        empty = torch.zeros(B, T, dtype=torch.bool, device=device)
        found = torch.zeros(B, dtype=torch.bool, device=device)
        return AnswerSpans(empty, empty.clone(), found, torch.full((B,), -1, dtype=torch.long, device=device))

    table, lengths = _cached_table(tokenizer)
    vocab = len(table)
    ids = response_ids.detach().to("cpu", torch.long)
    valid = response_mask.detach().to("cpu") != 0
    if valid.any():
        valid_ids = ids[valid]
        lo, hi = int(valid_ids.min()), int(valid_ids.max())
        if lo < 0:
            raise ValueError(f"token id {lo} in the response is negative; the ids and the tokenizer do not match")
        global _warned_beyond_vocab
        if hi >= vocab and not _warned_beyond_vocab:
            # Models often have more embedding rows than the tokenizer has tokens (Qwen2.5: 151,936 vs 151,646);
            # a sampled id there has no text, so it spans zero bytes instead of failing the training step.
            logger.warning("token id %d is beyond the tokenizer's %d tokens; treating such ids as empty text", hi,
                           vocab)
            _warned_beyond_vocab = True

    # Byte offsets of every token, batch-wide: padding gets length 0 so it does not shift later offsets.
    known = valid & (ids < vocab)
    tok_len = torch.where(known, lengths[ids.clamp(0, vocab - 1)], torch.zeros((), dtype=torch.long))
    ends = tok_len.cumsum(dim=1)
    starts = ends - tok_len

    # Byte spans per row (the only per-row Python work: joining the row's bytes and scanning them).  Rows without an
    # answer keep (0, 0, 0, -1); the `found` gate below makes those values irrelevant.
    spans = [(0, 0, 0, -1)] * B
    for b in range(B):
        row = ids[b][known[b]].tolist()
        if row:
            spans[b] = find_answer_span(b"".join([table[i] for i in row]), patterns) or spans[b]
    marker, v_start, v_end, pattern_index = torch.tensor(spans, dtype=torch.long).reshape(B, 4).unbind(1)
    found = pattern_index >= 0

    never_reasoning = _as_id_list(tokenizer.eos_token_id if eos_token_ids is None else eos_token_ids)
    never_reasoning += _as_id_list([getattr(tokenizer, "pad_token_id", None)])
    if never_reasoning:
        special = torch.isin(ids, torch.tensor(never_reasoning, dtype=torch.long))
    else:
        special = torch.zeros_like(valid)
    candidates = valid & ~special
    f = found[:, None]
    reasoning = candidates & (~f | (ends <= marker[:, None]))
    answer = valid & f & (starts < v_end[:, None]) & (ends > v_start[:, None])
    return AnswerSpans(
        reasoning.to(device), answer.to(device), found.to(device), pattern_index.contiguous().to(device)
    )
