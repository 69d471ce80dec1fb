"""verl's FSDP1 engine on CPU ranks (tests only), in the processes that import this module
(``VERL_USE_EXTERNAL_MODULES``; never on GPUs):

* torch's FSDP1 refuses ``sync_module_states=True`` for parameters on the CPU (its broadcast is meant for GPUs), which
  verl always sets; gloo broadcasts CPU tensors, so the check is lifted;
* verl moves FSDP1's flat parameters "to the GPU" before syncing weights to the rollout, to the device named
  ``f"{device}:{index}"``, which the CPU platform's device id ("cpu") does not form: on CPU ranks they stay where they
  are.
"""

from __future__ import annotations

from torch.distributed.fsdp import _init_utils

_init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def _patch_verl() -> None:
    import verl.utils.fsdp_utils as fsdp_utils
    import verl.workers.engine.fsdp.transformer_impl as engine

    load = fsdp_utils.load_fsdp_model_to_gpu

    def load_fsdp_model(model):
        if fsdp_utils.fsdp_version(model) == 1:  # CPU ranks: the flat parameters never left the CPU
            return None
        return load(model)

    fsdp_utils.load_fsdp_model_to_gpu = engine.load_fsdp_model_to_gpu = load_fsdp_model


_patch_verl()
