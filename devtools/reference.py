"""OAR in one sitting: a plain, per-sequence, per-position reference of the whole method (docs/method.md).

Nothing here is fast or batched on purpose. Each function is the method's definition written as directly as torch
allows -- one unpadded sequence at a time, one masked copy per reasoning position, full-vocabulary logits, float64
where a model runs in float64 -- so that it can be read against the paper and trusted. The fast paths of
:mod:`oar_verl.core` (chunked copies, probe-only logits, prefix key/value reuse, fused micro-batches, Megatron's
vocab-parallel probes) are tested against these functions, and the attribution benchmark uses them as its naive
baseline.

A sequence is given as its token ids ``ids`` (L,) with no padding, the positions of its reasoning tokens and of its
answer tokens (the probe's teacher-forced answer), and a :class:`~oar_verl.core.batch.probes.ProbeKind`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oar_verl.core.methods.fisher import sketch_signs
from oar_verl.core.batch.probes import ProbeKind

__all__ = ["Outcome", "outcome", "shift", "mask_vector", "oar_p", "oar_p_segments", "oar_p_hierarchical", "oar_g",
           "fisher", "fisher_jacobian", "fisher_full", "fisher_sketch_variance", "token_weights", "batch_oar_p",
           "batch_oar_g", "batch_fisher", "path", "batch_path", "conservative_logits", "conservative",
           "batch_conservative"]


@dataclass(frozen=True)
class Outcome:
    """A probe's read-out: a distribution (``logp``: (V,) log-probabilities) or the AS-Joint scalar (``phi``)."""

    logp: torch.Tensor | None = None
    phi: torch.Tensor | None = None


def outcome(logits: torch.Tensor, ids: torch.Tensor, kind: ProbeKind, reasoning: list[int],
            answer: list[int]) -> Outcome:
    """The outcome probe of one sequence from its full logits (docs/method.md §2).

    Args:
        logits: (L, V) logits of the sequence; position j predicts token j + 1.
        ids: (L,) token ids.
        kind: the probe. Without answer tokens every kind reads LT-Logits.
        reasoning: reasoning positions.
        answer: answer positions a_1..a_A.

    LT-Logits: the distribution predicting the first answer token (no answer: after the last reasoning token, or the
    last token). AS-Mean: softmax of the mean *raw logits* over the positions predicting the answer tokens. AS-Joint:
    φ = mean_k log p(a_k | prefix, a_<k).
    """
    if kind == ProbeKind.LT_LOGITS or not answer:
        position = answer[0] - 1 if answer else (reasoning[-1] if reasoning else len(ids) - 1)
        return Outcome(logp=torch.log_softmax(logits[position].double(), -1))
    if kind == ProbeKind.AS_MEAN:
        mean_logits = sum(logits[a - 1].double() for a in answer) / len(answer)
        return Outcome(logp=torch.log_softmax(mean_logits, -1))
    phi = sum(torch.log_softmax(logits[a - 1].double(), -1)[ids[a]] for a in answer) / len(answer)
    return Outcome(phi=phi)


def shift(clean: Outcome, perturbed: Outcome) -> torch.Tensor:
    """How far the outcome moved: KL(P_clean ‖ P_perturbed), or φ_clean − φ_perturbed (signed) for AS-Joint."""
    if clean.phi is not None:
        return clean.phi - perturbed.phi
    return (clean.logp.exp() * (clean.logp - perturbed.logp)).sum()


