"""Rule-based reward for the tiny arithmetic data set of :mod:`oar_verl.quickstart.tiny_assets`.

Use it in verl with::

    reward.custom_reward_function.path=<path of this file>
    reward.custom_reward_function.name=compute_score

and in OpenRLHF with ``--reward.remote_url <path of this file>`` (its ``reward_func(queries, prompts, labels)``).
A correct final answer (the last ``The answer is N`` or ``#### N``) scores 1.0, anything else a shaping term
``0.1 x (share of digit characters)`` in [0, 0.1], so that a tiny model's GRPO groups get non-zero advantages (why:
docs/verl.md, "verl on a CPU-only machine"). Dependency-free: verl loads it by file path in its reward workers.
"""

from __future__ import annotations

import re

__all__ = ["CORRECT_REWARD", "SHAPING_SCALE", "compute_score", "extract_answer", "reward_func", "shaping_reward"]

CORRECT_REWARD = 1.0
SHAPING_SCALE = 0.1

# "The answer is N" (case-insensitive, optional sign, optional trailing period) or "#### N".
_ANSWER_RE = re.compile(r"(?:the\s+answer\s+is|####)\s*(-?\d+)", re.IGNORECASE)


def extract_answer(solution_str: str | None) -> int | None:
    """Return the integer of the last ``The answer is N`` / ``#### N`` in ``solution_str``, or None."""
    if not solution_str:
        return None
    matches = _ANSWER_RE.findall(solution_str)
    return int(matches[-1]) if matches else None


def shaping_reward(solution_str: str | None) -> float:
    """``SHAPING_SCALE`` times the fraction of digit characters: in ``[0, SHAPING_SCALE]``."""
    if not solution_str:
        return 0.0
    return SHAPING_SCALE * sum(c.isdigit() for c in solution_str) / len(solution_str)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl custom reward: 1.0 for a correct final answer, else a small shaping term (< 1).

    ``data_source``, ``extra_info`` and extra keyword arguments are accepted for verl's calling
    convention and ignored.
    """
    answer = extract_answer(solution_str)
    try:
        truth = int(str(ground_truth).strip())
    except ValueError:
        truth = None
    if answer is not None and truth is not None and answer == truth:
        return CORRECT_REWARD
    return shaping_reward(solution_str)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """OpenRLHF's custom reward (``--reward.remote_url`` a ``.py`` file): :func:`compute_score` of each response.

    ``queries`` are the decoded prompt + response; the response is what follows the prompt. Returns OpenRLHF's
    ``{"rewards", "scores", "extra_logs"}`` (1-D tensors, one value per query, as OpenRLHF's examples return).
    """
    import torch  # here, not at the top: verl's reward workers load this file for compute_score alone

    scores = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query.split(prompt, 1)[1] if prompt and prompt in query else query
        scores.append(compute_score(None, response, label))
    scores = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": scores, "scores": scores, "extra_logs": {}}
