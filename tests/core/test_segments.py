"""Reasoning segments (oar_verl.core.text.segments): split rules on response bytes, per-token segment ids through byte
offsets, merging of short and cutting of long segments, checked against a naive per-token reference."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.core.text.segments import SEGMENT_SPLITS, compile_segment_split, reasoning_segments, segment_boundaries
from oar_verl.core.text.token_bytes import token_byte_table

USER_SPLITS = (r"(?=Step \d)", ";", r"\d")
ALL_SPLITS = SEGMENT_SPLITS + USER_SPLITS


# ---------------------------------------------------------------------------------------------------------------------
# naive reference: per token, in pure Python
# ---------------------------------------------------------------------------------------------------------------------

_WS = b" \t\n\r\f\v"
_FULL_WIDTH = tuple(c.encode() for c in "。！？")


def _newline_run_end(text: bytes, i: int) -> int | None:
    """End of the run of line breaks (\\n, \\r\\n) starting at byte i, None if none starts there."""
    j = i
    while True:
        if text[j: j + 1] == b"\n":
            j += 1
        elif text[j: j + 2] == b"\r\n":
            j += 2
        else:
            return j if j > i else None


def naive_boundaries(text: bytes, split: str) -> set[int]:
    """Boundaries of a split rule, found byte by byte for the built-ins (the regex for user rules)."""
    n = len(text)
    found = set()
    if split in SEGMENT_SPLITS:
        for i in range(n):
            if text[i: i + 1] == b"\n" and _newline_run_end(text, i + 1) is None:
                found.add(i + 1)  # the last line break of a run
        if split == "sentence":
            for i in range(n):
                end = None
                if text[i] in b".!?" and (i + 1 == n or text[i + 1] in _WS):
                    end = i + 1
                elif any(text[i: i + 3] == c for c in _FULL_WIDTH):
                    end = i + 3
                if end is not None:
                    found.add(_newline_run_end(text, end) or end)
    else:
        found = {m.end() for m in re.compile(split.encode()).finditer(text)}
    return {p for p in found if 0 < p < n}


def reference_row(ids: list[int], sel: list[bool], table: list[bytes], split: str, min_tokens: int,
                  max_tokens: int | None) -> list[int]:
    positions = [t for t in range(len(ids)) if sel[t]]
    starts, text = [], b""
    for t in positions:
        starts.append(len(text))
        text += table[ids[t]] if ids[t] < len(table) else b""
    bounds = naive_boundaries(text, split)
    raw: list[list[int]] = []
    for k, t in enumerate(positions):
        if k == 0 or any(starts[k - 1] < b <= starts[k] for b in bounds):
            raw.append([])
        raw[-1].append(t)
    merged: list[list[int]] = []
    pending: list[int] = []
    for seg in raw:
        pending = pending + seg
        if len(pending) >= min_tokens:
            merged.append(pending)
            pending = []
    if pending:
        if merged:
            merged[-1] = merged[-1] + pending
        else:
            merged.append(pending)
    final: list[list[int]] = []
    for seg in merged:
        if max_tokens is None or len(seg) <= max_tokens:
            final.append(seg)
            continue
        k = -(-len(seg) // max_tokens)
        sizes = [len(seg) // k + (1 if i < len(seg) % k else 0) for i in range(k)]
        at = 0
        for size in sizes:
            final.append(seg[at: at + size])
            at += size
    out = [-1] * len(ids)
    for s, seg in enumerate(final):
        for t in seg:
            out[t] = s
    return out


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def pad_rows(rows: list[tuple[list[int], list[bool], list[bool]]], pad: int = 0, width: int | None = None):
    """(ids, response_mask, reasoning_mask) rows -> right-padded (B, T) tensors."""
    T = max([len(r[0]) for r in rows] + [width or 0])
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    resp = torch.zeros(len(rows), T, dtype=torch.long)
    reas = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (i, m, r) in enumerate(rows):
        ids[b, : len(i)] = torch.tensor(i, dtype=torch.long)
        resp[b, : len(m)] = torch.tensor(m, dtype=torch.long)
        reas[b, : len(r)] = torch.tensor(r, dtype=torch.bool)
    return ids, resp, reas


def response_row(tok, reasoning: str, answer: str = " \\boxed{42}"):
    """A response: reasoning tokens, answer tokens (not reasoning), EOS."""
    r = tok.encode(reasoning, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False)
    ids = r + a + [tok.eos_token_id]
    return ids, [True] * len(ids), [True] * len(r) + [False] * (len(a) + 1)


def check_invariants(seg: torch.Tensor, resp: torch.Tensor, reas: torch.Tensor, min_tokens: int,
                     max_tokens: int | None) -> None:
    sel = (resp != 0) & reas.bool()
    assert seg.dtype == torch.long and seg.shape == resp.shape
    assert torch.equal(seg >= 0, sel)  # -1 exactly off the reasoning (answer, EOS, padding)
    assert (seg >= -1).all()
    for b in range(seg.shape[0]):
        row = seg[b][sel[b]]
        if row.numel() == 0:
            continue
        assert row[0] == 0 and (row.diff() >= 0).all() and (row.diff() <= 1).all()  # contiguous runs 0..S-1
        sizes = torch.bincount(row).tolist()
        if row.numel() < min_tokens:
            assert sizes == [row.numel()]
            continue
        assert max_tokens is None or max(sizes) <= max_tokens
        if max_tokens is None or max_tokens >= 2 * min_tokens - 1:
            assert min(sizes) >= min_tokens


def segment_texts(tok, ids: list[int], seg: torch.Tensor) -> list[str]:
    table = token_byte_table(tok)
    out: dict[int, bytes] = {}
    for i, s in zip(ids, seg.tolist()):
        if s >= 0:
            out[s] = out.get(s, b"") + table[i]
    return [out[s].decode("utf-8") for s in range(len(out))]


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------------------------------------------------------------
# split rules on bytes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, text, expected", [
    ("line", b"a\nb\n\nc\r\nd", [2, 5, 8]),
    ("line", b"\n\na\n", [2]),  # offsets 0 and len(text) are dropped
    ("sentence", b"It is 3.5 m. Then e.g.x! Ok?", [12, 24]),
    ("sentence", b"x.\n\nStep", [4]),  # punctuation + line breaks: one boundary, after the breaks
    ("sentence", b"x. \n\nStep", [2, 5]),
    ("sentence", b"a.\r\nb", [4]),
    ("sentence", "中文。下一步！好？x".encode(), [9, 21, 27]),
    ("sentence", "$\\frac{1}{2}$. So \\(x^2\\) holds".encode(), [14]),
    ("(?=Step \\d)", b"Step 1 a Step 2 b Step x", [9]),
    (";", b"a;b;;c;", [2, 4, 5]),
])
def test_segment_boundaries(split, text, expected):
    assert segment_boundaries(text, compile_segment_split(split)) == expected
    assert sorted(naive_boundaries(text, split)) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b".", b"!", b"?", b" ", b"\n", b"\r", b"\t", b"x", b"3", "。".encode(), "！".encode(),
                                 b"\xe3", b"\x80\x82", "é".encode()]), max_size=20), st.sampled_from(SEGMENT_SPLITS))
def test_builtin_rules_match_naive_scan(parts, split):
    text = b"".join(parts)
    assert segment_boundaries(text, compile_segment_split(split)) == sorted(naive_boundaries(text, split))


def test_compile_segment_split():
    assert compile_segment_split("line").pattern == rb"(?:\r?\n)+"
    assert compile_segment_split("sentence") is compile_segment_split("sentence")
    assert compile_segment_split("(?=Step)").search(b"1. Step 2").start() == 3
    assert compile_segment_split("。").pattern == "。".encode()
    with pytest.raises(ValueError, match=r"'\(' is neither one of \('line', 'sentence'\) nor a valid regex"):
        compile_segment_split("(")
    with pytest.raises(ValueError, match="not allowed"):
        compile_segment_split("(?u)x")
    for empty in ("\\n*", "$", "(?=x)|"):
        with pytest.raises(ValueError, match="matches the empty text"):
            compile_segment_split(empty)
    for bad in ("", None, 3, b"line"):
        with pytest.raises(ValueError, match="must be one of"):
            compile_segment_split(bad)


# ---------------------------------------------------------------------------------------------------------------------
# token segments on the real Qwen2.5 vocabulary
# ---------------------------------------------------------------------------------------------------------------------

QWEN_TEXT = ("First, 3.5 is a decimal. Then é → 中文。下一步\n\nStep 2: $\\frac{1}{2}$. So \\(x^2\\) works; "
             "see e.g.x!\r\nStep 3: done")


@pytest.mark.parametrize("split, expected", [
    ("line", ["First, 3.5 is a decimal. Then é → 中文。下一步\n\n",
              "Step 2: $\\frac{1}{2}$. So \\(x^2\\) works; see e.g.x!\r\n", "Step 3: done"]),
    ("sentence", ["First, 3.5 is a decimal.", " Then é → 中文。", "下一步\n\n", "Step 2: $\\frac{1}{2}$.",
                  " So \\(x^2\\) works; see e.g.x!\r\n", "Step 3: done"]),
    (r"(?=Step \d)", ["First, 3.5 is a decimal. Then é → 中文。下一步\n\n",
                      "Step 2: $\\frac{1}{2}$. So \\(x^2\\) works; see e.g.x!\r\n", "Step 3: done"]),
    (";", ["First, 3.5 is a decimal. Then é → 中文。下一步\n\nStep 2: $\\frac{1}{2}$. So \\(x^2\\) works;",
           " see e.g.x!\r\nStep 3: done"]),
])
def test_qwen_segments(qwen25_tokenizer, split, expected):
    tok = qwen25_tokenizer
    ids, resp, reas = pad_rows([response_row(tok, QWEN_TEXT)])
    seg = reasoning_segments(ids, resp, reas, tok, split)
    check_invariants(seg, resp, reas, 1, None)
    assert segment_texts(tok, ids[0].tolist(), seg[0]) == expected
    assert (seg[0][~reas[0]] == -1).all()  # the answer and EOS


def test_merged_punctuation_token_keeps_its_segment(qwen25_tokenizer):
    tok, table = qwen25_tokenizer, token_byte_table(qwen25_tokenizer)
    ids = tok.encode("x.\n\nStep 2", add_special_tokens=False)
    assert [table[i] for i in ids] == [b"x", b".\n\n", b"Step", b" ", b"2"]  # ".\n\n" is one Qwen token
    row = torch.tensor([ids])
    assert reasoning_segments(row, torch.ones_like(row), torch.ones_like(row), tok).tolist() == [[0, 0, 1, 1, 1]]
    # the same bytes as separate tokens: the boundary is after the line breaks, "\n\n" stays with "x."
    ids = [tok.convert_tokens_to_ids(t) for t in ("x", ".", "ĊĊ", "Step")]
    row = torch.tensor([ids])
    assert reasoning_segments(row, torch.ones_like(row), torch.ones_like(row), tok).tolist() == [[0, 0, 0, 1]]


DECODE_TEXTS = [
    QWEN_TEXT,
    "Compute 3.5 × 2 = 7. Thus the value is 7!\n\nCheck: é, →, 中文。再来？ yes",
    "Step 1: let $x = \\frac{1}{2}$.\nStep 2: \\(x^2 = 0.25\\).\n\n\nStep 3: so; we stop.",
    "a.b.c. d!e?f\r\n\r\ng",
]


@pytest.mark.parametrize("split", ALL_SPLITS)
def test_segment_starts_match_decoded_prefixes(qwen25_tokenizer, tiny_bpe_tokenizer, split):
    """Token t starts a segment iff the decoded text before it passed a boundary since the previous token."""
    checked = 0
    for tok in (qwen25_tokenizer, tiny_bpe_tokenizer):
        for text in DECODE_TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            row = torch.tensor([ids])
            seg = reasoning_segments(row, torch.ones_like(row), torch.ones_like(row), tok, split)[0].tolist()
            full = decode(tok, ids)
            assert full == text
            bounds = segment_boundaries(full.encode(), compile_segment_split(split))
            # byte length of the decoded prefix before each token, where that prefix is whole characters
            prefix = {}
            for t in range(len(ids) + 1):
                p = decode(tok, ids[:t])
                if full.startswith(p):
                    prefix[t] = len(p.encode())
            aligned = sorted(prefix)
            for t0, t1 in zip(aligned, aligned[1:]):
                if t1 == len(ids):
                    continue
                passed = any(prefix[t0] < b <= prefix[t1] for b in bounds)
                assert (seg[t1] > seg[t0]) == passed, (text, t1)
                checked += 1
            # the segments' bytes, in order, are the text
            table = token_byte_table(tok)
            pieces = [b"".join(table[i] for i, s in zip(ids, seg) if s == k) for k in range(max(seg) + 1)]
            assert all(pieces) and b"".join(pieces) == text.encode()
    assert checked > 100


# ---------------------------------------------------------------------------------------------------------------------
# merging and cutting, exactly
# ---------------------------------------------------------------------------------------------------------------------


def _sized_row(tok, sizes: list[int]) -> torch.Tensor:
    """Ids whose raw ';' segments have the given token counts: 'x' * (n - 1) + ';' each."""
    x, semi = tok.convert_tokens_to_ids("x"), tok.convert_tokens_to_ids(";")
    return torch.tensor([[i for n in sizes for i in [x] * (n - 1) + [semi]]])


@pytest.mark.parametrize("sizes, min_tokens, max_tokens, expected", [
    ([1, 3, 1, 2, 1], 1, None, [1, 3, 1, 2, 1]),
    ([1, 3, 1, 2, 1], 2, None, [4, 4]),  # 1 joins the next; the short tail 1 joins its predecessor
    ([1, 1, 1, 1, 3], 3, None, [3, 4]),  # short segments keep accumulating until min_tokens
    ([1, 3, 1, 2, 1], 2, 3, [2, 2, 2, 2]),  # merged 4s cut in two
    ([10], 1, 4, [4, 3, 3]),  # ceil(10/4) = 3 near-equal chunks, the longer first, no tiny tail
    ([9], 2, 4, [3, 3, 3]),
    ([2, 1], 5, None, [3]),  # a row shorter than min_tokens is one segment
    ([5], 3, 4, [3, 2]),  # max_tokens < 2 * min_tokens - 1: the cap wins
])
def test_merge_and_cut(qwen25_tokenizer, sizes, min_tokens, max_tokens, expected):
    row = _sized_row(qwen25_tokenizer, sizes)
    seg = reasoning_segments(row, torch.ones_like(row), torch.ones_like(row), qwen25_tokenizer, ";",
                             min_tokens, max_tokens)
    assert torch.bincount(seg[0]).tolist() == expected
    assert (seg[0].diff() >= 0).all()


def test_ids_beyond_vocabulary_are_empty(qwen25_tokenizer):
    tok = qwen25_tokenizer
    a, b = tok.encode("a.", add_special_tokens=False), tok.encode(" b. c", add_special_tokens=False)
    beyond = len(token_byte_table(tok)) + 5
    for ids, expected in [(a + [beyond] + b, [0] * len(a) + [1] * (1 + len(b) - 1) + [2]),
                          ([beyond] + a, [0] * (1 + len(a)))]:
        row = torch.tensor([ids])
        seg = reasoning_segments(row, torch.ones_like(row), torch.ones_like(row), tok)
        assert seg[0].tolist() == expected


# ---------------------------------------------------------------------------------------------------------------------
# against the reference, on both tokenizers; batch = rows
# ---------------------------------------------------------------------------------------------------------------------

FRAGMENTS = ["Step 1", "Step 2:", " Then", " so", ".", "!", "?", " ", "\n", "\r\n", "\n\n", "3.5", "e.g.x", "é", "→",
             "中文", "。", "！", "？", "$\\frac{1}{2}$", "\\(x^2\\)", ";", "We add 12 and 7", " is"]


@st.composite
def rows_strategy(draw, vocab: int):
    kind = draw(st.sampled_from(["text", "ids"]))
    if kind == "text":
        return "text", draw(st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join))
    # random ids, some beyond the vocabulary (0 bytes), and a random reasoning mask with holes
    ids = draw(st.lists(st.integers(0, vocab + 3), max_size=30))
    mask = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    return "ids", (ids, mask)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), use_qwen=st.booleans(), split=st.sampled_from(ALL_SPLITS), min_tokens=st.integers(1, 4),
       extra=st.one_of(st.none(), st.integers(0, 6)), n_rows=st.integers(1, 4))
def test_matches_reference(tiny_bpe_tokenizer, qwen25_tokenizer, data, use_qwen, split, min_tokens, extra, n_rows):
    tok = qwen25_tokenizer if use_qwen else tiny_bpe_tokenizer
    table = token_byte_table(tok)
    # with the real vocabulary, random ids are drawn from a small range (ids < 400, plus beyond-vocabulary ones)
    vocab = len(table) if not use_qwen else 400
    max_tokens = None if extra is None else min_tokens + extra
    rows = []
    for _ in range(n_rows):
        kind, value = data.draw(rows_strategy(vocab))
        if kind == "text":
            rows.append(response_row(tok, value))
        else:
            ids, mask = value
            ids = [i if i < vocab else len(table) + i - vocab for i in ids]
            rows.append((ids, [True] * len(ids), mask))
    ids, resp, reas = pad_rows(rows, pad=tok.pad_token_id, width=data.draw(st.integers(0, 35)))
    seg = reasoning_segments(ids, resp, reas, tok, split, min_tokens, max_tokens)
    check_invariants(seg, resp, reas, min_tokens, max_tokens)
    for b in range(len(rows)):
        sel = ((resp[b] != 0) & reas[b]).tolist()
        assert seg[b].tolist() == reference_row(ids[b].tolist(), sel, table, split, min_tokens, max_tokens)
        # batch = rows: each row alone, at its own length, gives the same ids
        n = len(rows[b][0])
        alone = reasoning_segments(ids[b: b + 1, :n], resp[b: b + 1, :n], reas[b: b + 1, :n], tok, split, min_tokens,
                                   max_tokens)
        assert torch.equal(alone[0], seg[b, :n]) and (seg[b, n:] == -1).all()


# ---------------------------------------------------------------------------------------------------------------------
# edge cases and bad arguments
# ---------------------------------------------------------------------------------------------------------------------


def test_empty_inputs(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    for shape in [(0, 5), (3, 0), (0, 0)]:
        z = torch.zeros(shape, dtype=torch.long)
        seg = reasoning_segments(z, z, z.bool(), tok)
        assert seg.shape == shape and seg.dtype == torch.long
    ids, resp, reas = pad_rows([response_row(tok, "a. b"), ([5, 6], [True, True], [False, False])], width=12)
    seg = reasoning_segments(ids, resp, reas, tok)
    assert (seg[1] == -1).all() and (seg[0, reas[0]] >= 0).all()
    none = reasoning_segments(ids, resp, torch.zeros_like(reas), tok)
    assert (none == -1).all() and none.dtype == torch.long


def test_bad_arguments(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    ids = torch.ones(2, 4, dtype=torch.long)
    m = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        reasoning_segments(ids[0], m[0], m[0], tok)
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        reasoning_segments(ids, m, m[:, :3], tok)
    with pytest.raises(ValueError, match=r"min_tokens must be >= 1, got 0"):
        reasoning_segments(ids, m, m, tok, min_tokens=0)
    with pytest.raises(ValueError, match=r"max_tokens must be None or >= min_tokens \(3\), got 2"):
        reasoning_segments(ids, m, m, tok, min_tokens=3, max_tokens=2)
    with pytest.raises(ValueError, match="min_tokens must be an int"):
        reasoning_segments(ids, m, m, tok, min_tokens=1.5)
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        reasoning_segments(ids, m, m, tok, max_tokens=True)
    with pytest.raises(ValueError, match="nor a valid regex"):
        reasoning_segments(ids, m, m, tok, split="(")
    with pytest.raises(ValueError, match="token id -1 in the reasoning is negative"):
        reasoning_segments(torch.tensor([[1, -1]]), torch.ones(1, 2), torch.ones(1, 2), tok)
    # a negative id off the reasoning is never looked at
    seg = reasoning_segments(torch.tensor([[1, -1]]), torch.ones(1, 2), torch.tensor([[True, False]]), tok)
    assert seg.tolist() == [[0, -1]]
