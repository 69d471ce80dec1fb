"""OAR on OpenRLHF's replay buffer: per-item rows -> the core's attribute + reshape -> w_t x A_seq assigned back.

OpenRLHF 0.11 stores one unpadded :class:`openrlhf.trainer.ppo_utils.experience.Experience` per sample: ``sequences``
(L,) prompt + response ids, ``action_mask`` (L-1,) with ``action_mask[j]`` marking ``sequences[j + 1]`` as a generated
token (the shift of its log-probs), and ``advantages`` / ``returns`` (L-1,) aligned with ``action_mask``. The outcome
estimators (``group_norm`` = GRPO, ``rloo``, ``reinforce_baseline``, ``dr_grpo``, ``flash_reinforce``) broadcast one
value over the action tokens; OAR replaces it with ``w_t * A_seq``.

This module reads the items by attribute only and imports no OpenRLHF module, so the core's numbers can be checked
on the very rows the actor reshapes. The Ray actor (:mod:`oar_verl.openrlhf.actor`) calls :func:`reshape_replay_buffer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from oar_verl.core.methods.attribution import module_backend, pass_limits
from oar_verl.core.backends.collectives import gather_objects, max_over_ranks
from oar_verl.core.backends.memory import fixed_recompute
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.controls import EntropySource
from oar_verl.core.fidelity.step import due as fidelity_due
from oar_verl.core.fidelity.step import step_metrics
from oar_verl.core.fidelity.summary import default_min_gap
from oar_verl.core.pipeline import RowAttribution, attribute, reshape
from oar_verl.core.preprocess import PreparedAttribution
from oar_verl.core.reshaping.gating import TokenWeights
from oar_verl.core.reshaping.reshape import attribution_rows

__all__ = ["ItemRows", "assign_reshaped", "gather_rows", "item_rows", "reshape_replay_buffer"]


@dataclass(frozen=True)
class ItemRows:
    """The replay-buffer items as (prompt, response) rows.

    Attributes:
        prompts: N 1-D prompt ids (everything up to the first generated token).
        responses: N 1-D response ids (first to last generated token; tool/environment tokens in between stay, with
            action 0).
        actions: N 1-D bool, the generated tokens of each response.
        starts: N offsets of each response's first token in the item's action-aligned tensors.
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    actions: list[torch.Tensor]
    starts: list[int]

    def action_mask(self) -> torch.Tensor:
        """(N, T) bool: each response's generated tokens, right-padded with False to the longest response."""
        return _pad_float([a.double() for a in self.actions], max((len(a) for a in self.actions), default=0)).bool()

    def to_run(self, sel: torch.Tensor, has_action: torch.Tensor) -> list[int]:
        """The rows this rank runs the aligned passes on: ``sel``, or, when it has none, one own row with a generated
        token as filler (every rank must take part; the filler's result is discarded)."""
        run = sel if len(sel) else has_action.nonzero().flatten()[:1]
        if not len(run):
            raise RuntimeError("oar: this rank's replay buffer has no generated token to run the aligned attribution "
                               "passes on")
        return run.tolist()


def item_rows(items: Sequence) -> ItemRows:
    """Split every item's ``sequences`` at its first generated token (``action_mask`` is shifted by one).

    Items without a generated token get an empty response.
    """
    prompts, responses, actions, starts = [], [], [], []
    for it in items:  # per item: unpadded rows of different lengths
        am = it.action_mask.bool().reshape(-1)
        seq = it.sequences.reshape(-1)
        pos = am.nonzero().flatten()
        first, last = (int(pos[0]), int(pos[-1])) if len(pos) else (len(am), len(am) - 1)
        prompts.append(seq[: first + 1].cpu())
        responses.append(seq[first + 1: last + 2].cpu())
        actions.append(am[first: last + 1].cpu())
        starts.append(first)
    return ItemRows(prompts, responses, actions, starts)


def _response_field(items: Sequence, name: str, rows: ItemRows) -> torch.Tensor:
    """(N, T) float64 ``item.<name>`` on each response's positions, right-padded with 0."""
    vals = [getattr(it, name).reshape(-1)[s: s + len(a)].double().cpu()
            for it, s, a in zip(items, rows.starts, rows.actions)]
    return _pad_float(vals, max((len(v) for v in vals), default=0))


