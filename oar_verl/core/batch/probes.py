"""Outcome probes: what "the model's final-answer distribution" means, and how far a perturbation moves it.

Three probes (docs/method.md §2), all expressed as one weighted read-out of the logits at a set of *logit positions*
(position j predicts token j+1):

* **LT-Logits**: softmax of the logits at one position, the one predicting the first answer token.
* **AS-Mean**: softmax of the *mean raw logits* over the positions predicting the answer tokens.
* **AS-Joint**: φ = mean over the answer tokens of log p(a_k | prefix, a_<k), a scalar.

LT-Logits is AS-Mean over a one-position set, so a :class:`ProbeSpec` holds per row a weight over logit positions
(rows sum to 1) plus, for AS-Joint, the token each position should predict. Full-vocabulary logits are only ever
computed at the union of probe positions of a forward batch (HF ``logits_to_keep``), never ``[N, L, V]``.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

class ProbeKind(enum.IntEnum):
    """The outcome probe of a row; an int enum, so a (B,) long tensor of kinds compares with its members."""

    LT_LOGITS = 0
    AS_MEAN = 1
    AS_JOINT = 2

    @classmethod
    def from_name(cls, name: str) -> ProbeKind:
        """The kind of a config name (``lt_logits`` / ``as_mean`` / ``as_joint``)."""
        return cls[name.upper()]


@dataclass(frozen=True)
class ProbeSpec:
    """Where and how each row reads its outcome.

    Attributes:
        logit_weight: (B, L) float; weights over logit positions, each row sums to 1 (0 for a row without a probe).
        target_ids: (B, L) long; the token each logit position predicts (input_ids shifted left), for AS-Joint.
        joint: (B,) bool; the row uses AS-Joint (a scalar φ) instead of a distribution probe.
        reads_span: (B,) bool; the row reads answer tokens (AS-Mean / AS-Joint on a span), not LT-Logits.
    """

    logit_weight: torch.Tensor
    target_ids: torch.Tensor
    joint: torch.Tensor
    reads_span: torch.Tensor

    def index(self, rows: torch.Tensor) -> ProbeSpec:
        return ProbeSpec(self.logit_weight[rows], self.target_ids[rows], self.joint[rows], self.reads_span[rows])

    def columns(self, lo: int, hi: int) -> ProbeSpec:
        return ProbeSpec(self.logit_weight[:, lo:hi], self.target_ids[:, lo:hi], self.joint, self.reads_span)


@dataclass(frozen=True)
class ProbeOutput:
    """The outcome read-out of a batch of rows.

    Attributes:
        logp: (b, V) log-probabilities (fp32 or wider) of the probe distribution (rows with joint=True: unused).
        phi: (b,) AS-Joint score (rows with joint=False: 0).
    """

    logp: torch.Tensor
    phi: torch.Tensor

    def index(self, rows: torch.Tensor) -> ProbeOutput:
        return ProbeOutput(self.logp[rows], self.phi[rows])

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely outcomes of every row: (log-probabilities (b, k), token ids (b, k)), most likely first."""
        return self.logp.topk(k, dim=-1)

    def log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """(b,) log-probability of outcome ``ids`` (b,) under every row's probe distribution."""
        return self.logp.gather(-1, ids[:, None]).squeeze(-1)

    def sketch(self, signs, exclude: torch.Tensor) -> torch.Tensor:
        """(b, S) Rademacher sketches of the probe distribution outside ``exclude``: L_j = Σ_{v ∉ exclude} s_{j,v}
        √sg(p_v) log p_v (sg: stop-gradient), whose gradient is Σ_v s_{j,v} √p_v ∇ log p_v (the fisher mode's
        unbiased sketch of its Fisher sum, oar_verl.core.methods.fisher).

        Args:
            signs: (global vocabulary ids (V,) long) -> (S, V) signs ±1.
            exclude: (b, K) long ids left out of every row's sum (the outcomes kept exactly); K may be 0.
        """
        return sketch_losses(self.logp, self.logp, signs(torch.arange(self.logp.shape[-1], device=self.logp.device)),
                             exclude)


def sketch_losses(logp_local: torch.Tensor, read: torch.Tensor, signs: torch.Tensor, exclude: torch.Tensor
                  ) -> torch.Tensor:
    """(b, S) Σ_{v ∉ exclude} s_{j,v} √sg(p_v) read_v over the vocabulary columns at hand (the whole vocabulary, or a
    tensor-parallel rank's shard, whose partial sums the caller reduces).

    Args:
        logp_local: (b, V) log p_v of the columns (only its value is used: the weights √p_v carry no gradient).
        read: (b, V) what the weights multiply: log p_v (a whole vocabulary), or the shard's mean logits.
        signs: (S, V) ±1 signs of the columns.
        exclude: (b, K) long column indices left out (indices outside [0, V): none; K may be 0).
    """
    V = logp_local.shape[-1]
    inside = (exclude >= 0) & (exclude < V)
    # a count, not a boolean scatter: an index clamped from outside the shard must not un-exclude a real one
    dropped = torch.zeros_like(logp_local).scatter_add(-1, exclude.clamp(0, max(V - 1, 0)),
                                                       inside.to(logp_local.dtype)) > 0
    root_p = torch.where(dropped, 0.0, (0.5 * logp_local.detach()).exp())  # √p_v, stop-gradient
    return (root_p * read) @ signs.to(read.dtype).T


