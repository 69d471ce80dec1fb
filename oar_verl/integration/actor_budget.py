"""The actor's own token budget, read from verl's engine settings, as the default budget of attribution passes.

OAR-P's passes are forward-only, like verl's log-prob pass; OAR-G's are forward + backward, like the PPO update. So
each method takes the budget of its counterpart: with ``use_dynamic_bsz`` the ``*_max_token_len_per_gpu`` of that
pass, otherwise its micro-batch size × the longest sequence of the batch. ``algorithm.oar.max_token_len_per_gpu``
overrides both. Under Ulysses sequence parallelism the budget is per GPU, for each rank's shard of a pass, as verl's
own budgets are (docs/verl.md).
"""

from __future__ import annotations

from oar_verl.core.methods.attribution import METHODS
from oar_verl.core.config import OARConfig


def actor_token_budget(cfg: OARConfig, engine_config, longest: int) -> int:
    """Tokens one attribution pass may hold on this rank.

    Args:
        cfg: the OAR configuration (``max_token_len_per_gpu`` wins when set).
        engine_config: the actor's verl engine config (``use_dynamic_bsz``, ``[infer_]max_token_len_per_gpu``,
            ``[infer_]micro_batch_size_per_gpu``).
        longest: tokens of the longest sequence in the batch (all ranks: the budget must not depend on the rank).
    """
    if cfg.max_token_len_per_gpu is not None:
        return cfg.max_token_len_per_gpu
    forward_only = METHODS.get(cfg.mode).forward_only
    if engine_config.use_dynamic_bsz:
        tokens = engine_config.infer_max_token_len_per_gpu if forward_only else engine_config.max_token_len_per_gpu
        if tokens:
            return int(tokens)
    rows = engine_config.infer_micro_batch_size_per_gpu if forward_only else engine_config.micro_batch_size_per_gpu
    return max(1, int(rows or 1)) * max(1, int(longest))
