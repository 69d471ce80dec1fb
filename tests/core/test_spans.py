"""Answer-span location end to end: the token byte table (oar_verl.core.text.token_bytes), the byte patterns
(oar_verl.core.text.answer_patterns) and the token masks (oar_verl.core.text.spans)."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar_verl.core.text.answer_patterns import BUILTIN_PATTERNS, compile_answer_pattern, find_answer_span
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.text.spans import AnswerSpans, locate_answer_spans
from oar_verl.core.text.token_bytes import token_byte_table


TOKENIZERS = ("tiny_bpe_tokenizer", "qwen25_tokenizer")


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def batch_of(tokenizer, texts: list[str], add_eos: bool = True, pad_to: int | None = None):
    """Right-padded (B, T) ids and mask from texts, each followed by EOS, padded with the pad (or 0) id."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if add_eos else [])
            for t in texts]
    T = max([len(r) for r in rows] + [pad_to or 0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = 1
    return ids, mask


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def masked_text(tokenizer, ids_row: torch.Tensor, mask_row: torch.Tensor) -> str:
    return decode(tokenizer, ids_row[mask_row].tolist())


def check_invariants(spans: AnswerSpans, mask: torch.Tensor) -> None:
    valid = mask.bool()
    assert spans.reasoning_mask.dtype == torch.bool and spans.answer_mask.dtype == torch.bool
    assert not (spans.reasoning_mask & spans.answer_mask).any()
    assert not (spans.reasoning_mask & ~valid).any()
    assert not (spans.answer_mask & ~valid).any()
    assert torch.equal(spans.found, spans.pattern_index >= 0)
    assert not spans.answer_mask[~spans.found].any()
    # reasoning is a prefix of the response: nothing reasoning after the first non-reasoning answer token
    for b in range(mask.shape[0]):
        if spans.found[b] and spans.answer_mask[b].any():
            first_answer = int(spans.answer_mask[b].nonzero()[0])
            assert not spans.reasoning_mask[b, first_answer:].any()


# ---------------------------------------------------------------------------------------------------------------------
# tokenizers and the byte table
# ---------------------------------------------------------------------------------------------------------------------


def test_qwen25_vocabulary(qwen25_tokenizer):
    tok = qwen25_tokenizer
    assert tok("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]
    assert len(tok) == 151646
    assert (tok.pad_token_id, tok.eos_token_id) == (151643, 151645)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644


@pytest.mark.parametrize("name", TOKENIZERS)
def test_byte_table_concatenates_to_the_text(name, request):
    tok = request.getfixturevalue(name)
    table = token_byte_table(tok)
    assert len(table) == len(tok)
    assert token_byte_table(tok) is table  # cached per tokenizer object
    assert table[tok.eos_token_id] == b"<|im_end|>" and table[tok.pad_token_id] == b"<|endoftext|>"
    for text in ["What is 12 plus 30? The answer is 42.", "π ≈ 3.14 ∑ ≤ 日本語 \\boxed{\\frac{1}{2}}\n#### 1,000",
                 "  leading spaces\tand\ttabs\n\n", "emoji 🙂 and é"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")


def test_byte_table_splits_multibyte_characters(tiny_bpe_tokenizer, qwen25_tokenizer):
    # "∑" (3 bytes) never occurs in the tiny tokenizer's corpus, so it falls apart into single-byte tokens; Qwen
    # splits " ≈" into " \xe2\x89" + "\x88".  Each token gets exactly its bytes, not U+FFFD.
    tiny_ids = tiny_bpe_tokenizer("∑", add_special_tokens=False)["input_ids"]
    assert [token_byte_table(tiny_bpe_tokenizer)[i] for i in tiny_ids] == [b"\xe2", b"\x88", b"\x91"]
    q_ids = qwen25_tokenizer(" ≈", add_special_tokens=False)["input_ids"]
    assert [token_byte_table(qwen25_tokenizer)[i] for i in q_ids] == [b" \xe2\x89", b"\x88"]


def test_byte_table_rebuilt_after_tokens_are_added(tiny_bpe_tokenizer):
    tok = copy.deepcopy(tiny_bpe_tokenizer)
    before = token_byte_table(tok)
    tok.add_tokens(["<think>"])
    after = token_byte_table(tok)
    assert len(after) == len(before) + 1 and after[-1] == b"<think>"


def _sentencepiece_tokenizer():
    """A Llama-style SentencePiece BPE: ``▁`` word marker, ``<0xNN>`` byte fallback, Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "\u2581": 2}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789{}\\#.":
        vocab[ch] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ("th", "the", "\u2581the"):
        vocab[piece] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("\u2581", "the")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def test_sentencepiece_style_table():
    tok = _sentencepiece_tokenizer()
    table = token_byte_table(tok)
    assert table[tok.convert_tokens_to_ids("\u2581the")] == b" the"
    assert table[tok.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert table[tok.eos_token_id] == b"</s>"
    text = "the \u2211 is \\boxed{3}"
    ids, mask = batch_of(tok, [text])
    # the normaliser prepends a space: offsets are self-consistent bytes of " the ∑ is \boxed{3}"
    assert b"".join(table[i] for i in ids[0, :-1].tolist()) == b" " + text.encode()
    spans = locate_answer_spans(ids, mask, tok)
    assert spans.found.tolist() == [True]
    assert masked_text(tok, ids[0], spans.answer_mask[0]) == "3"
    assert masked_text(tok, ids[0], spans.reasoning_mask[0]) == "the \u2211 is "  # "▁" before "\\" is its own piece


def test_unknown_style_falls_back_to_decoding_each_id():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "the": 1, "answer": 2, "42": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert token_byte_table(tok) == [b"[UNK]", b"the", b"answer", b"42"]


# ---------------------------------------------------------------------------------------------------------------------
# find_answer_span on bytes
# ---------------------------------------------------------------------------------------------------------------------

# (text, patterns, expected marker text, expected value, expected pattern index); marker/value None = not found
CASES = [
    ("so \\boxed{42}.", BUILTIN_PATTERNS, "\\boxed{", "42", 0),
    ("nested \\boxed{\\frac{1}{2}} done", BUILTIN_PATTERNS, "\\boxed{", "\\frac{1}{2}", 0),
    ("\\boxed{1}, then \\boxed{2}, finally \\boxed{3}", BUILTIN_PATTERNS, "\\boxed{", "3", 0),
    ("\\boxed{7} but wait \\boxed{8", BUILTIN_PATTERNS, "\\boxed{", "7", 0),  # unclosed last box
    ("\\boxed{7} and \\boxed{}", BUILTIN_PATTERNS, "\\boxed{", "7", 0),  # empty last box
    ("\\boxed{ } #### 5", BUILTIN_PATTERNS, "#### ", "5", 1),  # only box empty: next pattern
    ("\\boxed{  x + 1 \n}", BUILTIN_PATTERNS, "\\boxed{  ", "x + 1", 0),  # value stripped
    ("\\fbox{12}", BUILTIN_PATTERNS, "\\fbox{", "12", 0),
    ("\\boxed {12}", BUILTIN_PATTERNS, "\\boxed {", "12", 0),
    ("a } stray } brace \\boxed{5}", BUILTIN_PATTERNS, "\\boxed{", "5", 0),
    ("\\boxed{\\{1, 2\\}}", BUILTIN_PATTERNS, "\\boxed{", "\\{1, 2\\}", 0),  # escaped braces are not groups
    ("\\boxed{x \\boxed{3}", BUILTIN_PATTERNS, "\\boxed{", "3", 0),  # unclosed outer, complete inner
    ("\\mboxed{3}", BUILTIN_PATTERNS, None, None, -1),
    ("\\\\boxed{3}", BUILTIN_PATTERNS, None, None, -1),  # "\\" is an escaped backslash: no box opener
    ("\\\\\\boxed{3}", BUILTIN_PATTERNS, "\\boxed{", "3", 0),
    ("So 600 + 400 = 1000.\n#### 1,000", BUILTIN_PATTERNS, "#### ", "1,000", 1),
    ("#### -12.5\n#### 3", BUILTIN_PATTERNS, "#### ", "3", 1),
    ("#### $18", BUILTIN_PATTERNS, "#### $", "18", 1),
    ("#### many", BUILTIN_PATTERNS, None, None, -1),
    ("The answer is -3.5.", BUILTIN_PATTERNS, "The answer is ", "-3.5", 2),
    ("so THE FINAL ANSWER IS: 3/4.", BUILTIN_PATTERNS, "THE FINAL ANSWER IS: ", "3/4", 2),
    ("the answer is 2. No, the answer is 1,234!", BUILTIN_PATTERNS, "the answer is ", "1,234", 2),
    ("The answer is unknown.", BUILTIN_PATTERNS, None, None, -1),
    ("no answer here, just 42", BUILTIN_PATTERNS, None, None, -1),
    ("", BUILTIN_PATTERNS, None, None, -1),
    ("#### 4 and \\boxed{5}", ("gsm8k", "boxed"), "#### ", "4", 0),  # pattern order decides
    ("#### 4 and \\boxed{5}", BUILTIN_PATTERNS, "\\boxed{", "5", 0),
    ("Result: 17 (final)", (r"Result:\s*(?P<answer>\d+)",), "Result: ", "17", 0),
    ("Result: 17 Result: 18", ("boxed", r"Result: (?P<answer>\d+)"), "Result: ", "18", 1),
    ("π ≈ 3.14, so \\boxed{3}", BUILTIN_PATTERNS, "\\boxed{", "3", 0),
    ("\\boxed{π²}", BUILTIN_PATTERNS, "\\boxed{", "π²", 0),
]


@pytest.mark.parametrize("text,patterns,marker,value,index", CASES)
def test_find_answer_span(text, patterns, marker, value, index):
    data = text.encode("utf-8")
    span = find_answer_span(data, patterns)
    if marker is None:
        assert span is None
        return
    m0, v0, v1, idx = span
    assert idx == index
    assert data[v0:v1].decode("utf-8") == value
    assert data[m0:v0].decode("utf-8") == marker
    assert find_answer_span(text, patterns) == span  # str input: the same byte offsets


def _naive_boxed(data: bytes):
    """Quadratic reference: match each opener's braces on its own, keep the complete box that closes last."""
    best = None
    for m in re.finditer(rb"\\(?:boxed|fbox)[ \t]*\{", data):
        k = m.start()
        while k > 0 and data[k - 1 : k] == b"\\":
            k -= 1
        if (m.start() - k) % 2:  # the opener's backslash is the second half of an escaped "\\"
            continue
        depth, i = 1, m.end()
        while i < len(data):
            if data[i : i + 1] == b"\\" and data[i + 1 : i + 2] in (b"\\", b"{", b"}"):
                i += 2
                continue
            depth += {b"{": 1, b"}": -1}.get(data[i : i + 1], 0)
            if depth == 0:
                break
            i += 1
        inner = data[m.end() : i]
        if depth == 0 and inner.strip() and (best is None or i > best[2]):
            v0 = m.end() + len(inner) - len(inner.lstrip())
            best = (m.start(), v0, v0 + len(inner.strip()))
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\fbox{", "{", "}", "\\", "\\{", "\\}", "x", " ", "1"]), max_size=25))
def test_boxed_scanner_matches_naive_reference(parts):
    data = "".join(parts).encode()
    span = find_answer_span(data, ("boxed",))
    assert (span[:3] if span else None) == _naive_boxed(data)


def test_custom_regex_needs_an_answer_group():
    with pytest.raises(ValueError, match=r"named group \(\?P<answer>"):
        find_answer_span(b"x = 3", (r"x = (\d+)",))
    with pytest.raises(ValueError, match="not a valid regex on response bytes"):
        find_answer_span(b"x = 3", (r"x = (?P<answer>\d+",))


@pytest.mark.parametrize("pattern", [r"(?u)answer: (?P<answer>\d+)", r"(?P<answer>\d+", r"answer: (\d+)"])
def test_a_regex_refused_on_bytes_fails_at_start_up_naming_the_key(pattern):
    """Validation and use compile through one function: what start-up accepts, every step can run (a str-mode check
    once accepted (?u), which bytes patterns reject, and the run failed at its first attribution step)."""
    from oar_verl.core.checks.startup import check_config

    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.answer_patterns entry"):
        check_config(OARConfig(answer_patterns=(pattern,)))


@pytest.mark.parametrize("pattern", [r"answer: (?P<answer>\d+)", r"(?i)ANSWER\s*=\s*(?P<answer>[-\w.]+)",
                                     r"结果：(?P<answer>\d+)"])
def test_a_regex_accepted_at_start_up_runs_on_bytes(pattern):
    cfg = OARConfig(answer_patterns=(pattern,))
    text = "so the answer: 12 ... Answer = 7.5 ... 结果：3".encode()
    span = find_answer_span(text, cfg.answer_patterns)
    assert span is not None and compile_answer_pattern(pattern).pattern == pattern.encode()
    # byte mode: \d is ASCII only, so a fullwidth digit is not a number
    assert find_answer_span("answer: ３ = ３".encode(), cfg.answer_patterns) is None


@pytest.mark.parametrize(
    "text",
    [
        "{" * 100_000,
        "}" * 100_000,
        "\\boxed{" * 100_000,
        "\\boxed{\\boxed{" * 50_000 + "}",
        "\\boxed{" + "{}" * 100_000,
        "\\" * 100_000 + "\\boxed{1}",
        "#### " + " " * 100_000,
        "the answer is " + " " * 100_000 + ":",
        "The answer is " * 20_000,
        "1," * 100_000,
        "answer is " + "9" * 100_000 + "/",
    ],
    ids=lambda t: t[:12].replace("\\", "/"),
)
def test_pathological_inputs_are_fast(text):
    t0 = time.perf_counter()
    find_answer_span(text.encode())
    assert time.perf_counter() - t0 < 1.0


# ---------------------------------------------------------------------------------------------------------------------
# locate_answer_spans: token masks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text,patterns,marker,value,index", [c for c in CASES if c[0]])
def test_masks_match_the_byte_span(name, text, patterns, marker, value, index, request):
    tok = request.getfixturevalue(name)
    ids, mask = batch_of(tok, [text, "padding row " * 3])  # the second row makes the first one padded
    spans = locate_answer_spans(ids, mask, tok, patterns=patterns)
    check_invariants(spans, mask)
    assert spans.found[0].item() == (marker is not None)
    assert spans.pattern_index[0].item() == index
    row, reasoning, answer = ids[0], spans.reasoning_mask[0], spans.answer_mask[0]
    eos_pos = int(mask[0].sum()) - 1
    assert not reasoning[eos_pos] and not answer[eos_pos]
    if marker is None:
        assert torch.equal(reasoning, mask[0].bool() & (torch.arange(ids.shape[1]) != eos_pos))
        return
    # answer tokens cover the value and nothing outside the tokens that touch it
    answer_text = masked_text(tok, row, answer)
    assert value in answer_text
    # reasoning is exactly the tokens that end before the marker starts
    table = token_byte_table(tok)
    m0 = find_answer_span(text.encode(), patterns)[0]
    ends = torch.tensor([len(table[i]) for i in row.tolist()]).cumsum(0)
    expected = mask[0].bool() & (ends <= m0)
    expected[eos_pos] = False
    assert torch.equal(reasoning, expected)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_masks_agree_with_prefix_decoding(name, request):
    # Independent token boundaries: decode ids[:k] for every k (ASCII, so characters are bytes).
    tok = request.getfixturevalue(name)
    texts = ["First 12 + 30 = 42. The answer is 42, \\boxed{42} indeed.",
             "Compute {a} + {b}: we get \\boxed{\\frac{3}{4}} so done",
             "Sum: 600 + 400\n#### 1,000",
             "I think the final answer is -7/8."]
    ids, mask = batch_of(tok, texts)
    spans = locate_answer_spans(ids, mask, tok)
    check_invariants(spans, mask)
    for b, text in enumerate(texts):
        n = int(mask[b].sum())
        row = ids[b, :n].tolist()
        bounds = [len(decode(tok, row[:k])) for k in range(n + 1)]
        full = decode(tok, row)
        m0, v0, v1, _ = find_answer_span(full.encode())
        eos = tok.eos_token_id
        exp_reasoning = [bounds[k + 1] <= m0 and row[k] != eos for k in range(n)]
        exp_answer = [bounds[k] < v1 and bounds[k + 1] > v0 for k in range(n)]
        assert spans.reasoning_mask[b, :n].tolist() == exp_reasoning
        assert spans.answer_mask[b, :n].tolist() == exp_answer
        assert not spans.reasoning_mask[b, n:].any() and not spans.answer_mask[b, n:].any()


def test_qwen_digit_tokens_exact(qwen25_tokenizer):
    tok = qwen25_tokenizer
    ids, mask = batch_of(tok, ["So the sum is \\boxed{123}.", "Total\n#### 1,000"])
    spans = locate_answer_spans(ids, mask, tok)
    toks0 = tok.convert_ids_to_tokens(ids[0][spans.answer_mask[0]].tolist())
    assert toks0 == ["1", "2", "3"]  # Qwen splits digits; "{" and "}" are neither reasoning nor answer
    assert masked_text(tok, ids[0], spans.reasoning_mask[0]) == "So the sum is"
    assert masked_text(tok, ids[1], spans.answer_mask[1]) == "1,000"
    assert masked_text(tok, ids[1], spans.reasoning_mask[1]) == "Total\n"
    assert spans.pattern_index.tolist() == [0, 1]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_unicode_split_across_tokens(name, request):
    tok = request.getfixturevalue(name)
    text = "π ≈ 3.14 ∑ ≤ 4, so \\boxed{3}"
    ids, mask = batch_of(tok, [text])
    table = token_byte_table(tok)
    n = int(mask[0].sum())
    # some token holds only part of a character (a lone byte is not valid UTF-8)
    assert any(not _is_utf8(table[i]) for i in ids[0, :n].tolist())
    spans = locate_answer_spans(ids, mask, tok)
    assert spans.found.tolist() == [True]
    assert masked_text(tok, ids[0], spans.answer_mask[0]) == "3"
    reasoning = masked_text(tok, ids[0], spans.reasoning_mask[0])
    assert text.startswith(reasoning) and reasoning.rstrip() == "π ≈ 3.14 ∑ ≤ 4, so"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_not_found_excludes_eos_and_pad(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    body = tok("no answer at all", add_special_tokens=False)["input_ids"]
    row = body[:2] + [tok.pad_token_id] + body[2:] + [tok.eos_token_id]  # a pad id inside the valid region
    ids = torch.tensor([row + [tok.pad_token_id] * 2])
    mask = torch.tensor([[1.0] * len(row) + [0.0] * 2])  # float mask
    spans = locate_answer_spans(ids, mask, tok)
    expected = [True] * 2 + [False] + [True] * (len(body) - 2) + [False] + [False] * 2
    assert spans.reasoning_mask[0].tolist() == expected
    assert not spans.answer_mask.any() and spans.found.tolist() == [False] and spans.pattern_index.tolist() == [-1]


def test_eos_token_ids_override(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    body = tok("no answer", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([body + [im_start, tok.eos_token_id]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    default = locate_answer_spans(ids, mask, tok)
    assert default.reasoning_mask[0].tolist() == [True] * len(body) + [True, False]
    custom = locate_answer_spans(ids, mask, tok, eos_token_ids=[im_start])
    assert custom.reasoning_mask[0].tolist() == [True] * len(body) + [False, True]
    single = locate_answer_spans(ids, mask, tok, eos_token_ids=im_start)
    assert torch.equal(single.reasoning_mask, custom.reasoning_mask)


def test_tokenizer_without_pad_token(tiny_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_bpe_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert tok.pad_token_id is None
    ids, mask = batch_of(tok, ["The answer is 5.", "nothing"])
    spans = locate_answer_spans(ids, mask, tok)
    check_invariants(spans, mask)
    assert spans.found.tolist() == [True, False]
    assert masked_text(tok, ids[0], spans.answer_mask[0]).strip() == "5"


def test_empty_and_degenerate_batches(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    for B, T in [(0, 5), (3, 0), (0, 0)]:
        spans = locate_answer_spans(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), tok)
        assert spans.reasoning_mask.shape == spans.answer_mask.shape == (B, T)
        assert spans.found.shape == spans.pattern_index.shape == (B,)
    one = tok("7", add_special_tokens=False)["input_ids"]
    assert len(one) == 1
    ids = torch.tensor([[one[0], 0, 0], [tok.pad_token_id] * 3, [tok.eos_token_id, 0, 0]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    spans = locate_answer_spans(ids, mask, tok)
    assert spans.reasoning_mask.tolist() == [[True, False, False], [False] * 3, [False] * 3]
    assert not spans.answer_mask.any() and spans.found.tolist() == [False] * 3
    assert spans.pattern_index.tolist() == [-1] * 3


def test_invalid_ids(tiny_bpe_tokenizer):
    tok = tiny_bpe_tokenizer
    # ids past the tokenizer (unused embedding rows a model can still sample) are empty text, not an error
    seven = tok("7", add_special_tokens=False)["input_ids"]
    marker = tok("The answer is ", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[5, len(tok) + 10] + marker + seven])
    spans = locate_answer_spans(ids, torch.ones_like(ids), tok)
    assert spans.found.tolist() == [True]
    assert spans.reasoning_mask[0, :2].tolist() == [True, True]
    assert spans.answer_mask[0, -len(seven):].all()
    with pytest.raises(ValueError, match="token id -1"):
        locate_answer_spans(torch.tensor([[-1, 5]]), torch.ones(1, 2), tok)
    # out-of-range ids in padding positions are ignored (e.g. -100 label padding)
    spans = locate_answer_spans(torch.tensor([[5, -100]]), torch.tensor([[1, 0]]), tok)
    assert spans.reasoning_mask.tolist() == [[True, False]]
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        locate_answer_spans(torch.zeros(3, dtype=torch.long), torch.zeros(3), tok)


def test_batch_equals_rows_and_mask_layout(qwen25_tokenizer):
    tok = qwen25_tokenizer
    texts = ["We get \\boxed{12}.", "", "#### 7", "The answer is 3/4", "none", "π≈\\boxed{π}"]
    ids, mask = batch_of(tok, texts, pad_to=24)
    mask[1] = 0  # an all-padding row
    batch = locate_answer_spans(ids, mask, tok)
    check_invariants(batch, mask)
    assert batch.found.tolist() == [True, False, True, True, False, True]
    assert batch.pattern_index.tolist() == [0, -1, 1, 2, -1, 0]
    for b in range(len(texts)):
        single = locate_answer_spans(ids[b : b + 1], mask[b : b + 1], tok)
        assert torch.equal(single.reasoning_mask[0], batch.reasoning_mask[b])
        assert torch.equal(single.answer_mask[0], batch.answer_mask[b])
    # left padding: only the mask decides which positions are tokens
    left_ids = torch.stack([torch.roll(r, int((m == 0).sum())) for r, m in zip(ids, mask)])
    left_mask = torch.stack([torch.roll(m, int((m == 0).sum())) for m in mask])
    left = locate_answer_spans(left_ids, left_mask, tok)
    for b in range(len(texts)):
        shift = int((mask[b] == 0).sum())
        assert torch.equal(torch.roll(batch.answer_mask[b], shift), left.answer_mask[b])
        assert torch.equal(torch.roll(batch.reasoning_mask[b], shift), left.reasoning_mask[b])


def test_large_batch_is_fast(qwen25_tokenizer):
    tok = qwen25_tokenizer
    text = "Let me think step by step about {x}. " * 60 + "So \\boxed{\\frac{1}{2}}"
    ids, mask = batch_of(tok, [text] * 64)
    locate_answer_spans(ids[:1], mask[:1], tok)  # table built
    t0 = time.perf_counter()
    spans = locate_answer_spans(ids, mask, tok)
    assert time.perf_counter() - t0 < 1.0
    assert spans.found.all()


# ---------------------------------------------------------------------------------------------------------------------
# property test
# ---------------------------------------------------------------------------------------------------------------------

# Printable ASCII without the characters that could form or break a box ("\", "{", "}").
_ASCII = st.text(st.sampled_from([chr(c) for c in range(32, 127) if chr(c) not in "\\{}"] + ["\n"]), max_size=60)


@settings(max_examples=60, deadline=None)
@given(prefix=_ASCII, suffix=_ASCII, value=st.integers(-10**9, 10**9), use_qwen=st.booleans())
def test_property_inserted_box_is_found(tiny_bpe_tokenizer, qwen25_tokenizer, prefix, suffix, value, use_qwen):
    tok = qwen25_tokenizer if use_qwen else tiny_bpe_tokenizer
    text = f"{prefix}\\boxed{{{value}}}{suffix}"
    ids, mask = batch_of(tok, [text, "x"])
    spans = locate_answer_spans(ids, mask, tok)
    check_invariants(spans, mask)
    assert spans.found[0] and spans.pattern_index[0] == 0
    assert str(value) in masked_text(tok, ids[0], spans.answer_mask[0])
    reasoning = masked_text(tok, ids[0], spans.reasoning_mask[0])
    assert (prefix + "\\boxed{").startswith(reasoning) and len(reasoning) <= len(prefix)
