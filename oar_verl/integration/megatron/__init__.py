"""OAR attribution through verl 0.9.1's Megatron engine (``actor.strategy=megatron``): TP, SP, PP and DP layouts.

* :mod:`.layout_checks` -- which layouts are supported (start-up and engine checks, no megatron-core needed);
* :mod:`.vocab_parallel` -- the outcome probe on vocab-parallel logits (never gathered on one rank);
* :mod:`.engine` -- rows in the engine's layout, engine batches, the probe hook the engine calls, settings switched
  for attribution calls;
* :mod:`.drivers` -- OAR-P and OAR-G as engine calls.

The result is returned on the engine's collecting rank (``engine.is_mp_src_rank_with_outputs()``: tp0, last pipeline
stage, cp0) and None elsewhere, like ``compute_log_prob``'s outputs. The engine's training layout may be packed
(``use_remove_padding=True``); attribution switches the engine to its padded BSHD path for its own calls.
``algorithm.oar.prefix_cache`` does not apply (the engine has no key/value cache path): OAR-P runs the batched masked
copies, with the same numbers.

Memory: micro-batches are sized by the token budget (rows × the longest sequence), as verl sizes its own passes
without dynamic batching; OAR-G's backward recomputes under the engine's full activation recomputation. The engine
materialises the logits of a whole micro-batch, ``(b, s, V/tp)`` in the model dtype (as its own log-prob pass does);
the probe itself works on ``(n_probe, V/tp)`` fp32.

megatron-core is imported lazily, so this package imports without it.
"""

from __future__ import annotations

import torch

from oar_verl.core.budget import PassLimits
from oar_verl.core.config import OARConfig
from oar_verl.core.layout import AttributionBatch
from oar_verl.integration.megatron import drivers
from oar_verl.integration.megatron.engine import engine_rows
from oar_verl.integration.megatron.layout_checks import (MegatronLayoutError, check_megatron_layout,
                                                         megatron_layout_error)

__all__ = ["MegatronLayoutError", "check_megatron_layout", "megatron_layout_error", "megatron_token_importance"]


def megatron_token_importance(engine, batch: AttributionBatch, cfg: OARConfig, limits: PassLimits, *,
                              mask_token_id: int | None, seeds: torch.Tensor | None) -> torch.Tensor | None:
    """OAR importance of the batch's reasoning tokens through a verl Megatron engine.

    Call under ``engine.eval_mode()`` on every rank of the actor mesh (all tensor/pipeline ranks of a data-parallel
    group hold the same batch, as verl dispatches ``compute_log_prob``).

    Args:
        engine: verl's ``MegatronEngineWithLMHead``, initialised.
        batch: AttributionBatch (B, L), on any device; each row's real tokens contiguous with position ids 0..n-1
            (verl's layout: left-padded prompt + right-padded response).
        cfg: OARConfig (``prefix_cache`` does not apply: the Megatron path always runs the batched masked copies;
            ``noise_samples`` must be 1).
        limits: the token budget of one engine micro-batch (rows × the longest sequence); caps apply.
        mask_token_id: OAR-P mask token (required for perturbation).
        seeds: (B,) int64 OAR-G noise seeds (required for gradient).

    Returns:
        (B, L) float32 importance (0 off the reasoning tokens) on the collecting rank
        (``engine.is_mp_src_rank_with_outputs()``), None on every other rank.

    Raises:
        MegatronLayoutError: a layout OAR does not support (context parallelism, virtual pipeline, fused kernels,
            multi-token prediction, per-token-loss regime).
    """
    check_megatron_layout(engine)
    if cfg.mode == "perturbation":
        if mask_token_id is None:
            raise ValueError("OAR-P needs a mask token: set algorithm.oar.mask_token_id or give the tokenizer a pad "
                             "token")
        if cfg.perturbation != "exact":  # refused at start-up too (oar_verl.integration.startup)
            raise MegatronLayoutError(f"{cfg.prefix}.perturbation={cfg.perturbation!r}: the Megatron path runs exact "
                                      "OAR-P only")
    elif seeds is None:
        raise ValueError("OAR-G needs per-sequence noise seeds (see oar_verl.core.gradient.sequence_seeds)")
    elif cfg.noise_samples != 1:  # refused at start-up too (oar_verl.integration.startup)
        raise MegatronLayoutError(f"{cfg.prefix}.noise_samples={cfg.noise_samples}: the Megatron path runs one OAR-G "
                                  "noise draw per sequence only")
    rows = engine_rows(batch)
    if cfg.mode == "perturbation":
        importance = drivers.oar_p(engine, batch, rows, cfg, limits, int(mask_token_id))
    else:
        importance = drivers.oar_g(engine, batch, rows, cfg, limits, seeds)
    if not engine.is_mp_src_rank_with_outputs():
        return None
    return importance
