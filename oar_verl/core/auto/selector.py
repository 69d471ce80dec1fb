"""The ``mode=auto`` state machine (docs/auto.md §4): calibrate on the first rows, decide per band, re-check every
``auto_every`` steps on fresh rows, switch only when two consecutive checks agree, fall back loudly; JSON state for
checkpoints and ``oar/auto/*`` scalars for the trainer's logger. Runs on the driver: one decision for every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.auto.evidence import Evidence
from oar_verl.core.auto.rule import DEFAULT_CONTROLS, Decision, decide

__all__ = ["AutoSelector", "AutoSettings", "FALLBACKS", "UNIFORM"]

UNIFORM = "grpo"  # a band's mode when the fallback is plain GRPO: its rows are not reshaped (uniform weights)
FALLBACKS = ("grpo", "best")


@dataclass(frozen=True)
class AutoSettings:
    """The selector's settings (the ``algorithm.oar.auto_*`` keys, docs/config.md) and the model's sliding window.

    Attributes:
        candidates: the modes scored. default: the mode before the first decision. rows, prompts: the evidence a
            check needs (per band). every: steps from one check's decision to the next check. max_cost: the cost
            cap in training forward+backward units. fallback: ``grpo`` or ``best``. controls: the required controls.
        window: the model's sliding window (None: one band ``all``). resamples, seed, min_gap: the bootstrap's.
    """

    candidates: tuple[str, ...]
    default: str
    rows: int = 32
    prompts: int = 8
    every: int = 20
    max_cost: float = 2.0
    fallback: str = "grpo"
    controls: tuple[str, ...] = DEFAULT_CONTROLS
    window: int | None = None
    resamples: int = 1000
    seed: int = 0
    min_gap: float = 0.0

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"auto: fallback={self.fallback!r} is not allowed; choose one of: {', '.join(FALLBACKS)}")
        if not self.candidates or self.rows < 1 or self.prompts < 1 or self.every < 1:
            raise ValueError("auto: candidates must be non-empty and rows, prompts, every >= 1")

    @classmethod
    def from_config(cls, cfg, window: int | None = None, min_gap: float = 0.0) -> AutoSettings:
        """From an OARConfig with ``mode=auto`` and the model's sliding window."""
        return cls(tuple(cfg.auto_candidates), cfg.auto_default, cfg.auto_rows, cfg.auto_prompts, cfg.auto_every,
                   float(cfg.auto_max_cost), cfg.auto_fallback, window=window, seed=cfg.seed, min_gap=min_gap)

    @property
    def bands(self) -> tuple[str, ...]:
        return ("all",) if self.window is None else ("inside", "past")


