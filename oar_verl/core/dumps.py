"""Token-level dumps of attributed rollouts for heatmaps (``python -m oar_verl.viz.heatmap``), written by every trainer
integration (verl's step, the TRL trainer).

Every ``dump_every`` steps (the first step at or past each multiple, where a trainer's steps skip numbers) a trainer
writes ``step_<N>.jsonl`` with the rollouts of ``dump_groups`` prompt groups whose rows it reshaped from their scores;
a due step that reshaped none (every group's rewards tied, or verl's ``mode=auto`` on its plain-GRPO fallback) says so
and passes the dump on to the next step that reshapes one (:class:`DumpSchedule`). One JSON object per rollout:

    {"step", "uid", "sample", "reward", "advantage", "tokens": [str], "importance": [float], "weight": [float],
     "reasoning": [0|1], "answer": [0|1], "span_found": bool}

with ``"due_step"``, the due step a dump stands in for, where it was passed on; and, on a multi-turn row (tool outputs
or user turns inside the response; docs/multi_turn.md), ``"turn": [int]``: the assistant turn of each of the model's
tokens (0, 1, ...) and -1 on the context, which the heatmap boxes.

``tokens`` are the exact text of each response token (from the token byte table: no re-tokenisation, multi-byte
characters split across tokens show as replacement characters). Framework-free: the integrations pick the rows.
"""

from __future__ import annotations


import json
import os
from pathlib import Path

import numpy as np
import torch

from oar_verl.core.config import OARConfig
from oar_verl.core.text.token_bytes import token_byte_table
from oar_verl.core.text.turns import turn_layout


class DumpSchedule:
    """Which steps write a dump: the first step at or past each multiple of ``every`` (its due step), or, where that
    step reshaped no row from its scores, the first later step that does (one dump for any number of due steps passed
    on). A trainer keeps one per launch; a dump still waiting when it stops is not carried across a resume, and a step
    number lower than the last one seen starts the schedule afresh.

    Args:
        every: ``dump_every`` (0: never).
        key: the key as the user sets it (verl: ``algorithm.oar.dump_every``; TRL: ``oar_dump_every``), for the log.
        where: whose rows decide, for the log (TRL: " on the main process", which dumps its own rows).
        why: what leaves a step without a reshaped row, for the log.
    """

    def __init__(self, every: int, key: str, where: str = "", why: str = "every prompt group's rewards tied"):
        self.every, self.key, self.where, self.why = every, key, where, why
        self.last: int | None = None  # the last step seen
        self.pending: int | None = None  # the due step whose dump is still to be written

    def take(self, step: int, attributed: bool) -> int | None:
        """The due step whose dump ``step`` writes (``step`` itself, or an earlier one passed on), or None; prints
        once, at the due step, where a due step passes its dump on."""
        if self.every <= 0:
            return None
        if self.last is not None and step < self.last:  # a new start from an earlier step: nothing is waiting
            self.last = self.pending = None
        last = step - 1 if self.last is None else self.last
        self.last = step
        if step // self.every > last // self.every and self.pending is None:
            self.pending = step
        if self.pending is None:
            return None
        if attributed:
            due, self.pending = self.pending, None
            return due
        if self.pending == step:
            print(f"oar: no row reshaped from its scores{self.where} at step {step} ({self.why}): the token dump due "
                  f"there ({self.key}={self.every}) is written at the next step that reshapes one", flush=True)
        return None


def dump_dir(cfg: OARConfig, default_local_dir: str | None) -> Path:
    return Path(cfg.dump_dir) if cfg.dump_dir else Path(default_local_dir or ".") / "oar_dumps"


def pick_groups(uids: np.ndarray, attributed: torch.Tensor, groups: int) -> list[int]:
    """Row indices of the first ``groups`` prompt groups that had rows attributed (all rows of each group)."""
    chosen: list = []
    for i in attributed.nonzero().squeeze(1).tolist():
        if uids[i] not in chosen:
            chosen.append(uids[i])
        if len(chosen) == groups:
            break
    return [i for i in range(len(uids)) if uids[i] in chosen]


def write_dump(path: Path, step: int, rows: list[int], uids: np.ndarray, scores: torch.Tensor,
               advantages: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
               importance: torch.Tensor, weights: torch.Tensor, reasoning: torch.Tensor, answer: torch.Tensor,
               span_found: torch.Tensor, tokenizer, valid: torch.Tensor | None = None,
               due_step: int | None = None) -> Path:
    """Write the rows' token records.

    Args:
        scores: (B,) sequence rewards. advantages: (B,) sequence (base) advantages.
        responses, response_mask, importance, weights, reasoning, answer: (B, T) response-aligned.
        span_found: (B,) bool.
        valid: (B, T) every real response token, where ``response_mask`` holds the model's only (verl's agent loop:
            0 on tool outputs); rows are written to their last real token, with ``"turn"`` on multi-turn rows. None:
            ``response_mask`` is every real token (single-turn).
        due_step: the due step this dump stands in for (:meth:`DumpSchedule.take`); recorded where not ``step``.
    """
    layout = None
    if valid is not None:
        valid = valid.bool()[:, :response_mask.shape[1]]
        layout = turn_layout(valid, response_mask)
    lengths = (valid if valid is not None else response_mask.bool()).sum(-1).tolist()
    table = token_byte_table(tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: dict = {}
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for i in rows:  # a few rows per dump
            n = int(lengths[i])
            ids = responses[i, :n].tolist()
            sample = seen.get(uids[i], 0)
            seen[uids[i]] = sample + 1
            f.write(json.dumps({
                "step": step, "uid": str(uids[i]), "sample": sample, "reward": float(scores[i]),
                "advantage": float(advantages[i]),
                "tokens": [table[t].decode("utf-8", errors="replace") if 0 <= t < len(table) else "" for t in ids],
                # 9 significant digits hold a float32 exactly: OAR-G scores are often ~1e-7, which a fixed number
                # of decimals would flatten (and the weights could not be recomputed from the dump)
                "importance": [float(f"{v:.9g}") for v in importance[i, :n].float().tolist()],
                "weight": [round(float(v), 5) for v in weights[i, :n]],
                "reasoning": reasoning[i, :n].int().tolist(), "answer": answer[i, :n].int().tolist(),
                "span_found": bool(span_found[i]),
                **({"due_step": due_step} if due_step is not None and due_step != step else {}),
                **({"turn": layout.turn[i, :n].tolist()} if layout is not None and bool(layout.context[i].any())
                   else {}),
            }) + "\n")
    os.replace(tmp, path)  # readers never see half a file
    return path
