"""The per-row evidence ``mode=auto`` decides on: every candidate's and every control's deletion AOPC on the same rows,
from one scorer call (docs/auto.md §1). Shapes: B rows, L columns, C candidates, P controls besides random, J random
rankings, F fractions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import AttributionBackend, Replacement
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.fidelity.controls import RANDOM, control_scores
from oar_verl.core.fidelity.curves import FRACTIONS, deletion_sets, rankings
from oar_verl.core.fidelity.shifts import removal_shifts
from oar_verl.core.fidelity.step import RANDOM_RANKINGS
from oar_verl.core.fidelity.summary import static_rows

__all__ = ["Evidence", "candidate_metrics"]


@dataclass(frozen=True)
class Evidence:
    """Per-row AOPC of the candidates and the controls on N rows, with the rows' prompt groups and bands.

    Attributes:
        aopc: name -> (N,) float64 AOPC (NaN: the row was not measured, e.g. no reasoning tokens); candidates and
            controls (``random``, ``position``, ``entropy`` where measured) share the namespace.
        static: (N,) float64 1.0 where nothing moves under any ranking measured (counted, never dropped), else 0.0.
        groups: (N,) int64 prompt cluster ids (rows of one prompt resample together).
        bands: N band names (``all``, or ``inside`` / ``past`` a sliding window).
    """

    aopc: Mapping[str, torch.Tensor]
    static: torch.Tensor
    groups: torch.Tensor
    bands: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.static.shape[0])

    def select(self, keep: torch.Tensor) -> Evidence:
        """The rows where ``keep`` (N,) bool."""
        idx = keep.nonzero().squeeze(1)
        return Evidence({k: v[idx] for k, v in self.aopc.items()}, self.static[idx], self.groups[idx],
                        tuple(self.bands[i] for i in idx.tolist()))

    def band(self, name: str) -> Evidence:
        """The rows of one band."""
        return self.select(torch.tensor([b == name for b in self.bands], dtype=torch.bool))

    @staticmethod
    def concat(parts: Sequence[Evidence]) -> Evidence:
        """The rows of ``parts`` one after another (e.g. several steps, or several data-parallel ranks' rows); a name
        missing from a part is NaN on its rows."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return Evidence({}, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long), ())
        names = list(dict.fromkeys(k for p in parts for k in p.aopc))
        nan = (lambda p: torch.full((len(p),), float("nan"), dtype=torch.float64))
        return Evidence({k: torch.cat([p.aopc.get(k, nan(p)).double() for p in parts]) for k in names},
                        torch.cat([p.static.double() for p in parts]), torch.cat([p.groups.long() for p in parts]),
                        tuple(b for p in parts for b in p.bands))

    def to_dict(self) -> dict:
        """JSON-serialisable (NaN as None)."""
        clean = (lambda t: [None if v != v else float(v) for v in t.tolist()])
        return {"aopc": {k: clean(v) for k, v in self.aopc.items()}, "static": clean(self.static),
                "groups": [int(g) for g in self.groups.tolist()], "bands": list(self.bands)}

    @staticmethod
    def from_dict(d: Mapping) -> Evidence:
        """The inverse of :meth:`to_dict`."""
        f64 = (lambda xs: torch.tensor([float("nan") if v is None else v for v in xs], dtype=torch.float64))
        return Evidence({k: f64(v) for k, v in d["aopc"].items()}, f64(d["static"]),
                        torch.tensor(d["groups"], dtype=torch.long), tuple(d["bands"]))


def candidate_metrics(backend: AttributionBackend, batch: AttributionBatch, importances: Mapping[str, torch.Tensor],
                      *, replacement: Replacement, fractions: Sequence[float] = FRACTIONS,
                      random_rankings: int = RANDOM_RANKINGS, seed: int = 0, min_gap: float = 0.0,
                      entropy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-row deletion AOPC of every candidate's ranking and of the controls, from ONE
    :func:`~oar_verl.core.fidelity.shifts.removal_shifts` call (the controls' removal sets built once for all
    candidates). Each row's AOPC is what :func:`~oar_verl.core.fidelity.step.deletion_metrics` gives that ranking
    alone (a test checks it), so a candidate's numbers do not depend on which other candidates ran.

    Args:
        backend: the model runtime (its ``align`` keeps the data-parallel ranks' pass counts equal).
        batch: AttributionBatch (B, L), B >= 1.
        importances: C >= 1 candidates' (B, L) scores in full-sequence columns (NaN ranks last).
        replacement: the run's mask operator on ``batch``. fractions: F in (0, 1]. random_rankings: J >= 4 (the
            random control is their mean). seed: the random rankings' seed. min_gap: :func:`static_rows`' noise floor.
        entropy: (B, L) or response-aligned (B, T) policy entropies (the entropy control), or None (skipped).

    Returns:
        name -> (B,) float64: each candidate's name, ``random``, ``position`` (and ``entropy`` when given): the mean
        over f of the outcome shift under the ranking's top ⌈f·R⌉ removal (NaN on rows without reasoning tokens);
        ``static``: 1.0 where every ranking's |AOPC| is within ``min_gap``; ``passes``: this rank's passes. Cost:
        (C + P + J)·F perturbed rows per row, P = 1 or 2.
    """
    fractions = tuple(float(f) for f in fractions)
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ValueError(f"auto: fractions must lie in (0, 1], got {fractions}")
    if random_rankings < 4:
        raise ValueError(f"auto: random_rankings must be >= 4 (the random control is their mean), got "
                         f"{random_rankings}")
    names = list(importances)
    if not names or any(n in (RANDOM, "position", "entropy", "static", "passes") for n in names):
        raise ValueError(f"auto: candidates must be >= 1 method names other than the controls', got {names}")
    controls = {"position": control_scores("position", batch, None)}
    if entropy is not None:
        controls["entropy"] = control_scores("entropy", batch, None, entropy)
    scores = [importances[n] for n in names] + list(controls.values())
    ranks = rankings(batch, scores, random_rankings, seed)  # (Q, B, L), Q = C + P + J
    Q, F = ranks.shape[0], len(fractions)
    B, L = batch.input_ids.shape
    sets = deletion_sets(ranks, batch.reasoning_mask.bool(), fractions, methods=0, random_rankings=0,
                         suppress_fraction=1.0)  # (Q·F, B, L): the top sets only
    src = torch.arange(B, device=batch.input_ids.device).repeat(Q * F)
    got = removal_shifts(backend, batch, sets.reshape(Q * F * B, L), src, [[replacement]])
    aopc = got.values[0, 0].view(Q, F, B).mean(1)  # (Q, B)
    n = len(names) + len(controls)
    out = {name: aopc[i] for i, name in enumerate(names + list(controls))}
    out[RANDOM] = aopc[n:].mean(0)
    nan = torch.full_like(out[RANDOM], float("nan"))
    out["static"] = torch.where(aopc.isnan().any(0), nan, static_rows(aopc, min_gap).to(aopc.dtype))
    out["passes"] = torch.full_like(nan, float(got.passes))
    return out
