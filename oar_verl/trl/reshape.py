"""OAR on TRL's generation batch: padded prompt/completion tensors -> the core's attribute + reshape -> (B, T) advantages.

TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` returns, per process, ``prompt_ids`` / ``prompt_mask``
(B, P) left-padded, ``completion_ids`` / ``completion_mask`` (B, C) right-padded (the mask a prefix: the tokens up to
and with the EOS; all 0 for a truncated completion under ``mask_truncated_completions``), an optional ``tool_mask``
(B, C) (0 on tool-result tokens: TRL's ``tools`` loop, a ``rollout_func``'s ``env_mask``) and ``advantages`` (B,):
GRPO's group-normalised rewards. :func:`reshape_batch` attributes the rows with a non-zero advantage on the policy and
returns (B, C) advantages ``w_t * A`` over the completion tokens (Σw = R over each row's reasoning tokens: each row's
advantage mass kept; rows with zero advantage, or nothing to attribute, keep A on every token), which
``_compute_loss`` consumes as they are.

Tool outputs inside a completion are context (docs/multi_turn.md): they stay in every pass's input, but the core is
given the model's own tokens (``completion_mask`` x ``tool_mask``) as ``model_masks``, as verl's ``response_mask`` and
OpenRLHF's ``action_mask`` are, so they are never scored, replaced, reshaped or searched for the answer, and their
advantage is TRL's (0: its loss masks them).

This module imports no TRL (the tests compare it with the core on the very rows the trainer reshapes). Every process
calls :func:`reshape_batch` together: under FSDP and DeepSpeed ZeRO-3 every forward gathers parameters collectively,
so the ranks agree on whether anyone attributes, a rank with nothing of its own runs one of its rows as filler (its
result discarded), and the passes are aligned over the ranks (the OpenRLHF adapter's scheme).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar_verl.core.backends.collectives import gather_objects, max_over_ranks
from oar_verl.core.backends.memory import fixed_recompute
from oar_verl.core.config import OARConfig
from oar_verl.core.methods.attribution import module_backend, pass_limits
from oar_verl.core.pipeline import RowAttribution, attribute, reshape, token_advantages
from oar_verl.core.preprocess import PreparedAttribution
from oar_verl.core.reshaping.reshape import Reshaped, attribution_rows

__all__ = ["BatchRows", "TRLReshaped", "batch_rows", "reduce_metrics", "reshape_batch", "rows_to_run"]


@dataclass(frozen=True)
class BatchRows:
    """TRL's padded batch as the core's rows.

    Attributes:
        prompts: B unpadded 1-D prompt ids (on the CPU).
        responses: B 1-D completion ids, the ``completion_mask`` prefix (empty for a masked-out completion).
        response_mask: (B, C) bool the responses' tokens, right-aligned with ``completion_ids``.
        loss_mask: (B, C) bool the tokens that carry an advantage, the model's own (``completion_mask`` x
            ``tool_mask``, inside the response); the response's other tokens are context (tool outputs).
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    response_mask: torch.Tensor
    loss_mask: torch.Tensor

    def model_masks(self, idx: list[int]) -> list[torch.Tensor]:
        """The 1-D model-token masks of rows ``idx`` over their responses (the core's ``model_masks``)."""
        return [self.loss_mask[i, :len(self.responses[i])] for i in idx]


def batch_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
               completion_mask: torch.Tensor, tool_mask: torch.Tensor | None = None) -> BatchRows:
    """The (prompt, response) rows of TRL's padded batch (shapes: the module docstring)."""
    width = completion_ids.shape[1]
    cols = torch.arange(width, device=completion_mask.device)
    # the response: up to the last masked-in completion token (the mask is a prefix; tool tokens in between stay)
    lengths = torch.where(completion_mask.bool(), cols + 1, 0).amax(-1).cpu() if width else \
        torch.zeros(completion_ids.shape[0], dtype=torch.long)
    response_mask = torch.arange(width)[None, :] < lengths[:, None]
    loss = completion_mask.bool() if tool_mask is None else completion_mask.bool() & tool_mask.bool()
    p_ids, p_mask, c_ids = prompt_ids.cpu(), prompt_mask.bool().cpu(), completion_ids.cpu()
    prompts = [p_ids[i][p_mask[i]] for i in range(p_ids.shape[0])]  # per row: unpadded rows of different lengths
    responses = [c_ids[i, :n] for i, n in enumerate(lengths.tolist())]
    return BatchRows(prompts, responses, response_mask, loss.cpu() & response_mask)


