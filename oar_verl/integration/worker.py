"""Token attribution inside verl's actor workers, through the worker's own engine.

:class:`TokenImportanceMixin` adds one RPC, ``compute_token_importance``, dispatched over the actor mesh exactly
like ``compute_log_prob``, to verl's actor worker (:class:`OARActorRolloutRefWorker`) and to the detachable actor
worker of verl's ``separate_async`` trainer (:class:`OARDetachActorWorker`). Each data-parallel rank unpacks its
shard into token rows, attributes them with the core's one way in (:func:`oar_verl.core.pipeline.attribute`) on
the engine's (sharded) module under ``engine.eval_mode()`` (parameters loaded as the engine does, offloaded again
after), and returns response-aligned nested tensors that the TransferQueue bridge stores under
the batch keys (V1) or that the legacy trainer reads back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.workers.engine_workers import ActorRolloutRefWorker

from oar_verl.core.auto.measure import measure_candidates
from oar_verl.core.checks.startup import require_resolved
from oar_verl.core.config import OARConfig
from oar_verl.core.fidelity.summary import default_min_gap
from oar_verl.core.fidelity.step import due
from oar_verl.core.backends.shared import SharedTeacher, Stopwatch
from oar_verl.core.methods.attribution import run_attribution
from oar_verl.core.methods.contract import AttributionResult
from oar_verl.core.pipeline import RowAttribution, attribute, row_attribution
from oar_verl.core.batch.layout import last_index
from oar_verl.core.preprocess import PreparedAttribution, prepare_attribution
from oar_verl.integration.actor_budget import actor_token_budget
from oar_verl.integration.backends import ENGINE_BACKENDS
from oar_verl.core.backends.collectives import from_source, max_over_ranks
from oar_verl.integration.fields import (ATTRIBUTE_FIELD, AUTO_CONTROLS, AUTO_FIELDS, AUTO_KEY, AUTO_SLOTS, CONFIG_KEY,
                                         FIDELITY_FIELDS, GROUND_TRUTH_KEY, ROW_FIELD, SECONDS_FIELD, SHARED_KEY,
                                         STEP_KEY)

logger = logging.getLogger("oar_verl")

def unpack_rows(data: TensorDict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-row prompt and response token ids (unpadded) from verl's nested (V1) or padded (legacy) layout."""
    responses, prompts = data["responses"], data["prompts"]
    if responses.is_nested:
        return list(prompts.unbind()), list(responses.unbind())
    attn = data["attention_mask"].bool()
    P = prompts.shape[1]
    p_rows = [p[m] for p, m in zip(prompts, attn[:, :P])]
    r_rows = [r[m] for r, m in zip(responses, attn[:, P:])]
    return p_rows, r_rows


def unpack_model_masks(data: TensorDict) -> list[torch.Tensor] | None:
    """Per-row 1-D 0/1 masks of the model's own response tokens, aligned with :func:`unpack_rows`' responses: verl's
    ``response_mask``, 0 on the tool outputs and user turns its agent loop interleaves (``multi_turn.enable``;
    docs/multi_turn.md); None when the batch carries no response mask (every response token is then the model's)."""
    if "response_mask" not in data.keys():
        return None
    mask, responses = data["response_mask"], data["responses"]
    if mask.is_nested:
        return list(mask.unbind())
    if responses.is_nested:  # per row, not per token
        return [m[:len(r)] for m, r in zip(mask, responses.unbind())]
    attn = data["attention_mask"].bool()
    P = data["prompts"].shape[1]
    return [m[a] for m, a in zip(mask, attn[:, P:])]  # per row, not per token


def response_lengths(data: TensorDict) -> list[int]:
    """Tokens of each row's response, the tool outputs of a multi-turn row included (not ``response_mask.sum``, which
    leaves them out)."""
    responses = data["responses"]
    if responses.is_nested:
        return [int(n) for n in responses.offsets().diff().tolist()]
    P = data["prompts"].shape[1]
    return data["attention_mask"][:, P:].bool().sum(-1).tolist()


