"""No hand-written comparative word beside a figure where the docs state results (issue #68 item 1).

Scope: README.md; all of docs/method.md (§15 the measured comparison, §1–14's measured asides); each research page's
"Current answers" section.
A comparative word (above, below, faster, slower, beat(s), equal(s)) fails when a figure (a number standing alone,
optionally signed, with % or ×) is within 60 characters of it in the same clause; " = " fails between two names
(e.g. "bf16 = fp32"), never after a one-symbol left side, subscripted or not (σ = 1e-3, w = 1, I_t = shift(…):
definitions).
Exempt, removed before the check: generated blocks (their words come from research/verdict.py), fenced code and code
spans, link targets, section references (§15), and everything after a line that opens "**History" (dated history).
"""

from __future__ import annotations

import re

import pytest

from research import REPO

BLOCK = re.compile(r"<!-- gen:(?P<name>[\w.-]+) -->.*?<!-- /gen:(?P=name) -->", re.S)
WORD = re.compile(r"\b(above|below|faster|slower|beats?|equals?)\b")
EQUALS = re.compile(r"(?<![\w])(?![A-Za-z]_)([A-Za-z][\w-]{2,}) = ([A-Za-z][\w-]{2,})")
FIGURE = re.compile(r"(?<![\w.§/-])[+−-]?\d+(?:[.,]\d+)*(?:\s?%|×)?(?![\w])")
WINDOW = 60


def _clean(text: str) -> str:
    text = text.split("\n**History")[0]
    text = BLOCK.sub(" ", text)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"§\s?\d+(?:[–-]\d+)?", "§", text)


def offending(text: str) -> list[str]:
    """The clauses of ``text`` where a comparative word stands beside a figure, or " = " joins two names."""
    bad = []
    for clause in re.split(r"(?<=[.;:!?|])\s+|\n\s*\n", _clean(text)):
        for m in WORD.finditer(clause):
            if FIGURE.search(clause[max(0, m.start() - WINDOW):m.end() + WINDOW]):
                bad.append(clause[max(0, m.start() - WINDOW):m.end() + WINDOW].strip())
        bad += [m.group(0) for m in EQUALS.finditer(clause)]
    return bad


def section(text: str, start: str, stop: str = r"\n## ") -> str:
    m = re.search(start, text)
    if m is None:
        return ""
    rest = text[m.end():]
    end = re.search(stop, rest)
    return rest[:end.start()] if end else rest


def scopes() -> dict[str, str]:
    method = (REPO / "docs" / "method.md").read_text()
    out = {"README.md": (REPO / "README.md").read_text(),
           "docs/method.md": method}
    for page in sorted((REPO / "research" / "docs").glob("*.md")):
        out[f"research/docs/{page.name} current answers"] = section(page.read_text(), r"\n## Current answers\n",
                                                                    r"\n## |\n\*\*History")
    return out


@pytest.mark.parametrize("where", sorted(scopes()))
def test_no_comparative_word_beside_a_figure(where):
    assert not offending(scopes()[where]), f"{where}: write it through research/verdict.py: {offending(scopes()[where])}"


def test_the_lint_catches_what_the_issue_named_and_passes_definitions():
    assert offending("the default's scores ranked the probe below random (16 rows)")
    assert offending("beats position alone by +0.83")
    assert offending("its mode (bf16 = fp32)")
    assert offending("fisher is cheaper on a GPU (0.50× vs 0.86×) and faster by 20 %")
    assert not offending("σ = 1e-3 absolute; w = 1 on every token; τ = 0.4; I_t = shift(p0, p_t)")  # definitions
    assert not offending("as <!-- gen:x -->above (p 0.003)<!-- /gen:x --> says, see method §15")
    assert not offending("`x = 1 above 0`, then\n**History (dated)**: it ranked below random at 0.24")
    assert section("a\n## Current answers\nbody\n**History** x\n## next", r"\n## Current answers\n",
                   r"\n## |\n\*\*History") == "body"
