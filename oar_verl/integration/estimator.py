"""The ``oar`` advantage estimator: a base outcome advantage (GRPO by default) reshaped token by token.

verl's advantage step calls it like any registered estimator. Its per-token inputs (importance, reasoning mask,
attributed rows, and the base advantage the step already computed) come through :mod:`oar_verl.integration.handoff`,
open only while the OAR step runs verl's advantage step; called outside one, it raises :class:`OARSetupError`
explaining how to run OAR.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import register_adv_est

from oar_verl.core.config import OARConfig
from oar_verl.core.reshaping.reshape import Reshaped, reshape_advantages
from oar_verl.integration import handoff

ESTIMATOR_NAME = "oar"

RUN_HINT = (
    "Run OAR with the OAR trainer:\n"
    "    python -m oar_verl.main algorithm.adv_estimator=oar algorithm.oar.mode=gradient ...\n"
    "(same config tree as verl.trainer.main_ppo, with the algorithm.oar.* keys declared; trainer.use_v1=false selects "
    "the legacy RayPPOTrainer). Or keep verl's entry point and select the registered OAR trainer:\n"
    "    python -m verl.trainer.main_ppo --config-path=<oar_verl>/integration/config --config-name=oar_trainer ...\n"
)


class OARSetupError(RuntimeError):
    """OAR is selected but the run is not set up to compute token importance."""


def read_oar_config(algorithm: Any) -> OARConfig:
    """The validated OARConfig of verl's ``algorithm`` config (DictConfig, AlgoConfig or dict), or an OARConfig."""
    if isinstance(algorithm, OARConfig):
        return algorithm
    oar = None
    if algorithm is not None:
        oar = algorithm.get("oar", None) if hasattr(algorithm, "get") else getattr(algorithm, "oar", None)
    return OARConfig.from_mapping(oar)


def base_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, algorithm: Any,
                   oar: OARConfig, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (B, T), of the base outcome estimator ``oar.base_estimator``.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uids.
        algorithm: verl's ``algorithm`` config (the base estimator reads its own keys from it).
        oar: the OAR configuration.
        **kwargs: any further arguments verl passes estimators.
    """
    norm_by_std = algorithm.get("norm_adv_by_std_in_grpo", True) if hasattr(algorithm, "get") else True
    if oar.base_estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                                         norm_adv_by_std_in_grpo=norm_by_std, config=algorithm)
    try:
        fn = core_algos.get_adv_estimator_fn(oar.base_estimator)
    except ValueError as e:
        raise OARSetupError(f"{oar.prefix}.base_estimator={oar.base_estimator!r} is not a registered verl "
                            f"estimator; registered: {', '.join(sorted(core_algos.ADV_ESTIMATOR_REGISTRY))}") from e
    if index is not None:
        kwargs["index"] = index
    return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, config=algorithm, **kwargs)


def compute_oar(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None,
                token_importance: torch.Tensor | None = None, reasoning_mask: torch.Tensor | None = None,
                attributed: torch.Tensor | None = None,
                base: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> Reshaped:
    """Base advantage × OAR weights, with everything the trainer logs.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T) 0/1.
        index: (B,) prompt uids (numpy object array).
        config: verl's ``algorithm`` config holding ``oar``.
        token_importance: (B, T) raw importance, response-aligned (from the OAR worker).
        reasoning_mask: (B, T) bool tokens to reshape (default: every valid token).
        attributed: (B,) bool rows whose importance was computed (default: all); the others keep w = 1.
        base: the base estimator's (advantages, returns), each (B, T), when already computed for these rewards.
        **kwargs: any further arguments verl passes estimators (given to the base estimator).

    Returns:
        Reshaped (:func:`oar_verl.core.reshaping.reshape.reshape_advantages`). Rows with zero base advantage, rows excluded by ``apply_to`` and rows with non-finite importance
        keep their base advantage unchanged.
    """
    cfg = read_oar_config(config)
    if token_importance is None:
        raise OARSetupError("adv_estimator=oar needs per-token importance (`token_importance`), which verl's stock "
                            "trainers never pass to an estimator.\n" + RUN_HINT)
    if token_importance.shape != response_mask.shape:
        raise ValueError(f"token_importance has shape {tuple(token_importance.shape)} but the responses have "
                         f"{tuple(response_mask.shape)}")
    base_adv, base_ret = base or base_advantage(token_level_rewards, response_mask, index, config, cfg, **kwargs)
    if reasoning_mask is None:
        reasoning_mask = response_mask.bool()
    return reshape_advantages(base_adv, token_importance, reasoning_mask, response_mask, cfg, attributed=attributed,
                              base_returns=base_ret)


@register_adv_est(ESTIMATOR_NAME)
def compute_oar_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None,
                          config: Any = None, token_importance: torch.Tensor | None = None,
                          reasoning_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl estimator ``oar``: returns (advantages, returns), each (B, T). See :func:`compute_oar`.

    The live path: verl calls it with (rewards, response_mask, index, config) inside an OAR step's handoff scope; the
    per-token inputs come from the scope, and the full result goes back to it. ``token_importance`` and
    ``reasoning_mask`` are never passed by verl: they serve direct calls outside a trainer (tests, core-only use).
    """
    opened = handoff.current()
    attributed = base = None
    if token_importance is None and opened is not None:
        inputs = opened.take(response_mask)
        token_importance, reasoning_mask, attributed = (inputs.token_importance, inputs.reasoning_mask,
                                                        inputs.attributed)
        base = inputs.base_for(token_level_rewards, response_mask)
    out = compute_oar(token_level_rewards, response_mask, index, config, token_importance, reasoning_mask,
                      attributed=attributed, base=base, **kwargs)
    if opened is not None:
        opened.result = out
    return out.advantages, out.returns
