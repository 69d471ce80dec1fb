"""The controls a method's fidelity is measured against: the free rankings a user would pick instead (docs/fidelity.md
§1, "Gain over a control").

A control is a ranking of each row's reasoning tokens that costs nothing to compute: ``random`` (the mean AOPC of the
J seeded random rankings), ``position`` (the latest tokens first, :func:`~oar_verl.core.fidelity.curves.
position_scores`) and ``entropy`` (the policy's next-token entropy at each reasoning position, :func:`entropy_scores`,
free in training: the old-log-prob pass has the logits). :data:`CONTROLS` is their one registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from oar_verl.core.backends.hf import column_window
from oar_verl.core.batch.layout import AttributionBatch
from oar_verl.core.batch.probes import logits_at
from oar_verl.core.fidelity.curves import full_columns, position_scores
from oar_verl.core.registry import Registry

__all__ = ["CONTROLS", "Control", "DEFAULT_CONTROLS", "EntropySource", "RANDOM", "check_controls", "control_scores",
           "entropies_at", "entropies_of", "entropy_from_logits", "entropy_scores", "evaluated", "response_aligned"]

RANDOM = "random"  # the control that is no single ranking: the mean of the J random rankings


@dataclass(frozen=True)
class Control:
    """One control ranking.

    Attributes:
        scores: (batch, model) -> (B, L) float64 scores of the ranking (model: the policy, None when the caller
            passes the scores); None for ``random``, whose AOPC is the mean over the J seeded random rankings.
        needs_model: the scores come from a forward of the policy (unless the caller passes them).
    """

    scores: Callable[[AttributionBatch, torch.nn.Module | None], torch.Tensor] | None
    needs_model: bool = False


CONTROLS: Registry[Control] = Registry("fidelity control", "controls")


@contextlib.contextmanager
def evaluated(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no gradient inside; every module's train/eval flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            model.eval()
            yield
    finally:
        for m, t in flags:
            m.training = t


def entropy_from_logits(logits: torch.Tensor, batch: AttributionBatch) -> torch.Tensor:
    """The policy's next-token entropy at each reasoning position from logits already computed.

    H_t = −Σ_v p(v | x_<t) log p(v | x_<t), the entropy of the distribution that produced token t, read from the
    logits at position t − 1 (a causal LM's position j predicts token j + 1).

    Args:
        logits: (B, L, V) logits (or log-probabilities: the softmax of a log-softmax is the same distribution) in the
            batch's full-sequence columns; computed in float32 at least.
        batch: AttributionBatch (B, L).

    Returns:
        (B, L) float64: H_t on the reasoning tokens, 0 elsewhere (and at a reasoning token in column 0, which no
        position predicts).
    """
    B, L = batch.input_ids.shape
    if logits.shape[:2] != (B, L):
        raise ValueError(f"fidelity: logits have shape {tuple(logits.shape)}; expected (B, L, V) with (B, L) = "
                         f"{(B, L)}")
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    h = torch.special.entr(torch.softmax(x, -1)).sum(-1).double()  # (B, L): entropy of the prediction of j + 1
    out = torch.nn.functional.pad(h[:, :-1], (1, 0))  # column t: the entropy read at t − 1
    return torch.where(batch.reasoning_mask.bool().to(out.device), out, 0.0)


def entropy_scores(model: torch.nn.Module, batch: AttributionBatch) -> torch.Tensor:
    """:func:`entropy_from_logits` by running the policy: one forward per row, in the row's own column window (no
    padding), logits only at the positions that predict a reasoning token, so that at most one row's (R, V) logits
    exist at a time (read in float32 at least).

    Written over a plain Hugging Face causal LM (or an FSDP wrapper), not the backend interface: that interface
    hands a method the outcome probe only, never full logits. Eval mode under ``torch.no_grad()``, every module's
    train/eval flag restored. In training the old-log-prob pass has these logits already: pass its entropies
    instead (``fidelity_report(..., entropy=)``, ``step_fidelity(..., entropy=)``).

    Args:
        model: the policy. batch: AttributionBatch (B, L).

    Returns:
        (B, L) float64 entropies on the reasoning tokens, 0 elsewhere; a row's values depend on that row only.
    """
    reasoning = batch.reasoning_mask.bool()
    B, L = reasoning.shape
    out = torch.zeros(B, L, dtype=torch.float64, device=reasoning.device)
    with evaluated(model):
        for b in range(B):  # one row per forward (B rows, never per token)
            row = torch.tensor([b], device=reasoning.device)
            lo, hi = column_window(batch.attention_mask, row)
            cols = (reasoning[b] & (torch.arange(L, device=reasoning.device) > lo)).nonzero().squeeze(1)
            if cols.numel() == 0:
                continue
            logits = logits_at(model, cols - 1 - lo, **batch.model_inputs(row, lo, hi))[0]  # (R, V)
            x = logits if logits.dtype == torch.float64 else logits.float()
            out[b, cols] = torch.special.entr(torch.softmax(x, -1)).sum(-1).to(out.device, torch.float64)
    return out


CONTROLS.register(RANDOM)(Control(None))
CONTROLS.register("position")(Control(lambda batch, model: position_scores(batch)))
CONTROLS.register("entropy")(Control(lambda batch, model: entropy_scores(model, batch), needs_model=True))
DEFAULT_CONTROLS = CONTROLS.names()  # random, position, entropy


# the policy's per-response-token entropies of a batch's rows: a list (one 1-D tensor per row), or a function of the
# measured rows' indices returning theirs (an integration that computes entropies only for the rows a step measures)
EntropySource = Sequence[torch.Tensor] | Callable[[list[int]], Sequence[torch.Tensor]]


def entropies_of(source: EntropySource, rows: Sequence[int]) -> list[torch.Tensor]:
    """``source``'s per-row 1-D entropies of ``rows``, in order (a function ``source`` is called once, with them)."""
    rows = list(rows)
    got = list(source(rows)) if callable(source) else [source[i] for i in rows]
    if len(got) != len(rows):
        raise ValueError(f"fidelity: {len(got)} rows of entropies for {len(rows)} measured rows")
    return got


