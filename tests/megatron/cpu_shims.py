"""TEST-ONLY shims that let verl 0.9.1's Megatron engine (megatron-core 0.16.1, mbridge 0.15.1) run on a CPU-only torch.

Never imported by the package: only ``engine_job.py`` (run in the .venv-mcore interpreter) imports this, before verl
and megatron-core build anything. Each shim names the error it removes (found by dropping one at a time, see
shared/reference/megatron-cpu-probes/ablation.txt). None changes the model's maths except M6, which makes the
local (non-TransformerEngine) attention causal the way TransformerEngine's is; the tests compare every number against
the Hugging Face reference, which is what catches a shim that would change results.

M1  mbridge hard-codes the TransformerEngine layer spec (``NameError: name 'TENorm' is not defined``):
    megatron-core's local spec instead.
M2  ``torch.cuda.current_device()`` / ``Module.cuda()`` / ``Tensor.cuda()`` (``Torch not compiled with CUDA``): CPU.
M3  the local spec names the RMSNorms ``input_layernorm`` / ``pre_mlp_layernorm`` (mbridge only knows TE's fused
    names: ``NotImplementedError: Unsupported parameter name``): extra weight-name mappings.
M4  ``device="cuda"`` literals all over megatron-core: a TorchFunctionMode that rewrites them to the CPU.
M5  megatron-core's CUDA RNG tracker: backed by the CPU generator.
M6  verl's BSHD path passes a [b, s] "True = real token" mask that the local DotProductAttention applies literally
    and then skips its causal mask (SILENTLY non-causal): drop 2-D masks so the kernel builds its causal mask
    (rows are right-padded, so padding is harmless), as TransformerEngine's causal attention does.
M7  the megatron optimizer checks ``param.type()`` against ``torch.cuda.*Tensor``: report CUDA type names.
M8  CUDA streams and events: no-ops.
M9  (``OAR_TEST_SP=1`` only) the local norm wrapper refuses sequence parallelism (``sequence parallel not supported by
    torch LayerNorm``); norms are per-token, so build it from a config copy without the flag.
M10 register verl's Megatron engine for device "cpu" (verl registers it for cuda/npu only).
M11 the local softmax's default causal mask is built with ``device="cuda"`` where M4's mode is not active: inside a
    full-recompute (``recompute_granularity="full"``) block's recomputation during the backward
    (``Torch not compiled with CUDA enabled``): build it on the CPU.
M12 verl's packed (THD, ``use_remove_padding=True``) layout: the local DotProductAttention refuses packed sequences
    (``Packed sequence is not supported by DotProductAttention``): attend within each packed sequence (its padded
    span), causally, as TransformerEngine's varlen kernel does.
plus ``float32_engine_config``: verl's McoreEngineConfig accepts only bf16/fp16; the exact-agreement tests run the
engine in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(d) -> bool:
    return (isinstance(d, str) and d.startswith("cuda")) or (isinstance(d, torch.device) and d.type == "cuda")


class _CudaToCpu(TorchFunctionMode):  # M4
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Event:  # M8
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _Stream:  # M8
    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _Event()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_MODE = None


def install() -> None:
    """Apply every shim (idempotent). Call before building the engine."""
    global _MODE
    if _MODE is not None:
        return
    # M2
    torch.cuda.current_device = lambda: "cpu"
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self
    # M4
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    # M5
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    torch.cuda.manual_seed = lambda s: torch.manual_seed(s)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    # M7
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            t = original_type(self)
            return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = tensor_type
    # M8
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.synchronize = lambda *a, **k: None
    # M1
    from mbridge.core import llm_bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(self, vp_stage=None):
        params = inspect.signature(get_gpt_decoder_block_spec).parameters
        self.has_vp_stage = "vp_stage" in params
        extra = {"vp_stage": vp_stage} if self.has_vp_stage else {}
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)

    llm_bridge.LLMBridge._get_transformer_layer_spec = local_spec
    # M3
    from mbridge.models.qwen2 import Qwen2Bridge

    Qwen2Bridge._OTHER_MAPPING = {**Qwen2Bridge._OTHER_MAPPING,
                                  "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    Qwen2Bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        **Qwen2Bridge._MLP_MAPPING}
    # M6
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original_forward = DotProductAttention.forward

    def causal_forward(self, query, key, value, attention_mask, *a, **k):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None
        return original_forward(self, query, key, value, attention_mask, *a, **k)

    # M12
    def packed_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                       packed_seq_params=None):
        if packed_seq_params is None:
            return causal_forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
        parts = [causal_forward(self, query[a:b, None], key[a:b, None], value[a:b, None], None, attn_mask_type,
                                attention_bias)[:, 0] for a, b in zip(cu[:-1], cu[1:])]  # per packed sequence
        return torch.cat(parts, 0)  # [t, hidden]: the attention reshapes it to [t, 1, hidden]

    DotProductAttention.forward = packed_forward
    # M9
    if os.environ.get("OAR_TEST_SP") == "1":
        from megatron.core.transformer import torch_norm

        original_new = torch_norm.WrappedTorchNorm.__new__

        def norm_new(cls, config, *a, **k):
            if config.sequence_parallel:
                config = copy.copy(config)
                config.sequence_parallel = False
            return original_new(cls, config, *a, **k)

        torch_norm.WrappedTorchNorm.__new__ = norm_new
    # M11
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    # M10
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend="megatron", device="cpu")(MegatronEngineWithLMHead)


def float32_engine_config(engine_config) -> None:
    """Make an McoreEngineConfig build an fp32 engine (verl's validation admits only bf16/fp16)."""
    object.__setattr__(engine_config, "dtype", "float32")