def ground_truths(data: TensorDict) -> list | None:
    """Per-row ground-truth answers: an explicit ``oar_ground_truth`` list, else verl's ``reward_model.ground_truth``
    (stored with every sample by verl's RL dataset); None when the batch has neither."""
    truths = tu.get(data, GROUND_TRUTH_KEY)
    if truths is None:
        reward_model = tu.get(data, "reward_model")
        if reward_model is not None:
            truths = [(rm or {}).get("ground_truth") for rm in reward_model]
    return None if truths is None else list(truths)


# verl's old-log-prob entropies in the batch: the V1 trainers' TransferQueue field, and the legacy trainer's key
# (which OAR's legacy adapter hands over with the rows: verl drops it from the batch before the advantage step)
ENTROPY_KEYS = ("entropy", "entropys")


def response_entropies(data: TensorDict) -> list[torch.Tensor] | None:
    """Per-row 1-D policy entropies over each response's tokens from the old-log-prob pass (nested, or padded and cut
    to each row's response length), or None when the batch carries none (rollout-correction bypass mode computes no
    old log-probs: the entropy control is then skipped, not faked)."""
    for key in ENTROPY_KEYS:
        values = tu.get(data, key)
        if values is None:
            continue
        if values.is_nested:
            return list(values.unbind())
        # each row's response tokens, tool outputs included (multi-turn rows: response_mask is 0 on them)
        if "attention_mask" in data.keys() and "prompts" in data.keys():
            lengths = response_lengths(data)
        elif "response_mask" in data.keys():  # to the last token the mask holds (sum: not past a tool output)
            mask = data["response_mask"].bool()
            lengths = torch.where(mask.any(-1), last_index(mask, 0) + 1, 0).tolist()
        else:
            lengths = [values.shape[1]] * values.shape[0]
        return [v[:int(n)] for v, n in zip(values, lengths)]  # per row, not per token
    return None


def _first_module(engine) -> torch.nn.Module:
    """The engine's module (Megatron's: the first of its virtual pipeline chunks)."""
    return engine.module[0] if isinstance(engine.module, (list, tuple)) else engine.module


