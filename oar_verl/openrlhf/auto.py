"""``--oar.mode auto`` in the OpenRLHF actor (docs/auto.md §8): every policy rank holds the same
:class:`~oar_verl.core.auto.AutoSelector`, fed the same evidence (every rank's rows, gathered), so the ranks decide
alike without a driver. A calibration step scores every candidate on each rank's first ``fidelity_rows`` attributed
rows (:func:`~oar_verl.core.auto.measure.measure_candidates`); a candidate's cost is its seconds per token over the
previous ``fit``'s (the PPO update's) seconds per token, the slowest rank's ratio. One band (``all``) here.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import torch

from oar_verl.core.auto import UNIFORM, AutoSelector, AutoSettings, Evidence
from oar_verl.core.auto.measure import measure_candidates
from oar_verl.core.config import AUTO_MODE, OARConfig
from oar_verl.core.fidelity.summary import default_min_gap
from oar_verl.core.methods.attribution import module_backend, pass_limits
from oar_verl.core.backends.collectives import max_over_ranks
from oar_verl.core.reshaping.reshape import attribution_rows
from oar_verl.openrlhf.reshape import _pad_float, _response_field, gather_rows, item_rows

__all__ = ["AutoStep", "prompt_ids"]


def prompt_ids(prompts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(N,) int64 cluster id of each row's prompt (CRC-32 of its token ids: the same prompt on every rank)."""
    return torch.tensor([zlib.crc32(p.to(torch.int64).numpy().tobytes()) for p in prompts], dtype=torch.long)


class AutoStep:
    """One rank's ``mode=auto`` state: the selector, and the last update's seconds per token."""

    def __init__(self, cfg: OARConfig):
        self.cfg = cfg
        self.selector = AutoSelector(AutoSettings.from_config(cfg))
        self.update_spt = float("nan")
        self.calibrating = False

    @staticmethod
    def wanted(cfg: OARConfig) -> bool:
        return cfg.mode == AUTO_MODE

    def resolved(self, step: int) -> tuple[OARConfig | None, OARConfig]:
        """(the configuration to reshape with, None on the plain-GRPO fallback; the one calibration attributes
        with) at ``step``."""
        self.calibrating = self.selector.calibrating(step)
        mode = self.selector.mode("all")
        run = dataclasses.replace(self.cfg, mode=self.selector.settings.default if mode == UNIFORM else mode)
        return (None if mode == UNIFORM else run), run

    def measure(self, items: Sequence, model: torch.nn.Module, tokenizer, cfg: OARConfig, step: int, *,
                max_tokens: int | None, checkpointing: bool = False, device=None) -> list[str]:
        """On a calibration step: score every candidate on this rank's attributable rows (every rank together),
        gather every rank's rows and costs, feed the selector; the lines it printed. A no-op otherwise."""
        if not self.calibrating:
            return []
        device = torch.device(device if device is not None else next(model.parameters()).device)
        rows = item_rows(items)
        width = max((len(a) for a in rows.actions), default=0)
        action = _pad_float([a.double() for a in rows.actions], width).bool()
        wanted = attribution_rows(_response_field(items, "advantages", rows), action, cfg, action.any(-1))
        run = wanted.nonzero().flatten()
        if not len(run):  # filler: one own row keeps the passes aligned; measured like any row
            run = action.any(-1).nonzero().flatten()[:1]
        if not len(run):
            raise RuntimeError("oar: this rank's replay buffer has no generated token for mode=auto's calibration")
        idx = run.tolist()
        truths = [items[i].labels[0] if items[i].labels else None for i in idx] if cfg.target == "reference" else None

        def backend_for(c: OARConfig, prepared):
            longest = max_over_ranks(prepared.longest, device)
            return module_backend(model, c, limits=pass_limits(c, max(max_tokens or 0, longest) or None),
                                  checkpointing=checkpointing, align=lambda n: max_over_ranks(n, device),
                                  pad_id=tokenizer.pad_token_id or 0)

        cands = list(self.selector.settings.candidates)
        was_training = model.training
        model.eval()
        try:
            got = measure_candidates([rows.prompts[i] for i in idx], [rows.responses[i] for i in idx], tokenizer,
                                     cfg, step, cands, backend_for, ground_truths=truths, device=device,
                                     min_gap=default_min_gap(model))
        finally:
            model.train(was_training)
        n = len(idx)
        ratio = (lambda c: float(got["seconds_per_token"][c]) / self.update_spt if self.update_spt > 0
                 else float("nan"))
        local = {**{f"aopc/{k}": v for k, v in got["aopc"].items()}, "static": got["static"],
                 "groups": prompt_ids([rows.prompts[i] for i in idx]),
                 **{f"cost/{c}": torch.full((n,), ratio(c), dtype=torch.float64) for c in cands}}
        every = gather_rows(local)
        measured = ~every[f"aopc/{cands[0]}"].isnan()
        evidence = Evidence({k[5:]: v[measured] for k, v in every.items() if k.startswith("aopc/")},
                            every["static"][measured], every["groups"][measured],
                            tuple("all" for _ in range(int(measured.sum()))))
        costs = {c: (float(every[f"cost/{c}"].max()) if not bool(every[f"cost/{c}"].isnan().any()) else float("nan"))
                 for c in cands}
        return self.selector.observe(step, evidence, costs)

    def note_update(self, seconds: float, tokens: int) -> None:
        """The PPO update's seconds on this rank over its ``tokens`` (its items' sequences, counted before ``fit``:
        OpenRLHF clears the replay buffer in it): the next calibration's cost unit."""
        if tokens > 0 and math.isfinite(seconds):
            self.update_spt = seconds / tokens

    def metrics(self, step: int) -> dict[str, float]:
        out = self.selector.metrics(step)
        out["oar/auto/calibrating"] = float(self.calibrating)
        return out
