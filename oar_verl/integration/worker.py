"""Token attribution inside verl's actor workers, through the worker's own engine.

:class:`TokenImportanceMixin` adds one RPC, ``compute_token_importance``, dispatched over the actor mesh exactly
like ``compute_log_prob``, to verl's actor worker (:class:`OARActorRolloutRefWorker`) and to the detachable actor
worker of verl's ``separate_async`` trainer (:class:`OARDetachActorWorker`). Each data-parallel rank unpacks its
shard into token rows, prepares them with the core (:func:`oar_verl.core.preprocess.prepare_attribution`),
attributes them with the engine's (sharded) module under ``engine.eval_mode()`` (parameters loaded as the engine
does, offloaded again after), and returns response-aligned nested tensors that the TransferQueue bridge stores under
the batch keys (V1) or that the legacy trainer reads back.
"""

from __future__ import annotations

import functools
import json
import logging

import torch
from tensordict import TensorDict
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.workers.engine_workers import ActorRolloutRefWorker

from oar_verl.core.attribution import pass_limits, run_attribution
from oar_verl.core.config import OARConfig
from oar_verl.core.memory import memory_guard, model_shape
from oar_verl.core.preprocess import prepare_attribution
from oar_verl.core.sequence_parallel import SequenceShards
from oar_verl.integration.budget import actor_token_budget
from oar_verl.integration.collectives import max_over_ranks

logger = logging.getLogger("oar_verl")

# non-tensor entries the step attaches to the batch (prefixed: extra_info entries persist for later RPCs)
CONFIG_KEY = "oar_config"
STEP_KEY = "oar_global_step"
GROUND_TRUTH_KEY = "oar_ground_truth"

# what compute_token_importance returns: per row (nested, response-aligned) and per sequence
OUTPUT_FIELDS = ("token_importance", "oar_reasoning_mask", "oar_answer_mask", "oar_span_found", "oar_answer_probe",
                 "oar_rounds", "oar_copies", "oar_refined", "oar_weights", "oar_log_prob_weights")


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


def ground_truths(data: TensorDict) -> list | None:
    """Per-row ground-truth answers: an explicit ``oar_ground_truth`` list, else verl's ``reward_model.ground_truth``
    (stored with every sample by verl's RL dataset); None when the batch has neither."""
    truths = tu.get(data, GROUND_TRUTH_KEY)
    if truths is None:
        reward_model = tu.get(data, "reward_model")
        if reward_model is not None:
            truths = [(rm or {}).get("ground_truth") for rm in reward_model]
    return None if truths is None else list(truths)


@functools.lru_cache(maxsize=8)
def _config(serialised: str) -> OARConfig:
    """The OARConfig of a JSON-serialised mapping, validated once per distinct configuration (not every step)."""
    return OARConfig.from_mapping(json.loads(serialised))


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def weights_fingerprint(engine) -> float:
    """A number that changes when the engine's weights change: the sum of this rank's shard of its first and last
    parameters, in float64 (policy consistency: attribution must see the weights of the old-log-prob pass)."""
    modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
    params = [p for m in modules for p in m.parameters()]
    if not params:
        return 0.0
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in (params[0], params[-1])]
    return float(sum(t.detach().double().sum() for t in local))