def mask_vector(model: torch.nn.Module, mask: int | str) -> torch.Tensor:
    """(H,) float64 the embedding a masked token moves to (``algorithm.oar.mask``): a token id's embedding, ``"zero"``
    the zero vector, ``"mean"`` the mean over the vocabulary of what the embedding module outputs (so with a scaled
    embedding's ``embed_scale``)."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        if mask == "mean":
            return embed(torch.arange(embed.weight.shape[0])[None])[0].double().mean(0)
        if mask == "zero":
            return torch.zeros(embed.weight.shape[-1], dtype=torch.float64)
        return embed(torch.tensor([[int(mask)]]))[0, 0].double()


def oar_p(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int], kind: ProbeKind,
          mask_token_id: int | str, span: int = 1, copies_per_forward: int | None = 1,
          blocks: list[list[int]] | None = None) -> torch.Tensor:
    """OAR-P of one sequence (docs/method.md §3): mask each block of ``span`` consecutive reasoning tokens with the
    mask token (length unchanged), or set their input-embedding output to the zero / mean vector, and score the block
    by the outcome shift; every token of a block gets its score.

    Args:
        model: causal LM (eval mode).
        ids: (L,) token ids.
        reasoning: reasoning positions.
        answer: answer positions.
        kind: the probe.
        mask_token_id: the replacement token id, or ``"zero"`` / ``"mean"`` (:func:`mask_vector`).
        span: reasoning tokens masked together (1 = exact OAR-P).
        copies_per_forward: masked copies per forward pass; None = all of them in one batch, as the official code
            runs them (full [copies, L, V] logits: the naive baseline's memory).
        blocks: explicit blocks (lists of positions), one masked copy each; overrides ``span``.

    Returns:
        (L,) float64 importance, 0 off the reasoning positions.
    """
    importance = torch.zeros(len(ids), dtype=torch.float64)
    if blocks is None:
        blocks = [reasoning[k: k + span] for k in range(0, len(reasoning), span)]
    at_embedding = isinstance(mask_token_id, str)
    copies = []
    with torch.no_grad():
        clean_embeddings = model.get_input_embeddings()(ids[None])[0] if at_embedding else None
        for block in blocks:
            if at_embedding:  # the copy's input embeddings, its block set to the vector
                masked = clean_embeddings.clone()
                masked[block] = mask_vector(model, mask_token_id).to(masked.dtype)
            else:
                masked = ids.clone()
                masked[block] = mask_token_id
            copies.append(masked)
    per_forward = copies_per_forward or max(len(copies), 1)
    with torch.no_grad():
        clean = outcome(model(ids[None]).logits[0], ids, kind, reasoning, answer)
        for start in range(0, len(copies), per_forward):
            chunk = torch.stack(copies[start: start + per_forward])
            logits = model(inputs_embeds=chunk).logits if at_embedding else model(chunk).logits
            for k in range(chunk.shape[0]):
                score = shift(clean, outcome(logits[k], ids, kind, reasoning, answer))
                importance[blocks[start + k]] = score.double()
    return importance


def oar_p_segments(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int],
                   kind: ProbeKind, mask_token_id: int | str, segments: list[list[int]]) -> torch.Tensor:
    """Segment-level OAR-P of one sequence (docs/method.md §8): one masked copy per segment; each of a segment's n
    tokens gets s / n of its score s. Returns (L,) float64, 0 off the segments."""
    scores = oar_p(model, ids, reasoning, answer, kind, mask_token_id, blocks=segments)
    spread = torch.zeros_like(scores)
    for seg in segments:
        spread[seg] = scores[seg] / len(seg)
    return spread


def oar_p_hierarchical(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int],
                       kind: ProbeKind, mask_token_id: int | str, segments: list[list[int]],
                       refine_share: float) -> torch.Tensor:
    """Hierarchical OAR-P of one sequence (docs/method.md §8): segment scores; then, segments by score (highest
    first), refine each while the refined ones so far hold fewer than ``refine_share`` × the segments' tokens; refined
    tokens get their exact OAR-P score, the others their segment's spread score. Returns (L,) float64."""
    raw = oar_p(model, ids, reasoning, answer, kind, mask_token_id, blocks=segments)
    result = oar_p_segments(model, ids, reasoning, answer, kind, mask_token_id, segments)
    total = sum(len(seg) for seg in segments)
    ranked = sorted(range(len(segments)), key=lambda k: -float(raw[segments[k][0]]))  # stable: ties by position
    covered, refined = 0, []
    for k in ranked:
        if covered >= refine_share * total:
            break
        refined.extend(segments[k])
        covered += len(segments[k])
    refined.sort()
    exact = oar_p(model, ids, reasoning, answer, kind, mask_token_id, blocks=[[t] for t in refined])
    result[refined] = exact[refined]
    return result


def oar_g(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int], kind: ProbeKind,
          noise_std: float, seed: int, parameter_gradients: bool = False) -> torch.Tensor:
    """OAR-G of one sequence (docs/method.md §4): gradient × input of the outcome shift under embedding noise.

    p0 = the clean outcome; the k-th reasoning token's embedding gets draw k of N(0, σ²) from a generator seeded with
    ``seed``; J = shift(p0, p_noisy); the score is |⟨∂J/∂e_t, e_t⟩| with the clean embedding e_t.

    Args:
        model: causal LM (eval mode) with ``get_input_embeddings()``.
        ids: (L,) token ids.
        reasoning: reasoning positions.
        answer: answer positions.
        kind: the probe.
        noise_std: σ (absolute).
        seed: the sequence's noise seed.
        parameter_gradients: backpropagate through every parameter and clear the gradients after, as the official
            code's ``J.backward()`` does (the naive baseline's cost; the scores are the same).

    Returns:
        (L,) float64 importance, 0 off the reasoning positions.
    """
    importance = torch.zeros(len(ids), dtype=torch.float64)
    if not reasoning:
        return importance
    with torch.no_grad():
        clean = outcome(model(ids[None]).logits[0], ids, kind, reasoning, answer)
        embeddings = model.get_input_embeddings()(ids[None])
    generator = torch.Generator().manual_seed(int(seed))
    noise = torch.randn(len(reasoning), embeddings.shape[-1], generator=generator, dtype=torch.float32) * noise_std
    noisy = embeddings.clone()
    noisy[0, reasoning] += noise.to(embeddings.dtype)
    noisy.requires_grad_(True)
    J = shift(clean, outcome(model(inputs_embeds=noisy).logits[0], ids, kind, reasoning, answer))
    if parameter_gradients:
        J.backward()
        grad = noisy.grad
        model.zero_grad(set_to_none=True)
    else:
        (grad,) = torch.autograd.grad(J, noisy)
    for t in reasoning:
        importance[t] = (grad[0, t].double() * embeddings[0, t].double()).sum().abs()
    return importance


