"""A read-only key/value prefix shared by many masked copies of one sequence (OAR-P's prefix reuse).

Every copy in a pass of OAR-P continues the same clean prefix [0, t0). Copying that prefix per copy (what a
``DynamicCache`` deep copy + ``batch_repeat_interleave`` does) would keep c copies of it in every layer for the whole
forward. Here each layer serves a broadcast view of the clean cache and keeps nothing: attention sees
cat(prefix, suffix) for the one layer being computed, and the pass holds one layer's keys and values at a time.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class _SharedPrefixLayer(DynamicLayer):
    """One layer's cache: a fixed prefix (a broadcast view), extended by each call's keys/values, storing nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def shared_prefix_cache(cache: DynamicCache, t0: int, copies: int) -> DynamicCache:
    """A cache presenting the first ``t0`` positions of a one-row ``cache`` to ``copies`` rows, copying nothing.

    Falls back to an explicit per-copy copy for cache layers it does not know. (The module backend's clean pass builds
    full layers even for sliding-window models: a sliding-window layer past its window cannot be cropped.)
    """
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        prefix = copy.deepcopy(cache)  # the forward appends to the cache it is given
        prefix.crop(t0)
        prefix.batch_repeat_interleave(copies)
        return prefix
    shared = DynamicCache()
    shared.layers = [_SharedPrefixLayer(layer.keys[..., :t0, :].expand(copies, -1, -1, -1),
                                        layer.values[..., :t0, :].expand(copies, -1, -1, -1)) for layer in layers]
    return shared
