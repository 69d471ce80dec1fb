"""verl's FSDP1 engine on CPU ranks (tests only): torch's FSDP1 refuses ``sync_module_states=True`` for parameters on
the CPU (its broadcast is meant for GPUs), which verl always sets; gloo broadcasts CPU tensors, so the check is lifted
in the processes that import this module (``VERL_USE_EXTERNAL_MODULES``). Never used on GPUs."""

from __future__ import annotations

from torch.distributed.fsdp import _init_utils

_init_utils._check_module_states_for_sync_module_states = lambda module_states: None