def fisher(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int], kind: ProbeKind,
           mask_token_id: int | str, outcomes: int, sketches: int = 0, seed: int = 0) -> torch.Tensor:
    """Second-order masking scores of one sequence (docs/method.md §11).

    δ_t = e_mask − e_t, e_mask the mask token's embedding or the zero / mean vector (:func:`mask_vector`).
    Distribution probes: the ``outcomes`` most likely answers v of the clean distribution p, and
    I_t = ½ Σ_v p_v ⟨∂ log p_v / ∂e_t, δ_t⟩², one gradient of log p_v (all tokens at once) per kept v; with
    ``sketches`` S >= 1 plus ½ (1/S) Σ_j (Σ_{v ∉ top} s_{j,v} √p_v ⟨∂ log p_v / ∂e_t, δ_t⟩)², the signs of
    :func:`oar_verl.core.methods.fisher.sketch_signs`, each term read from the full Jacobian (:func:`fisher_jacobian`), not
    from a sketch loss. AS-Joint: I_t = −⟨∂φ/∂e_t, δ_t⟩.

    Returns:
        (L,) float64 scores, 0 off the reasoning positions.
    """
    importance = torch.zeros(len(ids), dtype=torch.float64)
    if not reasoning:
        return importance
    embed = model.get_input_embeddings()
    with torch.no_grad():
        embeddings = embed(ids[None])
        delta = mask_vector(model, mask_token_id) - embeddings[0].double()  # (L, H)
    leaf = embeddings.clone().requires_grad_(True)
    read = outcome(model(inputs_embeds=leaf).logits[0], ids, kind, reasoning, answer)
    if read.phi is not None:
        (grad,) = torch.autograd.grad(read.phi, leaf)
        for t in reasoning:
            importance[t] = -(grad[0, t].double() * delta[t]).sum()
        return importance
    if sketches:
        logp, jac = fisher_jacobian(model, ids, reasoning, answer, kind, mask_token_id)
        p = logp.exp()
        top = logp.topk(outcomes).indices if outcomes else torch.zeros(0, dtype=torch.long)
        tail = torch.ones_like(p, dtype=torch.bool)
        tail[top] = False
        signs = sketch_signs(seed, sketches, torch.arange(len(p)))  # (S, V)
        exact = (p[top, None] * jac[top].square()).sum(0)  # (L,)
        sketched = ((signs * torch.where(tail, p.sqrt(), 0.0)) @ jac).square().mean(0)  # (L,)
        importance[reasoning] = 0.5 * (exact + sketched)[reasoning]
        return importance
    top = read.logp.detach().topk(outcomes)
    for logp_v, v in zip(top.values.tolist(), top.indices.tolist()):
        (grad,) = torch.autograd.grad(read.logp[v], leaf, retain_graph=True)
        for t in reasoning:
            importance[t] += 0.5 * math.exp(logp_v) * float((grad[0, t].double() * delta[t]).sum()) ** 2
    return importance


