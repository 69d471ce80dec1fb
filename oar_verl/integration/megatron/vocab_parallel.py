"""The outcome probe on vocab-parallel logits: the maths of :mod:`oar_verl.core.batch.probes`, split over the vocabulary.

On Megatron's last pipeline stage each tensor-parallel rank holds the logits of its vocabulary shard ``(b, s, V/tp)``.
The probe is read at the probe positions only, in fp32; log-softmax, KL and AS-Joint log-probabilities reduce local
partial sums over the tensor-parallel group with megatron-core's autograd-aware reduction, so the full vocabulary is
never gathered on one rank and OAR-G's backward through the KL is exact on every rank. megatron-core is imported
lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CleanProbe", "VPProbe", "detach_clean", "probe_from_vp_logits", "vp_outcome_shift"]


@dataclass
class VPProbe:
    """Probe read-out of b rows on one tensor-parallel rank.

    Attributes:
        zbar: (b, V_local) fp32, this rank's vocabulary shard of the weighted mean raw logits Σ_k w_k z_k.
        lse: (b,) logsumexp of zbar over the FULL vocabulary (identical on every tensor-parallel rank).
        phi: (b,) AS-Joint score (0 on other rows), identical on every tensor-parallel rank.
        vocab_lo: global id of this rank's first vocabulary column.
    The probe distribution is log P = zbar − lse.
    """

    zbar: torch.Tensor
    lse: torch.Tensor
    phi: torch.Tensor
    vocab_lo: int = 0

    def head(self, n: int) -> VPProbe:
        """The first ``n`` rows."""
        return VPProbe(self.zbar[:n], self.lse[:n], self.phi[:n], self.vocab_lo)

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely outcomes of every row over the full vocabulary: (log-probabilities (b, k), global token
        ids (b, k)), the same on every tensor-parallel rank (each rank's top k, gathered; then the top k of those)."""
        from megatron.core import parallel_state as mpu

        local, idx = (self.zbar - self.lse[:, None]).topk(min(k, self.zbar.shape[-1]), dim=-1)
        ids = idx + self.vocab_lo
        tp = mpu.get_tensor_model_parallel_world_size()
        if tp > 1:
            group = mpu.get_tensor_model_parallel_group()
            vals = [torch.empty_like(local) for _ in range(tp)]
            gids = [torch.empty_like(ids) for _ in range(tp)]
            dist.all_gather(vals, local.detach().contiguous(), group=group)
            dist.all_gather(gids, ids.contiguous(), group=group)
            local, pick = torch.cat(vals, -1).topk(k, dim=-1)
            ids = torch.cat(gids, -1).gather(-1, pick)
        return local, ids

    def log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """(b,) log-probability of global token ``ids`` (b,): the owner rank's logit, summed over the group (the
        gradient flows through the owner's shard only), minus the replicated log-normaliser."""
        v_local = self.zbar.shape[-1]
        local = ids - self.vocab_lo
        inside = (local >= 0) & (local < v_local)
        picked = self.zbar.gather(-1, local.clamp(0, max(v_local - 1, 0))[:, None]).squeeze(-1)
        return _tp_reduce(torch.where(inside, picked, torch.zeros_like(picked))) - self.lse

    def sketch(self, signs, exclude: torch.Tensor) -> torch.Tensor:
        """(b, S) Rademacher sketches L_j = Σ_{v ∉ exclude} s_{j,v} √sg(p_v) log p_v over the full vocabulary, the same
        on every tensor-parallel rank (:meth:`oar_verl.core.batch.probes.ProbeOutput.sketch`, split over the vocabulary).

        With log p_v = zbar_v − lse, L_j = Σ_v w_{j,v} zbar_v − lse · Σ_v w_{j,v} (w_{j,v} = s_{j,v} √sg(p_v)): each
        rank sums its shard with the signs of its global ids, one reduction over the group brings both partial sums
        (the second carries no gradient), and the replicated lse combines them after, so the gradient with respect to
        the local logits is exact on every rank (see :func:`_tp_reduce`).

        Args:
            signs: (global vocabulary ids (V_local,) long) -> (S, V_local) signs ±1.
            exclude: (b, K) long global ids left out (the outcomes kept exactly); K may be 0.
        """
        from oar_verl.core.batch.probes import sketch_losses

        v_local = self.zbar.shape[-1]
        s = signs(torch.arange(v_local, device=self.zbar.device) + self.vocab_lo)
        logp = self.zbar - self.lse[:, None]
        local = exclude - self.vocab_lo
        weighted = sketch_losses(logp, self.zbar, s, local)  # (b, S) Σ_local w zbar
        mass = sketch_losses(logp, torch.ones_like(self.zbar), s, local)  # (b, S) Σ_local w (no gradient)
        both = _tp_reduce(torch.cat([weighted, mass.detach()], -1))
        S = weighted.shape[-1]
        return both[:, :S] - self.lse[:, None] * both[:, S:]