def _pad_float(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):  # per row: a slice copy
        out[i, : len(r)] = r.double()
    return out


_SUMS = ("adv_mass_before", "adv_mass_after", "reshaped_tokens")
_PER_ITEM = ("reshaped_seq_frac", "attributed_seq_frac", "fallback_seq_frac", "flat_seq_frac",
             "no_reasoning_seq_frac")
_PER_ATTRIBUTED = ("span_found_frac", "answer_probe_frac", "shared_forward")
_EXTREMES = {"weight_min": dist.ReduceOp.MIN, "weight_max": dist.ReduceOp.MAX}


def _reduce_metrics(metrics: dict[str, float], counts: dict[str, float], device: torch.device,
                    prefix: str = "oar/") -> dict[str, float]:
    """``oar/*`` of the whole data-parallel batch from each rank's: masses and token counts summed, fractions weighted
    by the rows they are fractions of, row/token statistics weighted by reshaped rows, min/max as min/max.

    Args:
        metrics: this rank's :meth:`oar_verl.core.reshaping.reshape.Reshaped.metrics` (same keys on every rank).
        counts: this rank's ``items``, ``attributed`` and ``reshaped`` row counts.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return metrics
    keys = sorted(k for k in metrics if k[len(prefix):] not in _EXTREMES)

    def weight(k: str) -> float:
        name = k[len(prefix):]
        if name in _SUMS:
            return 1.0
        if name in _PER_ITEM or name == "global_step":
            return counts["items"]
        return counts["attributed"] if name in _PER_ATTRIBUTED else counts["reshaped"]

    w = torch.tensor([weight(k) for k in keys], dtype=torch.float64, device=device)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device) * w
    both = torch.cat([t, w])
    dist.all_reduce(both, op=dist.ReduceOp.SUM)
    t, w = both[: len(keys)], both[len(keys):]
    out = {k: float(v) if k[len(prefix):] in _SUMS else (float(v / d) if d > 0 else float(metrics[k]))
           for k, v, d in zip(keys, t.tolist(), w.tolist())}
    mass = out.get(prefix + "adv_mass_before", 0.0)
    if prefix + "adv_mass_rel_err" in out:
        out[prefix + "adv_mass_rel_err"] = abs(out[prefix + "adv_mass_after"] - mass) / mass if mass > 0 else 0.0
    reshaped = counts["reshaped"] > 0
    for name, op in _EXTREMES.items():  # ranks without a reshaped row do not take part
        k = prefix + name
        if k in metrics:
            fill = float("inf") if op == dist.ReduceOp.MIN else float("-inf")
            v = torch.tensor([metrics[k] if reshaped else fill], dtype=torch.float64, device=device)
            dist.all_reduce(v, op=op)
            out[k] = float(v[0]) if torch.isfinite(v[0]) else 0.0
    return out


def gather_rows(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-row values of every data-parallel rank, rank by rank (name -> (N_total,) on the CPU); this rank's alone
    without a process group. Every rank calls it together."""
    local = {k: v.detach().cpu() for k, v in values.items()}
    parts = gather_objects(local)
    return {k: torch.cat([p[k] for p in parts]) for k in local}


def _replaced(old: torch.Tensor, start: int, values: torch.Tensor) -> torch.Tensor:
    """A new tensor equal to ``old`` with ``values`` at the flat positions ``start:start + len(values)``."""
    new = old.detach().clone()
    new.reshape(-1)[start: start + len(values)] = values.to(device=new.device, dtype=new.dtype)
    return new


def assign_reshaped(items: Sequence, rows: ItemRows, advantages: torch.Tensor, returns: torch.Tensor | None) -> None:
    """Give every item new ``advantages`` (and ``returns``) tensors with the reshaped response slices.

    Never writes into the items' tensors: they can be zero-copy views into Ray's object store (OpenRLHF starts Ray
    with ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, and the replay buffer splits each received batch into views), so an
    in-place write could change memory other readers share, or fail on a read-only buffer.

    Args:
        advantages / returns: (N, T) float64, response-aligned (``rows.starts`` maps them into each item).
    """
    for i, it in enumerate(items):  # per item: unpadded items of different lengths
        n, start = len(rows.actions[i]), rows.starts[i]
        it.advantages = _replaced(it.advantages, start, advantages[i, :n])
        if returns is not None:
            it.returns = _replaced(it.returns, start, returns[i, :n])


