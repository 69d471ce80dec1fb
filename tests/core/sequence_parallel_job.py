"""Sharded attribution on 2 gloo ranks (a sequence-parallel group), for test_sequence_parallel.py.

usage: python -m torch.distributed.run --nproc_per_node 2 sequence_parallel_job.py OUT_DIR
Each rank writes OUT_DIR/rank{R}.pt with its OAR-G (one and three noise draws), OAR-P, fisher and path scores and the
in-step fidelity metric (every rank holds the whole result); fisher's and conservative's scores read from sharded
forwards the caller runs (verl's old-log-prob pass under Ulysses: each micro-batch padded to a multiple of the group,
and ``@bucket`` also to verl's ``pad_to_length`` bucket first, so that a shard is longer than the micro-batch's
tokens), with whether those forwards' logits are unchanged; and the error of a forward whose shard on rank 1 alone
cannot cover its tokens, which every rank raises (``shard_error``); and values only rank 0 holds (verl's outputs: the
old-log-prob entropies) shared with the group, or an error on every rank with two such ranks (``from_source``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from oar_verl.core.backends.budget import PassLimits, row_spans
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.backends.ulysses import SequenceShards, UlyssesBackend
from oar_verl.core.config import OARConfig
from oar_verl.core.methods.attribution import shared_attribution
from oar_verl.core.methods.conservative import conservative
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.methods.gradient import oar_g
from oar_verl.core.methods.mask_operator import mask_replacement
from oar_verl.core.methods.path import path_integrated
from oar_verl.core.methods.perturbation import mask_blocks, oar_p
from devtools import ulysses_attention
from oar_helpers import count_passes, fidelity_of


def model(attn: str):
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256,
                      attn_implementation=attn)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        m.get_input_embeddings().weight.mul_(20.0)
    return m


def batch(kind: int):
    g = torch.Generator().manual_seed(5)
    B, P, T = 4, 5, 11
    p_len, r_len = torch.tensor([5, 2, 4, 3]), torch.tensor([11, 6, 9, 10])
    cols_p, cols_r = torch.arange(P)[None], torch.arange(T)[None]
    prompt_mask = (cols_p >= P - p_len[:, None]).long()
    response_mask = (cols_r < r_len[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), torch.randint(1, 97, (B, P), generator=g), 0)
    responses = torch.where(response_mask.bool(), torch.randint(1, 97, (B, T), generator=g), 0)
    reasoning = cols_r < (r_len - 4)[:, None]
    answer = (cols_r >= (r_len - 2)[:, None]) & response_mask.bool()
    return build_attribution_batch(prompts, prompt_mask, responses, response_mask, reasoning, answer,
                                   torch.full((B,), kind))


# the methods that read their scores from the caller's forward (docs/method.md §14), as the test names them
SHARED = {"shared_f": OARConfig(mode="fisher", mask="token", mask_token_id=5, fisher_outcomes=2),
          "shared_cons": OARConfig(mode="conservative")}
MICRO_BATCHES = ([3, 0], [2, 1])  # verl's micro-batches of the pass, rows packed end to end in each
BUCKET = 64  # verl's pad_to_length_bucket: a micro-batch here holds at most 30 tokens, a shard 32 positions


def packed_shard(b, rows: list[int], shards: SequenceShards, bucket: int | None = None) -> dict:
    """Rank ``shards.rank``'s inputs of verl's sharded forward of ``rows`` packed end to end: padded at the end to a
    multiple of ``bucket`` (``pad_to_length``), then of the group, with positions 0, 1, ... (one more packed row),
    and sliced (``FSDPEngineWithLMHead.prepare_model_inputs``)."""
    start, end = row_spans(b.attention_mask)
    ids = torch.cat([b.input_ids[r, start[r]:end[r]] for r in rows])
    pos = torch.cat([torch.arange(int(end[r] - start[r])) for r in rows])
    pad = (-ids.shape[0] % bucket if bucket else 0)
    pad += -(ids.shape[0] + pad) % shards.size
    ids, pos = torch.cat([ids, ids.new_zeros(pad)]), torch.cat([pos, torch.arange(pad)])
    n = ids.shape[0] // shards.size
    return {"input_ids": ids[None, shards.rank * n:(shards.rank + 1) * n],
            "position_ids": pos[None, shards.rank * n:(shards.rank + 1) * n], "use_cache": False}


def shared_forwards(lm, b, cfg: OARConfig, shards: SequenceShards, bucket: int | None = None
                    ) -> tuple[torch.Tensor, bool]:
    """verl's sharded old-log-prob forwards (:func:`packed_shard`, ``bucket``: verl's ``pad_to_length``) run inside
    the method's shared attribution (the second micro-batch recomputed); returns its scores and whether every
    forward's logits equal the same forward outside it, bitwise."""
    start, end = row_spans(b.attention_mask)
    shared = shared_attribution(lm, b, cfg, True, mask_token_id=cfg.mask_token_id, shards=shards)
    same = True
    for i, rows in enumerate(MICRO_BATCHES):
        order = torch.tensor(rows)
        local = packed_shard(b, rows, shards, bucket)
        if bucket:  # the layout a check of shard <= tokens refused
            assert local["input_ids"].shape[1] > int((end - start)[order].sum())
        shared.recompute = lambda tokens, i=i: float(i == 1)
        with torch.no_grad():
            plain = lm(**local).logits
            with shared.forward(ForwardLayout.sequences(order, (end - start)[order], start[order])):
                logits = lm(**local).logits
        same = same and torch.equal(plain, logits)
    return shared.result(), same


