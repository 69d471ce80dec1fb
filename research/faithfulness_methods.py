"""Prototype token-attribution estimators for the faithfulness study (issue #21, research phase).

PROTOTYPES: these run on one plain Hugging Face causal LM, one response row at a time, and exist to decide which
estimator is worth porting onto the attribution engine in ``oar_verl/core``. They are not the implementation OAR
ships. The second-order (fisher) estimator was ported: the study runs the product's ``mode=fisher``
(:func:`research.faithfulness.core_check`), not a prototype.

Every estimator scores the reasoning tokens of one row against the same outcome as OAR: the probe distribution of
:mod:`oar_verl.core.batch.probes` (``probe_forward``), moved as measured by ``outcome_shift`` (KL(P_clean ‖ P_perturbed)
for the distribution probes used here). Notation: a row is ``L`` tokens, ``H`` the hidden size, ``R`` the reasoning
positions scored, ``e_t`` the clean input embedding of position t, ``m`` the mask embedding (the embedding of the mask
token), ``δ_t = m − e_t``.

Exact references (one perturbed forward per scored token):

* ``exact_shift(..., variant="pad")``   token t replaced by the mask token (OAR-P's perturbation);
* ``variant="zero"``                   e_t replaced by the zero vector;
* ``variant="delete"``                 token t removed (the sequence is one shorter);
* ``variant="sample"``                 token t replaced by a token drawn from the model's own next-token
                                       distribution at t (the actual token excluded).

Cheap estimators (a fixed number of passes, independent of R):

* ``ig_kl``         integrated gradients of the masking KL along the straight path e → e + α·δ (all reasoning tokens at
                    once), S midpoint steps: score_t = (1/S) Σ_s ⟨∂KL/∂x_t (α_s), δ_t⟩. S = 1 is
                    "gradient × (input − mask)" at the midpoint. One forward+backward on S copies.
* ``random_ablation``  K random masks (each reasoning token masked with probability ρ), K perturbed forwards, and a
                    ridge fit KL ≈ Σ_t w_t·mask_t (ContextCite-style surrogate); score_t = w_t.
* ``refine``        a cheap ranking, then exact OAR-P on its top-M candidates; the candidates rank above the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar_verl.core.backends.base import frozen_parameters
from oar_verl.core.batch.probes import ProbeKind, ProbeOutput, ProbeSpec, build_probe_spec, outcome_shift, probe_forward


@dataclass(frozen=True)
class Row:
    """One response row, unpadded.

    Attributes:
        ids: (L,) long, prompt + response tokens.
        positions: (R,) long, the reasoning positions to score (in order).
        spec: ProbeSpec of batch size 1 over the L positions (AS-Mean on the answer span).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    spec: ProbeSpec


def make_row(ids: torch.Tensor, positions: torch.Tensor, answer_mask: torch.Tensor) -> Row:
    """Row with an AS-Mean probe on ``answer_mask`` ((L,) bool); LT position = the one predicting the first answer
    token."""
    first = int(answer_mask.nonzero()[0, 0])  # once per row, not in a hot path
    spec = build_probe_spec(ids[None], answer_mask[None], torch.tensor([first - 1]),
                            torch.tensor([int(ProbeKind.AS_MEAN)]))
    return Row(ids, positions, spec)


def _spec_rows(spec: ProbeSpec, n: int) -> ProbeSpec:
    """The batch-1 spec repeated for n copies."""
    return ProbeSpec(spec.logit_weight.expand(n, -1), spec.target_ids.expand(n, -1), spec.joint.expand(n),
                     spec.reads_span.expand(n))


def _embed(model, ids: torch.Tensor) -> torch.Tensor:
    """(L, H) input embeddings of ``ids`` (L,)."""
    return model.get_input_embeddings()(ids[None])[0]


@torch.no_grad()
def clean_probe(model, row: Row) -> ProbeOutput:
    """The clean outcome of the row (batch 1)."""
    return probe_forward(model, row.spec, input_ids=row.ids[None])


@torch.no_grad()
def exact_shift(model, row: Row, clean: ProbeOutput, *, variant: str, mask_id: int, chunk: int = 32,
                seed: int = 0) -> torch.Tensor:
    """(R,) exact one-token-at-a-time outcome shift KL(P_clean ‖ P_perturbed) for each reasoning position.

    Copies of the row are batched ``chunk`` at a time: (chunk, L, H) embeddings, each with one position replaced.
    """
    L = row.ids.shape[0]
    E = _embed(model, row.ids)
    if variant == "pad":
        repl = _embed(model, torch.tensor([mask_id]))[0].expand(row.positions.shape[0], -1)
    elif variant == "zero":
        repl = torch.zeros(row.positions.shape[0], E.shape[1], dtype=E.dtype)
    elif variant == "sample":
        # the model's own next-token distribution at each scored position (logits at t-1), actual token excluded
        logits = model(input_ids=row.ids[None], use_cache=False).logits[0, row.positions - 1].float()
        logits[torch.arange(row.positions.shape[0]), row.ids[row.positions]] = float("-inf")
        gen = torch.Generator().manual_seed(seed)
        drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        repl = _embed(model, drawn)
    elif variant == "delete":
        repl = None
    else:
        raise ValueError(f"variant must be one of pad/zero/sample/delete, got {variant!r}")
    out = []
    for lo in range(0, row.positions.shape[0], chunk):
        pos = row.positions[lo:lo + chunk]
        n = pos.shape[0]
        if variant == "delete":
            # drop column pos[i] of copy i; every probe position lies after every reasoning position, so each copy's
            # probe moves one position left
            keep = torch.arange(L)[None].expand(n, -1) != pos[:, None]
            X = E[None].expand(n, -1, -1)[keep].view(n, L - 1, -1)
            spec = ProbeSpec(row.spec.logit_weight[:, 1:], row.spec.target_ids[:, 1:], row.spec.joint,
                             row.spec.reads_span)
        else:
            X = E[None].repeat(n, 1, 1)
            X[torch.arange(n), pos] = repl[lo:lo + chunk]
            spec = row.spec
        pert = probe_forward(model, _spec_rows(spec, n), inputs_embeds=X)
        out.append(outcome_shift(_repeat(clean, n), pert, spec.joint.expand(n)))
    return torch.cat(out)