@dataclass(frozen=True)
class ReshapeResult:
    """What :func:`reshape_replay_buffer` did on this rank.

    Attributes:
        weights: TokenWeights (N, T) over the response positions of every item (1 on rows left alone).
        base_advantages / advantages: (N, T) float64 before / after, response-aligned.
        attributed: (N,) bool rows whose importance was computed.
        importance: (N, T) float64 raw importance (0 where not attributed).
        metrics: ``oar/*`` scalars of the whole data-parallel batch (:func:`_reduce_metrics`).
    """

    weights: TokenWeights
    base_advantages: torch.Tensor
    advantages: torch.Tensor
    attributed: torch.Tensor
    importance: torch.Tensor
    metrics: dict[str, float]


def _attribute(items: Sequence, rows: ItemRows, sel: torch.Tensor, has_action: torch.Tensor, model, tokenizer,
               cfg: OARConfig, global_step: int, *, max_tokens: int | None, checkpointing: bool, device: torch.device,
               align: Callable[[int], int], entropies: EntropySource | None
               ) -> tuple[RowAttribution, dict[str, torch.Tensor] | None]:
    """One aligned attribution of this rank's rows ``sel`` with ``cfg`` (every rank together; a rank without a row
    runs one of its own as filler) and, on a due step, its in-step fidelity (the filler's: no row)."""
    idx = rows.to_run(sel, has_action)
    truths = [items[i].labels[0] if items[i].labels else None for i in idx] if cfg.target == "reference" else None

    def backend(prepared: PreparedAttribution):
        longest = max_over_ranks(prepared.longest, device)
        return module_backend(model, cfg, limits=pass_limits(cfg, max(max_tokens or 0, longest) or None),
                              checkpointing=fixed_recompute(cfg.recompute, checkpointing), align=align,
                              pad_id=tokenizer.pad_token_id or 0)

    fidelity = None
    was_training = model.training
    model.eval()  # eval numerics (no dropout) for the attribution passes
    try:
        # the generated tokens only are the model's: tool/environment outputs stay context (docs/multi_turn.md)
        ran = attribute(backend, [rows.prompts[i] for i in idx], [rows.responses[i] for i in idx], tokenizer, cfg,
                        global_step, ground_truths=truths, device=device, model_masks=[rows.actions[i] for i in idx])
        if fidelity_due(cfg, global_step):  # the in-step fidelity metric, every rank alike (docs/fidelity.md §5)
            ents = None if entropies is None else (lambda picked: entropies([idx[j] for j in picked]))
            fidelity = ran.fidelity(cfg, global_step, min_gap=default_min_gap(model), entropies=ents)
            if not len(sel):  # the filler's rows: measured for the alignment only
                fidelity = {k: v[:0] for k, v in fidelity.items()}
    finally:
        model.train(was_training)
    return ran, fidelity


