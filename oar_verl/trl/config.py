"""TRL's ``GRPOConfig`` with OAR's keys as ``oar_<key>`` fields (``OARGRPOConfig``), built from the core's config.

Every field of :class:`oar_verl.core.config.OARConfig` (``algorithm.oar.<key>`` under verl, ``--oar.<key>`` under
OpenRLHF) becomes ``oar_<key>`` here, with the same default and help text (the prefix keeps the names apart from
TRL's own ``beta`` and ``seed``); tuple-valued keys are lists, as TRL's argument parser takes them. The class is
built from the core's fields, so a key added there appears here without being retyped.

Construction validates the OAR keys (ranges and registered names: :func:`~oar_verl.core.checks.startup.check_config`)
and the TRL settings OAR cannot be sound with (:func:`check_trl_args`); errors name the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from trl import GRPOConfig

from oar_verl.core.checks.versions import check_tested_release
from oar_verl.core.config import OARConfig, OARConfigError

__all__ = ["FIELD_PREFIX", "OARGRPOConfig", "OARTRLArgsError", "TESTED_TRL", "check_trl_args", "check_trl_version",
           "oar_config_of"]

TESTED_TRL = "1.16"  # the release line the trainer is tested against (tests/trl, docs/trl.md)
ALLOW_UNTESTED_ENV = "OAR_TRL_ALLOW_UNTESTED"
FIELD_PREFIX = "oar_"
_ERROR_PREFIX = "__oar_trl__"  # the prefix OARConfig's messages carry, rewritten to the TRL field names


class OARTRLArgsError(ValueError):
    """A TRL setting OAR cannot run with; the message names the field and the allowed values."""


def check_trl_version(version: str | None = None, *, allow_untested: bool | None = None) -> str:
    """Refuse a TRL outside the tested release line (:data:`TESTED_TRL`); ``OAR_TRL_ALLOW_UNTESTED=1`` turns the
    refusal into a warning. The trainer relies on ``GRPOTrainer._generate_and_score_completions`` returning the
    local ``advantages`` beside ``completion_mask``, and on ``_compute_loss`` taking (B, T) advantages."""
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("trl")
    return check_tested_release(version, TESTED_TRL, framework="TRL", extra="trl", allow_env=ALLOW_UNTESTED_ENV,
                                allow_untested=allow_untested, error=OARTRLArgsError, digits=2)


def _rename(message: str) -> str:
    """OARConfig's ``<prefix>.<key>`` names as this config's ``oar_<key>`` fields."""
    return re.sub(re.escape(_ERROR_PREFIX) + r"\.(\w+)", lambda m: FIELD_PREFIX + m.group(1), message)


# loss types whose gradient a mass-preserving token reshaping cannot change under a sequence-level ratio: their
# per-token loss is f(s) * A_t with s one ratio per sequence and every w_t > 0, so Σ_t f(s) w_t A = f(s) A Σ_t w_t =
# f(s) A T, exactly GRPO's (OpenRLHF's GSPO, refused there likewise); cispo and vespo multiply A_t by each token's own
# log-probability, where the weights matter
SEQUENCE_INVARIANT_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo")
UNSUPPORTED_OAR = {  # OAR keys whose machinery this adapter does not carry: value refused -> why
    ("mode", "auto"): "mode=auto's calibration (docs/auto.md) runs in the verl and OpenRLHF trainers only; choose "
                      "one of conservative, gradient, perturbation, fisher, path",
    ("target", "reference"): "target=reference needs each row's ground truth, which TRL's batch does not carry to "
                             "the trainer; use response",
}


def check_trl_args(args) -> None:
    """Refuse TRL settings under which OAR would silently do nothing or cannot run, naming the field.

    Raises:
        OARTRLArgsError: ``importance_sampling_level=sequence`` with a loss of :data:`SEQUENCE_INVARIANT_LOSSES`;
            ``use_liger_kernel`` (Liger's kernels replace the norms and MLPs the default mode's rules read, and are
            not tested here); ``oar_base_estimator`` other than ``grpo`` (TRL computes the base advantage itself);
            ``oar_fidelity_every`` > 0 (the in-step fidelity is not wired into TRL's step); the keys of
            :data:`UNSUPPORTED_OAR`.
    """
    level, loss = getattr(args, "importance_sampling_level", "token"), getattr(args, "loss_type", "dapo")
    if level == "sequence" and loss in SEQUENCE_INVARIANT_LOSSES:
        raise OARTRLArgsError(
            f"importance_sampling_level='sequence' with loss_type={loss!r}: one importance ratio s per sequence makes "
            f"the per-token loss f(s) * A_t, and OAR's weights keep each row's sum of A_t, so the gradient is GRPO's "
            f"whatever the weights (OAR would cost its passes and change nothing). Allowed: "
            f"importance_sampling_level='token' (any loss_type), or 'sequence' with loss_type 'cispo' or 'vespo'")
    if getattr(args, "use_liger_kernel", False):
        raise OARTRLArgsError("use_liger_kernel=True: Liger's kernels replace the model's norms, MLPs and rotary "
                              "embedding, which OAR's attribution backward passes (and the default mode's "
                              "propagation rules) run through; untested with OAR. Allowed: use_liger_kernel=False")
    base = getattr(args, FIELD_PREFIX + "base_estimator", "grpo")
    if base != "grpo":
        raise OARTRLArgsError(f"{FIELD_PREFIX}base_estimator={base!r}: under TRL the base advantage is TRL's own "
                              "(scale_rewards, multi_objective_aggregation); allowed: 'grpo'")
    if getattr(args, FIELD_PREFIX + "fidelity_every", 0):
        raise OARTRLArgsError(f"{FIELD_PREFIX}fidelity_every={getattr(args, FIELD_PREFIX + 'fidelity_every')!r}: "
                              "the in-step fidelity is not wired into TRL's step; allowed: 0 (measure offline with "
                              "oar_verl.core.fidelity.fidelity_report, docs/fidelity.md)")
    for (key, value), why in UNSUPPORTED_OAR.items():
        if getattr(args, FIELD_PREFIX + key, None) == value:
            raise OARTRLArgsError(f"{FIELD_PREFIX}{key}={value!r}: {why}")


def oar_config_of(args) -> OARConfig:
    """The core's :class:`OARConfig` from a config's ``oar_<key>`` fields (a plain ``GRPOConfig``: the defaults),
    checked against the registries; errors name the ``oar_<key>`` field."""
    from oar_verl.core.checks.startup import check_config

    values = {f.name: getattr(args, FIELD_PREFIX + f.name) for f in dataclasses.fields(OARConfig)
              if f.name != "prefix" and hasattr(args, FIELD_PREFIX + f.name)}
    try:
        return check_config(OARConfig.from_mapping(values, prefix=_ERROR_PREFIX))
    except OARConfigError as e:
        raise OARConfigError(_rename(str(e))) from None


def _oar_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """``(oar_<key>, type, field)`` for every key of :class:`OARConfig`, with its default and help text."""
    hints = typing.get_type_hints(OARConfig)
    out = []
    for f in dataclasses.fields(OARConfig):
        if f.name == "prefix":
            continue
        kind, meta = hints[f.name], {"help": f"OAR: {f.metadata['help']} (oar_verl's `{f.name}` key)"}
        if isinstance(f.default, tuple):  # TRL's parser takes lists; a mutable default needs a factory
            default = list(f.default)
            field = dataclasses.field(default_factory=lambda d=default: list(d), metadata=meta)
            kind = list[str]
        else:
            field = dataclasses.field(default=f.default, metadata=meta)
        out.append((FIELD_PREFIX + f.name, kind, field))
    return out


def _post_init(self) -> None:
    GRPOConfig.__post_init__(self)
    oar_config_of(self)
    check_trl_args(self)


def _oar(self) -> OARConfig:
    """The core's :class:`OARConfig` of these fields."""
    return oar_config_of(self)


OARGRPOConfig = dataclasses.make_dataclass(
    "OARGRPOConfig", _oar_fields(), bases=(GRPOConfig,),
    namespace={"__module__": __name__, "__post_init__": _post_init, "oar": _oar, "__doc__": (
        "TRL's GRPOConfig with OAR's keys as `oar_<key>` fields (the core's names, defaults and help: "
        "oar_verl.core.config.OARConfig; docs/config.md). Use it in place of GRPOConfig with OARGRPOTrainer; "
        "construction refuses invalid OAR values and TRL settings OAR cannot run with, naming the field.")})
