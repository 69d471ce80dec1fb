"""OAR attribution through verl 0.9.1's Megatron engine (``actor.strategy=megatron``): TP, SP, PP and DP layouts.

* :mod:`.layout_checks` -- which layouts are supported (start-up and engine checks, no megatron-core needed);
* :mod:`.vocab_parallel` -- the outcome probe on vocab-parallel logits (never gathered on one rank);
* :mod:`.engine` -- rows in the engine's layout, engine batches, the probe hook the engine calls, settings switched
  for attribution calls;
* :mod:`.backend` -- the engine as a backend of the core's backend interface (:mod:`oar_verl.core.backends.base`), so every
  method and option of the core runs on it.

The result is complete on the engine's collecting rank (``engine.is_mp_src_rank_with_outputs()``: tp0, last pipeline
stage, cp0), like ``compute_log_prob``'s outputs. The engine's training layout may be packed
(``use_remove_padding=True``); attribution switches the engine to its padded BSHD path for its own calls.
``algorithm.oar.prefix_cache`` does not apply (the engine has no key/value cache path): OAR-P runs the batched masked
copies, with the same numbers.

Memory: micro-batches are sized by the token budget (rows × the longest sequence), as verl sizes its own passes
without dynamic batching; OAR-G's backward recomputes under the engine's full activation recomputation. The engine
materialises the logits of a whole micro-batch, ``(b, s, V/tp)`` in the model dtype (as its own log-prob pass does);
the probe itself works on ``(n_probe, V/tp)`` fp32.

megatron-core is imported lazily, so this package imports without it.
"""

from oar_verl.integration.megatron.layout_checks import (MegatronLayoutError, check_megatron_layout,
                                                         megatron_layout_error)

__all__ = ["MegatronLayoutError", "check_megatron_layout", "megatron_layout_error"]
