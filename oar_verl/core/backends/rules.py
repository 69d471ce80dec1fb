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
the model uses, and ``eager_attention_forward`` of its modelling module), norms by class name (``*RMSNorm``, whatever
forward the instance holds: Hugging Face's or a kernel Liger bound there), MLPs by their ``gate_proj`` / ``up_proj`` /
``down_proj`` (hooks: the forward's own kernel keeps computing the value). :func:`rules_error` accounts for every
module, so a model the rules do not cover is refused (at start-up too: ``core/checks/model_rules.py``) instead of
scored by plain gradient × input; the family matrix (devtools/family_matrix.py, tests/core/test_family_matrix.py)
proves each family.
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

from oar_verl.core.backends.patching import patched_attributes
from oar_verl.core.config import ATTENTION_RULES


def ratio_times(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad · (out / x) elementwise, the ratio in fp32 or wider (0 where x = 0), in x's dtype: the gradient of a map
    taken as linear at its own value. One wide temporary, formed and used in place (:func:`_ratio_`)."""
    wide = torch.promote_types(out.dtype, torch.float32)
    return _ratio_(out.to(wide, copy=True), x).mul_(grad).to(x.dtype)


def _ratio_(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` (wide, owned) overwritten by out / x, 0 where x = 0: the division in out's dtype (x converted in the
    kernel, exactly), then its non-finite entries set to 0. Where x = 0 the quotient is ±inf or nan, so this is the
    ratio with the zeros masked, without a mask: two passes and no bool tensor (the compare and masked fills cost
    more than the division on CPU). A quotient of finite out and x ≠ 0 overflows only where |out / x| passes the
    dtype's range, which none of the ruled maps reaches (act(g) / g in (0, 1) for SiLU and GELU, the norm's scale
    at most |w| / √ε, a soft-cap's tanh ratio at most 1)."""
    return out.div_(x).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


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


def linear_rule(map_, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``map_(x, ...)``'s value with the gradient of x ↦ x · (out / x) at constant ratio (the identity and norm
    rules); the map itself runs without a graph."""
    with torch.no_grad():
        out = map_(x, *args, **kwargs)
    return _Linearised.apply(x, out)


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
    """``h`` = act(g) ⊙ u of a gated MLP (g, u: its gate and up projections' outputs), with the identity rule on act
    and the half rule on the product: ∂g = ½ ∂h ⊙ u ⊙ act(g) / g, ∂u = ½ ∂h ⊙ act(g). ``h`` is the model's own value,
    whichever kernel computed it (Hugging Face's, Liger's fused SwiGLU, Megatron's); act is recomputed in fp32 in the
    backward."""

    @staticmethod
    def forward(ctx, g, u, h, act):
        ctx.save_for_backward(g, u)
        ctx.act = act
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        wide = torch.promote_types(g.dtype, torch.float32)
        gw = g.to(wide)
        a = ctx.act(gw)
        if a.untyped_storage().data_ptr() == gw.untyped_storage().data_ptr():  # an act that hands back its input
            a = a.clone()
        half = grad.to(wide, copy=True).mul_(0.5)
        du = (half * a).to(u.dtype)
        # ∂g = ratio_times(half · u, a, g): a and half reused in place (u converted in the kernel, exactly)
        return _ratio_(a, gw).mul_(half.mul_(u)).to(g.dtype), du, None, None


def gated_half_split(g: torch.Tensor, u: torch.Tensor, h: torch.Tensor, act) -> torch.Tensor:
    """``h`` = act(g) ⊙ u (its value, detached) with the gated MLP's rules' gradient to the gate and up projections'
    outputs ``g`` and ``u``."""
    return _GatedHalf.apply(g, u, h.detach(), act)


def gated_half(y: torch.Tensor, h: torch.Tensor, act) -> torch.Tensor:
    """``h`` = act(g) ⊙ u (its value, detached) with the gated MLP's rules' gradient to ``y`` = [g, u] (one layer's
    concatenated output, Megatron's layout)."""
    g, u = y.chunk(2, dim=-1)
    return gated_half_split(g, u, h, act)


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


def _attention_rule(fn, rule: str, reached: list[int]):
    @functools.wraps(fn)
    def attention(module, query, key, value, *args, **kwargs):
        reached[0] += 1
        return fn(module, *ATTENTION_RULE_INPUTS[rule](query, key, value), *args, **kwargs)

    return attention


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))


def _is_rmsnorm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _is_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") or all(hasattr(module, n) for n in ("q_proj", "k_proj"))


def _activation(mlp: torch.nn.Module):
    """The gated MLP's activation: its ``act_fn`` (Hugging Face), else its config's ``hidden_act`` (a class-level
    Liger SwiGLU MLP keeps only the config), or None."""
    act = getattr(mlp, "act_fn", None)
    if act is not None:
        return act
    hidden_act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    if hidden_act is None:
        return None
    from transformers.activations import ACT2FN

    return ACT2FN[hidden_act]


# leaf modules that compute nothing the rules must know: linear maps, lookups, dropout (off in eval), and the empty
# containers a wrapper leaves (PEFT's unused LoRA slots); rotary tables and a gated MLP's activation are named apart
_PLAIN_LEAVES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Dropout, torch.nn.Identity, torch.nn.ModuleDict,
                 torch.nn.ParameterDict, torch.nn.ModuleList, torch.nn.ParameterList)


def rules_error(model: torch.nn.Module, attention_rule: str = "values") -> str | None:
    """Why the conservative rules cannot cover every non-linearity of ``model`` (a Hugging Face causal LM, plain,
    FSDP- or PEFT-wrapped, or built on the meta device from a config), or None. Covered: attention through
    transformers' attention interface (separate q/k/v projections), ``*RMSNorm`` norms, gated MLPs (``gate_proj`` /
    ``up_proj`` / ``down_proj``); every other leaf module must be linear (:data:`_PLAIN_LEAVES`, rotary tables, a
    gated MLP's activation). A mixture of experts, LayerNorm, an ungated MLP or an unknown module is named; so is
    ``attention_rule=uniform`` on an attention that soft-caps its scores (the cap's tanh between the two products has
    no rule; ``values`` holds the scores constant, cap included)."""
    from oar_verl.core.backends.families import expert_count, model_config, text_config

    config = model_config(model)
    experts = expert_count(config)
    if experts:
        return f"a mixture of {experts} experts: its router and experts have no rule"
    if attention_rule == "uniform" and getattr(text_config(config), "attn_logit_softcapping", None) is not None:
        return ("attention scores soft-capped (attn_logit_softcapping) under attention_rule=uniform: the cap has no "
                "rule; algorithm.oar.attention_rule=values holds")
    modules = list(model.modules())
    mlps = [m for m in modules if _is_gated_mlp(m)]
    activations = {id(_activation(m)) for m in mlps}
    for m in modules:
        name = type(m).__name__
        if _is_attention(m) and not all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj")):
            return f"an attention without separate q/k/v projections: {name}"
        if name.endswith("MLP") and not _is_gated_mlp(m):
            return f"an MLP without gate_proj / up_proj / down_proj: {name}"
        if _is_gated_mlp(m) and _activation(m) is None:
            return f"a gated MLP without act_fn or config.hidden_act: {name}"
        if any(True for _ in m.children()):
            continue
        if isinstance(m, _PLAIN_LEAVES) or _is_rmsnorm(m) or name.endswith("RotaryEmbedding") or id(m) in activations:
            continue
        kind = "a norm other than RMSNorm" if "Norm" in name else "a module the rules do not know"
        return f"{kind}: {name}"
    if not any(_is_attention(m) for m in modules) or not mlps or not any(_is_rmsnorm(m) for m in modules):
        return "no attention, RMSNorm or gated MLP module the rules know"
    return None


def _mlp_rule(mlp: torch.nn.Module, act) -> list:
    """Hooks giving ``mlp`` (any forward of down(act(gate(x)) ⊙ up(x)): Hugging Face's, a kernel bound on the
    instance) the identity and half rules: the gate's and up projection's outputs are kept and handed on detached (so
    the forward's own act · up, by whichever kernel, runs without a graph), and the down projection's input (that
    value) replaced by :func:`gated_half_split` of the kept ones. Returns the hook handles."""
    kept: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            kept[name] = out
            return out.detach()

        return hook

    def ruled(module, args):
        if "g" not in kept or "u" not in kept:
            raise RuntimeError(f"mode=conservative: {type(mlp).__name__}'s forward reached down_proj without "
                               "gate_proj and up_proj: its rule cannot apply")
        return (gated_half_split(kept.pop("g"), kept.pop("u"), args[0], act), *args[1:])

    return [mlp.gate_proj.register_forward_hook(keep("g")), mlp.up_proj.register_forward_hook(keep("u")),
            mlp.down_proj.register_forward_pre_hook(ruled)]


def _reached_check(module: torch.nn.Module, reached: list[int]) -> list:
    """Hooks that fail a forward of attention ``module`` that never called the ruled attention function (a modelling
    code or kernel that bypasses transformers' attention interface would run unruled)."""
    before: list[int] = []

    def pre(m, args):
        before.append(reached[0])

    def post(m, args, out):
        if reached[0] == before.pop():
            raise RuntimeError(f"mode=conservative: {type(m).__name__} ran without transformers' attention interface "
                               "(its attention rule never applied); use mode=fisher for this model")

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


@contextlib.contextmanager
def conservative_rules(model: torch.nn.Module, attention_rule: str = "values") -> Iterator[None]:
    """Apply the rules to ``model`` (plain or FSDP-wrapped) for the forwards and backwards run inside, attention by
    ``attention_rule`` (one of :data:`ATTENTION_RULES`); everything is restored on the way out, on error too: what was
    on an instance before (a kernel Liger bound there) is what is there after. Forward values are the model's own,
    whichever kernels compute them (the norms' and MLPs' forwards run as they are; the rules change backwards only).

    Raises:
        ValueError: a model the rules do not cover (:func:`rules_error`: a mixture of experts, LayerNorm, an ungated
            MLP, an unknown module), or an eager attention whose modelling module has no ``eager_attention_forward``;
            the scores would be plain gradient × input under another name.
        RuntimeError: (in a forward) an attention or MLP whose forward bypasses what its rule is attached to.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from oar_verl.core.backends.families import model_config, nonlinear_post_head, post_head_transform, text_config

    check_attention_rule(attention_rule)
    reason = rules_error(model, attention_rule)
    if reason is not None:
        raise ValueError(f"mode=conservative: {type(model).__name__} is not covered by the conservative rules: {reason}; "
                         "use mode=fisher (the same clean input-gradient pass without the rules)")
    modules = list(model.modules())
    attention = [m for m in modules if _is_attention(m)]
    impls = {getattr(getattr(m, "config", None), "_attn_implementation", None) or "eager" for m in attention}
    eager_modules = sorted({type(m).__module__ for m in attention}) if "eager" in impls else []
    missing = [name for name in eager_modules if not hasattr(sys.modules[name], "eager_attention_forward")]
    if missing:
        raise ValueError(f"mode=conservative: eager attention of {', '.join(missing)} has no eager_attention_forward "
                         "the attention rule can wrap; use attn_implementation=sdpa or mode=fisher")
    config = model_config(model)
    reached = [0]
    with contextlib.ExitStack() as stack:
        for impl in sorted(impls - {"eager"}):  # the registered implementation, wrapped in this interface's map
            had = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
            previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)
            ALL_ATTENTION_FUNCTIONS[impl] = _attention_rule(ALL_ATTENTION_FUNCTIONS[impl], attention_rule, reached)
            stack.callback(lambda impl=impl, had=had, previous=previous: (
                ALL_ATTENTION_FUNCTIONS.__setitem__(impl, previous) if had else ALL_ATTENTION_FUNCTIONS.__delitem__(impl)))
        for name in eager_modules:  # the modelling modules' own eager function, looked up at call time
            mod = sys.modules[name]
            stack.enter_context(patched_attributes(mod, eager_attention_forward=_attention_rule(
                mod.eager_attention_forward, attention_rule, reached)))
        handles: list = []
        stack.callback(lambda: [h.remove() for h in handles])
        for m in attention:
            handles += _reached_check(m, reached)
        for norm in (m for m in modules if _is_rmsnorm(m)):  # the norm's own forward (class or instance) without a graph
            stack.enter_context(patched_attributes(norm, forward=functools.partial(linear_rule, norm.forward)))
        for mlp in (m for m in modules if _is_gated_mlp(m)):
            handles += _mlp_rule(mlp, _activation(mlp))
        switched_off = nonlinear_post_head(config)
        if switched_off:  # a soft-cap after the head: applied at the head by the identity rule, the model's own off
            ruled = functools.partial(linear_rule, post_head_transform(config))
            stack.enter_context(patched_attributes(text_config(config), **switched_off))
            handles.append(model.get_output_embeddings().register_forward_hook(lambda m, args, out: ruled(out)))
        yield
