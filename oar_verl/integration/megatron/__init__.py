"""OAR attribution through verl 0.9.1's Megatron engine (``actor.strategy=megatron``): TP, SP, PP and DP layouts.

:mod:`.backend` makes the engine a backend of the core's interface (:mod:`oar_verl.core.backends.base`), so every
method and option runs on it; :mod:`.engine` holds the plumbing, :mod:`.vocab_parallel` the outcome probe on
vocab-parallel logits (never gathered), :mod:`.layout_checks` the supported layouts (no megatron-core needed). Results
are complete on the engine's collecting rank, like ``compute_log_prob``'s; ``prefix_cache`` does not apply (no
key/value cache path). megatron-core is imported lazily. Layouts, memory and refusals: docs/verl.md, "Ulysses,
Megatron, and what is refused".
"""

from oar_verl.integration.megatron.layout_checks import (MegatronLayoutError, check_megatron_layout,
                                                         megatron_layout_error)

__all__ = ["MegatronLayoutError", "check_megatron_layout", "megatron_layout_error"]
