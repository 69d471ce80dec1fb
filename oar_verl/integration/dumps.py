"""Token-level dumps of a verl step's attributed rollouts, for heatmaps (``python -m oar_verl.viz.heatmap``).

The format and the writer are the core's (:mod:`oar_verl.core.dumps`, shared with the TRL trainer); this module picks
a verl step's rows.
"""

from __future__ import annotations

from pathlib import Path

from oar_verl.core.batch.selection import sequence_advantage
from oar_verl.core.config import OARConfig
from oar_verl.core.dumps import DumpSchedule, dump_dir, pick_groups, write_dump

__all__ = ["DumpSchedule", "dump_dir", "dump_step", "pick_groups", "write_dump"]


def dump_step(cfg: OARConfig, step: int, att, result, tokenizer, default_local_dir: str | None,
              due_step: int | None = None) -> Path:
    """Dump ``cfg.dump_groups`` attributed prompt groups of a step (``att``: the step's
    :class:`~oar_verl.integration.rows.StepAttribution`, with responses; ``result``: the estimator's Reshaped;
    ``due_step``: the due step it stands in for)."""
    batch, inputs = att.batch, att.estimator_inputs
    rows = pick_groups(batch.uids, inputs.attributed, cfg.dump_groups)
    return write_dump(dump_dir(cfg, default_local_dir) / f"step_{step}.jsonl", step, rows, batch.uids,
                      batch.scores.sum(-1), sequence_advantage(result.base_advantages, inputs.response_mask),
                      batch.responses, inputs.response_mask, inputs.token_importance, result.token_weights.weights,
                      inputs.reasoning_mask, att.answer, att.found, tokenizer, valid=batch.valid, due_step=due_step)