def rows_to_run(rows: BatchRows, sel: torch.Tensor, has_tokens: torch.Tensor, completion_ids: torch.Tensor
                ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The rows this process attributes, as (indices, responses, model masks): ``sel`` (n,) long, or on a process
    with none of its own (others have some: the passes are collective) a filler row, its result discarded: the first
    with a model token, else row 0 (its first completion id if its response is empty, as the model's token)."""
    run = sel if len(sel) else has_tokens.nonzero().flatten()[:1]
    if not len(run):  # no model token at all on this process: a prompt-only filler row
        run = torch.zeros(1, dtype=torch.long)
    idx = run.tolist()
    responses = [rows.responses[i] if len(rows.responses[i]) else completion_ids[i, :1].cpu() for i in idx]
    masks = [m if len(m) else torch.ones(1, dtype=torch.bool) for m in rows.model_masks(idx)]
    return idx, responses, masks


@dataclass(frozen=True)
class TRLReshaped:
    """What :func:`reshape_batch` did on this process.

    Attributes:
        advantages: (B, C) float32 on the batch's device: ``w_t * A`` on the loss tokens, 0 elsewhere.
        reshaped: the core's :class:`Reshaped` (B, C) (weights, base advantages, this process's metrics).
        attribution: the :class:`RowAttribution` (B, C) (importance, masks; rows not attributed: zeros).
        metrics: ``oar/*`` of every process's rows (:func:`reduce_metrics`).
        model_mask: (B, C) bool the model's own completion tokens (:attr:`BatchRows.loss_mask`); the attribution's
            ``response_mask`` minus it is the context (tool outputs): the dump's ``valid`` / ``response_mask`` pair.
    """

    advantages: torch.Tensor
    reshaped: Reshaped
    attribution: RowAttribution
    metrics: dict[str, float]
    model_mask: torch.Tensor


_SUMS = ("adv_mass_before", "adv_mass_after", "reshaped_tokens")
_PER_ROW = ("reshaped_seq_frac", "attributed_seq_frac", "fallback_seq_frac", "flat_seq_frac", "no_reasoning_seq_frac",
            "global_step")
_PER_ATTRIBUTED = ("span_found_frac", "answer_probe_frac")
_EXTREMES = {"weight_min": min, "weight_max": max}


def reduce_metrics(metrics: dict[str, float], counts: dict[str, float], prefix: str = "oar/") -> dict[str, float]:
    """``oar/*`` of every process's rows from each process's (every process calls it together): masses and token
    counts summed, fractions weighted by the rows they are fractions of, weight statistics by reshaped rows, min/max
    over the processes that reshaped a row.

    Args:
        metrics: this process's :meth:`Reshaped.metrics` (the same keys on every process).
        counts: this process's ``rows``, ``attributed`` and ``reshaped`` row counts.
    """
    parts = gather_objects((metrics, counts))
    if len(parts) == 1:
        return dict(metrics)
    out = {}
    for key in metrics:
        name = key[len(prefix):]
        if name in _SUMS:
            out[key] = sum(m[key] for m, _ in parts)
        elif name in _EXTREMES:
            vals = [m[key] for m, c in parts if c["reshaped"] > 0]
            out[key] = _EXTREMES[name](vals) if vals else 0.0
        else:
            weight = "rows" if name in _PER_ROW else "attributed" if name in _PER_ATTRIBUTED else "reshaped"
            total = sum(c[weight] for _, c in parts)
            out[key] = sum(m[key] * c[weight] for m, c in parts) / total if total > 0 else metrics[key]
    mass = out.get(prefix + "adv_mass_before", 0.0)
    if prefix + "adv_mass_rel_err" in out:
        out[prefix + "adv_mass_rel_err"] = abs(out[prefix + "adv_mass_after"] - mass) / mass if mass > 0 else 0.0
    return out


def reshape_batch(model: torch.nn.Module, tokenizer, cfg: OARConfig, step: int, *, prompt_ids: torch.Tensor,
                  prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                  advantages: torch.Tensor, tool_mask: torch.Tensor | None = None, max_tokens: int | None = None,
                  checkpointing: bool = False) -> TRLReshaped:
    """Attribute this process's rows with a non-zero advantage on ``model`` and reshape TRL's advantages.

    Args:
        model: the policy's causal LM (plain, DDP's module, FSDP2-sharded, DeepSpeed's module, a PEFT model); put in
            eval mode for the passes and restored.
        tokenizer: the policy's tokenizer.
        cfg: OARConfig. step: the training step (probe schedule, OAR-G noise seeds).
        prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask: TRL's batch (the module docstring).
        advantages: (B,) TRL's advantages of these rows (or (B, C) per token).
        max_tokens: one pass's token budget (``cfg.max_token_len_per_gpu`` wins; None: the longest row).
        checkpointing: the policy's gradient checkpointing (``cfg.recompute=auto`` follows it).

    Returns:
        TRLReshaped.
    """
    device = completion_ids.device
    rows = batch_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, tool_mask)
    base = token_advantages(advantages.detach().float().cpu(), rows.loss_mask)
    has_tokens = rows.loss_mask.any(-1)
    wanted = attribution_rows(base, rows.loss_mask, cfg, has_tokens)
    sel = wanted.nonzero().flatten()
    att = RowAttribution.unattributed(rows.response_mask)
    align = (lambda n: max_over_ranks(n, device))
    if max_over_ranks(len(sel), device) > 0:  # every process takes part as soon as one has a row to attribute
        idx, responses, masks = rows_to_run(rows, sel, has_tokens, completion_ids)

        def backend(prepared: PreparedAttribution):
            longest = max_over_ranks(prepared.longest, device)
            return module_backend(model, cfg, limits=pass_limits(cfg, max(max_tokens or 0, longest) or None),
                                  checkpointing=fixed_recompute(cfg.recompute, checkpointing), align=align,
                                  pad_id=tokenizer.pad_token_id or 0)

        was_training = model.training
        model.eval()  # eval numerics (no dropout) for the attribution passes
        try:
            # the model's own tokens only: tool outputs stay context (docs/multi_turn.md)
            ran = attribute(backend, [rows.prompts[i] for i in idx], responses, tokenizer, cfg, step, device=device,
                            model_masks=masks)
        finally:
            model.train(was_training)
        if len(sel):
            att = ran.placed(sel, rows.response_mask)
    res = reshape(base, att, cfg, response_mask=rows.loss_mask)
    metrics = res.metrics()
    metrics["oar/attributed_seq_frac"] = float(att.attributed.float().mean()) if len(sel) else 0.0
    metrics["oar/global_step"] = float(step)
    counts = {"rows": float(len(rows.prompts)), "attributed": float(att.attributed.sum()),
              "reshaped": float(res.token_weights.reshaped.any(-1).sum())}
    out = res.advantages.to(device=device, dtype=torch.float32)
    return TRLReshaped(out, res, att, reduce_metrics(metrics, counts), rows.loss_mask)
