"""verl plugin entry point (group ``verl.plugins``): registers the ``oar`` estimator and the OAR trainer mode, and
makes verl's stock trainers refuse ``adv_estimator=oar`` at construction.

verl imports this module on ``import verl`` in the driver, the TaskRunner and every Ray worker, and swallows any
exception at DEBUG level, so a broken install would only surface later as "Unknown advantage estimator". We log our
own failure at WARNING instead. Without entry points (or with VERL_USE_EXTERNAL_PLUGINS=none) the same registration
runs with ``VERL_USE_EXTERNAL_MODULES=oar_verl.integration.plugin``.
"""

import logging

logger = logging.getLogger("oar_verl")

try:
    from oar_verl.integration import estimator as _estimator  # noqa: F401  registers adv_estimator "oar"
    from oar_verl.integration import trainer_v1 as _trainer_v1  # noqa: F401  registers trainer mode "oar_sync"
    from oar_verl.integration.guard import install_stock_trainer_guard

    install_stock_trainer_guard()
    loaded = True
except Exception:  # verl would hide this; make it visible
    loaded = False
    logger.warning("oar_verl: plugin failed to load; adv_estimator=oar will be unavailable", exc_info=True)
