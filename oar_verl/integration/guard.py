"""Refuse ``adv_estimator=oar`` in verl's stock trainers at construction, before any rollout.

Without the OAR trainer nothing computes token importance, and the failure would otherwise come only at the first
advantage step, after a full rollout. Installed by the plugin entry point in every process that loads it.
"""

from __future__ import annotations

import functools

from oar_verl.integration.estimator import ESTIMATOR_NAME, RUN_HINT, OARSetupError


def uses_oar(config) -> bool:
    """Whether a verl config selects the ``oar`` estimator."""
    return config.algorithm.get("adv_estimator", None) == ESTIMATOR_NAME


def install_stock_trainer_guard() -> None:
    """Wrap the constructors of verl's V1 ``PPOTrainer`` and legacy ``RayPPOTrainer`` (idempotent); OAR's own trainers
    set ``_oar_trainer = True`` and pass."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    for cls in (PPOTrainer, RayPPOTrainer):
        original = cls.__init__
        if getattr(original, "_oar_guard", False):
            continue

        @functools.wraps(original)
        def guarded(self, config, *args, __original=original, **kwargs):
            if uses_oar(config) and not getattr(self, "_oar_trainer", False):
                raise OARSetupError(f"algorithm.adv_estimator=oar was selected with verl's stock trainer "
                                    f"{type(self).__name__}, which cannot compute token importance.\n" + RUN_HINT)
            __original(self, config, *args, **kwargs)

        guarded._oar_guard = True
        cls.__init__ = guarded
