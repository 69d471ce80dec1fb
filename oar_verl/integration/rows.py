"""Which rows of a batch are attributed, and how the worker's per-row results come back into batch tensors.

Pure tensor functions (no verl import), so row selection and assembly are unit-tested on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from oar_verl.integration.fields import AUTO_FIELDS, FIDELITY_FIELDS, SECONDS_FIELD
from oar_verl.integration.handoff import EstimatorInputs


@dataclass(frozen=True)
class BatchRows:
    """What the OAR step reads of verl's batch, in the batch's row order.

    Attributes:
        response_mask: (B, T) 0/1.
        scores: (B, T) token-level outcome scores (verl's ``rm_scores``: the reward on the last token).
        uids: (B,) prompt uids (numpy object array; a prompt's rollouts share one).
        eligible: (B,) bool rows that may be attributed (not verl's synthetic padding rows).
        responses: (B, T) token ids, when asked for (the step asks every step: the token dump, and the spans of
            paid rows not attributed for ``oar/rewarded_without_span_frac``).
        lengths: (B,) tokens of each row, prompt + response (``mode=auto``: the sliding-window band and the actor
            update's tokens); None when the trainer does not give them.
        valid: (B, T) bool every real response token, the tool outputs of verl's agent loop included
            (``response_mask`` is 0 on those; docs/multi_turn.md); None when the trainer does not give it.
        session_final: (B,) long, for each row, the batch row of its session's final output (verl's V1 batch keys
            ``{uid}_{session_id}_{index}``: a custom agent loop may return several outputs per session;
            :func:`session_finals`); None when the trainer does not give them (one output per session).
    """

    response_mask: torch.Tensor
    scores: torch.Tensor
    uids: np.ndarray
    eligible: torch.Tensor
    responses: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    session_final: torch.Tensor | None = None


def session_finals(keys) -> torch.Tensor:
    """(B,) long, for each row, the row of its session's final output, by verl V1's rule
    (``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories``): a key ``{uid}_{session_id}_{index}``
    belongs to session ``{uid}_{session_id}``, whose final output is the row with the largest ``index``.

    Raises:
        ValueError: a key not of that form, naming it.
    """
    best: dict[str, tuple[int, int]] = {}
    sessions = []
    for row, key in enumerate(keys):  # per row, not per token
        fields = str(key).rsplit("_", 2)
        if len(fields) != 3 or not fields[2].lstrip("-").isdigit():
            raise ValueError(f"oar: batch key {key!r} is not verl's '{{uid}}_{{session_id}}_{{index}}'")
        session, index = f"{fields[0]}_{fields[1]}", int(fields[2])
        sessions.append(session)
        if session not in best or best[session][0] < index:
            best[session] = (index, row)
    return torch.tensor([best[s][1] for s in sessions], dtype=torch.long)


def select_rows(wanted: torch.Tensor, eligible: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Rows to attribute: the wanted ones, topped up to a multiple of the data-parallel size.

    verl splits the selection into ``dp_size`` equal shards, so its length must be a multiple of it. The top-up takes
    other eligible rows first, then padding rows, then any rows (their results are not used: only wanted rows are
    reshaped).

    Args:
        wanted: (B,) bool rows whose importance is needed.
        eligible: (B,) bool rows that may be attributed.
        dp_size: the actor's data-parallel size, >= 1.

    Returns:
        (N,) long sorted row indices, N a multiple of ``dp_size`` (empty when no row is wanted).
    """
    wanted = wanted & eligible
    idx = wanted.nonzero().squeeze(1)
    if len(idx) == 0:
        return idx
    short = (-len(idx)) % dp_size
    if short:
        fill = ((~wanted) & eligible).nonzero().squeeze(1)
        fill = torch.cat([fill, ((~wanted) & ~eligible).nonzero().squeeze(1)])[:short]
        if len(fill) < short:  # fewer rows than one per rank: repeat rows (a rank attributes a duplicate)
            fill = torch.cat([fill, idx.repeat(short)])[:short]
        idx = torch.cat([idx, fill]).sort().values
    return idx


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, n_rows: int, width: int, fill=0.0) -> torch.Tensor:
    """(n_rows, width) tensor with ``values`` (len(rows), w <= width) placed at ``rows``; ``fill`` elsewhere."""
    out = torch.full((n_rows, width), fill, dtype=values.dtype)
    out[rows, : values.shape[1]] = values
    return out


@dataclass(frozen=True)
class StepAttribution:
    """One step's attribution, in the batch's row order.

    Attributes:
        estimator_inputs: what the ``oar`` estimator takes through the handoff, (B, T) / (B,).
        rows: (N,) attributed row indices.
        answer: (B, T) bool answer-span tokens of each response.
        found: (B,) bool an answer span was found in the response.
        answer_probe: (B,) bool the probe read answer tokens (the response's or, with ``target=reference``, the
            ground truth's) rather than LT-Logits.
        batch: the batch rows the step read.
        passes: (N,) the attribution passes the rank of each attributed row ran (-1: not counted).
        policy_match: (N,) per attributed row, 1 if its rank attributed with exactly the weights of its last
            old-log-prob pass, 0 if not, NaN if no such pass ran (rollout-correction bypass mode).
        copies: (B,) OAR-P masked copies run per row, -1 where not attributed or not counted.
        refined: (B,) reasoning tokens per row with a token-level OAR-P score, -1 where not attributed or not
            counted.
        fidelity: name -> (N,) float64 per attributed row, the worker's ``oar_fidelity_<name>`` fields
            (:data:`~oar_verl.integration.fields.FIDELITY_FIELDS`; NaN: not measured); empty when none came back.
        auto: name -> (N,) float64 per attributed row, the worker's ``oar_auto_<name>`` fields
            (:data:`~oar_verl.integration.fields.AUTO_FIELDS`: a ``mode=auto`` calibration step's measurement);
            empty when none came back.
        recomputed: (N,) per attributed row, the share of its rank's backwards that recomputed the layers (NaN:
            not counted). shared: (N,) 1 where its scores were read from the old-log-prob forward, 0 where not.
    """

    estimator_inputs: EstimatorInputs
    rows: torch.Tensor
    answer: torch.Tensor
    found: torch.Tensor
    answer_probe: torch.Tensor
    batch: BatchRows
    passes: torch.Tensor
    policy_match: torch.Tensor
    copies: torch.Tensor
    refined: torch.Tensor
    fidelity: dict[str, torch.Tensor] = field(default_factory=dict)
    auto: dict[str, torch.Tensor] = field(default_factory=dict)
    recomputed: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    shared: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


def assemble(out: dict[str, torch.Tensor] | None, rows: torch.Tensor, batch: BatchRows,
             base: tuple[torch.Tensor, torch.Tensor] | None) -> StepAttribution:
    """Scatter the worker's padded (N, T') outputs for ``rows`` into (B, T) batch tensors.

    Args:
        out: the worker's outputs, padded: ``token_importance`` (N, T') float, ``oar_reasoning_mask`` and
            ``oar_answer_mask`` (N, T') 0/1, ``oar_span_found`` and ``oar_answer_probe`` (N,) 0/1, ``oar_passes`` (N,),
            ``oar_copies`` and ``oar_refined`` (N,) (-1: not counted); None when no row was attributed.
        rows: (N,) the rows ``out`` belongs to (duplicates allowed: the last write wins, with identical values).
        batch: the batch rows.
        base: the base estimator's (advantages, returns), (B, T) each, or None.
    """
    B, T = batch.response_mask.shape
    attributed = torch.zeros(B, dtype=torch.bool)
    importance, reasoning = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    answer = torch.zeros(B, T, dtype=torch.bool)
    found, probe = torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    passes = torch.full((len(rows),), -1.0)
    match = torch.full((len(rows),), float("nan"))
    copies, refined = torch.full((B,), -1.0), torch.full((B,), -1.0)
    fidelity, auto = {}, {}
    recomputed, shared = torch.full((len(rows),), float("nan")), torch.zeros(len(rows))
    if out is not None and len(rows):
        recomputed = out["oar_recomputed"].float() if "oar_recomputed" in out else recomputed
        shared = out["oar_shared"].float() if "oar_shared" in out else shared
        fidelity = {k: out[f"oar_fidelity_{k}"].double() for k in FIDELITY_FIELDS if f"oar_fidelity_{k}" in out}
        auto = {k: out[f"oar_auto_{k}"].double() for k in AUTO_FIELDS if f"oar_auto_{k}" in out}
        passes = out["oar_passes"].float() if "oar_passes" in out else passes
        if "oar_params_fingerprint" in out:
            logp = out["oar_log_prob_params_fingerprint"].double()
            now = out["oar_params_fingerprint"].double()
            match = torch.where(logp.isnan(), float("nan"), (logp == now).double()).float()
        importance = scatter_rows(out["token_importance"].float(), rows, B, T)
        reasoning = scatter_rows(out["oar_reasoning_mask"].bool(), rows, B, T, fill=False)
        answer = scatter_rows(out["oar_answer_mask"].bool(), rows, B, T, fill=False)
        found[rows], probe[rows] = out["oar_span_found"].bool(), out["oar_answer_probe"].bool()
        attributed[rows] = True
        if "oar_copies" in out:  # duplicated rows (the data-parallel top-up) write identical values
            copies[rows], refined[rows] = out["oar_copies"].float(), out["oar_refined"].float()
    base_adv, base_ret = base if base is not None else (None, None)
    inputs = EstimatorInputs(importance, reasoning & batch.response_mask.bool(), attributed, batch.response_mask,
                             batch.scores if base is not None else None, base_adv, base_ret)
    return StepAttribution(inputs, rows, answer, found, probe, batch, passes, match, copies, refined, fidelity, auto,
                           recomputed, shared)


def call_seconds(out: dict[str, torch.Tensor] | None) -> float:
    """The slowest rank's attribution seconds inside verl's old-log-prob call, from that call's outputs for the rows
    of the batch (:data:`~oar_verl.integration.fields.SECONDS_FIELD`, every row of a rank alike: the largest); 0.0
    where they hold none (no output, or a call that attributed nothing)."""
    if out is None or SECONDS_FIELD not in out or not len(out[SECONDS_FIELD]):
        return 0.0
    return float(out[SECONDS_FIELD].double().nan_to_num(0.0).max())


def merge_outputs(parts: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> tuple[torch.Tensor, dict | None]:
    """Several RPC calls' (rows (N_i,), outputs) as one (rows, outputs) for :func:`assemble`: rows concatenated, (N_i,)
    fields concatenated, (N_i, T_i) fields right-padded with 0 to the widest; the fields every call returned."""
    parts = [(r, o) for r, o in parts if o is not None and len(r)]
    if not parts:
        return torch.zeros(0, dtype=torch.long), None
    keys = [k for k in parts[0][1] if all(k in o for _, o in parts)]
    out = {}
    for k in keys:
        vals = [o[k] for _, o in parts]
        if vals[0].dim() == 2:
            width = max(v.shape[1] for v in vals)
            vals = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in vals]
        out[k] = torch.cat(vals)
    return torch.cat([r.long() for r, _ in parts]), out


def take(rows: torch.Tensor, out: dict[str, torch.Tensor], keep: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The entries ``keep`` (n,) long positions of one call's (rows, outputs)."""
    return rows[keep], {k: v[keep] for k, v in out.items()}
