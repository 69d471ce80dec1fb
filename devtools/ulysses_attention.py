"""A CPU stand-in for verl's Ulysses attention, so that sequence parallelism runs on CPU (tests only).

verl implements Ulysses sequence parallelism for Hugging Face LMs by wrapping the flash-attention-2 varlen kernel
(``verl.models.transformers.monkey_patch._ulysses_flash_attention_forward``): all-to-all from sequence shards to head
shards, attention over whole packed sequences (rows told apart by their position ids), all-to-all back. flash-attn is
a CUDA package, so that path cannot run on CPU. This module registers the same computation around
``scaled_dot_product_attention`` as the Hugging Face attention implementation ``ulysses_sdpa``
(``actor_rollout_ref.model.override_config.attn_implementation=ulysses_sdpa``), using verl's own all-to-all utilities
and Ulysses group; with no group (or a group of one) it is a packed-sequence causal sdpa. Never used on GPUs.

Importing it registers the implementation as soon as transformers is loaded, so a worker group gets it in every
process through ``VERL_USE_EXTERNAL_MODULES=oar_verl.quickstart.platform,devtools.ulysses_attention``.
"""

from __future__ import annotations

import torch

NAME = "ulysses_sdpa"


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) packed-row index of every position: a new row starts wherever the position id is 0."""
    return (position_ids == 0).long().cumsum(-1)


def ulysses_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                           dropout: float = 0.0, scaling: float | None = None, position_ids=None, **kwargs):
    """Hugging Face attention interface: q (b, h, s_local, d), k/v (b, kv, s_local, d) -> (b, s_local, h, d)."""
    from verl.utils.ulysses import (gather_heads_scatter_seq, gather_seq_scatter_heads,
                                    get_ulysses_sequence_parallel_group, get_ulysses_sequence_parallel_world_size)

    sp = get_ulysses_sequence_parallel_world_size() if get_ulysses_sequence_parallel_group() is not None else 1
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, heads, d): verl's layout
    if position_ids is None:
        position_ids = torch.arange(q.shape[1], device=q.device)[None].expand(q.shape[0], -1)
    if sp > 1:
        q, k, v = (gather_seq_scatter_heads(t, seq_dim=1, head_dim=2) for t in (q, k, v))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        torch.distributed.all_gather(parts, position_ids.contiguous(), group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    seg = _segments(position_ids)
    s = q.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # (b, s, s): within a packed row, causally
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=allowed[:, None], dropout_p=dropout,
                                                           scale=scaling)
    out = out.transpose(1, 2)  # (b, s, heads/sp, d)
    if sp > 1:
        out = gather_heads_scatter_seq(out, head_dim=2, seq_dim=1)
    return out.contiguous(), None


def register() -> None:
    """Make ``ulysses_sdpa`` a Hugging Face attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ulysses_sdpa_attention)


def _register_when_transformers_loads() -> None:
    from oar_verl.quickstart.platform import when_imported

    when_imported("transformers.modeling_utils", lambda _module: register())


_register_when_transformers_loads()
