"""The registries the start-up checks read, always filled: importing the method modules is what registers the built-in
methods (``gradient``, ``perturbation`` with its policies, ``fisher``, ``path``) in
:data:`~oar_verl.core.methods.contract.METHODS`, so a check never meets a registry that is still empty. The lookups
of a configuration's entries (:func:`method_of`, :func:`mask_operator_of`) are the checks' only way to a mode's or an
operator's facts.
"""

from __future__ import annotations

import oar_verl.core.methods.fisher  # noqa: F401  (registers fisher)
import oar_verl.core.methods.gradient  # noqa: F401  (registers gradient)
import oar_verl.core.methods.path  # noqa: F401  (registers path)
import oar_verl.core.methods.policies  # noqa: F401  (registers perturbation and its policies)
from oar_verl.core.methods.contract import METHODS, Method
from oar_verl.core.methods.mask_operator import MASK_OPERATORS, MaskOperator
from oar_verl.core.methods.policies import POLICIES

__all__ = ["MASK_OPERATORS", "METHODS", "POLICIES", "mask_operator_of", "method_of"]


def method_of(cfg) -> Method:
    """The registered method of ``cfg.mode`` (a ValueError naming the key and the registered modes if none)."""
    return METHODS.get(cfg.mode)


def mask_operator_of(cfg) -> MaskOperator:
    """The registered mask operator of ``cfg.mask``."""
    return MASK_OPERATORS.get(cfg.mask)