def _json(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def _num(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def _summary(d: Decision, target: str) -> dict:
    """What :meth:`AutoSelector.metrics` reports of a decision (strict JSON: NaN as None)."""
    return {"choice": d.choice, "target": target, "reason": d.reason, "rows": d.rows, "prompts": d.prompts,
            "static": d.static, "cost": {c: _json(float(v)) for c, v in d.cost.items()},
            "random_like": list(d.random_like),
            "gains": {c: {k: [_json(iv.mean), _json(iv.lo), _json(iv.hi)] for k, iv in per.items()}
                      for c, per in d.gains.items()}}


class AutoSelector:
    """Chooses each band's attribution mode from the run's own rows (module docstring).

    Per band: before the first decision rows attribute with ``default`` and every step is a calibration step, until
    ``rows`` rows from ``prompts`` prompts are in; then :func:`~oar_verl.core.auto.rule.decide` and the choice (or
    the fallback) applies. From then on a check opens every ``every`` steps after the last decision and collects
    fresh rows (that window's only); its target replaces the current mode only when the previous check named the same
    target (two agreeing checks), so one noisy check never switches.
    """

    def __init__(self, settings: AutoSettings):
        self.settings = settings
        self._bands = {b: self._fresh() for b in settings.bands}

    def _fresh(self) -> dict:
        return {"mode": self.settings.default, "decided": False, "pending": None, "collecting": False,
                "next_check": 0, "switches": 0, "buffer": [], "costs": {}, "last": None}

    # -- what the step asks -------------------------------------------------------------------------------------
    def _due(self, band: dict, step: int) -> bool:
        return not band["decided"] or band["collecting"] or step >= band["next_check"]

    def calibrating(self, step: int) -> bool:
        """Whether the workers should also score every candidate at this step."""
        return any(self._due(b, step) for b in self._bands.values())

    def mode(self, band: str) -> str:
        """The mode the band's rows attribute with now (a candidate, or :data:`UNIFORM`)."""
        return self._bands[band]["mode"]

    def modes(self) -> dict[str, str]:
        return {name: b["mode"] for name, b in self._bands.items()}

    def steady_mode(self, step: int) -> str | None:
        """The one mode every band runs at ``step`` when the step does not calibrate (a candidate; not the plain-GRPO
        fallback), else None: such a step attributes every row alike, as a run with that mode would."""
        if self.calibrating(step):
            return None
        modes = set(self.modes().values())
        return modes.pop() if len(modes) == 1 and UNIFORM not in modes else None

    def plan(self, bands: Sequence[str], step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Which rows attribute with which mode at ``step``, from each row's band (:func:`~oar_verl.core.auto.rule.
        bands_of`).

        Returns:
            (mode -> (B,) bool its rows, one entry per band's mode in this selector's band order, so every rank that
            holds the same selector gets the same modes in the same order, even with no row of a band; (B,) bool the
            rows left on plain GRPO). A band on the plain-GRPO fallback attributes with ``default`` on a calibration
            step only (the evidence for the next check); its rows are never reshaped.
        """
        calibrating, B = self.calibrating(step), len(bands)
        groups: dict[str, torch.Tensor] = {}
        plain = torch.zeros(B, dtype=torch.bool)
        for name in self.settings.bands:
            rows = torch.tensor([b == name for b in bands], dtype=torch.bool).reshape(B)
            mode = self.mode(name)
            if mode == UNIFORM:
                plain |= rows
                if not calibrating:
                    continue
                mode = self.settings.default
            groups[mode] = groups.get(mode, torch.zeros(B, dtype=torch.bool)) | rows
        return groups, plain

    # -- the evidence ---------------------------------------------------------------------------------------------
    def observe(self, step: int, evidence: Evidence, costs: Mapping[str, float]) -> list[str]:
        """Feed one step's measured rows (every rank's, gathered) and each candidate's cost this step; returns the
        lines to print (a decision, a check, a switch). Rows of a band that is not checking at ``step`` are ignored."""
        lines = []
        for name, band in self._bands.items():
            if not self._due(band, step):
                continue
            band["collecting"] = True
            rows = evidence.band(name)
            if len(rows):
                band["buffer"].append(rows.to_dict())
            for c in self.settings.candidates:
                v = float(costs.get(c, float("nan")))
                if not math.isnan(v):
                    band["costs"].setdefault(c, []).append(v)
            window = Evidence.concat([Evidence.from_dict(d) for d in band["buffer"]])
            if len(window) < self.settings.rows or torch.unique(window.groups).numel() < self.settings.prompts:
                continue
            lines.append(self._check(name, band, step, window))
        return lines

    def _costs(self, band: dict) -> dict[str, float]:
        got = band["costs"]
        return {c: (sum(got[c]) / len(got[c]) if got.get(c) else float("nan")) for c in self.settings.candidates}

    def _check(self, name: str, band: dict, step: int, window: Evidence) -> str:
        s = self.settings
        d = decide(window, self._costs(band), max_cost=s.max_cost, controls=s.controls, resamples=s.resamples,
                   seed=s.seed, min_gap=s.min_gap)
        if d.choice is not None:
            target, how = d.choice, "chosen"
        elif s.fallback == "best" and d.best is not None:
            target, how = d.best, "FALLBACK best (highest lower bound, beats no control)"
        else:
            target, how = UNIFORM, "FALLBACK plain GRPO advantages for these rows"
        band.update(collecting=False, buffer=[], costs={}, next_check=step + s.every, last=_summary(d, target))
        head = f"oar auto [{name}] step {step}: "
        if not band["decided"]:
            band.update(mode=target, decided=True, pending=None)
            return head + f"DECIDED {target} ({how}). {d.reason}"
        if target == band["mode"]:
            band["pending"] = None
            return head + f"check confirms {target}. {d.reason}"
        if band["pending"] == target:
            old = band["mode"]
            band.update(mode=target, pending=None, switches=band["switches"] + 1)
            return head + f"SWITCH {old} -> {target} ({how}; two checks agree). {d.reason}"
        band["pending"] = target
        return head + f"check prefers {target} over {band['mode']} ({how}); switching only if the next check agrees. " \
                      f"{d.reason}"

    # -- reporting and checkpoints -------------------------------------------------------------------------------
    def metrics(self, step: int | None = None, prefix: str = "oar/auto/") -> dict[str, float]:
        """``oar/auto/*`` scalars: ``calibrating`` (at ``step``), and per band ``<band>/``: ``mode_index`` (index in
        the candidates, -1 for plain GRPO), ``mode/<name>`` 1/0 flags, ``decided``, ``switches``, ``pending`` (1 when
        a check awaits confirmation) and, from the last check, ``rows``, ``rows_static``, ``prompts``,
        ``no_candidate`` (1: none beat the controls affordably), ``random_like`` (candidates ranking like random),
        ``cost/<c>`` and ``gain/<c>/<control>`` with ``_lo`` / ``_hi``."""
        s = self.settings
        out = {}
        if step is not None:
            out[prefix + "calibrating"] = float(self.calibrating(step))
        for name, band in self._bands.items():
            p = f"{prefix}{name}/"
            mode = band["mode"]
            out[p + "mode_index"] = float(s.candidates.index(mode)) if mode in s.candidates else -1.0
            for c in (*s.candidates, UNIFORM):
                out[p + f"mode/{c}"] = float(mode == c)
            out[p + "decided"] = float(band["decided"])
            out[p + "switches"] = float(band["switches"])
            out[p + "pending"] = float(band["pending"] is not None)
            last = band["last"]
            if last is None:
                continue
            out[p + "rows"], out[p + "rows_static"] = float(last["rows"]), float(last["static"])
            out[p + "prompts"] = float(last["prompts"])
            out[p + "no_candidate"] = float(last["choice"] is None)
            out[p + "random_like"] = float(len(last["random_like"]))
            for c, v in last["cost"].items():
                out[p + f"cost/{c}"] = _num(v)
            for c, per in last["gains"].items():
                for k, (mean, lo, hi) in per.items():
                    out[p + f"gain/{c}/{k}"], out[p + f"gain/{c}/{k}_lo"] = _num(mean), _num(lo)
                    out[p + f"gain/{c}/{k}_hi"] = _num(hi)
        return out

    def summary(self) -> str:
        """One line: each band's mode and its last check's reason."""
        parts = []
        for name, band in self._bands.items():
            last = band["last"]
            parts.append(f"[{name}] {band['mode']}" + ("" if last is None else f" ({last['reason']})")
                         + ("" if band["decided"] else " (calibrating)"))
        return "oar auto: " + "; ".join(parts)

    def state_dict(self) -> dict:
        """JSON-serialisable state (the bands, and the settings it must be resumed with)."""
        s = self.settings
        return {"version": 1, "candidates": list(s.candidates), "default": s.default, "window": s.window,
                "bands": {name: {**b, "last": b["last"]} for name, b in self._bands.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from :meth:`state_dict`; a ValueError when the candidates or the bands differ from this run's."""
        s = self.settings
        if list(state.get("candidates", ())) != list(s.candidates) or set(state.get("bands", {})) != set(self._bands):
            raise ValueError(f"auto: the checkpoint's selector scored {state.get('candidates')} on bands "
                             f"{sorted(state.get('bands', {}))}; this run has algorithm.oar.auto_candidates="
                             f"{list(s.candidates)} on bands {sorted(self._bands)}")
        self._bands = {name: {**self._fresh(), **dict(b)} for name, b in state["bands"].items()}

