"""The refusal of mask tokens that would end a turn mid-reasoning, for the methods that mask (registered with
``uses_mask_token``) with an operator that inserts a token, ``algorithm.oar.mask=pad|token``.

Called at start-up (:func:`oar_verl.core.checks.startup.startup_checks`, for verl and OpenRLHF) and where the token is
resolved at run time (:mod:`oar_verl.core.preprocess`); docs/method.md §3.

In many chat models the pad token is the EOS or an end-of-turn marker (SmolLM2's pad is ``<|im_end|>``,
Qwen2.5-Instruct's ``<|endoftext|>`` is one of its generation EOS ids): masking with it inserts an end of turn in the
middle of the reasoning, and the "importance" measures the reaction to that. The operators themselves:
:mod:`oar_verl.core.methods.mask_operator`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from oar_verl.core.checks.registries import mask_operator_of, method_of
from oar_verl.core.config import OARConfigError
from oar_verl.core.methods.mask_operator import operators_for

__all__ = ["check_mask_token", "check_model_mask_token", "generation_eos_ids", "resolve_mask_token",
           "template_token_ids", "unsafe_mask_reason"]

_ROLE_TOKENS = ("bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id")
_DEDICATED_TOKENS = ("mask_token_id", "unk_token_id", "pad_token_id")


def _eos_set(tokenizer, eos_ids: Iterable[int] | int | None) -> set[int]:
    out = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    return out | {int(i) for i in (eos_ids or ()) if i is not None}


_PLACEHOLDER = "OARPLACEHOLDER"
# conversations the chat template is rendered on, the first it accepts wins (some templates refuse a system turn)
_PROBE_ROLES = (("system", "user", "assistant", "user"), ("user", "assistant", "user"))


def template_token_ids(tokenizer) -> set[int] | None:
    """The token ids the chat template itself writes: role and end-of-turn markers, separators, a default system
    prompt.

    The template is rendered on a short conversation whose every message is a placeholder, with the generation prompt;
    the text between the placeholders is the template's own, and its tokens are returned. (Matching a token's text
    against the Jinja source instead would refuse every short plain token: ``_`` is in ``add_generation_prompt``.) A
    tokenizer with named templates (a dict: ``default``, ``tool_use``, ...) has every one of them rendered: the union.

    Returns:
        the set of ids; empty without a chat template; None when no template renders any of the probe conversations
        (the caller then relies on the special-token check alone).
    """
    templates = getattr(tokenizer, "chat_template", None)
    if not templates:
        return set()
    found = None
    for name in (list(templates) if isinstance(templates, dict) else [None]):
        ids = _written_ids(tokenizer, name)
        if ids is not None:
            found = (found or set()) | ids
    return found


def _written_ids(tokenizer, name: str | None) -> set[int] | None:
    """The ids one template (``name`` of the named templates; None: the only one) writes; None when it renders none of
    the probe conversations."""
    named = {} if name is None else {"chat_template": name}
    for roles in _PROBE_ROLES:
        messages = [{"role": r, "content": _PLACEHOLDER} for r in roles]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **named)
        except Exception:  # a template that refuses this conversation (roles, alternation): try the next
            continue
        if not isinstance(text, str) or _PLACEHOLDER not in text:
            continue
        ids: set[int] = set()
        for piece in text.split(_PLACEHOLDER):
            if piece:
                ids.update(tokenizer.encode(piece, add_special_tokens=False))
        return ids
    return None


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}


def unsafe_mask_reason(tokenizer, token_id: int, eos_ids: Iterable[int] | int | None = ()) -> str | None:
    """Why ``token_id`` must not replace reasoning tokens, or None when it may.

    Refused: an EOS (the tokenizer's ``eos_token_id`` and ``eos_ids``, e.g. the generation config's list), a token
    the chat template writes (:func:`template_token_ids`: end-of-turn and role markers), any other special or added
    special token (bos, ``<|im_start|>``, ...) unless it is a dedicated mask / unk / pad token that is none of those,
    and an id outside the vocabulary.
    """
    token_id = int(token_id)
    size = len(tokenizer)
    if not 0 <= token_id < size:
        return f"is outside the tokenizer's vocabulary (size {size})"
    if token_id in _eos_set(tokenizer, eos_ids):
        return "is an end-of-sequence token (the tokenizer's or the generation config's eos_token_id)"
    if token_id in (template_token_ids(tokenizer) or ()):
        return "is written by the tokenizer's chat template (an end-of-turn, role or separator token)"
    roles = {getattr(tokenizer, k, None) for k in _ROLE_TOKENS} - {None}
    dedicated = {getattr(tokenizer, k, None) for k in _DEDICATED_TOKENS} - {None} - roles
    if token_id in (_special_ids(tokenizer) | roles) - dedicated:
        return "is a special token of the tokenizer that the model reads as structure (bos, a role marker, ...)"
    return None


def _instead(cfg) -> str:
    """What to set instead of an inserting operator: the operators this mode takes that insert no token, or
    ``mask_token_id``."""
    p = cfg.prefix
    return (f"{p}.mask={'|'.join(operators_for(method_of(cfg), inserting=False))}, or {p}.mask=token "
            f"{p}.mask_token_id=<a plain token>")


def resolve_mask_token(cfg, tokenizer) -> int | None:
    """The token id of an operator that inserts one (``mask_token_id`` where the operator takes it, else the
    tokenizer's pad token); None for the others.

    Raises:
        OARConfigError: an operator that inserts the tokenizer's pad token, and a tokenizer without one.
    """
    op = mask_operator_of(cfg)
    if op.needs_mask_token_id:
        return cfg.mask_token_id
    if not op.inserts_token:
        return None
    if tokenizer.pad_token_id is None:
        raise OARConfigError(f"{cfg.prefix}.mask={cfg.mask} but the tokenizer has no pad token; set {_instead(cfg)}")
    return int(tokenizer.pad_token_id)


def check_mask_token(cfg, tokenizer, eos_ids: Iterable[int] | int | None = ()) -> int | None:
    """:func:`resolve_mask_token`, refused when :func:`unsafe_mask_reason` objects (vetted for the methods that mask
    tokens, ``Method.uses_mask_token``; returned as is for the others).

    Raises:
        OARConfigError: naming ``algorithm.oar.mask``, the token id and text, why, and how to override.
    """
    token = resolve_mask_token(cfg, tokenizer)
    if token is None or not method_of(cfg).uses_mask_token:
        return token
    why = unsafe_mask_reason(tokenizer, token, eos_ids)
    if why is None:
        return token
    p = cfg.prefix
    source = f"{p}.mask_token_id={token}" if mask_operator_of(cfg).needs_mask_token_id else "the tokenizer's pad token"
    text = tokenizer.convert_ids_to_tokens(token) if 0 <= token < len(tokenizer) else None
    raise OARConfigError(f"{p}.mask={cfg.mask}: the mask token {token} ({text!r}, {source}) {why}; masking with it "
                         f"inserts it mid-reasoning and OAR would score the reaction to it. Set {_instead(cfg)}")


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
                           trust_remote_code: bool = False, eos_ids: Iterable[int] | None = None) -> int | None:
    """Start-up form of :func:`check_mask_token` for a model directory: its tokenizer (loaded from ``tokenizer_path``
    or ``model_path`` when none is given) and the EOS ids of its generation config, with ``eos_ids`` (the ones a
    trainer already resolved, e.g. TRL's ``GRPOTrainer.eos_token_ids`` from the loaded model's generation config,
    which a hub id's has no local file for). Nothing to check (None) when the operator uses no token or the tokenizer
    is not at hand (a remote path: :mod:`oar_verl.core.preprocess` checks at the first step).

    Raises:
        OARConfigError: an unsafe mask token (see :func:`check_mask_token`).
    """
    if not method_of(cfg).uses_mask_token or not mask_operator_of(cfg).inserts_token:
        return None
    if tokenizer is None:
        path = tokenizer_path or model_path
        if not path or not os.path.isdir(str(path)):
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return check_mask_token(cfg, tokenizer, [*generation_eos_ids(model_path), *(eos_ids or ())])