def entropies_at(source: EntropySource, rows: Sequence[int], B: int) -> list[torch.Tensor]:
    """B per-row 1-D entropies: :func:`entropies_of` ``rows`` placed at them, an empty tensor at every other row (0
    after :func:`response_aligned`; those rows are not measured)."""
    rows = list(rows)
    got = entropies_of(source, rows)
    out = [torch.zeros(0, dtype=torch.float64) for _ in range(B)]
    for r, v in zip(rows, got):  # per row, never per token
        out[r] = v
    return out


def response_aligned(values: Sequence[torch.Tensor], batch: AttributionBatch) -> torch.Tensor:
    """(B, L − P) float64 response-aligned scores of the batch's rows from per-row 1-D values over each row's response
    tokens (e.g. the old-log-prob pass's entropies, verl's ``entropy`` / ``entropys``): value j of row b at response
    column j, cut to the batch's response width, 0 past a row's values. A ValueError naming the rows when B differs.
    One copy per row, never per token."""
    B, L = batch.input_ids.shape
    if len(values) != B:
        raise ValueError(f"fidelity: {len(values)} rows of per-token values for a batch of {B} rows")
    out = torch.zeros(B, L - batch.response_start, dtype=torch.float64, device=batch.input_ids.device)
    for b, v in enumerate(values):
        n = min(int(v.numel()), out.shape[1])
        out[b, :n] = v.reshape(-1)[:n].to(out)
    return out


def check_controls(controls: Sequence[str]) -> tuple[str, ...]:
    """The controls as a tuple without repeats, or a ValueError naming the key ``controls`` and the registered
    controls."""
    names = tuple(dict.fromkeys(controls))
    for name in names:
        CONTROLS.get(name)
    return names


def control_scores(name: str, batch: AttributionBatch, model: torch.nn.Module | None,
                   given: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L) float64 scores of the control ``name`` (not ``random``): ``given`` ((B, L) or response-aligned (B, T),
    e.g. the old-log-prob pass's entropies) if passed, else computed (with ``model`` where the control needs it)."""
    control = CONTROLS.get(name)
    if control.scores is None:
        raise ValueError(f"fidelity: control {name!r} is the mean of the random rankings, not one ranking")
    if given is not None:
        return full_columns(given, batch, name).double()
    if control.needs_model and model is None:
        raise ValueError(f"fidelity: control {name!r} needs the model's logits: pass the model or its scores")
    return control.scores(batch, model).double()