@dataclass
class CleanProbe:
    """A stored (detached) clean / teacher probe: zbar, lse, p = exp(zbar − lse) (local shard), psum = Σ_v p over
    the full vocabulary (1 up to rounding), phi."""

    zbar: torch.Tensor
    lse: torch.Tensor
    p: torch.Tensor
    psum: torch.Tensor
    phi: torch.Tensor


def _tp_reduce(x: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the tensor-parallel group; backward is the identity (megatron-core semantics).

    The identity backward is exact only when everything computed from the reduced value is identical on every rank,
    so the vocab-parallel maths below reduces local partial sums first and combines the reduced values after.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def _vp_logsumexp(z: torch.Tensor) -> torch.Tensor:
    """logsumexp over a vocabulary split over the tensor-parallel group: z (..., V_local) fp32 -> (...) replicated."""
    from megatron.core import parallel_state as mpu

    m = z.detach().amax(-1)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m + _tp_reduce((z - m[..., None]).exp().sum(-1)).log()


def _vocab_lo(v_local: int) -> int:
    """Global id of this tensor-parallel rank's first vocabulary column."""
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank() * v_local


def _real_columns(v_local: int, true_vocab: int | None) -> int:
    """Local vocabulary columns that are real tokens (a vocabulary padded for TP has extra columns at the end)."""
    if true_vocab is None:
        return v_local
    return max(0, min(v_local, true_vocab - _vocab_lo(v_local)))


def probe_from_vp_logits(logits: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, joint: torch.Tensor,
                         true_vocab: int | None) -> VPProbe:
    """Outcome probe of a micro-batch from vocab-parallel logits (oar_verl.core.batch.probes.probe_from_logits, split
    over the vocabulary).

    Args:
        logits: (b, s, V_local) the engine's logits (vocab-parallel, last stage).
        weight: (b, s) probe weight per logit position (each row sums to 1).
        target: (b, s) token each position predicts (AS-Joint).
        joint: (b,) bool.
        true_vocab: the tokenizer's vocabulary size (columns beyond it are TP padding), None = all columns.
    """
    b, _, v_local = logits.shape
    v_real = _real_columns(v_local, true_vocab)
    r, j = (weight != 0).nonzero(as_tuple=True)
    z = logits[r, j, :v_real].float()  # (n_probe, V_real_local): only the probe positions, in fp32
    w = weight[r, j].to(z.dtype)
    zbar = torch.zeros(b, z.shape[-1], dtype=z.dtype, device=z.device).index_add(0, r, w[:, None] * z)
    lse = _vp_logsumexp(zbar)
    phi = torch.zeros(b, dtype=z.dtype, device=z.device)
    if bool(joint.any()):  # per-position log-softmax only when a row uses AS-Joint
        local_t = target[r, j] - _vocab_lo(v_local)
        inside = (local_t >= 0) & (local_t < z.shape[-1])
        picked = z.gather(-1, local_t.clamp(0, max(z.shape[-1] - 1, 0))[:, None]).squeeze(-1)
        tok_logp = _tp_reduce(torch.where(inside, picked, torch.zeros_like(picked))) - _vp_logsumexp(z)
        phi = torch.zeros(b, dtype=z.dtype, device=z.device).index_add(0, r, w * tok_logp)
        phi = torch.where(joint, phi, torch.zeros_like(phi))
    return VPProbe(zbar, lse, phi, _vocab_lo(v_local))


def detach_clean(probe: VPProbe) -> CleanProbe:
    """The stored form of a clean / teacher probe (detached; tensor-parallel collective: every rank of the stage)."""
    zbar, lse = probe.zbar.detach(), probe.lse.detach()
    p = (zbar - lse[:, None]).exp()
    return CleanProbe(zbar, lse, p, _tp_reduce(p.sum(-1)), probe.phi.detach())


def vp_outcome_shift(clean: CleanProbe, pert: VPProbe, joint: torch.Tensor) -> torch.Tensor:
    """(b,) KL(P_clean ‖ P_pert) or φ_clean − φ_pert on AS-Joint rows, identical on every tensor-parallel rank.

    KL = Σ_v p_v (log p_v − log q_v) = Σ_v p_v (zbar0_v − zbar_v) + (Σ_v p_v)(lse − lse0): one reduced sum of local
    terms plus replicated values, so the gradient with respect to the local logits is exact on every rank.
    """
    kl = _tp_reduce((clean.p * (clean.zbar - pert.zbar)).sum(-1)) + clean.psum * (pert.lse - clean.lse)
    return torch.where(joint, clean.phi - pert.phi, kl)