def fisher_jacobian(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int],
                    kind: ProbeKind, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean distribution probe of one sequence and the Jacobian of its log-probabilities projected on δ_t.

    Returns:
        (log p (V,) float64, J (V, L) float64 with J[v, t] = ⟨∂ log p_v / ∂e_t, δ_t⟩, δ_t = e_mask − e_t): one
        backward per vocabulary entry (a tiny vocabulary only).
    """
    embed = model.get_input_embeddings()
    with torch.no_grad():
        embeddings = embed(ids[None])
        delta = embed(torch.tensor([[mask_token_id]]))[0, 0].double() - embeddings[0].double()  # (L, H)
    leaf = embeddings.clone().requires_grad_(True)
    read = outcome(model(inputs_embeds=leaf).logits[0], ids, kind, reasoning, answer)
    V = read.logp.shape[0]
    jac = torch.zeros(V, len(ids), dtype=torch.float64)
    for v in range(V):
        (grad,) = torch.autograd.grad(read.logp[v], leaf, retain_graph=v + 1 < V)
        jac[v] = (grad[0].double() * delta).sum(-1)
    return read.logp.detach().double(), jac


def fisher_full(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int], kind: ProbeKind,
                mask_token_id: int) -> torch.Tensor:
    """The full-vocabulary Fisher form of one sequence, what the fisher mode estimates: I_t = ½ Σ_v p_v ⟨∂ log p_v /
    ∂e_t, δ_t⟩² over every v, from the Jacobian of :func:`fisher_jacobian` (distribution probes only).

    Returns:
        (L,) float64 scores, 0 off the reasoning positions.
    """
    logp, jac = fisher_jacobian(model, ids, reasoning, answer, kind, mask_token_id)
    importance = torch.zeros(len(ids), dtype=torch.float64)
    importance[reasoning] = 0.5 * (logp.exp()[:, None] * jac.square()).sum(0)[reasoning]
    return importance


def fisher_sketch_variance(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int],
                           kind: ProbeKind, mask_token_id: int, outcomes: int, sketches: int) -> torch.Tensor:
    """(L,) float64 variance over the signs of the sketched fisher score of one sequence (docs/method.md §11): with
    a_v = √p_v ⟨∂ log p_v / ∂e_t, δ_t⟩ over the outcomes beyond the top K, one sketch's ½ (Σ_v s_v a_v)² has variance
    ¼ (2 (Σ_v a_v²)² − 2 Σ_v a_v⁴), and the mean of S independent sketches 1/S of it."""
    logp, jac = fisher_jacobian(model, ids, reasoning, answer, kind, mask_token_id)
    tail = torch.ones_like(logp, dtype=torch.bool)
    tail[logp.topk(outcomes).indices if outcomes else torch.zeros(0, dtype=torch.long)] = False
    a2 = torch.where(tail[:, None], logp.exp()[:, None] * jac.square(), 0.0)  # (V, L) a_v²
    var = torch.zeros(len(ids), dtype=torch.float64)
    var[reasoning] = (0.25 * (2 * a2.sum(0).square() - 2 * a2.square().sum(0)) / sketches)[reasoning]
    return var


def token_weights(importance: torch.Tensor, tau: float, beta: float, floor: float = 0.1) -> torch.Tensor:
    """OAR weights of one sequence's R reasoning tokens from their raw importance (docs/method.md §5).

    u = log1p(max(I, 0)); n = min-max of u (0 when constant); θ = the τ-quantile of n (linear interpolation);
    w = max(n / θ, floor) below θ, 1 + β (n − θ) / (1 − θ) from θ up; then w · R / Σw so that Σw = R.
    """
    u = torch.log1p(importance.double().clamp(min=0))
    n = (u - u.min()) / (u.max() - u.min()) if u.max() > u.min() else torch.zeros_like(u)
    theta = torch.quantile(n, tau)
    w = torch.where(n < theta, (n / (theta + 1e-8)).clamp(min=floor), 1 + beta * (n - theta) / (1 - theta + 1e-8))
    return w * len(w) / w.sum()


# ---------------------------------------------------------------------------------------------------------------------
# verl's padded batch layout, one row at a time
# ---------------------------------------------------------------------------------------------------------------------


def _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask, b: int):
    """Row ``b`` without padding: ids, reasoning and answer positions in its own coordinates, and the prompt length."""
    prompt = prompts[b][prompt_mask[b].bool()]
    response = responses[b][response_mask[b].bool()]
    ids = torch.cat([prompt, response])
    n = int(response_mask[b].sum())
    reasoning = [len(prompt) + i for i in range(n) if reasoning_mask[b, i]]
    answer = [len(prompt) + i for i in range(n) if answer_mask[b, i]]
    return ids, reasoning, answer, len(prompt)


def batch_oar_p(model, prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask, kind: ProbeKind,
                mask_token_id: int | str, span: int = 1, copies_per_forward: int | None = 1) -> torch.Tensor:
    """(B, T) float64 response-aligned OAR-P of a verl-layout batch (left-padded prompts (B, P), right-padded
    responses (B, T), (B, T) masks), row by row with :func:`oar_p`."""
    out = torch.zeros(responses.shape, dtype=torch.float64)
    for b in range(responses.shape[0]):
        ids, reasoning, answer, p = _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                         b)
        scores = oar_p(model, ids, reasoning, answer, kind, mask_token_id, span, copies_per_forward)
        out[b, : len(ids) - p] = scores[p:]
    return out


def batch_oar_g(model, prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask, kind: ProbeKind,
                noise_std: float, seeds: torch.Tensor, parameter_gradients: bool = False) -> torch.Tensor:
    """(B, T) float64 response-aligned OAR-G of a verl-layout batch, row by row with :func:`oar_g` (seeds: (B,))."""
    out = torch.zeros(responses.shape, dtype=torch.float64)
    for b in range(responses.shape[0]):
        ids, reasoning, answer, p = _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                         b)
        scores = oar_g(model, ids, reasoning, answer, kind, noise_std, int(seeds[b]), parameter_gradients)
        out[b, : len(ids) - p] = scores[p:]
    return out


def batch_fisher(model, prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask, kind: ProbeKind,
                 mask_token_id: int | str, outcomes: int, sketches: int = 0, seed: int = 0) -> torch.Tensor:
    """(B, T) float64 response-aligned second-order masking scores of a verl-layout batch, row by row with
    :func:`fisher`."""
    out = torch.zeros(responses.shape, dtype=torch.float64)
    for b in range(responses.shape[0]):
        ids, reasoning, answer, p = _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                         b)
        scores = fisher(model, ids, reasoning, answer, kind, mask_token_id, outcomes, sketches, seed)
        out[b, : len(ids) - p] = scores[p:]
    return out


def path(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int], kind: ProbeKind,
         mask_token_id: int | str, points: int) -> torch.Tensor:
    """Path-integrated gradients of one sequence (docs/method.md §12), signed, one point at a time.

    At α_m = (m − ½)/M every reasoning embedding is moved to e_t + α_m (e_mask − e_t) (e_mask: :func:`mask_vector`),
    J = shift(clean, moved), and c_t = (1/M) Σ_m ⟨∂J/∂e_t, e_mask − e_t⟩.

    Returns:
        (L,) float64 signed scores, 0 off the reasoning positions.
    """
    importance = torch.zeros(len(ids), dtype=torch.float64)
    if not reasoning:
        return importance
    with torch.no_grad():
        clean = outcome(model(ids[None]).logits[0], ids, kind, reasoning, answer)
        embeddings = model.get_input_embeddings()(ids[None])
        delta = mask_vector(model, mask_token_id).to(embeddings.dtype) - embeddings[0, reasoning]  # (R, H)
    for m in range(points):
        alpha = (m + 0.5) / points
        moved = embeddings.clone()
        moved[0, reasoning] += alpha * delta
        moved.requires_grad_(True)
        J = shift(clean, outcome(model(inputs_embeds=moved).logits[0], ids, kind, reasoning, answer))
        (grad,) = torch.autograd.grad(J, moved)
        for j, t in enumerate(reasoning):
            importance[t] += float((grad[0, t].double() * delta[j].double()).sum()) / points
    return importance


def batch_path(model, prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask, kind: ProbeKind,
               mask_token_id: int | str, points: int) -> torch.Tensor:
    """(B, T) float64 response-aligned signed path-integrated gradients of a verl-layout batch, row by row with
    :func:`path`."""
    out = torch.zeros(responses.shape, dtype=torch.float64)
    for b in range(responses.shape[0]):
        ids, reasoning, answer, p = _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                         b)
        out[b, : len(ids) - p] = path(model, ids, reasoning, answer, kind, mask_token_id, points)[p:]
    return out


def conservative_logits(model: torch.nn.Module, embeddings: torch.Tensor, attention_rule: str = "values"
                        ) -> torch.Tensor:
    """(L, V) float64 logits of one unpadded sequence from its (L, H) input embeddings, computed by hand from a Qwen2
    (or Llama) model's weights with the conservative rules written into the forward (docs/method.md §13): the norm
    scale rsqrt(mean x² + ε) detached; attention by ``attention_rule``: ``values`` — queries and keys detached after
    RoPE (the attention probabilities constant), ``uniform`` — the scores q·k and the output P·V each the half-sum of
    their two one-factor-detached products (AttnLRP's half rule), the softmax plain; SiLU by the identity rule
    (silu(g) = g · [silu(g)/g], the ratio detached) and the gate × up product by the half rule. The values are the
    model's own; only the backward differs from the plain forward's."""
    cfg = model.config
    L, H = embeddings.shape
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(L, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]  # (L, 1, hd)

    def rope(x):  # (L, n, hd)
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def norm(x, weight, eps):
        return weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach())

    def linear(x, lin):
        return x @ lin.weight.double().T + (lin.bias.double() if lin.bias is not None else 0.0)

    causal = torch.ones(L, L, dtype=torch.bool).tril()
    h = embeddings.double()
    for layer in model.model.layers:
        att = layer.self_attn
        x = norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        q = rope(linear(x, att.q_proj).view(L, heads, hd))
        k = rope(linear(x, att.k_proj).view(L, kv, hd))
        v = linear(x, att.v_proj).view(L, kv, hd)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        if attention_rule == "values":
            scores = torch.einsum("qnd,knd->nqk", q.detach(), k.detach()) / math.sqrt(hd)
        else:
            scores = 0.5 * (torch.einsum("qnd,knd->nqk", q, k.detach())
                            + torch.einsum("qnd,knd->nqk", q.detach(), k)) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        if attention_rule == "values":
            out = torch.einsum("nqk,knd->qnd", probs, v)
        else:
            out = 0.5 * (torch.einsum("nqk,knd->qnd", probs, v.detach())
                         + torch.einsum("nqk,knd->qnd", probs.detach(), v))
        h = h + linear(out.reshape(L, heads * hd), att.o_proj)
        x = norm(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        mlp = layer.mlp
        gate, up = linear(x, mlp.gate_proj), linear(x, mlp.up_proj)
        ratio = torch.where(gate != 0, torch.nn.functional.silu(gate) / torch.where(gate != 0, gate, 1.0), 0.0)
        act = gate * ratio.detach()
        h = h + linear(0.5 * (act * up.detach() + act.detach() * up), mlp.down_proj)
    h = norm(h, model.model.norm.weight, model.model.norm.variance_epsilon)
    return linear(h, model.lm_head)


def conservative(model: torch.nn.Module, ids: torch.Tensor, reasoning: list[int], answer: list[int],
                 kind: ProbeKind, on_module: bool = False, pad_id: int = 0, attention_rule: str = "values"
                 ) -> torch.Tensor:
    """``mode=conservative`` of one sequence (docs/method.md §13): ⟨∂φ/∂e_t, e_t⟩ with φ the answer tokens'
    log-probability over the probe's positions (LT-Logits: the first answer token; AS-Mean and AS-Joint: the mean over
    the answer tokens; no answer: LT-Logits' fallback position, the last reasoning token, and the token after it).

    Args:
        on_module: run the model's own modules under :func:`oar_verl.core.backends.rules.conservative_rules` (any
            family; a per-sequence reference of the batched, padded fast path) instead of the hand-written Qwen2
            forward :func:`conservative_logits` (the rules' own definition).
        pad_id: the token after a sequence's last position (what the batch's shifted targets hold there).
        attention_rule: ``algorithm.oar.attention_rule``.

    Returns:
        (L,) float64 signed relevance, 0 off the reasoning positions.
    """
    importance = torch.zeros(len(ids), dtype=torch.float64)
    if not reasoning:
        return importance
    if answer:
        targets = [(a - 1, int(ids[a])) for a in (answer[:1] if kind == ProbeKind.LT_LOGITS else answer)]
    else:
        position = reasoning[-1]
        targets = [(position, int(ids[position + 1]) if position + 1 < len(ids) else pad_id)]
    with torch.no_grad():
        embeddings = model.get_input_embeddings()(ids[None])[0]
    e = embeddings.clone().requires_grad_(True)
    if on_module:
        from oar_verl.core.backends.rules import conservative_rules

        with conservative_rules(model, attention_rule):
            logits = model(inputs_embeds=e[None]).logits[0].double()
            phi = sum(torch.log_softmax(logits[p], -1)[t] for p, t in targets) / len(targets)
            (grad,) = torch.autograd.grad(phi, e)
    else:
        logits = conservative_logits(model, e, attention_rule)
        phi = sum(torch.log_softmax(logits[p], -1)[t] for p, t in targets) / len(targets)
        (grad,) = torch.autograd.grad(phi, e)
    for t in reasoning:
        importance[t] = (grad[t].double() * embeddings[t].double()).sum()
    return importance


def batch_conservative(model, prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                       kind: ProbeKind, on_module: bool = False, attention_rule: str = "values") -> torch.Tensor:
    """(B, T) float64 response-aligned ``mode=conservative`` of a verl-layout batch, row by row."""
    out = torch.zeros(responses.shape, dtype=torch.float64)
    for b in range(responses.shape[0]):
        ids, reasoning, answer, p = _row(prompts, prompt_mask, responses, response_mask, reasoning_mask, answer_mask,
                                         b)
        scores = conservative(model, ids, reasoning, answer, kind, on_module, attention_rule=attention_rule)
        out[b, : len(ids) - p] = scores[p:]
    return out
