"""OAR-P's mask operator (``algorithm.oar.mask``): what replaces a masked token, and the start-up refusal of mask tokens
that would end a turn mid-reasoning (docs/method.md §3).

OAR-P scores a reasoning token by the outcome's shift when the token is replaced; ``fisher`` linearises that swap as a
move of the token's embedding. The operators:

* ``pad`` / ``token``: the token id (the tokenizer's pad token / ``mask_token_id``) replaces ``input_ids``;
* ``zero`` / ``mean``: the masked position's input-embedding output is set to the zero vector / the mean of the
  embedding table's rows (as the embedding module outputs them, i.e. with a scaled embedding's ``embed_scale``);
* ``resample``: each masked token is replaced by a token id drawn from the same row's own reasoning tokens (the
  policy's empirical marginal, not the model's conditional), seeded by the row's seed and the token's reasoning rank,
  so the draw does not depend on batching, padding or the data-parallel layout.

In many chat models the pad token is the EOS or an end-of-turn marker (SmolLM2's pad is ``<|im_end|>``,
Qwen2.5-Instruct's ``<|endoftext|>`` is one of its generation EOS ids): masking with it inserts an end of turn in the
middle of the reasoning, and the "importance" measures the reaction to that. :func:`check_mask_token` refuses such
tokens at start-up (verl, OpenRLHF) and where the token is resolved at run time (:mod:`oar_verl.core.preprocess`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from oar_verl.core.backend import AttributionBackend, Replacement
from oar_verl.core.layout import AttributionBatch

MASK_OPERATORS = ("mean", "zero", "resample", "pad", "token")
TOKEN_OPERATORS = ("pad", "token")  # a token id replaces input_ids (the ones :func:`check_mask_token` vets)
EMBEDDING_OPERATORS = ("zero", "mean")  # the embedding output is replaced
DEFAULT_MASK = "mean"  # always safe (no token is inserted); the one place the default lives

__all__ = ["DEFAULT_MASK", "EMBEDDING_OPERATORS", "MASK_OPERATORS", "TOKEN_OPERATORS", "check_mask_token",
           "check_model_mask_token", "generation_eos_ids", "mask_replacement", "replacement_embedding", "resample_ids", "resolve_mask_token",
           "unsafe_mask_reason"]

_ROLE_TOKENS = ("bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id")
_DEDICATED_TOKENS = ("mask_token_id", "unk_token_id", "pad_token_id")


def _eos_set(tokenizer, eos_ids: Iterable[int] | int | None) -> set[int]:
    out = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    return out | {int(i) for i in (eos_ids or ()) if i is not None}


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}


def unsafe_mask_reason(tokenizer, token_id: int, eos_ids: Iterable[int] | int | None = ()) -> str | None:
    """Why ``token_id`` must not replace reasoning tokens, or None when it may.

    Refused: an EOS (the tokenizer's ``eos_token_id`` and ``eos_ids``, e.g. the generation config's list), a token
    whose text appears in the chat template (end-of-turn and role markers), any other special or added special token
    (bos, ``<|im_start|>``, ...) unless it is a dedicated mask / unk / pad token that is none of those, and an id
    outside the vocabulary.
    """
    token_id = int(token_id)
    size = len(tokenizer)
    if not 0 <= token_id < size:
        return f"is outside the tokenizer's vocabulary (size {size})"
    if token_id in _eos_set(tokenizer, eos_ids):
        return "is an end-of-sequence token (the tokenizer's or the generation config's eos_token_id)"
    text = tokenizer.convert_ids_to_tokens(token_id)
    if text and text in _template_text(tokenizer):
        return "appears in the tokenizer's chat template (an end-of-turn or role marker)"
    roles = {getattr(tokenizer, k, None) for k in _ROLE_TOKENS} - {None}
    dedicated = {getattr(tokenizer, k, None) for k in _DEDICATED_TOKENS} - {None} - roles
    if token_id in (_special_ids(tokenizer) | roles) - dedicated:
        return "is a special token of the tokenizer that the model reads as structure (bos, a role marker, ...)"
    return None


def resolve_mask_token(cfg, tokenizer) -> int | None:
    """The token id of a token operator (``pad``: the tokenizer's pad token, ``token``: ``mask_token_id``); None for
    the others.

    Raises:
        OARConfigError: ``mask=pad`` with a tokenizer that has no pad token.
    """
    from oar_verl.core.config import OARConfigError

    if cfg.mask == "token":
        return cfg.mask_token_id
    if cfg.mask != "pad":
        return None
    if tokenizer.pad_token_id is None:
        raise OARConfigError(f"{cfg.prefix}.mask=pad but the tokenizer has no pad token; set {cfg.prefix}.mask="
                             f"mean|zero|resample, or {cfg.prefix}.mask=token {cfg.prefix}.mask_token_id=<a plain token>")
    return int(tokenizer.pad_token_id)


def check_mask_token(cfg, tokenizer, eos_ids: Iterable[int] | int | None = ()) -> int | None:
    """:func:`resolve_mask_token`, refused when :func:`unsafe_mask_reason` objects (only OAR-P and fisher mask).

    Raises:
        OARConfigError: naming ``algorithm.oar.mask``, the token id and text, why, and how to override.
    """
    from oar_verl.core.config import OARConfigError

    token = resolve_mask_token(cfg, tokenizer)
    if token is None or cfg.mode == "gradient":
        return token
    why = unsafe_mask_reason(tokenizer, token, eos_ids)
    if why is None:
        return token
    p = cfg.prefix
    source = f"{p}.mask_token_id={token}" if cfg.mask == "token" else "the tokenizer's pad token"
    text = tokenizer.convert_ids_to_tokens(token) if 0 <= token < len(tokenizer) else None
    raise OARConfigError(f"{p}.mask={cfg.mask}: the mask token {token} ({text!r}, {source}) {why}; masking with it "
                         f"inserts it mid-reasoning and OAR would score the reaction to it. Set {p}.mask=mean|zero|"
                         f"resample, or {p}.mask=token {p}.mask_token_id=<a plain token>")


def generation_eos_ids(path: str | None) -> list[int]:
    """The ``eos_token_id`` (an id or a list) of the generation config at ``path``; [] when there is none."""
    if not path:
        return []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except Exception:  # no generation_config.json (or no transformers): only the tokenizer's EOS is known
        return []
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def check_model_mask_token(cfg, model_path: str | None, tokenizer=None, *, tokenizer_path: str | None = None,
                           trust_remote_code: bool = False) -> int | None:
    """Start-up form of :func:`check_mask_token` for a model directory: its tokenizer (loaded from ``tokenizer_path``
    or ``model_path`` when none is given) and the EOS ids of its generation config. Nothing to check (None) when the operator uses no token or the
    tokenizer is not at hand (a remote path: :mod:`oar_verl.core.preprocess` checks at the first step).

    Raises:
        OARConfigError: an unsafe mask token (see :func:`check_mask_token`).
    """
    import os

    if cfg.mode == "gradient" or cfg.mask not in TOKEN_OPERATORS:
        return None
    if tokenizer is None:
        path = tokenizer_path or model_path
        if not path or not os.path.isdir(str(path)):
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return check_mask_token(cfg, tokenizer, generation_eos_ids(model_path))


def resample_ids(batch: AttributionBatch, seeds: torch.Tensor) -> torch.Tensor:
    """(B, L) long: every reasoning token replaced by one of its own row's reasoning tokens, drawn uniformly (the
    row's empirical token marginal); other tokens unchanged.

    Draw k of row b is hash(seeds[b], k) mod R_b, k the token's rank among the row's R_b reasoning tokens: a pure
    function of (seed, rank), so no generator state, device or layout enters.

    Args:
        batch: AttributionBatch (B, L).
        seeds: (B,) int64 per-row seeds (content-derived, :func:`oar_verl.core.gradient.sequence_seeds`).
    """
    from oar_verl.core.gradient import draw_seeds

    mask = batch.reasoning_mask.bool()
    L = mask.shape[1]
    rank = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L) reasoning rank of each column
    counts = mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    # splitmix64-style mixes of (seed, rank): draw_seeds over the ranks 0..L-1, column k+1 -> rank k (column 0 keeps
    # the seed itself, a poor draw for rank 0)
    mixed = draw_seeds(seeds.to(mask.device), L + 1)[:, 1:]  # (B, L) non-negative int64
    pick = mixed.gather(1, rank).remainder(counts)  # (B, L) index into the row's reasoning tokens
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # reasoning columns first, in order
    drawn = batch.input_ids.gather(1, order.gather(1, pick))
    return torch.where(mask, drawn, batch.input_ids)


def mask_replacement(backend: AttributionBackend, batch: AttributionBatch, operator: str, token_id: int | None,
                     seeds: torch.Tensor | None) -> Replacement:
    """The :class:`~oar_verl.core.backend.Replacement` of ``operator`` for this batch, built once per batch.

    Args:
        backend: the model runtime (the table's mean embedding, the embedding's width).
        batch: AttributionBatch (B, L).
        operator: one of :data:`MASK_OPERATORS`.
        token_id: the resolved token of ``pad`` / ``token``.
        seeds: (B,) int64 per-row seeds for ``resample`` (None: a content hash of each row).
    """
    if operator in TOKEN_OPERATORS:
        if token_id is None:
            raise ValueError(f"mask={operator} needs a mask token: set algorithm.oar.mask=token and "
                             "algorithm.oar.mask_token_id, give the tokenizer a pad token, or use mask=mean|zero")
        return Replacement(token=int(token_id))
    if operator == "resample":
        if seeds is None:
            from oar_verl.core.gradient import sequence_seeds
            from oar_verl.core.preprocess import row_fingerprints

            seeds = sequence_seeds(0, 0, row_fingerprints(batch.input_ids, batch.attention_mask,
                                                          batch.input_ids[:, :0], batch.attention_mask[:, :0]))
        return Replacement(ids=resample_ids(batch, seeds))
    if operator == "mean":
        return Replacement(vector=backend.mean_embedding(), embedding=True)
    if operator == "zero":
        e = backend.mean_embedding()  # (H,) where an embedding lives: its width and dtype
        return Replacement(vector=None if e is None else torch.zeros_like(e), embedding=True)
    raise ValueError(f"unknown mask operator {operator!r}; one of {', '.join(MASK_OPERATORS)}")


def replacement_embedding(backend: AttributionBackend, replacement: Replacement) -> torch.Tensor | None:
    """(H,) the embedding output a masked token moves to (fisher's δ_t = this − e_t): the token's embedding, or the
    zero / mean vector; None where no embedding lives (Megatron's later stages)."""
    if replacement.ids is not None:
        raise ValueError("fisher linearises a move to one embedding; mask=resample has none (use "
                         "algorithm.oar.mask=mean|zero|pad|token)")
    return replacement.vector if replacement.embedding else backend.embedding(replacement.token)
