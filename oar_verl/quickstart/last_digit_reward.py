"""Verifiable reward of the *last-digit* credit-assignment task (see :mod:`oar_verl.quickstart.last_digit`), self-contained so
that verl can load it by file path inside its reward workers (``reward.custom_reward_function.path=<this file>``).

The prompt says "Write K digits. The last one must be above T." A response is correct (reward 1.0) when

* it ends its reasoning with ``The answer is N`` (the last such statement counts),
* the reasoning before that statement contains exactly K digit characters d_1..d_K,
* N == d_K (the answer states the last digit written), and
* d_K > T.

Anything else scores 0.0. ``ground_truth`` is ``"K,T"``. Only the last digit decides correctness among the
reasoning tokens: the other digits and the filler text around them are free.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "parse_ground_truth", "score_response"]

_ANSWER_RE = re.compile(r"The answer is (-?\d+)")


def parse_ground_truth(ground_truth: str) -> tuple[int, int]:
    """``"K,T"`` -> (K, T)."""
    k, t = str(ground_truth).split(",")
    return int(k), int(t)


def score_response(text: str, n_digits: int, threshold: int) -> float:
    """1.0 if ``text`` writes ``n_digits`` digits, the last above ``threshold``, and states that last digit."""
    matches = list(_ANSWER_RE.finditer(text or ""))
    if not matches:
        return 0.0
    last = matches[-1]
    digits = [int(c) for c in text[: last.start()] if c.isdigit()]
    if len(digits) != n_digits:
        return 0.0
    return 1.0 if int(last.group(1)) == digits[-1] > threshold else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl custom reward (``data_source``, ``extra_info`` and extra keywords are accepted and ignored)."""
    n_digits, threshold = parse_ground_truth(ground_truth)
    return score_response(solution_str, n_digits, threshold)
