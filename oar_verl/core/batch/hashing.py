"""Seeded integer hashing on int64 tensors (splitmix64): random numbers that are pure functions of a seed and integer
keys, so a draw does not depend on batching, padding, sharding, rank or device.

Used by the fidelity metric's random rankings (:mod:`oar_verl.core.fidelity.curves`) and by the fisher mode's
Rademacher sketches (:mod:`oar_verl.core.methods.fisher`), whose sign of vocabulary entry v must be the same on every
tensor-parallel shard.
"""

from __future__ import annotations

import torch


def _s64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLD, _C1, _C2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLD
    x = (x ^ _shr(x, 30)) * _C1
    x = (x ^ _shr(x, 27)) * _C2
    return x ^ _shr(x, 31)


def _uniform(seed: int, *keys: torch.Tensor | int) -> torch.Tensor:
    """Uniform [0, 1) float64 of the broadcast int64 ``keys``: a pure function of (seed, keys), so a row's draws do
    not depend on batching, padding or device."""
    x = _mix(torch.tensor(_s64(seed % (1 << 64)), dtype=torch.long))
    for k in keys:
        x = _mix(x ^ torch.as_tensor(k, dtype=torch.long))
    return _shr(x, 11).double() * 2.0 ** -53
