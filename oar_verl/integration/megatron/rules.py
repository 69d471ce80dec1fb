"""Conservative propagation rules on megatron-core's GPT layers (``mode=conservative``; docs/method.md §13).

The rules of :mod:`oar_verl.core.backends.rules`, applied through module hooks so that every forward value stays
the engine's own, on megatron-core's local layer spec and on TransformerEngine's alike:

* attention: a pre-hook on each layer's ``core_attention`` (``DotProductAttention`` / ``TEDotProductAttention``)
  hands it the queries and keys detached (``values``) or gradient-scaled (``uniform``);
* RMSNorm: a hook on each norm -- a module of its own (``*RMSNorm``: the local spec's, TransformerEngine's final and
  query/key norms) or fused into the next linear (``TELayerNormColumnParallelLinear``: any module with a
  ``layer_norm_weight``) -- adds the backward term that holds the norm's scale constant
  (:func:`~oar_verl.core.backends.rules.norm_scale_held`), completed over the tensor-parallel group where the fused
  linear's output is a column shard (gathered over the sequence under sequence parallelism);
* gated MLP: ``linear_fc1``'s output [gate, up] is kept by a hook and ``linear_fc2``'s input replaced by the same
  value with the identity and half rules' gradient (:func:`~oar_verl.core.backends.rules.gated_half`), whatever
  activation kernel ran (fused swiglu, TransformerEngine's, plain).

A layer the rules do not know (LayerNorm, a mixture of experts, an MLP without a gate) raises instead of running
plain gradient × input under the method's name; so does a model with no attention, norm or MLP the rules found, and
an attention or MLP whose forward bypasses the submodule its rule is hooked on (TransformerEngine's operation fuser,
``use_te_op_fuser``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from oar_verl.core.backends.rules import ATTENTION_RULE_INPUTS, check_attention_rule, gated_half, norm_scale_held

_UNKNOWN = ("mode=conservative on the Megatron engine: the propagation rules know dense GPT layers with RMSNorm and "
            "a gated MLP; ")


def _is_fused_norm(module: torch.nn.Module) -> bool:
    return hasattr(module, "layer_norm_weight")


def _tp_dot(x_tokens: int):
    """The per-token dot of a column-parallel output summed over the tensor-parallel group, cut to this rank's
    sequence shard where the linear gathered its input (sequence parallelism)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    size = mpu.get_tensor_model_parallel_world_size()
    if size == 1:
        return None

    def reduce(dot: torch.Tensor) -> torch.Tensor:
        dot = dot.contiguous()
        dist.all_reduce(dot, group=mpu.get_tensor_model_parallel_group())
        if dot.shape[0] != x_tokens:
            rank = mpu.get_tensor_model_parallel_rank()
            dot = dot[rank * x_tokens:(rank + 1) * x_tokens]
        return dot

    return reduce


def _eps(module: torch.nn.Module, x: torch.Tensor) -> float:
    eps = module.eps  # checked to exist when the rules are applied; None: torch.nn.RMSNorm's default
    return float(torch.finfo(x.dtype).eps if eps is None else eps)


def _norm_hook(module, args, output):
    x = args[0]
    return norm_scale_held(x, output, _eps(module, x))


def _fused_norm_hook(module, args, output):
    x = args[0]
    out, bias = output if isinstance(output, tuple) else (output, None)
    added = getattr(module, "bias", None) if bias is None else None  # a bias the module added into out
    added = added if isinstance(added, torch.Tensor) and added.numel() > 0 else None
    held = norm_scale_held(x, out, _eps(module, x), bias=added, reduce=_tp_dot(x.shape[0]))
    return (held, bias) if isinstance(output, tuple) else held


def _attention_hook(rule: str):
    fn = ATTENTION_RULE_INPUTS[rule]

    def hook(module, args, kwargs):  # megatron-core calls core attention with query, key, value positional
        if len(args) < 3:
            raise RuntimeError(f"{_UNKNOWN}{type(module).__name__} was called without its query, key and value as "
                               "the first three arguments; use algorithm.oar.mode=fisher")
        return (*fn(*args[:3]), *args[3:]), kwargs

    return hook


