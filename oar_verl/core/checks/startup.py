"""The start-up checks, in one place: :func:`check_config` (the names a registry resolves, and the combinations that
depend on its entries' facts) and :func:`startup_checks` (that, then the model-dependent checks: an unsafe mask token
refused, gradient attribution past a sliding window warned of). verl's start-up
(:mod:`oar_verl.integration.startup`) and OpenRLHF's entry point (:mod:`oar_verl.openrlhf.checks`) call
:func:`startup_checks`; :func:`~oar_verl.core.preprocess.prepare_attribution` and
:func:`~oar_verl.core.methods.attribution.run_attribution` call :func:`check_config` for core-only users.

:class:`~oar_verl.core.config.OARConfig` itself checks types and ranges when built; every error here is an
:class:`~oar_verl.core.config.OARConfigError` naming the key and the allowed values (docs/config.md).
"""

from __future__ import annotations

from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.checks.mask_token import check_model_mask_token
from oar_verl.core.checks.model_rules import model_rules_error
from oar_verl.core.checks.registries import MASK_OPERATORS, METHODS, POLICIES
from oar_verl.core.checks.sliding_window import check_model_sliding_window
import dataclasses

from oar_verl.core.config import AUTO_MODE, AUTO_PROBE, OARConfig, OARConfigError
from oar_verl.core.methods.mask_operator import operator_names, operators_for
from oar_verl.core.text.answer_patterns import BUILTIN_PATTERNS, compile_answer_pattern
from oar_verl.core.text.segments import SEGMENT_SPLITS, compile_segment_split

__all__ = ["check_config", "concrete_configs", "registered_names", "require_resolved", "startup_checks"]


def registered_names() -> dict[str, tuple[str, ...]]:
    """The allowed values of every key that names a registry's entry, in the order errors list them: ``mode``
    (:data:`~oar_verl.core.methods.contract.METHODS`, sorted: its entries register from several modules), ``probe``
    (the schedule ``auto``, then every :class:`~oar_verl.core.batch.probes.ProbeKind`), ``mask``
    (:data:`~oar_verl.core.methods.mask_operator.MASK_OPERATORS`), ``perturbation``
    (:data:`~oar_verl.core.methods.policies.POLICIES`)."""
    return {"mode": tuple(sorted(METHODS.names())), "probe": (AUTO_PROBE, *(k.name.lower() for k in ProbeKind)),
            "mask": MASK_OPERATORS.names(), "perturbation": POLICIES.names()}


def check_config(cfg: OARConfig) -> OARConfig:
    """Check the names of ``cfg`` against the registries and the combinations their facts rule out; returns ``cfg``.

    Raises:
        OARConfigError: a name no registry holds (``mode``, ``perturbation``, ``mask``, ``probe``), an answer pattern
            or segment split that is neither built in nor a usable regex, ``mask_token_id`` missing for an operator
            that needs it or set for one that does not, an operator the mode cannot linearise (fisher + resample), or
            ``mask_span`` > 1 with a policy whose token level does not take it.
    """
    p = cfg.prefix
    if cfg.mode == AUTO_MODE:  # every mode auto may attribute with, checked as if it were the run's mode
        modes = registered_names()["mode"]
        for key, names in (("auto_candidates", cfg.auto_candidates), ("auto_default", (cfg.auto_default,))):
            for name in names:
                if name not in modes:
                    raise OARConfigError(f"{p}.{key}: {name!r} is not allowed; choose registered modes: "
                                         f"{', '.join(modes)}")
        for concrete in concrete_configs(cfg):
            check_config(concrete)
        return cfg
    for key, allowed in registered_names().items():
        if getattr(cfg, key) not in allowed:
            also = f", or {AUTO_MODE} (the run chooses, docs/auto.md)" if key == "mode" else ""
            raise OARConfigError(f"{p}.{key}={getattr(cfg, key)!r} is not allowed; choose one of: "
                                 f"{', '.join(allowed)}{also}")
    method, mask, policy = METHODS.get(cfg.mode), MASK_OPERATORS.get(cfg.mask), POLICIES.get(cfg.perturbation)
    _check_patterns(p, cfg.answer_patterns)
    if mask.needs_mask_token_id and cfg.mask_token_id is None:
        raise OARConfigError(f"{p}.mask={cfg.mask} needs {p}.mask_token_id (a plain token id); or choose {p}.mask="
                             f"{'|'.join(operator_names(lambda op: not op.needs_mask_token_id))}")
    if not mask.needs_mask_token_id and cfg.mask_token_id is not None:
        takes = '|'.join(operator_names(lambda op: op.needs_mask_token_id))
        raise OARConfigError(f"{p}.mask_token_id={cfg.mask_token_id} is used only with {p}.mask={takes} (got "
                             f"{p}.mask={cfg.mask!r}); set {p}.mask={takes} or drop {p}.mask_token_id")
    if method.linearises_mask and not mask.one_embedding:
        raise OARConfigError(f"{p}.mask={cfg.mask} is not allowed with {p}.mode={cfg.mode} ({cfg.mode} linearises a "
                             f"move to one embedding); choose {p}.mask={'|'.join(operators_for(method))}")
    if cfg.mask_span > 1 and not policy.mask_span:
        takes = '|'.join(n for n in POLICIES.names() if POLICIES.get(n).mask_span)
        raise OARConfigError(f"{p}.mask_span={cfg.mask_span} applies to {p}.perturbation={takes} only (got "
                             f"{p}.perturbation={cfg.perturbation!r}); set mask_span=1 or perturbation={takes}")
    try:
        compile_segment_split(cfg.segment_split)
    except ValueError as e:
        raise OARConfigError(f"{p}.segment_split={cfg.segment_split!r} is neither a built-in rule "
                             f"({', '.join(SEGMENT_SPLITS)}) nor a usable regex: {e}") from e
    return cfg


