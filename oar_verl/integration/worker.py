"""Token attribution inside verl's actor workers, through the worker's own engine.

:class:`OARActorRolloutRefWorker` adds one RPC, ``compute_token_importance``, dispatched over the actor mesh exactly like
``compute_log_prob``: each data-parallel rank attributes its shard with the engine's (sharded) module under
``engine.eval_mode()`` (parameters loaded as the engine does, offloaded again after), and returns response-aligned
nested tensors that the TransferQueue bridge stores under the batch keys (V1) or that the legacy trainer unions into
its DataProto.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker

from oar_verl.core.attribution import collective_rounds, probe_kinds, run_attribution
from oar_verl.core.config import OARConfig
from oar_verl.core.gradient import sequence_seeds
from oar_verl.core.layout import build_attribution_batch, build_reference_responses
from oar_verl.core.probes import LT_LOGITS
from oar_verl.core.spans import locate_answer_spans

logger = logging.getLogger("oar_verl")

# non-tensor entries the trainer attaches to the batch (prefixed: extra_info entries persist for later RPCs)
CONFIG_KEY = "oar_config"
STEP_KEY = "oar_global_step"
GROUND_TRUTH_KEY = "oar_ground_truth"

OUTPUT_FIELDS = ("token_importance", "oar_reasoning_mask", "oar_answer_mask")


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


def ground_truths(data: TensorDict, n: int) -> list[str]:
    """Per-row ground-truth answers: an explicit ``oar_ground_truth`` list, else verl's ``reward_model.ground_truth``
    (stored with every sample by verl's RL dataset)."""
    truths = tu.get(data, GROUND_TRUTH_KEY)
    if truths is None:
        reward_model = tu.get(data, "reward_model")
        if reward_model is not None:
            truths = [(rm or {}).get("ground_truth") for rm in reward_model]
    if truths is None or len(truths) != n or any(t is None for t in truths):
        raise ValueError("algorithm.oar.target=reference needs a ground-truth answer for every sample "
                         "(reward_model.ground_truth in the data set, as verl's RL parquet format has it)")
    return [str(t) for t in truths]


def pad_rows(rows: list[torch.Tensor], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) padded ids and (B, N) 0/1 mask from a list of 1-D tensors (left or right padding)."""
    n = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):  # per row; the copy itself is a slice assignment
        if len(r):
            sl = slice(n - len(r), n) if left else slice(0, len(r))
            ids[i, sl] = r.long()
            mask[i, sl] = 1
    return ids, mask


def row_fingerprints(prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 content hash of each unpadded (prompt, response): a sequence id that does not depend on padding,
    micro-batching or the data-parallel layout."""
    ids = torch.cat([prompts, responses], dim=1).long()
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    pos = mask.cumsum(-1)  # 1-based position among the real tokens
    return (mask * (ids + 1) * (pos * 0x9E3779B1 + 7)).sum(-1)  # wrapping int64 arithmetic


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class OARActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's actor/rollout/ref worker plus the ``compute_token_importance`` RPC."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_token_importance(self, data: TensorDict) -> TensorDict | None:
        """Response-aligned OAR importance of this rank's shard.

        Non-tensor entries read: ``oar_config`` (dict of OARConfig values), ``oar_global_step`` (int) and, with
        ``target=reference``, ``oar_ground_truth`` (list of answer strings).

        Returns (on the engine's output-collecting ranks):
            TensorDict, batch size B, of nested (B, T_i) tensors: ``token_importance`` float32,
            ``oar_reasoning_mask`` and ``oar_answer_mask`` float 0/1; plus ``oar_span_found`` (B,) float.
        """
        cfg = OARConfig.from_mapping(tu.get(data, CONFIG_KEY))
        step = int(tu.get(data, STEP_KEY, default=0))
        worker = self.actor
        engine = worker.engine
        tokenizer = worker.model_config.tokenizer
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.pad_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        p_rows, r_rows = unpack_rows(data)
        prompts, prompt_mask = pad_rows(p_rows, pad_id, left=True)
        responses, response_mask = pad_rows(r_rows, pad_id, left=False)
        spans = locate_answer_spans(responses, response_mask, tokenizer, cfg.answer_patterns)
        reasoning, answer = spans.reasoning_mask, spans.answer_mask
        attr_responses, attr_mask, attr_reasoning, attr_answer = responses, response_mask, reasoning, answer
        if cfg.target == "reference":
            truths = ground_truths(data, len(r_rows))
            conclude = tokenizer.encode(cfg.conclude_text, add_special_tokens=False)
            answers = [tokenizer.encode(str(t), add_special_tokens=False) for t in truths]
            attr_responses, attr_mask, attr_reasoning, attr_answer = build_reference_responses(
                responses, response_mask, reasoning, conclude, answers, pad_id)

        kinds = probe_kinds(cfg, step, len(r_rows))
        megatron = _is_megatron(engine)
        device = torch.device("cpu") if megatron else _module_device(engine.module)  # Megatron: a list of chunks
        batch = build_attribution_batch(prompts.to(device), prompt_mask.to(device), attr_responses.to(device),
                                        attr_mask.to(device), attr_reasoning.to(device), attr_answer.to(device),
                                        kinds.to(device))
        seq_ids = row_fingerprints(prompts, prompt_mask, responses, response_mask)
        seeds = sequence_seeds(cfg.seed, step, seq_ids).to(device)
        if megatron:  # the engine's own forward/backward over TP/PP/SP; it equalises its collectives over DP itself
            from oar_verl.integration.megatron_attribution import megatron_token_importance

            with engine.eval_mode():
                importance = megatron_token_importance(engine, batch, cfg, mask_token_id=mask_id, seeds=seeds)
        else:
            pad_to = _max_over_ranks(collective_rounds(batch, cfg), device)
            with engine.eval_mode(), whole_sequences():
                engine.module.eval()  # no dropout during attribution
                importance = run_attribution(engine.module, batch, cfg, mask_token_id=mask_id, seeds=seeds,
                                             pad_to=pad_to)
        if not engine.is_mp_src_rank_with_outputs():
            return None
        T = attr_responses.shape[1]
        imp = importance[:, batch.response_start: batch.response_start + T].float().cpu()
        answer_probe = (kinds != LT_LOGITS) & answer.any(-1)
        lens = [len(r) for r in r_rows]
        out = TensorDict({
            # the reasoning tokens are a prefix of the response, so reference-target scores map back unchanged
            "token_importance": _nested([imp[i, :n] if n <= T else torch.cat([imp[i], imp.new_zeros(n - T)])
                                         for i, n in enumerate(lens)]),
            "oar_reasoning_mask": _nested([reasoning[i, :n].float() for i, n in enumerate(lens)]),
            "oar_answer_mask": _nested([answer[i, :n].float() for i, n in enumerate(lens)]),
            "oar_span_found": spans.found.float(),
            "oar_answer_probe": answer_probe.float(),
        }, batch_size=[len(lens)])
        return out.cpu()


@contextlib.contextmanager
def whole_sequences():
    """Run the module on whole (unsliced) sequences even under Ulysses sequence parallelism.

    ``engine.eval_mode()`` installs the Ulysses group, and verl's patched attention then all-to-alls sequence shards.
    Attribution calls the module directly on whole padded sequences, which every rank of a sequence-parallel group
    holds identically, so the group is lifted for the duration: each SP rank computes the same result redundantly
    (correct, and the collective counts stay equal).
    """
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group, set_ulysses_sequence_parallel_group

    previous = get_ulysses_sequence_parallel_group()
    set_ulysses_sequence_parallel_group(None)
    try:
        yield
    finally:
        set_ulysses_sequence_parallel_group(previous)


def _is_megatron(engine) -> bool:
    """verl's Megatron engines (checked by module name: FSDP-only installs never import megatron-core)."""
    return type(engine).__module__.startswith("verl.workers.engine.megatron")


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor shards
        return local.device
    return torch.device("cpu")


def _max_over_ranks(value: int, device: torch.device) -> int:
    """Max of ``value`` over every rank of the default group: ranks holding fewer or shorter sequences pad their
    forward count so that sharded-parameter collectives stay matched (no hang)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    backend = dist.get_backend()
    t = torch.tensor([value], dtype=torch.long, device="cpu" if backend == "gloo" else device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