class TokenImportanceMixin:
    """The ``compute_token_importance`` RPC for a verl actor worker (mixed in before the worker class), and a record of
    the weights its last ``compute_log_prob`` ran with."""

    _oar_log_prob_weights: float | None = None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """verl's ``compute_log_prob``, unchanged, after noting the weights it runs with."""
        self._oar_log_prob_weights = weights_fingerprint(self.actor.engine)
        return super().compute_log_prob(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Response-aligned OAR importance of this rank's shard.

        Non-tensor entries read: ``oar_config`` (dict of OARConfig values), ``oar_global_step`` (int) and, with
        ``target=reference``, the ground truths (see :func:`ground_truths`).

        Returns (on the engine's output-collecting ranks, None elsewhere):
            TensorDict of batch size B: nested (B, T_i) ``token_importance`` float32, ``oar_reasoning_mask`` and
            ``oar_answer_mask`` float 0/1; (B,) ``oar_span_found`` and ``oar_answer_probe`` float 0/1, and
            ``oar_rounds``: the passes this rank needed (before padding to the slowest rank; -1 on Megatron),
            ``oar_copies`` / ``oar_refined``: OAR-P's masked copies and reasoning tokens scored at token level per
            row (-1 where not counted: OAR-G, Megatron),
            ``oar_weights`` / ``oar_log_prob_weights``: :func:`weights_fingerprint` now and at the last
            ``compute_log_prob`` (NaN if none ran since the last attribution).
        """
        cfg = _config(json.dumps(tu.get(data, CONFIG_KEY), sort_keys=True))
        step = int(tu.get(data, STEP_KEY, default=0))
        engine = self.actor.engine
        weights = weights_fingerprint(engine)
        log_prob_weights, self._oar_log_prob_weights = self._oar_log_prob_weights, None  # consumed once
        megatron = type(engine).__module__.startswith("verl.workers.engine.megatron")  # FSDP installs lack mcore
        own_rounds = -1  # passes this rank ran before padding to the slowest rank (not counted on Megatron)
        copies = refined = None  # OAR-P masked copies and token-level-scored reasoning tokens per row, where counted
        device = torch.device("cpu") if megatron else _module_device(engine.module)  # Megatron: a list of chunks
        prompts, responses = unpack_rows(data)
        truths = ground_truths(data) if cfg.target == "reference" else None
        prepared = prepare_attribution(prompts, responses, self.actor.model_config.tokenizer, cfg, step,
                                       ground_truths=truths, device=device)
        # the actor's own token budget; the longest sequence of any rank, so that every rank packs by the same budget
        lengths = prepared.batch.attention_mask.sum(-1)
        longest = max_over_ranks(int(lengths.max()) if lengths.numel() else 0, device)
        tokens = actor_token_budget(cfg, self.actor.engine_config, longest)
        checkpointing = bool(getattr(self.actor.model_config, "enable_gradient_checkpointing", False))
        if megatron:  # the engine's own forward/backward over TP/PP/SP; it equalises its collectives over DP itself
            from oar_verl.integration.megatron import megatron_token_importance

            with engine.eval_mode():
                importance = megatron_token_importance(engine, prepared.batch, cfg, pass_limits(cfg, tokens),
                                                       mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
        else:
            shape = model_shape(engine.module)
            guard = memory_guard(device, shape, checkpointing=checkpointing) if shape is not None else None
            limits = pass_limits(cfg, tokens, guard)
            with engine.eval_mode():
                engine.module.eval()  # no dropout during attribution
                # Ulysses (shards): every pass sharded over the group, like verl's own forward (docs/verl.md)
                result = run_attribution(engine.module, prepared.batch, cfg, mask_token_id=prepared.mask_token_id,
                                         seeds=prepared.seeds, limits=limits, checkpointing=checkpointing,
                                         align=lambda n: max_over_ranks(n, device),
                                         shards=_sequence_shards(engine),
                                         pad_id=self.actor.model_config.tokenizer.pad_token_id or 0)
            importance, own_rounds = result.importance, result.rounds
            if result.copies is not None:
                copies, refined = result.copies.cpu(), result.refined.cpu()
        if not engine.is_mp_src_rank_with_outputs():
            return None
        lens, spans = prepared.response_lengths, prepared.spans
        return TensorDict({
            "token_importance": _nested(prepared.response_importance(importance)),
            "oar_reasoning_mask": _nested([spans.reasoning_mask[i, :n].float() for i, n in enumerate(lens)]),
            "oar_answer_mask": _nested([spans.answer_mask[i, :n].float() for i, n in enumerate(lens)]),
            "oar_span_found": spans.found.float(),
            "oar_answer_probe": prepared.answer_probe.float(),
            "oar_rounds": torch.full((len(lens),), float(own_rounds)),
            "oar_copies": torch.full((len(lens),), -1.0) if copies is None else copies.float(),
            "oar_refined": torch.full((len(lens),), -1.0) if refined is None else refined.float(),
            "oar_weights": torch.full((len(lens),), weights, dtype=torch.float64),
            "oar_log_prob_weights": torch.full((len(lens),), float("nan") if log_prob_weights is None
                                               else log_prob_weights, dtype=torch.float64),
        }, batch_size=[len(lens)]).cpu()


def _sequence_shards(engine) -> SequenceShards | None:
    """The engine's Ulysses sequence-parallel group as :class:`SequenceShards`, None without sequence parallelism."""
    size = getattr(engine, "ulysses_sequence_parallel_size", 1) or 1
    if size <= 1:
        return None
    return SequenceShards(engine.ulysses_parallel_group, engine.ulysses_device_mesh["sp"].get_local_rank(), size)


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor shards
        return local.device
    return torch.device("cpu")


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