def reshape_replay_buffer(items: Sequence, model: torch.nn.Module, tokenizer, cfg: OARConfig, global_step: int, *,
                          max_tokens: int | None, checkpointing: bool = False,
                          device: torch.device | str | None = None,
                          align: Callable[[int], int] | None = None,
                          plan: Sequence[tuple[OARConfig, torch.Tensor]] | None = None,
                          entropies: EntropySource | None = None, shared=None) -> ReshapeResult:
    """Attribute this rank's replay-buffer items and set each generated token's advantage to ``w_t * A_seq``.

    Every data-parallel rank must call it together (ZeRO-3 gathers parameters inside every forward): the ranks agree
    on whether anyone attributes at all, a rank with nothing to attribute runs one of its own rows as filler (result
    discarded), and the attribution passes are aligned over the ranks (``align``, default: max over the default group).

    Args:
        items: the replay buffer's unpadded per-sample items (``sequences``, ``action_mask``, ``advantages``,
            ``returns``, ``labels``); their ``advantages`` and ``returns`` are replaced by new tensors
            (:func:`assign_reshaped`).
        model: the policy's causal LM (the DeepSpeed engine's module), put in eval mode for the passes.
        tokenizer: the policy's tokenizer.
        cfg: OARConfig.
        global_step: the training step (probe schedule, OAR-G noise seeds).
        max_tokens: the token budget of one pass from the trainer's settings (``cfg.max_token_len_per_gpu`` wins).
        checkpointing: the actor's gradient checkpointing.
        device: where the model runs (default: its first parameter's device).
        align: passes -> passes every rank runs (default: max over the default process group).
        plan: (configuration, (N,) bool its rows) pairs, in an order every rank shares (``mode=auto``: one per
            band's mode, :meth:`~oar_verl.core.auto.AutoSelector.plan`); each entry's rows attribute with its
            configuration (its gating keys are ``cfg``'s), rows in no entry keep their advantages. None: every row
            with ``cfg``.
        entropies: the policy's entropies of items by index (:func:`oar_verl.openrlhf.entropy.policy_entropies`):
            the in-step metric's entropy control; None: skipped.
        shared: scores read from the experience maker's forward (:class:`oar_verl.openrlhf.shared.SharedRows`, every
            rank's, of the one mode every entry of ``plan`` runs): the items found there take them, the others run
            their own passes; None: every item its own passes.

    Returns:
        ReshapeResult.
    """
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    align = align or (lambda n: max_over_ranks(n, device))
    rows = item_rows(items)
    action = rows.action_mask()
    width = action.shape[1]
    base = _response_field(items, "advantages", rows)
    base_ret = _response_field(items, "returns", rows) if all(it.returns is not None for it in items) else None
    has_action = action.any(-1)
    wanted = attribution_rows(base, action, cfg, has_action)
    response_mask = torch.arange(width)[None, :] < torch.tensor([len(a) for a in rows.actions])[:, None]  # (N, T)
    att = RowAttribution.unattributed(response_mask)
    found = torch.zeros(len(items), dtype=torch.bool)
    if shared is not None:  # the wanted items the experience maker's forward already scored
        read = shared.attribution(items, response_mask)
        found = read.attributed & wanted
        att = dataclasses.replace(read, importance=torch.where(found[:, None], read.importance, 0.0),
                                  reasoning_mask=read.reasoning_mask & found[:, None],
                                  answer_mask=read.answer_mask & found[:, None], attributed=found,
                                  span_found=read.span_found & found, answer_probe=read.answer_probe & found)
    plan = [(cfg, torch.ones(len(items), dtype=torch.bool))] if plan is None else plan
    measured = []  # each plan entry's in-step fidelity rows
    for run_cfg, rows_c in plan:  # every rank runs the same entries in the same order
        sel = (wanted & rows_c.bool() & ~found).nonzero().flatten()
        if max_over_ranks(len(sel), device) == 0:  # every rank takes part as soon as one has a row to attribute
            continue
        ran, fidelity = _attribute(items, rows, sel, has_action, model, tokenizer, run_cfg, global_step,
                                   max_tokens=max_tokens, checkpointing=checkpointing, device=device, align=align,
                                   entropies=entropies)
        if fidelity is not None:
            measured.append(fidelity)
        if len(sel):
            att = ran.placed(sel, response_mask, into=att)
    attributed = att.attributed
    fidelity = None
    if measured:  # one row set; the time measuring is every entry's
        fidelity = {k: torch.cat([f[k] for f in measured]) for k in measured[0]}
        fidelity["seconds"][:] = sum(float(f["seconds"].nan_to_num(0.0).max()) for f in measured if len(f["seconds"]))
    res = reshape(base, att, cfg, response_mask=action, base_returns=base_ret)
    assign_reshaped(items, rows, res.advantages, res.returns)
    metrics = res.metrics()
    metrics["oar/attributed_seq_frac"] = float(attributed.float().mean()) if len(items) else 0.0
    metrics["oar/shared_forward"] = float(found.sum()) / max(int(attributed.sum()), 1)
    metrics["oar/global_step"] = float(global_step)
    counts = {"items": float(len(items)), "attributed": float(attributed.sum()),
              "reshaped": float(res.token_weights.reshaped.any(-1).sum())}
    metrics = _reduce_metrics(metrics, counts, device)
    if fidelity is not None:  # every rank's rows: the step's oar/fidelity/* as verl logs them
        values = gather_rows(fidelity)
        metrics.update(step_metrics(values))
        if len(values["seconds"]) and not bool(values["seconds"].isnan().all()):
            metrics["timing/oar_fidelity"] = float(values["seconds"].nan_to_num(0.0).max())
    return ReshapeResult(res.token_weights, base, res.advantages, attributed, att.importance.double(), metrics)
