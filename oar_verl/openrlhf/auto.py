"""``--oar.mode auto`` in the OpenRLHF actor (docs/auto.md §8): every policy rank holds the same
:class:`~oar_verl.core.auto.AutoSelector`, fed the same evidence (every rank's rows, gathered), so the ranks decide
alike without a driver. Rows are banded inside / past the policy's sliding window as in verl. A calibration step
scores every candidate on each rank's first ``fidelity_rows`` attributed rows
(:func:`~oar_verl.core.auto.measure.measure_candidates`, the entropy control from OpenRLHF's own forward); a
candidate's cost is its seconds per token over the previous ``fit``'s (the PPO update's) seconds per token, the
slowest rank's ratio. The selector's state rides in OpenRLHF's checkpoint (``client_states``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence

import torch

from oar_verl.core.auto import AutoSelector, AutoSettings, Evidence, bands_of
from oar_verl.core.auto.measure import measure_candidates
from oar_verl.core.backends.collectives import max_over_ranks
from oar_verl.core.backends.memory import fixed_recompute
from oar_verl.core.config import AUTO_MODE, OARConfig
from oar_verl.core.fidelity.controls import EntropySource
from oar_verl.core.fidelity.summary import default_min_gap
from oar_verl.core.methods.attribution import module_backend, pass_limits
from oar_verl.core.reshaping.reshape import attribution_rows
from oar_verl.openrlhf.reshape import _response_field, gather_rows, item_rows

__all__ = ["AutoStep", "STATE_KEY", "item_lengths", "prompt_ids"]

STATE_KEY = "oar_auto"  # the selector's state in OpenRLHF's checkpoint client_states


def prompt_ids(prompts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(N,) int64 cluster id of each row's prompt (CRC-32 of its token ids: the same prompt on every rank)."""
    return torch.tensor([zlib.crc32(p.to(torch.int64).numpy().tobytes()) for p in prompts], dtype=torch.long)


def item_lengths(items: Sequence) -> torch.Tensor:
    """(N,) tokens of each item (prompt + response: its attention mask's, or its sequence's without one)."""
    return torch.tensor([int(it.attention_mask.sum()) if it.attention_mask is not None else int(it.sequences.numel())
                         for it in items], dtype=torch.long)


class AutoStep:
    """One rank's ``mode=auto`` state: the selector, and the last update's seconds per token.

    Args:
        cfg: the run's OARConfig (``mode=auto``). window: the policy's sliding window (None: one band ``all``).
    """

    def __init__(self, cfg: OARConfig, window: int | None = None):
        self.cfg = cfg
        self.selector = AutoSelector(AutoSettings.from_config(cfg, window))
        self.update_spt = float("nan")
        self.calibrating = False

    @staticmethod
    def wanted(cfg: OARConfig) -> bool:
        return cfg.mode == AUTO_MODE

    def bands(self, items: Sequence) -> tuple[str, ...]:
        """Each item's band (inside / past the window, or ``all``)."""
        return bands_of(item_lengths(items), self.selector.settings.window)

    def plan(self, items: Sequence, step: int) -> list[tuple[OARConfig, torch.Tensor]]:
        """The reshaping's plan at ``step`` (:func:`~oar_verl.openrlhf.reshape.reshape_replay_buffer`): each band's
        mode with its rows, the same entries in the same order on every rank; rows of a band on the plain-GRPO
        fallback are in none (they keep their advantages)."""
        self.calibrating = self.selector.calibrating(step)
        groups, plain = self.selector.plan(self.bands(items), step)
        return [(dataclasses.replace(self.cfg, mode=mode), rows & ~plain) for mode, rows in groups.items()]

    def measure(self, items: Sequence, model: torch.nn.Module, tokenizer, step: int, *, max_tokens: int | None,
                checkpointing: bool = False, device=None, entropies: EntropySource | None = None) -> list[str]:
        """On a calibration step: score every candidate on this rank's attributable rows (every rank together),
        gather every rank's rows, bands and costs, feed the selector; the lines it printed. A no-op otherwise.

        Args:
            entropies: the policy's entropies of items by index (:func:`oar_verl.openrlhf.entropy.policy_entropies`):
                the entropy control; None: skipped.
        """
        if not self.calibrating:
            return []
        cfg = dataclasses.replace(self.cfg, mode=self.selector.settings.default)  # the run's operator, seeds, rows
        device = torch.device(device if device is not None else next(model.parameters()).device)
        rows = item_rows(items)
        action = rows.action_mask()
        wanted = attribution_rows(_response_field(items, "advantages", rows), action, cfg, action.any(-1))
        idx = rows.to_run(wanted.nonzero().flatten(), action.any(-1))  # a filler row is measured like any row
        truths = [items[i].labels[0] if items[i].labels else None for i in idx] if cfg.target == "reference" else None

        def backend_for(c: OARConfig, prepared):
            longest = max_over_ranks(prepared.longest, device)
            return module_backend(model, c, limits=pass_limits(c, max(max_tokens or 0, longest) or None),
                                  checkpointing=fixed_recompute(c.recompute, checkpointing),
                                  align=lambda n: max_over_ranks(n, device),
                                  pad_id=tokenizer.pad_token_id or 0)

        cands = list(self.selector.settings.candidates)
        ents = None if entropies is None else (lambda picked: entropies([idx[j] for j in picked]))
        was_training = model.training
        model.eval()
        try:
            got = measure_candidates([rows.prompts[i] for i in idx], [rows.responses[i] for i in idx], tokenizer,
                                     cfg, step, cands, backend_for, ground_truths=truths, device=device,
                                     min_gap=default_min_gap(model), entropies=ents)
        finally:
            model.train(was_training)
        n = len(idx)
        ratio = (lambda c: float(got["seconds_per_token"][c]) / self.update_spt if self.update_spt > 0
                 else float("nan"))
        names = self.selector.settings.bands
        band = self.bands(items)
        local = {**{f"aopc/{k}": v for k, v in got["aopc"].items()}, "static": got["static"],
                 "groups": prompt_ids([rows.prompts[i] for i in idx]),
                 "band": torch.tensor([names.index(band[i]) for i in idx], dtype=torch.long),
                 **{f"cost/{c}": torch.full((n,), ratio(c), dtype=torch.float64) for c in cands}}
        every = gather_rows(local)
        measured = ~every[f"aopc/{cands[0]}"].isnan()
        evidence = Evidence({k[5:]: v[measured] for k, v in every.items() if k.startswith("aopc/")},
                            every["static"][measured], every["groups"][measured],
                            tuple(names[b] for b in every["band"][measured].tolist()))
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

    def state_dict(self) -> dict:
        """What OpenRLHF's checkpoint keeps (``client_states[STATE_KEY]``): the selector's state."""
        return self.selector.state_dict()

    def load_state_dict(self, state: Mapping) -> str:
        """Resume the selector from a checkpoint's state; the line to print."""
        self.selector.load_state_dict(state)
        return f"oar auto: resumed from the checkpoint: {self.selector.summary()}"
