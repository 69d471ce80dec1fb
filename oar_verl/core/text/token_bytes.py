"""Token ids -> bytes: the exact bytes every token of a vocabulary stands for.

Answer spans (and reasoning segments) are found in the response *bytes* and mapped back to token positions through
per-token byte offsets computed from the token ids themselves, never by re-tokenising decoded text: re-tokenising can
merge or split tokens differently from what the policy sampled, which would shift every position. This module builds
the per-vocabulary byte table those offsets come from.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref

import torch

__all__ = ["selected_byte_lengths", "token_byte_table", "token_byte_lengths"]

logger = logging.getLogger("oar_verl")
_warned_beyond_vocab = False


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


def token_byte_lengths(tokenizer) -> tuple[list[bytes], torch.Tensor]:
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
    return token_byte_lengths(tokenizer)[0]


def selected_byte_lengths(ids: torch.Tensor, selected: torch.Tensor, tokenizer,
                          what: str) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
    """The byte table and per-token byte lengths of the selected tokens of a batch (the base of byte offsets).

    Args:
        ids: (B, T) long CPU token ids. selected: (B, T) bool CPU, the tokens whose bytes count.
        tokenizer: a transformers tokenizer. what: names the selection in errors ("response", "reasoning").

    Returns:
        (byte table, known (B, T) bool: selected and inside the vocabulary, (B, T) long byte length of each known
        token, 0 elsewhere -- so unselected tokens shift no offset).

    Raises:
        ValueError: a selected id is negative. Ids beyond the tokenizer's vocabulary (unused embedding rows a model
        may still sample) count as empty text, with one warning per process.
    """
    table, lengths = token_byte_lengths(tokenizer)
    vocab = len(table)
    if selected.any():
        chosen = ids[selected]
        lo, hi = int(chosen.min()), int(chosen.max())
        if lo < 0:
            raise ValueError(f"token id {lo} in the {what} is negative; the ids and the tokenizer do not match")
        global _warned_beyond_vocab
        if hi >= vocab and not _warned_beyond_vocab:
            # Models often have more embedding rows than the tokenizer has tokens (Qwen2.5: 151,936 vs 151,646);
            # a sampled id there has no text, so it spans zero bytes instead of failing the training step.
            logger.warning("token id %d is beyond the tokenizer's %d tokens; treating such ids as empty text", hi,
                           vocab)
            _warned_beyond_vocab = True
    known = selected & (ids < vocab)
    return table, known, torch.where(known, lengths[ids.clamp(0, vocab - 1)], torch.zeros((), dtype=torch.long))