def _repeat(p: ProbeOutput, n: int) -> ProbeOutput:
    return ProbeOutput(p.logp.expand(n, -1), p.phi.expand(n))


def _delta(model, row: Row, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean embeddings E (L, H) and the masking displacement D (L, H): m − e_t at reasoning positions, 0 elsewhere."""
    E = _embed(model, row.ids).detach()
    m = _embed(model, torch.tensor([mask_id]))[0].detach()
    D = torch.zeros_like(E)
    D[row.positions] = m - E[row.positions]
    return E, D


def ig_kl(model, row: Row, clean: ProbeOutput, *, mask_id: int, steps: int) -> torch.Tensor:
    """(R,) integrated gradients of KL(P_0 ‖ P(e + α·D)) with ``steps`` midpoints α_s = (s + ½)/S, batched as S copies.

    score_t = (1/S) Σ_s ⟨∂KL/∂x_t(α_s), δ_t⟩; Σ_t score_t ≈ KL(all reasoning tokens masked) (completeness).
    """
    with frozen_parameters(model):
        return _ig_kl(model, row, clean, mask_id=mask_id, steps=steps)


def _ig_kl(model, row: Row, clean: ProbeOutput, *, mask_id: int, steps: int) -> torch.Tensor:
    E, D = _delta(model, row, mask_id)
    alpha = (torch.arange(steps, dtype=E.dtype) + 0.5) / steps
    X = (E[None] + alpha[:, None, None] * D[None]).requires_grad_(True)  # (S, L, H)
    pert = probe_forward(model, _spec_rows(row.spec, steps), inputs_embeds=X)
    kl = outcome_shift(_repeat(clean, steps), pert, row.spec.joint.expand(steps))
    (g,) = torch.autograd.grad(kl.sum(), X)
    return (g[:, row.positions] * D[row.positions][None]).sum(-1).mean(0).detach()


@torch.no_grad()
def random_ablation(model, row: Row, clean: ProbeOutput, *, mask_id: int, samples: int, rho: float = 0.1,
                    ridge: float = 1e-2, seed: int = 0, chunk: int = 32) -> torch.Tensor:
    """(R,) ridge surrogate: K masks M (K, R) ~ Bernoulli(ρ), y_k = KL(P_0 ‖ P(masked_k)), w = Mᵀ(MMᵀ + λI)⁻¹ y
    (dual form: a K×K solve, K ≪ R at long lengths)."""
    R = row.positions.shape[0]
    gen = torch.Generator().manual_seed(seed)
    M = (torch.rand(samples, R, generator=gen) < rho).float()
    E = _embed(model, row.ids)
    m = _embed(model, torch.tensor([mask_id]))[0]
    ys = []
    for lo in range(0, samples, chunk):
        Mk = M[lo:lo + chunk]
        n = Mk.shape[0]
        X = E[None].repeat(n, 1, 1)
        sel = X[:, row.positions]
        X[:, row.positions] = torch.where(Mk[..., None].bool(), m.expand_as(sel), sel)
        pert = probe_forward(model, _spec_rows(row.spec, n), inputs_embeds=X)
        ys.append(outcome_shift(_repeat(clean, n), pert, row.spec.joint.expand(n)))
    y = torch.cat(ys).double()
    Md = M.double()
    scale = y.abs().mean().clamp(min=1e-12)
    alpha = torch.linalg.solve(Md @ Md.T + ridge * samples * torch.eye(samples, dtype=torch.float64), y / scale)
    return (Md.T @ alpha * scale).float()


def refine(cheap: torch.Tensor, exact_fn, top: int) -> torch.Tensor:
    """(R,) the cheap ranking with its ``top`` best candidates rescored by ``exact_fn(idx) -> (top,)`` exact shifts;
    the rescored candidates rank above every other token (order among them: exact), the rest keep the cheap order."""
    top = min(top, cheap.shape[0])
    idx = cheap.topk(top).indices
    rank = torch.empty_like(cheap)
    # below-candidate tokens: their cheap rank squeezed into (−1, 0); candidates: exact shift ≥ 0
    order = cheap.argsort()
    rank[order] = torch.arange(cheap.shape[0], dtype=cheap.dtype) / cheap.shape[0] - 1.0
    rank[idx] = exact_fn(idx).to(cheap.dtype)
    return rank


def train_step_time(model, row: Row, repeats: int = 2) -> float:
    """Seconds of one training forward+backward on the row's tokens (full-vocabulary logits at every position, token
    cross-entropy, gradients for every parameter), the median of ``repeats`` runs after one warm-up."""
    import time

    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(True)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        logits = model(input_ids=row.ids[None], use_cache=False).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float(), row.ids[1:])
        loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    for p, f in zip(model.parameters(), flags):
        p.requires_grad_(f)
    return sorted(times)[len(times) // 2]
