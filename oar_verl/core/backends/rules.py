"""Conservative propagation rules on a Hugging Face causal LM (``mode=conservative``; docs/method.md §13).

Inside :func:`conservative_rules` the forward computes exactly what it computes outside (every value the same), and
the backward treats three non-linearities as constants of the forward (Ali et al. 2022; AttnLRP, Achtibat et al.
2024), so that gradient × input conserves relevance through the layers:

* attention, by ``attention_rule``: ``values`` — queries and keys detached (the attention probabilities constant;
  the values carry the gradient; Ali et al.'s rule), or ``uniform`` — AttnLRP's: the softmax by gradient × input and
  each of attention's two products by the half rule, so the queries' and keys' gradients are scaled by 1/4 and the
  values' by 1/2 (relevance also flows through what each token attends to);
* RMSNorm: the normalisation's scale detached (y = x ⊙ s with s = w·rsqrt(mean x² + ε) constant);
* gated MLP ``down(act(gate(x)) * up(x))``: the activation by the identity rule (act(g) = g · [act(g)/g], the ratio
  constant) and the product by the half rule (a·u with half the gradient to each factor).

Generic over the model family: attention through transformers' attention interface (the registered implementation
the model uses, and ``eager_attention_forward`` of its modelling module), norms by class name (``*RMSNorm``), MLPs by
their ``gate_proj`` / ``up_proj`` / ``down_proj`` / ``act_fn``. Checked on Qwen2 and Gemma 3 modules
(tests/core/test_conservative.py); a model with none of these raises instead of running plain gradient × input.
The rules as functions of tensors (:data:`ATTENTION_RULE_INPUTS`, :func:`norm_scale_held` for a norm whether or not
it is fused into the next linear, :func:`gated_half` for a concatenated gated layer) serve the Megatron engine's hooks
too (:mod:`oar_verl.integration.megatron.rules`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch

from oar_verl.core.config import ATTENTION_RULES


def ratio_times(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad · (out / x) elementwise, the ratio in fp32 or wider (0 where x = 0), in x's dtype: the gradient of a map
    taken as linear at its own value. Two wide temporaries at a time, formed in place."""
    wide = torch.promote_types(out.dtype, torch.float32)
    xf = x.to(wide, copy=True)
    zero = xf == 0
    ratio = out.to(wide, copy=True).div_(xf.masked_fill_(zero, 1.0))
    del xf
    return ratio.masked_fill_(zero, 0.0).mul_(grad).to(x.dtype)


class _Linearised(torch.autograd.Function):
    """``out`` (a value computed without a graph) with ∂out/∂x = out / x elementwise at constant ratio. The ratio is
    formed in the backward only, so the forward costs nothing beyond the map itself and keeps two tensors of the
    model's dtype (x, out) where a graph of the map would keep its fp32 intermediates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, out)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, out = ctx.saved_tensors
        return ratio_times(grad, out, x), None


class _HalfProduct(torch.autograd.Function):
    """a · u with half the gradient to each factor."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, u)
        return a * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, u = ctx.saved_tensors
        half = 0.5 * grad
        return half * u, half * a


