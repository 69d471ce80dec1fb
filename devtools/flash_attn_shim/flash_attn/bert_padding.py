"""Padding helpers with ``flash_attn.bert_padding``'s signatures, in plain torch (no kernels).

Shapes: ``attention_mask`` (B, S) 0/1; "unpadded" tensors put the valid tokens of all rows first-axis-contiguous
(total, ...), in row-major order of the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(len(indices), ...) rows ``indices`` of ``x`` (N, ...) (differentiable gather)."""
    return x[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Drop the padding of a (B, S, ...) batch.

    Returns:
        (total, ...) valid tokens, (total,) their flat indices into B*S, (B+1,) int32 cumulative sequence lengths,
        the longest row's length (int), (B,) int32 tokens per row (with ``unused_mask`` counted as used).
    """
    used = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = used.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(used.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max()) if seqlens.numel() else 0, attention_mask.sum(-1,
                                                                                                       dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(B, S, ...) from (total, ...) valid tokens at flat ``indices``, zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