def concrete_configs(cfg: OARConfig) -> list[OARConfig]:
    """The configurations a run may attribute with: ``[cfg]``, or with ``mode=auto`` one per candidate and the default
    (``mode`` replaced)."""
    if cfg.mode != AUTO_MODE:
        return [cfg]
    return [dataclasses.replace(cfg, mode=m) for m in dict.fromkeys((*cfg.auto_candidates, cfg.auto_default))]


def require_resolved(cfg: OARConfig) -> OARConfig:
    """``cfg``, or an OARConfigError when its mode is still ``auto``: ``auto`` is decided by the OAR trainer step (its
    selector, oar_verl.core.auto, resolves it to a registered mode before anything attributes); a core call
    (``attribute``, ``oar_advantages``, ``run_attribution``) needs a concrete mode, and the error says how to pick one."""
    if cfg.mode == AUTO_MODE:
        raise OARConfigError(
            f"{cfg.prefix}.mode=auto is decided by the OAR trainer step, not by an attribution call: the step scores "
            f"{cfg.prefix}.auto_candidates against free controls on the run's own batches and resolves it to a method "
            f"(docs/auto.md). Give a core call a concrete mode, one of {', '.join(registered_names()['mode'])} "
            "(docs/method.md); to choose one on your own rows by the deletion metric, score the candidates with "
            "oar_verl.core.auto.measure.measure_candidates")
    return cfg


def startup_checks(cfg: OARConfig, *, model_path: str | None = None, tokenizer=None,
                   tokenizer_path: str | None = None, trust_remote_code: bool = False, max_tokens: int | None = None,
                   fidelity_check: str | None = None, hf_modules: bool = True) -> list[str]:
    """Every start-up check of a run, in order: :func:`check_config`, the mask token
    (:func:`~oar_verl.core.checks.mask_token.check_model_mask_token`: the model's tokenizer and generation config), the
    conservative rules against the model's modules (:func:`~oar_verl.core.checks.model_rules.model_rules_error`, where
    the run attributes Hugging Face modules: ``hf_modules``), the sliding window
    (:func:`~oar_verl.core.checks.sliding_window.check_model_sliding_window`, logged).

    Args:
        cfg: the run's OARConfig.
        model_path: the policy's directory (a remote path: the model-dependent checks wait for the first step).
        tokenizer: the trainer's tokenizer, when it has one (else loaded from ``tokenizer_path`` or ``model_path``).
        tokenizer_path, trust_remote_code: how to load it.
        max_tokens: the longest row (prompt + response); None: unknown.
        fidelity_check: how users of this trainer check the fidelity (named in the sliding-window warning).

    Returns:
        the warnings (logged as well); errors raise.

    Raises:
        OARConfigError: see :func:`check_config`, an unsafe mask token, and a mode whose conservative rules do not
            cover the model (naming the model type and the modes that work).
    """
    check_config(cfg)
    for concrete in concrete_configs(cfg):
        check_model_mask_token(concrete, model_path, tokenizer, tokenizer_path=tokenizer_path,
                               trust_remote_code=trust_remote_code)
    refusal = model_rules_error(cfg, model_path, trust_remote_code) if hf_modules else None
    if refusal is not None:
        raise OARConfigError(refusal)
    if cfg.mode == AUTO_MODE:  # auto measures each band of a sliding-window model itself: nothing to warn of
        return []
    warning = check_model_sliding_window(cfg, model_path, max_tokens, fidelity_check)
    return [] if warning is None else [warning]


def _check_patterns(prefix: str, patterns: tuple[str, ...]) -> None:
    """Every answer pattern is a built-in name or a regex the span finder can use (compiled by the very function
    every step uses)."""
    for pat in patterns:
        if pat in BUILTIN_PATTERNS:
            continue
        try:
            compile_answer_pattern(pat)
        except ValueError as e:
            raise OARConfigError(f"{prefix}.answer_patterns entry {pat!r} is neither a built-in pattern "
                                 f"({', '.join(BUILTIN_PATTERNS)}) nor a usable answer regex: {e}") from e