def _check_mlp(mlp) -> str | None:
    config = mlp.config
    if not getattr(config, "gated_linear_unit", False):
        return "an MLP without a gated linear unit"
    if getattr(config, "glu_linear_offset", 0.0) or getattr(config, "activation_func_clamp_value", None):
        return "a gated MLP with a linear offset or a clamped activation"
    return None


def _layers(models) -> tuple[list, list, list, list, list[str]]:
    attention, mlps, norms, fused, unknown = [], [], [], [], []
    for model in models:
        for module in model.modules():
            name = type(module).__name__
            if hasattr(module, "core_attention"):
                attention.append(module)
            elif hasattr(module, "linear_fc1") and hasattr(module, "linear_fc2"):
                problem = _check_mlp(module)
                (unknown.append(f"{problem} ({name})") if problem else mlps.append(module))
            elif "MoE" in name or name.endswith("Experts"):
                unknown.append(f"a mixture of experts ({name})")
            elif _is_fused_norm(module) or name.endswith("RMSNorm"):
                norm = getattr(module, "normalization", "RMSNorm")
                if norm != "RMSNorm":
                    unknown.append(f"{norm} fused in {name}")
                elif not hasattr(module, "eps"):
                    unknown.append(f"an RMSNorm without an eps attribute ({name})")
                else:
                    (fused if _is_fused_norm(module) else norms).append(module)
            elif name.endswith("LayerNorm") or isinstance(module, torch.nn.LayerNorm):
                unknown.append(f"LayerNorm ({name})")
    return attention, mlps, norms, fused, unknown


def _must_reach(outer: torch.nn.Module, inner: torch.nn.Module, handles: list) -> None:
    """Raise after ``outer``'s forward if it did not call ``inner`` (a fused implementation, TransformerEngine's
    operation fuser for one, that bypasses the submodule a rule is hooked on: the rule would silently not apply)."""
    state = {"reached": True}

    def start(module, args):
        state["reached"] = False

    def reached(module, args):
        state["reached"] = True

    def check(module, args, output):
        if not state["reached"]:
            raise RuntimeError(f"{_UNKNOWN}{type(module).__name__} ran without calling its {type(inner).__name__} "
                               "(a fused implementation the rules cannot reach); use algorithm.oar.mode=fisher")

    handles += [outer.register_forward_pre_hook(start), inner.register_forward_pre_hook(reached),
                outer.register_forward_hook(check)]


@contextlib.contextmanager
def megatron_rules(models, attention_rule: str = "values") -> Iterator[None]:
    """Apply the rules to megatron-core model chunks (``engine.module``, DDP-wrapped or not) for the forwards and
    backwards run inside; every hook is removed on the way out, on error too.

    Raises:
        ValueError: a layer the rules do not know, or no attention / norm / MLP found (see the module docstring).
    """
    from verl.utils.megatron_utils import unwrap_model

    check_attention_rule(attention_rule)
    attention, mlps, norms, fused, unknown = _layers([unwrap_model(m) for m in models])
    if unknown:
        raise ValueError(_UNKNOWN + "this model has " + "; ".join(sorted(set(unknown))) +
                         " (use algorithm.oar.mode=fisher)")
    if not (attention and mlps and (norms or fused)):
        raise ValueError(_UNKNOWN + "none found in this model (use algorithm.oar.mode=fisher)")
    handles = []
    try:
        for layer in attention:
            handles.append(layer.core_attention.register_forward_pre_hook(_attention_hook(attention_rule),
                                                                          with_kwargs=True))
            _must_reach(layer, layer.core_attention, handles)
        for norm in norms:
            handles.append(norm.register_forward_hook(_norm_hook))
        for module in fused:
            handles.append(module.register_forward_hook(_fused_norm_hook))
        for mlp in mlps:
            kept: list = []
            act = mlp.config.activation_func

            def keep(module, args, output, kept=kept):
                out, bias = output if isinstance(output, tuple) else (output, None)
                kept.append(out if bias is None else out + bias)

            def replace(module, args, kept=kept, act=act):
                return (gated_half(kept.pop(), args[0], act), *args[1:])

            handles.append(mlp.linear_fc1.register_forward_hook(keep))
            handles.append(mlp.linear_fc2.register_forward_pre_hook(replace))
            _must_reach(mlp, mlp.linear_fc1, handles)
            _must_reach(mlp, mlp.linear_fc2, handles)
        yield
    finally:
        for handle in handles:
            handle.remove()
