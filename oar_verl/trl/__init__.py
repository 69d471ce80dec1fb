"""OAR for TRL 1.16: ``OARGRPOTrainer`` and ``OARGRPOConfig``, in place of TRL's ``GRPOTrainer`` and ``GRPOConfig``.

The only package of ``oar_verl`` that imports TRL (``pip install "oar-verl[trl]"``); the maths is the core's. A TRL
script changes one import and one config class (docs/trl.md)::

    from oar_verl.trl import OARGRPOConfig as GRPOConfig, OARGRPOTrainer as GRPOTrainer
"""

from oar_verl.trl.config import OARGRPOConfig, OARTRLArgsError
from oar_verl.trl.trainer import OARGRPOTrainer

__all__ = ["OARGRPOConfig", "OARGRPOTrainer", "OARTRLArgsError"]
