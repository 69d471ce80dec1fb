"""The one way in: token rows → per-token importance (:func:`attribute`) → reshaped advantages (:func:`reshape`), or
both in one call (:func:`oar_advantages`), on a Hugging Face module or any attribution backend.

Every integration goes through it: the verl worker attributes its rank's rows on its engine's backend, the OpenRLHF
adapter on its DeepSpeed module, a core-only user (TRL, a hand-written loop) calls :func:`oar_advantages`. The steps
and their maths: docs/method.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from oar_verl.core.backends.base import AttributionBackend
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.controls import EntropySource, entropies_at, response_aligned
from oar_verl.core.fidelity.step import due, measured_rows, step_fidelity
from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.methods.contract import AttributionResult
from oar_verl.core.methods.mask_operator import mask_replacement
from oar_verl.core.preprocess import PreparedAttribution, prepare_attribution
from oar_verl.core.reshaping.reshape import Reshaped, attribution_rows, reshape_advantages

__all__ = ["RowAttribution", "attribute", "oar_advantages", "reshape", "row_attribution"]

# what attribute() runs on: a Hugging Face module, a backend, or a function of the prepared batch returning a backend
Runner = torch.nn.Module | AttributionBackend | Callable[[PreparedAttribution], AttributionBackend]


@dataclass(frozen=True)
class RowAttribution:
    """Token importance of B responses, response-aligned and right-padded to T columns, with the masks the reshaping
    reads and what ran. Tensors are on the CPU.

    Attributes:
        importance: (B, T) float32 raw importance, 0 off the reasoning tokens and on padding.
        reasoning_mask: (B, T) bool tokens to reshape (the reasoning before the answer marker).
        answer_mask: (B, T) bool answer-span tokens.
        response_mask: (B, T) bool valid response tokens.
        attributed: (B,) bool rows whose importance was computed (all of them, unless :meth:`placed`).
        span_found: (B,) bool an answer span was found in the response.
        answer_probe: (B,) bool the probe read answer tokens (the response's or, with ``target=reference``, the ground
            truth's) rather than LT-Logits.
        passes: the attribution passes this rank ran (before alignment with other ranks).
        copies: (B,) long OAR-P masked copies per row (-1 where not attributed); None for the gradient methods.
        refined: (B,) long reasoning tokens per row with a token-level OAR-P score (-1 where not attributed); None for
            the gradient methods.
        prepared: the attributed rows' inputs (full-sequence batch, seeds, mask token); None when nothing ran.
        result: their AttributionResult ((B', L) full-sequence importance); None when nothing ran.
        backend: the backend they ran on (follow-up passes on the same batch, e.g. the step's fidelity); None when
            nothing ran.
    """

    importance: torch.Tensor
    reasoning_mask: torch.Tensor
    answer_mask: torch.Tensor
    response_mask: torch.Tensor
    attributed: torch.Tensor
    span_found: torch.Tensor
    answer_probe: torch.Tensor
    passes: int = 0
    copies: torch.Tensor | None = None
    refined: torch.Tensor | None = None
    prepared: PreparedAttribution | None = None
    result: AttributionResult | None = None
    backend: AttributionBackend | None = None

    @property
    def lengths(self) -> list[int]:
        """Tokens of each response."""
        return self.response_mask.sum(-1).tolist()

    def fidelity(self, cfg: OARConfig, global_step: int, *, min_gap: float = 0.0,
                 entropies: EntropySource | None = None) -> dict[str, torch.Tensor]:
        """The step's in-step fidelity of this attribution (:func:`~oar_verl.core.fidelity.step.step_fidelity`) on
        the same backend and batch, under the run's own mask operator; NaN everywhere on a step not due.

        Args:
            cfg: the configuration it ran with. global_step: the training step. min_gap: the noise floor.
            entropies: per attributed row, 1-D policy entropies over its response tokens (the old-log-prob pass's),
                or a function of the measured rows' indices returning theirs (called on a due step only, once, with
                the filler row on a rank that measures none): the entropy control; None: skipped.
        """
        batch = self.prepared.batch
        on = due(cfg, global_step)
        replacement = (mask_replacement(self.backend, batch, cfg.mask, self.prepared.mask_token_id,
                                        self.prepared.seeds) if on else None)
        entropy = None
        if entropies is not None and on:
            B = batch.input_ids.shape[0]
            rows = measured_rows(batch.reasoning_mask.bool().any(-1).cpu(), cfg).tolist() or list(range(min(B, 1)))
            entropy = response_aligned(entropies_at(entropies, rows, B), batch)
        return step_fidelity(self.backend, batch, self.result.importance, cfg, global_step, replacement=replacement,
                             min_gap=min_gap, entropy=entropy)

    @classmethod
    def unattributed(cls, response_mask: torch.Tensor) -> RowAttribution:
        """No row attributed, for responses with ``response_mask`` (B, T): reshaping leaves every row alone."""
        mask = response_mask.bool().cpu()
        rows = [torch.zeros(mask.shape[0], dtype=torch.bool) for _ in range(3)]  # attributed, span_found, answer_probe
        return cls(torch.zeros(mask.shape), torch.zeros_like(mask), torch.zeros_like(mask), mask, *rows)

    def placed(self, rows: torch.Tensor, response_mask: torch.Tensor,
               into: RowAttribution | None = None) -> RowAttribution:
        """These rows at ``rows`` of a larger batch whose responses have ``response_mask`` (B, T >= this T); the
        batch's other rows are not attributed, or keep what ``into`` holds (several attributions of one batch, e.g.
        one per mode with ``mode=auto``, merged; the last one's passes, batch and backend are kept).

        Args:
            rows: (B',) long batch rows of this attribution's rows, in order (a repeated row: the last write wins).
            response_mask: (B, T) valid response tokens of the whole batch.
            into: an attribution of the same batch (its ``placed`` result) to write these rows into; not modified.
        """
        out = RowAttribution.unattributed(response_mask) if into is None else replace(
            into, **{k: getattr(into, k).clone() for k in ("importance", "reasoning_mask", "answer_mask",
                                                             "attributed", "span_found", "answer_probe")})
        width = self.importance.shape[1]
        if width > out.importance.shape[1]:
            raise ValueError(f"placed: these responses are {width} tokens wide, the batch's only "
                             f"{out.importance.shape[1]}")
        rows = rows.cpu().long()
        for big, small in ((out.importance, self.importance), (out.reasoning_mask, self.reasoning_mask),
                           (out.answer_mask, self.answer_mask)):
            big[rows, :width] = small
        for big, small in ((out.attributed, self.attributed), (out.span_found, self.span_found),
                           (out.answer_probe, self.answer_probe)):
            big[rows] = small
        counts = {}
        for name in ("copies", "refined"):
            small, big = getattr(self, name), getattr(out, name)
            if small is not None:
                counts[name] = (torch.full((out.attributed.shape[0],), -1, dtype=small.dtype) if big is None
                                else big.clone())
                counts[name][rows] = small
        return replace(out, passes=self.passes, prepared=self.prepared, result=self.result, backend=self.backend,
                       **counts)


def _backend(runner: Runner, prepared: PreparedAttribution, cfg: OARConfig) -> AttributionBackend:
    """The backend to run ``prepared`` on: a module's (:func:`module_backend`), the backend given, or the one a
    function of the prepared batch builds."""
    if isinstance(runner, torch.nn.Module):
        return module_backend(runner, cfg)
    if all(callable(getattr(runner, name, None)) for name in ("plan", "run", "align")):
        return runner
    if callable(runner):
        return runner(prepared)
    raise TypeError(f"attribute: {type(runner).__name__} is neither a Hugging Face module, an attribution backend "
                    "(oar_verl.core.backends.base.AttributionBackend) nor a function of the prepared batch returning "
                    "one")


def _device_of(runner: Runner) -> torch.device | None:
    """A module's first parameter's device; None otherwise."""
    if isinstance(runner, torch.nn.Module):
        return next((p.device for p in runner.parameters()), None)
    return None


def attribute(backend: Runner, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], tokenizer,
              cfg: OARConfig, step: int = 0, *, ground_truths: Sequence[str] | None = None,
              device: torch.device | str | None = None,
              model_masks: Sequence[torch.Tensor] | None = None) -> RowAttribution:
    """Per-token importance of B (prompt, response) token rows with the configured method.

    Args:
        backend: where the passes run: a Hugging Face causal LM in eval mode (run through :func:`module_backend`: a
            token budget, gradient checkpointing in backward passes), an attribution backend (FSDP, Ulysses,
            Megatron), or a function of the :class:`PreparedAttribution` returning one (to size the pass budget by
            the batch, as the verl worker and the OpenRLHF adapter do).
        prompts: B unpadded 1-D prompt id tensors.
        responses: B unpadded 1-D response id tensors.
        tokenizer: the policy's tokenizer (answer spans, pad and mask tokens, ground truths).
        cfg: OARConfig.
        step: the training step (``probe=auto``, OAR-G noise seeds).
        ground_truths: B answer strings, required with ``target=reference``.
        device: where the attribution batch goes (default: a module's device, else the CPU).
        model_masks: B 1-D 0/1 masks of the model's own tokens of multi-turn responses (0 on tool outputs and user
            turns; docs/multi_turn.md); None: every response token is the model's.

    Returns:
        RowAttribution (B, T), T the longest response.
    """
    device = _device_of(backend) if device is None else device
    prepared = prepare_attribution(prompts, responses, tokenizer, cfg, step, ground_truths=ground_truths,
                                   device=device, model_masks=model_masks)
    runner = _backend(backend, prepared, cfg)
    result = run_attribution(runner, prepared.batch, cfg, mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
    return row_attribution(prepared, result, runner)


def row_attribution(prepared: PreparedAttribution, result: AttributionResult,
                    backend: AttributionBackend | None = None) -> RowAttribution:
    """The :class:`RowAttribution` of every prepared row from a method's result (run by :func:`attribute`, or read
    from a shared forward: :mod:`oar_verl.core.backends.shared`, ``backend`` None)."""
    mask, spans = prepared.response_mask, prepared.spans
    return RowAttribution(
        prepared.padded_importance(result.importance), spans.reasoning_mask.bool() & mask,
        spans.answer_mask.bool() & mask, mask, torch.ones(mask.shape[0], dtype=torch.bool), spans.found.bool(),
        prepared.answer_probe.bool(), result.passes, None if result.copies is None else result.copies.cpu(),
        None if result.refined is None else result.refined.cpu(), prepared, result, backend)


def token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token advantages: ``advantages`` (B,) broadcast over each row's valid tokens (0 on padding), or
    ``advantages`` (B, T) as they are.

    Args:
        advantages: (B,) one advantage per response (outcome estimators), or (B, T) per token.
        response_mask: (B, T) valid response tokens.
    """
    if advantages.dim() == 2 and advantages.shape == response_mask.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == response_mask.shape[0]:
        return torch.where(response_mask.bool().to(advantages.device), advantages[:, None], 0.0)
    raise ValueError(f"advantages: shape {tuple(advantages.shape)}, expected ({response_mask.shape[0]},) or "
                     f"{tuple(response_mask.shape)} (the responses' (B, T))")


def reshape(base_advantages: torch.Tensor, attribution: RowAttribution, cfg: OARConfig, *,
            response_mask: torch.Tensor | None = None, base_returns: torch.Tensor | None = None) -> Reshaped:
    """Â_t = w_t · A_t: the base advantages reshaped by the gated importance (docs/method.md §5).

    Args:
        base_advantages: (B,) one advantage per response, or (B, T) per token.
        attribution: RowAttribution (B, T); rows it did not attribute keep their base advantage.
        cfg: OARConfig (tau, beta, floor, apply_to).
        response_mask: (B, T) tokens that carry an advantage (default: the responses' tokens; OpenRLHF: the generated
            ones, without tool output); only reasoning tokens among them are reshaped.
        base_returns: (B, T) the base returns, reshaped like the advantages when given.

    Returns:
        Reshaped (B, T), with the attributed rows' ``span_found`` / ``answer_probe`` for its metrics.
    """
    mask = attribution.response_mask if response_mask is None else response_mask
    base = token_advantages(base_advantages, mask)
    reasoning = attribution.reasoning_mask.to(mask.device) & mask.bool()
    out = reshape_advantages(base, attribution.importance, reasoning, mask, cfg, attributed=attribution.attributed,
                             base_returns=base_returns)
    done = attribution.attributed
    return replace(out, span_found=attribution.span_found[done], answer_probe=attribution.answer_probe[done])


def oar_advantages(model: Runner, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                   advantages: torch.Tensor, tokenizer, cfg: OARConfig, step: int = 0, *,
                   ground_truths: Sequence[str] | None = None, device: torch.device | str | None = None,
                   model_masks: Sequence[torch.Tensor] | None = None) -> Reshaped:
    """OAR's per-token advantages of B (prompt, response) rows from their base advantages, in one call: the rows
    that will be reshaped are attributed (:func:`attribute`), then every row is reshaped (:func:`reshape`).

    Args:
        model: a Hugging Face causal LM in eval mode, or what :func:`attribute` accepts.
        prompts: B unpadded 1-D prompt id tensors.
        responses: B unpadded 1-D response id tensors.
        advantages: (B,) base advantages (e.g. GRPO's group-normalised rewards), or (B, T) per token; rows with a zero
            advantage (or excluded by ``apply_to``) are not attributed and keep it.
        tokenizer, cfg, step, ground_truths, device, model_masks: as :func:`attribute` takes them (with
            ``model_masks`` the tool outputs and user turns of multi-turn rows keep their base advantage, bit for bit,
            and stay out of the mass: Σw = R over the model's reasoning tokens).

    Returns:
        Reshaped: ``advantages`` (B, T) Â = w · A on the responses' tokens (T the longest), ``token_weights``,
        ``metrics()``.
    """
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = int(lengths.max()) if len(lengths) else 0
    response_mask = torch.arange(width)[None, :] < lengths[:, None]
    base = token_advantages(advantages, response_mask)
    rows = attribution_rows(base, response_mask, cfg).nonzero().flatten().cpu()
    att = RowAttribution.unattributed(response_mask)
    if len(rows):
        idx = rows.tolist()
        truths = None if ground_truths is None else [ground_truths[i] for i in idx]
        masks = None if model_masks is None else [model_masks[i] for i in idx]
        att = attribute(model, [prompts[i] for i in idx], [responses[i] for i in idx], tokenizer, cfg, step,
                        ground_truths=truths, device=device, model_masks=masks).placed(rows, response_mask)
    return reshape(base, att, cfg)