def shard_error(lm, b, shards: SequenceShards) -> str:
    """A shared forward whose shard on rank 1 is cut short (its positions no longer cover the micro-batch's tokens)
    while rank 0's is verl's: the error every rank raises together (none is left in the attention's all-to-all), and
    the ranks still in step after it (one more collective)."""
    rows = MICRO_BATCHES[0]
    start, end = row_spans(b.attention_mask)
    order = torch.tensor(rows)
    local = packed_shard(b, rows, shards)
    if shards.rank == 1:
        local = {k: v[:, :-2] if k != "use_cache" else v for k, v in local.items()}
    shared = shared_attribution(lm, b, SHARED["shared_f"], True, mask_token_id=SHARED["shared_f"].mask_token_id,
                                shards=shards)
    message = ""
    try:
        with torch.no_grad(), shared.forward(ForwardLayout.sequences(order, (end - start)[order], start[order])):
            lm(**local)
    except RuntimeError as e:
        message = str(e)
    flag = torch.ones(1)
    dist.all_reduce(flag)  # every rank got here
    assert int(flag) == shards.size
    return message


def shared_values(shards: SequenceShards) -> tuple:
    """:func:`~oar_verl.core.backends.collectives.from_source` over the group: rank 0's values on every rank (float64
    on the CPU, bitwise); None on every rank when rank 0 has none; with every rank claiming to be the source, the
    error every rank raises."""
    from oar_verl.core.backends.collectives import from_source

    values = torch.tensor([0.5, 1e-7, 3.25], dtype=torch.float32)
    source = shards.rank == 0
    got = from_source(values if source else None, 3, source=source, group=shards.group)
    none = from_source(None, 3, source=source, group=shards.group)
    try:
        from_source(values, 3, source=True, group=shards.group)
        error = ""
    except RuntimeError as e:
        error = str(e)
    return got, none, error


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    ulysses_attention.register()
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    shards = SequenceShards(dist.group.WORLD, rank, dist.get_world_size())
    lm = model(ulysses_attention.NAME)
    results = {}
    for kind in (ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT):
        b = batch(int(kind))
        seeds = sequence_seeds(3, 7, torch.arange(4))
        for tokens in (12, 40):  # per rank: 12 -> one row (or a few copies) per pass; 40 -> several
            limits = PassLimits(tokens)
            backend = UlyssesBackend(lm, limits, shards, checkpointing=tokens == 40)
            results[(int(kind), tokens, "g")] = oar_g(backend, b, seeds, 1e-3)[0]
            results[(int(kind), tokens, "p")] = oar_p(backend, b, mask_blocks(b.reasoning_mask, 1), 0)[0]
            results[(int(kind), tokens, "rounds")] = count_passes(b, OARConfig(mode="perturbation"), limits, shards)
            # K = 3 noise draws per row: 12 tokens -> one draw per pass, 40 -> a row's draws share passes
            results[(int(kind), tokens, "g3")] = oar_g(UlyssesBackend(lm, limits, shards), b, seeds, 1e-3, 3)[0]
            results[(int(kind), tokens, "rounds_g3")] = count_passes(
                b, OARConfig(mode="gradient", noise_samples=3), limits, shards)
            # the fisher mode: clean-point gradients of the top 2 outcomes, projected on e_mask - e_t
            results[(int(kind), tokens, "f")] = fisher(backend, b, 0, outcomes=2)[0]
            # the in-step fidelity metric of a fixed ranking (its removal sets packed as masked copies)
            results[(int(kind), tokens, "fid")] = fidelity_of(backend, b)
            # the embedding mask operators: each rank sets its own shard's replaced positions (OAR-P), and fisher
            # moves to the zero vector
            mean = mask_replacement(backend, b, "mean", None, None)
            results[(int(kind), tokens, "p_mean")] = oar_p(backend, b, mask_blocks(b.reasoning_mask, 1), mean)[0]
            zero = mask_replacement(backend, b, "zero", None, None)
            results[(int(kind), tokens, "f_zero")] = fisher(backend, b, zero, outcomes=2)[0]
            # path: 2 points per row toward the mean embedding, each shard moving its own clean rows
            results[(int(kind), tokens, "path")] = path_integrated(backend, b, mean, 2)[0]
            # the unbiased estimator: the top outcome exact, the rest in 2 Rademacher sketches (3 loss columns)
            results[(int(kind), tokens, "fs")] = fisher(backend, b, 0, 1, 2, seed=4)[0]
            # conservative propagation: the rules wrap the sequence-parallel attention itself
            results[(int(kind), tokens, "cons")] = conservative(backend, b)[0]
        # read from a forward the caller runs anyway, sharded as verl's old-log-prob pass is under Ulysses
        for method, cfg in SHARED.items():
            scores, same = shared_forwards(lm, b, cfg, shards)
            results[(int(kind), 0, method)] = scores
            results[(int(kind), 0, f"{method}_logits")] = same
            scores, same = shared_forwards(lm, b, cfg, shards, bucket=BUCKET)
            results[(int(kind), 0, f"{method}@bucket")] = scores
            results[(int(kind), 0, f"{method}@bucket_logits")] = same
    results[(0, 0, "shard_error")] = shard_error(lm, batch(int(ProbeKind.AS_MEAN)), shards)
    results[(0, 0, "from_source")] = shared_values(shards)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
