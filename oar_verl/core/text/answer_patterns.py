"""Final-answer patterns on response bytes: the built-ins (``\\boxed{…}``, GSM8K ``#### N``, "The answer is N") and user
regexes, with one compile function that start-up validation and the span finder share.

User regexes are compiled on the response's UTF-8 **bytes** (``re.compile(pattern.encode())``), the only form in which
match offsets are byte offsets that map onto tokens. In byte mode ``\\d`` matches the ASCII digits 0-9 only, ``\\w``
ASCII letters, digits and underscore, ``\\s`` ASCII whitespace; ``.`` matches one byte (a non-ASCII character is
several), case-insensitive matching is ASCII-only, and the ``(?u)`` flag is an error. A literal non-ASCII character in
the pattern matches its UTF-8 bytes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

__all__ = ["BUILTIN_PATTERNS", "compile_answer_pattern", "find_answer_span"]

BUILTIN_PATTERNS = ("boxed", "gsm8k", "answer_is")

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
def compile_answer_pattern(pattern: str) -> re.Pattern[bytes]:
    """Compile a user answer regex exactly as the span finder uses it: on UTF-8 bytes, with a named group ``answer``.

    Start-up validation (:class:`oar_verl.core.config.OARConfig`) and every attribution step call this one function,
    so a pattern that passes validation cannot fail later.

    Raises:
        ValueError: not a valid bytes regex (e.g. ``(?u)``, which bytes patterns reject), or no group ``answer``.
    """
    raw = pattern.encode("utf-8") if isinstance(pattern, str) else pattern
    try:
        compiled = re.compile(raw)
    except re.error as exc:
        raise ValueError(f"{pattern!r} is not a valid regex on response bytes: {exc} (answer regexes are compiled "
                         "on UTF-8 bytes: \\d, \\w and \\s match ASCII only and (?u) is not allowed)") from exc
    if "answer" not in compiled.groupindex:
        raise ValueError(f"{pattern!r} needs a named group (?P<answer>...) marking the answer value")
    return compiled


def _find_one(text: bytes, pattern: str | bytes) -> tuple[int, int, int] | None:
    """(marker_start, value_start, value_end) of one pattern's last occurrence in ``text``, or None."""
    if pattern == "boxed":
        return _find_boxed(text)
    if pattern == "gsm8k":
        return _find_last_regex(_GSM8K, text)
    if pattern == "answer_is":
        return _find_last_regex(_ANSWER_IS, text)
    return _find_last_regex(compile_answer_pattern(pattern), text)


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
            Any other string is a Python regex (see :func:`compile_answer_pattern`) with a named group ``answer``;
            the marker starts at the match start.  Within a pattern the last occurrence wins; empty values are skipped.

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