def pass_entropies(out: TensorDict | None, responses: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Per-row 1-D policy entropies over each response's tokens from this rank's old-log-prob output (nested over
    prompt + response; the entropy of token j is read at position j - 1, as verl slices its log-probs), or None when
    the pass computed none."""
    if out is None or "entropy" not in out.keys():
        return None
    rows = out["entropy"].unbind()
    return [e[len(e) - len(r) - 1:len(e) - 1] for e, r in zip(rows, responses)]  # per row, not per token


def group_entropies(kind, engine, out: TensorDict | None, responses: list[torch.Tensor],
                    device: torch.device) -> list[torch.Tensor] | None:
    """:func:`pass_entropies` of the old-log-prob output ``out``, the same on every rank of the engine's model-parallel
    group (``kind``: its ``ENGINE_BACKENDS`` entry, whose ``output_group`` names it): verl hands the output to one rank
    of the group only (the others get None), so that rank's are shared with the others, or None on every rank when it
    has none. Every rank of the group calls it together (one all-reduce of the rows' response tokens)."""
    group = kind.output_group(engine)
    mine = pass_entropies(out, responses)
    if group is None:
        return mine
    lengths = [len(r) for r in responses]
    flat = None
    if mine is not None:
        flat = torch.cat([e.reshape(-1).cpu() for e in mine]) if mine else torch.zeros(0)
    shared = from_source(flat, sum(lengths), source=bool(engine.is_mp_src_rank_with_outputs()), group=group,
                         device=device)
    return None if shared is None else list(shared.split(lengths))


def pass_tokens(data: TensorDict, engine_config, longest: int) -> int:
    """The most tokens one micro-batch of verl's ``compute_log_prob`` call over ``data`` holds: its
    ``max_token_len_per_gpu`` with dynamic batch sizes, else its micro-batch size × ``longest`` (the call's own
    options, else the engine's log-prob settings, as verl's ``TrainingWorker.infer_batch`` reads them)."""
    if tu.get(data, "use_dynamic_bsz", default=engine_config.use_dynamic_bsz):
        tokens = tu.get(data, "max_token_len_per_gpu", default=engine_config.infer_max_token_len_per_gpu)
        if tokens:
            return int(tokens)
    rows = tu.get(data, "micro_batch_size_per_gpu", default=engine_config.infer_micro_batch_size_per_gpu)
    return max(1, int(rows or 1)) * max(1, int(longest))


@functools.lru_cache(maxsize=8)
def _config(serialised: str) -> OARConfig:
    """The OARConfig of a JSON-serialised mapping, validated once per distinct configuration (not every step)."""
    return OARConfig.from_mapping(json.loads(serialised))


def _nested(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The jagged (B, T_i) rows of a right-padded (B, T) tensor, T_i = ``lengths[i]``."""
    return torch.nested.as_nested_tensor([padded[i, :n] for i, n in enumerate(lengths)], layout=torch.jagged)


def params_fingerprint(engine) -> float:
    """A number that changes when the engine's weights change: the sum of this rank's shard of its first and last
    parameters, in float64 (policy consistency: attribution must see the weights of the old-log-prob pass)."""
    modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
    params = [p for m in modules for p in m.parameters()]
    if not params:
        return 0.0
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in (params[0], params[-1])]
    return float(sum(t.detach().double().sum() for t in local))


def auto_fields(measured: dict | None, candidates, rows: int) -> dict[str, torch.Tensor]:
    """The ``oar_auto_*`` fields (:data:`~oar_verl.integration.fields.AUTO_FIELDS`, (rows,) float64 each) of a
    :func:`~oar_verl.core.auto.measure.measure_candidates` result for ``candidates`` in slot order; all NaN when
    nothing was measured (not a calibration step)."""
    out = {f"oar_auto_{k}": torch.full((rows,), float("nan"), dtype=torch.float64) for k in AUTO_FIELDS}
    if measured is None:
        return out
    for i, name in enumerate(candidates[:AUTO_SLOTS]):
        out[f"oar_auto_aopc_c{i}"] = measured["aopc"][name].double().cpu()
        out[f"oar_auto_spt_c{i}"][:] = float(measured["seconds_per_token"][name])
    for k in AUTO_CONTROLS:
        if k in measured["aopc"]:  # entropy: only where the batch had the old-log-prob entropies
            out[f"oar_auto_aopc_{k}"] = measured["aopc"][k].double().cpu()
    out["oar_auto_static"] = measured["static"].double().cpu()
    out["oar_auto_tokens"][:] = float(measured["tokens"])
    return out


class TokenImportanceMixin:
    """The ``compute_token_importance`` RPC for a verl actor worker (mixed in before the worker class), and a record of
    the weights its last ``compute_log_prob`` ran with."""

    _oar_log_prob_fingerprint: float | None = None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """verl's ``compute_log_prob`` after noting the weights it runs with; with ``oar_shared_forward`` among the
        call's options (:data:`~oar_verl.integration.fields.SHARED_KEY`: the step's ``oar_config`` and
        ``oar_global_step``), the same log-probs plus the ``compute_token_importance`` fields of every row, read from
        the same forward where the engine allows it (:mod:`oar_verl.integration.shared_pass`), else attributed right
        after it in this call. The attribution work of the call (not verl's pass) is timed as it runs
        (:data:`~oar_verl.integration.fields.SECONDS_FIELD`)."""
        self._oar_log_prob_fingerprint = params_fingerprint(self.actor.engine)
        options = tu.get(data, SHARED_KEY)
        if options is None:
            return super().compute_log_prob(data)
        clock = Stopwatch()  # this call's attribution work, segment by segment
        with clock():
            cfg = require_resolved(_config(json.dumps(options[CONFIG_KEY], sort_keys=True)))
            step = int(options[STEP_KEY])
            packed = tu.get(data, "use_remove_padding",
                            default=self.actor.model_config.get("use_remove_padding", False))
            reason = self._shared_pass_error(data, cfg, bool(packed))
        if reason is not None:
            _log_once(f"oar: attribution runs after the old-log-prob pass, not inside it: {reason}")
            out = super().compute_log_prob(data)
            with clock():
                # a fidelity step measures with the pass's entropies, as the shared path does (every rank the same)
                entropies = None
                if due(cfg, step):
                    kind = ENGINE_BACKENDS.get(self.actor.engine_config.strategy)
                    entropies = group_entropies(kind, self.actor.engine, out, unpack_rows(data)[1],
                                                kind.device(self.actor.engine))
                fields = self._importance(data, cfg, step, auto=None, entropies=entropies)
            return _merged(out, _timed(fields, clock.seconds))
        return self._shared_log_prob(data, cfg, step, bool(packed), clock)

    def _shared_pass_error(self, data: TensorDict, cfg: OARConfig, packed: bool) -> str | None:
        """Why this engine's old-log-prob pass cannot carry ``cfg``'s method (then attribution runs right after it),
        or None; the same answer on every rank."""
        ec = self.actor.engine_config
        kind = ENGINE_BACKENDS.get(ec.strategy)
        fused = tu.get(data, "use_fused_kernels", default=ec.use_fused_kernels)
        prompts, responses = unpack_rows(data)
        longest = max_over_ranks(max((len(p) + len(r) for p, r in zip(prompts, responses)), default=1),
                                 kind.device(self.actor.engine))
        return kind.shared_error(self.actor.engine, cfg, fused_kernels=bool(fused), packed=packed,
                                 tokens=(pass_tokens(data, ec, longest), actor_token_budget(cfg, ec, longest)))

    def _shared_log_prob(self, data: TensorDict, cfg: OARConfig, step: int, packed: bool,
                         clock: Stopwatch) -> TensorDict | None:
        """The old-log-prob pass with ``cfg.mode`` read from each micro-batch's forward (``packed``: verl's
        remove-padding layout); ``clock`` times the attribution work around the pass, the reader its own inside it."""
        engine = self.actor.engine
        kind = ENGINE_BACKENDS.get(self.actor.engine_config.strategy)
        device = kind.device(engine)
        with clock():
            prompts, responses = unpack_rows(data)
            tokenizer = self.actor.model_config.tokenizer
            # the model's own rows (never target=reference: core shared_mode), which verl's pass holds
            prepared = prepare_attribution(prompts, responses, tokenizer, cfg, step, device=device,
                                           model_masks=unpack_model_masks(data))
            data[ROW_FIELD] = torch.arange(len(responses))
            fingerprint = self._oar_log_prob_fingerprint  # noted by compute_log_prob: the weights of this very pass
            longest = max_over_ranks(prepared.longest, device)
            tokens = actor_token_budget(cfg, self.actor.engine_config, longest)
            recompute = kind.recompute(engine, cfg, tokens, checkpointing=self._oar_checkpointing(), shared=True)
        with kind.shared_pass(engine, cfg, prepared, recompute, packed) as made:
            out = super().compute_log_prob(data)
        if not made:
            raise RuntimeError("oar: verl's old-log-prob pass ran no micro-batch on this rank")
        shared = made[0]
        with clock():
            att, recomputed, fidelity = self._after_pass(data, cfg, step, prepared, shared, out, tokens, recompute,
                                                         kind)
        if out is None:
            return None
        # the reader's own seconds inside the pass (its backwards, OAR-G's probe reads; Megatron's reader has none:
        # its backward runs in megatron-core's schedule, with the forward)
        seconds = clock.seconds + float(getattr(shared, "seconds", 0.0))
        return _merged(out, importance_output(att, cfg, step, fingerprint, fingerprint, recomputed, fidelity=fidelity,
                                              shared=True, seconds=seconds))

    def _after_pass(self, data: TensorDict, cfg: OARConfig, step: int, prepared: PreparedAttribution, shared,
                    out: TensorDict | None, tokens: int, recompute, kind
                    ) -> tuple[RowAttribution, float, dict | None]:
        """What the shared path does right after the old-log-prob pass ``out`` (verl's output, None on ranks without
        outputs): the rank's attribution (read from the pass by ``shared``, or OAR-G's noisy passes with the teachers
        read from it), the share of its backwards that recomputed, and the step's fidelity when due (else None)."""
        engine = self.actor.engine
        device = kind.device(engine)
        tokenizer = self.actor.model_config.tokenizer
        responses = unpack_rows(data)[1]

        def make_backend():
            return kind.make(engine, cfg, tokens, pad_id=tokenizer.pad_token_id or 0, checkpointing=recompute,
                             align=lambda n: max_over_ranks(n, device))

        rows = None  # the shard's rows the attribution's batch holds (None: all)
        if isinstance(shared, SharedTeacher):  # OAR-G: its clean teachers from the pass, its noisy passes now
            att, rows = self._after_teachers(data, cfg, step, prepared, shared, make_backend(), kind)
            choices = getattr(att.backend, "recomputed", None) or []
            recomputed = sum(choices) / len(choices) if choices else float("nan")
        else:
            att = row_attribution(prepared, AttributionResult(shared.result(), len(shared.choices)))
            recomputed = sum(c for _, c in shared.choices) / max(len(shared.choices), 1)
        fidelity = None
        if due(cfg, step):  # the step's fidelity on the method's backend, every rank alike, the weights unchanged
            if att.backend is None:
                att = dataclasses.replace(att, backend=make_backend())
            # the pass's entropies (the entropy control), on every rank of a model-parallel group alike
            entropies = group_entropies(kind, engine, out, responses, device)
            if entropies is not None and rows is not None:
                entropies = [entropies[i] for i in rows.tolist()]
            with engine.eval_mode():
                kind.eval_numerics(engine)
                fidelity = att.fidelity(cfg, step, min_gap=default_min_gap(_first_module(engine)),
                                        entropies=entropies)
            if rows is not None:  # measured on the attributed rows: placed among the shard's
                fidelity = {k: torch.full((len(responses),), float("nan"), dtype=v.dtype).index_copy(0, rows, v)
                            for k, v in fidelity.items()}
        return att, recomputed, fidelity

    def _after_teachers(self, data: TensorDict, cfg: OARConfig, step: int, prepared: PreparedAttribution,
                        shared: SharedTeacher, backend, kind) -> tuple[RowAttribution, torch.Tensor | None]:
        """OAR-G's noisy passes right after the old-log-prob pass, with the clean teachers read from it, on the rows
        the trainer marked (:data:`~oar_verl.integration.fields.ATTRIBUTE_FIELD`: the rows the step reads; absent:
        every row). A rank with none marked attributes its first row, so that every rank runs the same passes.
        ``backend`` runs them on the engine of ``kind`` (its ``ENGINE_BACKENDS`` entry). Returns the shard's
        attribution and the rows its batch holds (None: all)."""
        flags = tu.get(data, ATTRIBUTE_FIELD)
        B = prepared.response_mask.shape[0]
        marked = torch.arange(B) if flags is None else torch.as_tensor(flags).flatten().cpu().bool().nonzero().flatten()
        rows = marked if marked.numel() or B == 0 else torch.zeros(1, dtype=torch.long)
        if rows.numel() == B:
            sub = prepared
        else:
            prompts, responses = unpack_rows(data)
            masks = unpack_model_masks(data)
            sub = prepare_attribution([prompts[i] for i in rows.tolist()], [responses[i] for i in rows.tolist()],
                                      self.actor.model_config.tokenizer, cfg, step,
                                      device=prepared.batch.input_ids.device,
                                      model_masks=None if masks is None else [masks[i] for i in rows.tolist()])
        engine = self.actor.engine
        with engine.eval_mode():
            kind.eval_numerics(engine)
            result = run_attribution(backend, sub.batch, cfg, mask_token_id=sub.mask_token_id, seeds=sub.seeds,
                                     teachers=shared.teachers(None if sub is prepared else rows))
        att = row_attribution(sub, result, backend)
        return (att, None) if sub is prepared else (att.placed(rows, prepared.response_mask.cpu()), rows)

    def _oar_checkpointing(self) -> bool:
        """The actor's own gradient checkpointing (attribution's backwards recompute alike unless told otherwise)."""
        return bool(getattr(self.actor.model_config, "enable_gradient_checkpointing", False))

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Response-aligned OAR importance of this rank's shard.

        Non-tensor entries read: ``oar_config`` (dict of OARConfig values), ``oar_global_step`` (int) and, with
        ``target=reference``, the ground truths (see :func:`ground_truths`).

        Returns (on the engine's output-collecting ranks, None elsewhere):
            TensorDict of batch size B: nested (B, T_i) ``token_importance`` float32, ``oar_reasoning_mask`` and
            ``oar_answer_mask`` float 0/1; (B,) ``oar_span_found`` and ``oar_answer_probe`` float 0/1, and
            ``oar_passes``: the passes this rank needed (before padding to the slowest rank),
            ``oar_copies`` / ``oar_refined``: OAR-P's masked copies and reasoning tokens scored at token level per
            row (-1 for OAR-G),
            ``oar_params_fingerprint`` / ``oar_log_prob_params_fingerprint``: :func:`params_fingerprint` now and at
            the last ``compute_log_prob`` (NaN if none ran since the last attribution),
            ``oar_fidelity_*`` (:data:`~oar_verl.integration.fields.FIDELITY_FIELDS`): the step's fidelity per
            measured row, NaN elsewhere and on steps not due (``fidelity_every``),
            ``oar_auto_*`` (:data:`~oar_verl.integration.fields.AUTO_FIELDS`): with ``oar_auto`` = {"candidates":
            [...]} (a ``mode=auto`` calibration step), every candidate scored on the first ``fidelity_rows`` rows
            (:func:`auto_fields`), NaN otherwise. ``oar_config`` never has ``mode=auto`` (the driver resolves it).
        """
        cfg = require_resolved(_config(json.dumps(tu.get(data, CONFIG_KEY), sort_keys=True)))  # never mode=auto
        auto = tu.get(data, AUTO_KEY)  # a mode=auto calibration step: {"candidates": [...]}; else None
        step = int(tu.get(data, STEP_KEY, default=0))
        return self._importance(data, cfg, step, auto)

    def _importance(self, data: TensorDict, cfg: OARConfig, step: int, auto: dict | None,
                    entropies: list[torch.Tensor] | None = None) -> TensorDict | None:
        """The body of ``compute_token_importance``: the configured method's own passes on this rank's rows.
        ``entropies``: the old-log-prob pass's (:func:`group_entropies`, right after the pass), else the batch's
        (:func:`response_entropies`: verl dispatches the same shard to every rank of a model-parallel group)."""
        engine = self.actor.engine
        kind = ENGINE_BACKENDS.get(self.actor.engine_config.strategy)
        fingerprint = params_fingerprint(engine)
        log_prob_fingerprint, self._oar_log_prob_fingerprint = self._oar_log_prob_fingerprint, None  # consumed once
        device = kind.device(engine)
        prompts, responses = unpack_rows(data)
        masks = unpack_model_masks(data)
        truths = ground_truths(data) if cfg.target == "reference" else None
        tokenizer = self.actor.model_config.tokenizer

        def backend_for(c: OARConfig, prepared: PreparedAttribution):
            # the actor's own token budget; the longest sequence of any rank, so that every rank packs by the same one
            longest = max_over_ranks(prepared.longest, device)
            tokens = actor_token_budget(c, self.actor.engine_config, longest)
            return kind.make(engine, c, tokens, pad_id=tokenizer.pad_token_id or 0,
                             checkpointing=kind.recompute(engine, c, tokens, checkpointing=self._oar_checkpointing()),
                             align=lambda n: max_over_ranks(n, device))

        def backend(prepared: PreparedAttribution):
            return backend_for(cfg, prepared)

        with engine.eval_mode():
            kind.eval_numerics(engine)
            att = attribute(backend, prompts, responses, tokenizer, cfg, step, ground_truths=truths, device=device,
                            model_masks=masks)
            # the step's fidelity, every rank alike (fillers align the pass counts); NaN when not due
            prepared = att.prepared
            gap = default_min_gap(_first_module(engine))
            if entropies is None and (due(cfg, step) or auto):
                entropies = response_entropies(data)
            fidelity = att.fidelity(cfg, step, min_gap=gap, entropies=entropies)
            candidates = list(auto["candidates"]) if auto else []
            measured = None if not auto else measure_candidates(
                prompts, responses, tokenizer, cfg, step, candidates, backend_for,
                has_reasoning=prepared.batch.reasoning_mask.bool().any(-1), ground_truths=truths, device=device,
                min_gap=gap, entropies=entropies, model_masks=masks)
        if not engine.is_mp_src_rank_with_outputs():
            return None
        choices = getattr(att.backend, "recomputed", None)
        recomputed = sum(choices) / len(choices) if choices else float("nan")
        return importance_output(att, cfg, step, fingerprint, log_prob_fingerprint, recomputed, fidelity=fidelity,
                                 measured=measured, candidates=candidates)


def importance_output(att, cfg: OARConfig, step: int, fingerprint: float, log_prob_fingerprint: float | None,
                      recomputed: float, *, fidelity: dict | None = None, measured: dict | None = None,
                      candidates=(), shared: bool = False, seconds: float = 0.0) -> TensorDict:
    """The :data:`~oar_verl.integration.fields.OUTPUT_FIELDS` of a rank's :class:`~oar_verl.core.pipeline.
    RowAttribution` (see ``compute_token_importance``); ``fidelity`` None: NaN (a step not due); ``seconds``: the
    rank's attribution seconds inside verl's old-log-prob call (:data:`~oar_verl.integration.fields.SECONDS_FIELD`;
    0: none ran there)."""
    lens = att.lengths
    B = len(lens)
    if fidelity is None:
        fidelity = {k: torch.full((B,), float("nan"), dtype=torch.float64) for k in FIDELITY_FIELDS}
    return TensorDict({
        "token_importance": _nested(att.importance, lens),
        "oar_reasoning_mask": _nested(att.reasoning_mask.float(), lens),
        "oar_answer_mask": _nested(att.answer_mask.float(), lens),
        "oar_span_found": att.span_found.float(),
        "oar_answer_probe": att.answer_probe.float(),
        "oar_passes": torch.full((B,), float(att.passes)),
        "oar_copies": torch.full((B,), -1.0) if att.copies is None else att.copies.float(),
        "oar_refined": torch.full((B,), -1.0) if att.refined is None else att.refined.float(),
        "oar_params_fingerprint": torch.full((B,), fingerprint, dtype=torch.float64),
        "oar_log_prob_params_fingerprint": torch.full((B,), float("nan") if log_prob_fingerprint is None
                                                      else log_prob_fingerprint, dtype=torch.float64),
        "oar_recomputed": torch.full((B,), float(recomputed)),
        "oar_shared": torch.full((B,), float(shared)),
        SECONDS_FIELD: torch.full((B,), float(seconds), dtype=torch.float64),
        **{f"oar_fidelity_{k}": fidelity[k] for k in FIDELITY_FIELDS},
        **auto_fields(measured, list(candidates), B),
    }, batch_size=[B]).cpu()


def _timed(fields: TensorDict | None, seconds: float) -> TensorDict | None:
    """``fields`` with :data:`~oar_verl.integration.fields.SECONDS_FIELD` set to ``seconds`` on every row (None
    stays None: a rank without outputs)."""
    if fields is not None:
        fields[SECONDS_FIELD] = torch.full((fields.batch_size[0],), float(seconds), dtype=torch.float64)
    return fields


def _merged(out: TensorDict | None, fields: TensorDict | None) -> TensorDict | None:
    """verl's log-prob output with the importance fields of the same rows added (None on ranks without outputs)."""
    if out is None or fields is None:
        return out
    for key in fields.keys():
        out[key] = fields[key]
    return out


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


class OARActorRolloutRefWorker(TokenImportanceMixin, ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker plus the ``compute_token_importance`` RPC."""


class OARDetachActorWorker(TokenImportanceMixin, DetachActorWorker):
    """verl's detachable actor worker (``separate_async``: weights saved to and restored from CPU) plus the RPC."""


# verl's actor worker classes and their OAR counterparts (named, importable classes: Ray pickles them by reference)
OAR_WORKERS = {ActorRolloutRefWorker: OARActorRolloutRefWorker, DetachActorWorker: OARDetachActorWorker}


def swap_actor_worker(role_worker_mapping: dict) -> None:
    """Give every actor role a trainer maps the OAR counterpart of the worker verl chose for it (the plain actor worker,
    or the detachable one of ``separate_async``); call after verl has made its own choice."""
    import ray
    from verl.trainer.ppo.utils import Role

    for role in (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor):
        if role not in role_worker_mapping:
            continue
        current = role_worker_mapping[role]
        cls = getattr(current, "__ray_actor_class__", current)
        if cls in OAR_WORKERS.values():
            continue
        if cls not in OAR_WORKERS:
            raise TypeError(f"oar: the trainer maps {role} to {cls.__name__}, which OAR has no attribution worker "
                            f"for (known: {', '.join(c.__name__ for c in OAR_WORKERS)})")
        role_worker_mapping[role] = ray.remote(OAR_WORKERS[cls])


def actor_dp_size(worker_group) -> int:
    """Data-parallel size of the actor mesh of a verl worker group (as verl's own batch balancing reads it)."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1