def linear_rule(map_, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``map_(x, ...)``'s value with the gradient of x ↦ x · (out / x) at constant ratio (the identity and norm
    rules); the map itself runs without a graph."""
    with torch.no_grad():
        out = map_(x, *args, **kwargs)
    return _Linearised.apply(x, out)


def half_rule(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """a · u with half the gradient to each factor (the value a · u exactly)."""
    return _HalfProduct.apply(a, u)


class _ScaleHeld(torch.autograd.Function):
    """``out`` = L(N(x)) of an RMSNorm N (L linear: the identity, or a linear layer the norm is fused into) whose
    backward, added to the module's own, holds the norm's scale constant. With s = rsqrt(mean x² + ε) and g the
    gradient at ``out``, the rule's input gradient is the module's plus x · s² ⟨out − b, g⟩ / H: the norm's own
    backward removes exactly that component, and ⟨out − b, g⟩ is ⟨N(x), Lᵀg⟩, so neither the norm's weight nor L is
    needed (derivation: docs/method.md §13). ``reduce`` completes the per-token dot where ``out`` holds a shard of
    L's outputs (tensor parallelism), matching x's tokens."""

    @staticmethod
    def forward(ctx, x, out, bias, eps, reduce):
        ctx.save_for_backward(x, out, bias)
        ctx.eps, ctx.reduce = eps, reduce
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        x, out, bias = ctx.saved_tensors
        wide = torch.promote_types(x.dtype, torch.float32)
        y = out.to(wide) if bias is None else out.to(wide) - bias.to(wide)
        dot = (y * grad.to(wide)).sum(-1, keepdim=True)
        if ctx.reduce is not None:
            dot = ctx.reduce(dot)
        xf = x.to(wide, copy=True)
        scale = dot.div_((xf.pow(2).mean(-1, keepdim=True) + ctx.eps) * x.shape[-1])
        return xf.mul_(scale).to(x.dtype), grad, None, None, None


def norm_scale_held(x: torch.Tensor, out: torch.Tensor, eps: float, bias: torch.Tensor | None = None,
                    reduce=None) -> torch.Tensor:
    """``out`` (an RMSNorm of x, or a linear map of it computed by one fused module, ``bias`` included in ``out``
    or None) with the norm rule's gradient: the scale rsqrt(mean x² + ε) constant. The forward is the module's own
    (values bitwise unchanged); only its backward gains a term. ``reduce``: (dot over this rank's output features,
    [..., 1] per output token) -> the complete dot per token of x (None: ``out`` holds every feature)."""
    return _ScaleHeld.apply(x, out, bias, eps, reduce)


class _GatedHalf(torch.autograd.Function):
    """``h`` = act(g) ⊙ u of a gated MLP whose first layer outputs ``y`` = [g, u] (concatenated on the last
    dimension, Megatron's layout), with the identity rule on act and the half rule on the product: ∂g = ½ ∂h ⊙ u ⊙
    act(g) / g, ∂u = ½ ∂h ⊙ act(g). ``h`` is the model's own value; act is recomputed in fp32 in the backward."""

    @staticmethod
    def forward(ctx, y, h, act):
        ctx.save_for_backward(y)
        ctx.act = act
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        wide = torch.promote_types(y.dtype, torch.float32)
        g, u = y.to(wide).chunk(2, dim=-1)
        a = ctx.act(g)
        half = 0.5 * grad.to(wide)
        return torch.cat([ratio_times(half * u, a, g), half * a], dim=-1).to(y.dtype), None, None


def gated_half(y: torch.Tensor, h: torch.Tensor, act) -> torch.Tensor:
    """``h`` = act(g) ⊙ u (its value, detached) with the gated MLP's rules' gradient to ``y`` = [g, u]."""
    return _GatedHalf.apply(y, h.detach(), act)


class _GradScale(torch.autograd.Function):
    """x itself, with its gradient times a constant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x (the value unchanged) with ∂/∂x scaled by ``factor``."""
    return _GradScale.apply(x, factor)


def uniform_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AttnLRP's attention rule on an unchanged attention kernel: o = P·V and the scores s = q·k each split their
    relevance in half between the factors (half rule), the softmax between them by gradient × input, so ∂ reaches the
    values ×1/2 and the queries and keys ×1/2·1/2."""
    return scale_gradient(query, 0.25), scale_gradient(key, 0.25), scale_gradient(value, 0.5)


def _values_attention(query, key, value):
    return query.detach(), key.detach(), value


# each attention rule as (query, key, value) -> the kernel's inputs: the values unchanged, the gradients ruled
ATTENTION_RULE_INPUTS = {"values": _values_attention, "uniform": uniform_attention}


def check_attention_rule(attention_rule: str) -> None:
    """Raise ValueError naming the allowed values unless ``attention_rule`` is one of :data:`ATTENTION_RULES`."""
    if attention_rule not in ATTENTION_RULE_INPUTS:
        raise ValueError(f"attention_rule must be one of {ATTENTION_RULES}, got {attention_rule!r}")


def _attention_rule(fn, rule: str):
    @functools.wraps(fn)
    def attention(module, query, key, value, *args, **kwargs):
        return fn(module, *ATTENTION_RULE_INPUTS[rule](query, key, value), *args, **kwargs)

    return attention


def _mlp_forward(mlp):
    def forward(x):
        return mlp.down_proj(half_rule(linear_rule(mlp.act_fn, mlp.gate_proj(x)), mlp.up_proj(x)))

    return forward


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _is_rmsnorm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


@contextlib.contextmanager
def conservative_rules(model: torch.nn.Module, attention_rule: str = "values") -> Iterator[None]:
    """Apply the rules to ``model`` (plain or FSDP-wrapped) for the forwards and backwards run inside, attention by
    ``attention_rule`` (one of :data:`ATTENTION_RULES`); everything is restored on the way out, on error too.

    Raises:
        ValueError: the model has no attention, RMSNorm or gated MLP module the rules know (a family they were not
            written for: the scores would be plain gradient × input under another name).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    check_attention_rule(attention_rule)
    modules = list(model.modules())
    attention = [m for m in modules if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "v_proj")]
    norms = [m for m in modules if _is_rmsnorm(m)]
    mlps = [m for m in modules if _is_gated_mlp(m)]
    if not (attention and norms and mlps):
        raise ValueError(f"mode=conservative: {type(model).__name__} has no {'attention' if not attention else ''}"
                         f"{' RMSNorm' if not norms else ''}{' gated MLP' if not mlps else ''} module the rules know "
                         "(q/k/v_proj attention, *RMSNorm, gate/up/down_proj MLP)")
    impls = {getattr(getattr(m, "config", None), "_attn_implementation", None) or "eager" for m in attention}
    undo: list = []
    try:
        for impl in sorted(impls - {"eager"}):  # the registered implementation, wrapped in this interface's map
            had = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
            previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)
            ALL_ATTENTION_FUNCTIONS[impl] = _attention_rule(ALL_ATTENTION_FUNCTIONS[impl], attention_rule)
            undo.append(lambda impl=impl, had=had, previous=previous: (
                ALL_ATTENTION_FUNCTIONS.__setitem__(impl, previous) if had else ALL_ATTENTION_FUNCTIONS.__delitem__(impl)))
        if "eager" in impls:  # the modelling modules' own eager function, looked up at call time
            for name in sorted({type(m).__module__ for m in attention}):
                mod = sys.modules[name]
                if hasattr(mod, "eager_attention_forward"):
                    original = mod.eager_attention_forward
                    mod.eager_attention_forward = _attention_rule(original, attention_rule)
                    undo.append(lambda mod=mod, original=original: setattr(mod, "eager_attention_forward", original))
        for norm in norms:  # an instance attribute over the class's forward, the norm's own forward without a graph
            norm.forward = functools.partial(linear_rule, norm.forward)
            undo.append(lambda norm=norm: delattr(norm, "forward"))
        for mlp in mlps:
            mlp.forward = _mlp_forward(mlp)  # an instance attribute over the class's forward
            undo.append(lambda mlp=mlp: delattr(mlp, "forward"))
        yield
    finally:
        for step in reversed(undo):
            step()
