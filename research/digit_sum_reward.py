"""Verifiable reward of the *digit-sum* task (see :mod:`research.task`), self-contained so that verl can load it by
file path inside its reward workers (``reward.custom_reward_function.path=<this file>``).

The prompt says "Start at S. Write K digits, then add them up." A response is correct (reward 1.0) when

* it ends its reasoning with ``The answer is N`` (the last such statement counts),
* the reasoning before that statement contains exactly K digit characters d_1..d_K, and
* N == S + d_1 + ... + d_K.

Anything else scores 0.0. ``ground_truth`` is ``"S,K"``. The reward checks the response's own arithmetic: which digits
to write is the policy's choice, so the digit tokens are the response tokens that decide the final answer.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "parse_ground_truth", "score_response"]

_ANSWER_RE = re.compile(r"The answer is (-?\d+)")


def parse_ground_truth(ground_truth: str) -> tuple[int, int]:
    """``"S,K"`` -> (S, K)."""
    s, k = str(ground_truth).split(",")
    return int(s), int(k)


def score_response(text: str, start: int, n_digits: int) -> float:
    """1.0 if ``text`` states the right sum of its own K digits plus ``start``, else 0.0."""
    if not text:
        return 0.0
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return 0.0
    last = matches[-1]
    digits = [int(c) for c in text[: last.start()] if c.isdigit()]
    if len(digits) != n_digits:
        return 0.0
    return 1.0 if int(last.group(1)) == start + sum(digits) else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl custom reward (``data_source``, ``extra_info`` and extra keywords are accepted and ignored)."""
    start, n_digits = parse_ground_truth(ground_truth)
    return score_response(solution_str, start, n_digits)