def build_probe_spec(input_ids: torch.Tensor, answer_mask: torch.Tensor, lt_position: torch.Tensor,
                     probe_kind: torch.Tensor) -> ProbeSpec:
    """Build the probe of every row.

    Args:
        input_ids: (B, L) long, the (clean) input.
        answer_mask: (B, L) bool, answer-value tokens a_1..a_A in the input (teacher-forced).
        lt_position: (B,) long, LT-Logits logit position (the one predicting a_1, or the last reasoning token when the
            row has no answer span).
        probe_kind: (B,) long :class:`ProbeKind` per row. Answer-span probes fall back to LT-Logits on rows without
            answer tokens.

    Returns:
        ProbeSpec with (B, L) weights that sum to 1 per row.
    """
    B, L = input_ids.shape
    answer_mask = answer_mask.bool()
    # logit position j predicts token j+1: the answer-predicting positions are the answer mask shifted left by one
    pred_mask = torch.zeros_like(answer_mask)
    pred_mask[:, :-1] = answer_mask[:, 1:]
    has_span = pred_mask.any(-1)
    use_span = (probe_kind != ProbeKind.LT_LOGITS) & has_span
    span_w = pred_mask.float() / pred_mask.sum(-1, keepdim=True).clamp(min=1)
    lt_w = F.one_hot(lt_position.clamp(0, max(L - 1, 0)), num_classes=L).float() if L > 0 else span_w
    weight = torch.where(use_span[:, None], span_w, lt_w)
    target = torch.zeros_like(input_ids)
    target[:, :-1] = input_ids[:, 1:]
    joint = use_span & (probe_kind == ProbeKind.AS_JOINT)
    return ProbeSpec(weight, target, joint, use_span)


@functools.lru_cache(maxsize=64)
def _accepts_logits_to_keep(forward_cls: type) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(forward_cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return False


def logits_at(model: torch.nn.Module, keep: torch.Tensor, **inputs) -> torch.Tensor:
    """Logits of a causal LM at the positions ``keep`` only.

    Args:
        model: a Hugging Face causal LM (or an FSDP wrapper of one); called through its root forward so that
            sharded wrappers gather their parameters as usual.
        keep: (K,) long, sequence positions whose logits are needed (shared by all rows).
        **inputs: ``input_ids`` or ``inputs_embeds`` (b, L[, H]), ``attention_mask`` (b, L), ``position_ids`` (b, L).

    Returns:
        (b, K, V) logits in the model's dtype.
    """
    if _accepts_logits_to_keep(type(model)):
        return model(**inputs, logits_to_keep=keep, use_cache=False).logits
    # models without logits_to_keep: full logits, then select (costs [b, L, V] once per forward)
    return model(**inputs, use_cache=False).logits.index_select(1, keep)


def probe_keep_positions(spec: ProbeSpec) -> torch.Tensor:
    """(K,) long: the union of logit positions any row of ``spec`` reads."""
    return (spec.logit_weight != 0).any(0).nonzero().squeeze(1)


def probe_from_logits(logits: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                      joint: torch.Tensor, combine: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> ProbeOutput:
    """Read the outcome from logits at the kept positions.

    Args:
        logits: (b, K, V) logits at the kept positions.
        weight: (b, K) per-row weights over the kept positions (sum to 1).
        target_ids: (b, K) token predicted at each kept position.
        joint: (b,) bool, rows scored by AS-Joint.
        combine: with the kept positions one shard's of a sequence (the other shards' weighted 0 here), completes
            the two weighted sums over the shards' ranks (a differentiable sum, the same on every rank); None: the
            positions are all there.

    Returns:
        ProbeOutput: logp = log_softmax(Σ_k w_k z_k) (b, V); phi = Σ_k w_k log p(target_k) (b,).
    """
    combine = combine or (lambda x: x)
    # fp32 at least (bf16 logits are upcast); a float64 model keeps float64 for exact reference comparisons
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    w = weight.to(z.dtype)
    logp = torch.log_softmax(combine(torch.einsum("bk,bkv->bv", w, z)), dim=-1)
    # AS-Joint needs per-position log-softmax; only pay for it when a row uses it (a data-dependent branch on a
    # (b,) flag, once per forward)
    if bool(joint.any()):
        tok_lp = torch.log_softmax(z, dim=-1).gather(-1, target_ids[..., None]).squeeze(-1)
        phi = torch.where(joint, combine((w * torch.where(w != 0, tok_lp, 0.0)).sum(-1)), 0.0)
    else:
        phi = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
    return ProbeOutput(logp, phi)


def probe_forward(model: torch.nn.Module, spec: ProbeSpec, **inputs) -> ProbeOutput:
    """Run the model and read every row's outcome probe (logits only at probe positions)."""
    keep = probe_keep_positions(spec)
    logits = logits_at(model, keep, **inputs)
    return probe_from_logits(logits, spec.logit_weight[:, keep], spec.target_ids[:, keep], spec.joint)


def outcome_shift(clean: ProbeOutput, perturbed: ProbeOutput, joint: torch.Tensor) -> torch.Tensor:
    """How much a perturbation moved the outcome.

    Args:
        clean, perturbed: ProbeOutput of the same rows, (b, V) / (b,).
        joint: (b,) bool.

    Returns:
        (b,) float32: KL(P_clean ‖ P_perturbed) for distribution probes; φ_clean − φ_perturbed (signed) for AS-Joint.
    """
    kl = (clean.logp.exp() * (clean.logp - perturbed.logp)).sum(-1)
    return torch.where(joint, clean.phi - perturbed.phi, kl)
