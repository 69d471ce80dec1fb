"""How much accelerator memory an attribution pass needs, from the model's shape: the memory guard and the cost model.

Per token position of a pass (rows × window), for a Llama / Qwen2-family decoder, it counts what each kind of pass
holds at its peak: a forward without cache, a forward on OAR-P's key/value prefix, OAR-G's forward + input-gradient
backward (with or without gradient checkpointing), and the training step as the comparator. Parameters and optimizer
state are the same for training and attribution and are not counted. Formulas and their checks: docs/scaling.md,
"The model".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ModelShape", "PassKind", "attribution_need", "free_accelerator_bytes", "memory_guard", "model_shape",
           "pass_bytes", "fixed_recompute", "recompute_choice", "recompute_policy"]

# saved-for-backward elements per token per layer, in units of (H, I, q/kv widths); from the layer's graph:
# input norm in/out (2H), q/k/v (Q + 2KV), attention output (Q) + its softmax statistics, o_proj input (Q),
# residual + post-norm in/out (2H), gate/up (2I), activation and product (2I), down input (I)
_SAVED_H, _SAVED_I = 4, 5
# with the weights frozen (attribution's input-gradient passes) no linear keeps its input for a weight gradient: the
# two norms' fp32 inputs (HF's RMSNorm upcasts), q and the attention output (2Q), k and v (2KV), gate, up and the
# activation (3I); under the conservative rules each norm keeps its input and output in the model's dtype (4H).
# Counted with autograd's saved-tensor hooks (tests/core/test_memory_model.py); 0.62 GiB a layer at Qwen2.5-7B x 4k
# in bf16, where the H100 measured 0.60 (docs/performance.md) and the training count gives 0.95
_FROZEN_FP32_H, _RULES_H, _FROZEN_Q, _FROZEN_KV, _FROZEN_I = 2, 4, 2, 2, 3
# under the rules the gated MLP keeps only its gate and up projections' outputs (the activation is recomputed in the
# backward; the forward's own graph of act · up is dropped when the down projection's input is replaced)
_RULES_I = 2
_TRANSIENT_H, _TRANSIENT_I = 4, 3  # one layer's live tensors in a no-grad forward: hidden, norm, residual; gate/up/act
_BACKWARD = 2  # a layer in its backward: its saved activations plus gradients of the same size
# under the conservative propagation rules the norms run without a graph and keep their input and output (what the
# plain graph keeps); in the backward the norms and the MLP's rule form their ratios in fp32, at most the MLP's two wide
# (T, I) temporaries beside the layer's tensors: one more layer's worth bounds it (measured on CPU, cpu-quick shape,
# 2 x 1,152 tokens, fp32: 282-304 MiB against 281-292 for fisher's plain input-gradient pass; docs/method.md §13)
_RULES_BACKWARD = _BACKWARD + 1


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set activation memory.

    Attributes:
        layers: decoder layers. hidden: H. intermediate: I (MLP width). heads / kv_heads: attention heads.
        head_dim: per-head width. vocab: V. dtype_bytes: bytes per activation element (2 for bf16, 4 for fp32).
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, config, dtype: torch.dtype = torch.bfloat16) -> ModelShape:
        """The shape of a Hugging Face decoder config (``Qwen2Config``, ``LlamaConfig``, ...)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, config.vocab_size,
                   torch.finfo(dtype).bits // 8)

    def per_layer_saved(self) -> int:
        """Elements one layer saves for backward, per token."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return _SAVED_H * self.hidden + _SAVED_I * self.intermediate + 3 * q + 2 * kv

    def per_layer_saved_frozen(self, rules: bool = False) -> int:
        """Elements one layer saves for an input-gradient backward with frozen weights, per token (``rules``: under the
        conservative propagation rules); fp32 tensors count as 4 / ``dtype_bytes`` elements."""
        q, kv, wide = self.heads * self.head_dim, self.kv_heads * self.head_dim, 4 // self.dtype_bytes
        norms = _RULES_H * self.hidden if rules else _FROZEN_FP32_H * self.hidden * wide
        stats = (2 + self.heads) * wide  # the norms' fp32 rsqrt, the attention's fp32 log-sum-exp per head
        mlp = (_RULES_I if rules else _FROZEN_I) * self.intermediate
        return norms + _FROZEN_Q * q + _FROZEN_KV * kv + mlp + stats

    def per_layer_transient(self) -> int:
        """Elements one layer holds at once in a no-grad forward, per token."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return _TRANSIENT_H * self.hidden + _TRANSIENT_I * self.intermediate + q + 2 * kv

    def kv_cache(self) -> int:
        """Elements of the key/value cache of every layer, per token."""
        return self.layers * 2 * self.kv_heads * self.head_dim


class PassKind:
    FORWARD = "forward"
    FORWARD_CACHED = "forward_cached"
    INPUT_GRADIENT = "input_gradient"
    RULES_GRADIENT = "rules_gradient"  # an input-gradient pass under the conservative propagation rules
    TRAINING = "training"  # a bare training forward + backward: the fp32 log-softmax of every logit and its gradient
    # verl's actor update: the same layers, its log-probs taken without a full-vocabulary fp32 copy (fused or chunked),
    # so the logits and their gradient in the model's dtype (H200, Qwen2.5-1.5B, 8,192-token micro-batches: 12.98 /
    # 20.30 GiB measured above the update's start in bf16 / fp32, 12.75 / 19.7 modelled with its fp32 gradients;
    # docs/gpu_check.md, research/tests/test_gpu_memory_model.py)
    UPDATE = "update"
    # verl's old-log-prob forward, which a shared attribution's backward runs inside: one layer's no-grad tensors, the
    # logits and their temperature-scaled copy in the model's dtype (the same run: 4.12 / 10.08 GiB measured, 4.8 /
    # 10.3 modelled)
    LOG_PROB = "log_prob"


def pass_bytes(kind: str, tokens: int, shape: ModelShape, *, checkpointing: bool = False,
               logit_positions: int = 0, kept_layers: int | None = None) -> int:
    """Peak activation bytes of one pass holding ``tokens`` positions (rows × window).

    Args:
        kind: a :class:`PassKind`.
        tokens: token positions of the pass.
        shape: the model's shape.
        checkpointing: layer inputs only are saved, one layer is recomputed at a time (INPUT_GRADIENT, TRAINING).
        logit_positions: positions whose full-vocabulary logits the pass computes (probe positions; for TRAINING the
            response tokens, default all ``tokens``).
        kept_layers: layers that keep their activations, the others checkpointed (overrides ``checkpointing``:
            None is 0 with it, every layer without it).
    """
    b, H, V = shape.dtype_bytes, shape.hidden, shape.vocab
    layer = shape.per_layer_transient() * tokens * b
    if kind == PassKind.FORWARD:
        return layer + logit_positions * V * 4
    if kind == PassKind.LOG_PROB:
        return layer + 2 * tokens * V * b
    if kind == PassKind.FORWARD_CACHED:
        return shape.kv_cache() * tokens * b + layer + logit_positions * V * 4
    frozen = kind in (PassKind.INPUT_GRADIENT, PassKind.RULES_GRADIENT)  # attribution's: no parameter gradients
    per_token = shape.per_layer_saved_frozen(kind == PassKind.RULES_GRADIENT) if frozen else shape.per_layer_saved()
    saved_layer = per_token * tokens * b
    # the layer being differentiated holds its saved activations and their gradients at once
    backward = (_RULES_BACKWARD if kind == PassKind.RULES_GRADIENT else _BACKWARD) * saved_layer
    kept = (0 if checkpointing else shape.layers) if kept_layers is None else kept_layers
    saved = (shape.layers - kept) * H * tokens * b + kept * saved_layer + backward
    if frozen:
        leaf = 3 * H * tokens * b + 2 * H * tokens * 4  # clean, leaf, gradient; the fp32 product for the saliency
        return saved + leaf + logit_positions * V * 4 * 2
    if kind == PassKind.TRAINING:
        positions = tokens if logit_positions == 0 else logit_positions
        # logits at every position in the model's dtype; the fp32 log-softmax of the response and its gradient
        return saved + tokens * V * b + positions * V * 4 * 2
    if kind == PassKind.UPDATE:
        return saved + 2 * tokens * V * b  # the logits and their gradient
    raise ValueError(f"unknown pass kind {kind!r}")


def free_accelerator_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (including what the caching allocator holds but does not use); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(reserved, 0)


def memory_guard(device: torch.device, shape: ModelShape, *, checkpointing: bool = False,
                 logit_positions_per_row: int = 8, headroom: float = 0.9, margin: float = 1.5):
    """A ``fits(kind, rows, window)`` callback for :class:`oar_verl.core.backends.budget.PassLimits`, or None where the device
    has no memory to guard (CPU). The free memory is read once, when the guard is made (right before the passes it
    guards), so every pass of a call is judged against the same figure and data-parallel ranks count their passes
    before running them. A pass fits when ``margin`` × its estimate is within ``headroom`` × the free memory: the
    estimates were checked against measured peaks on CPU (docs/scaling.md), and the margin covers their low side."""
    free = free_accelerator_bytes(device)
    if free is None:
        return None
    limit = headroom * free

    def fits(kind: str, rows: int, window: int) -> bool:
        need = pass_bytes(kind, rows * window, shape, checkpointing=checkpointing,
                          logit_positions=rows * logit_positions_per_row)
        return margin * need <= limit

    return fits


def model_shape(model: torch.nn.Module) -> ModelShape | None:
    """The :class:`ModelShape` of a Hugging Face causal LM (or a wrapper with its ``config``), None if unknown."""
    config = getattr(model, "config", None)
    try:
        dtype = next(model.parameters()).dtype
        return ModelShape.from_hf_config(config, dtype if dtype.is_floating_point else torch.bfloat16)
    except (AttributeError, StopIteration, TypeError):
        return None


def recompute_choice(setting: str, need: Callable[[int, int], int], limit: int | None, layers: int
                     ) -> Callable[[int], float]:
    """(tokens of a pass) -> the share of the decoder layers its backward recomputes, for ``algorithm.oar.recompute``.

    Args:
        setting: ``always`` (1: checkpoint every layer), ``never`` (0), or ``auto``: keep the activations of as many
            layers as fit, the pass then needing at most ``limit`` bytes; recompute the others.
        need: (tokens, kept layers) -> the pass's peak activation bytes (:func:`pass_bytes`).
        limit: bytes a pass may hold (:func:`recompute_policy`); None: no bound known (``auto`` recomputes all).
        layers: the model's decoder layers.
    """
    from oar_verl.core.config import RECOMPUTE

    if setting not in RECOMPUTE:
        raise ValueError(f"algorithm.oar.recompute={setting!r} is not allowed; choose one of: {', '.join(RECOMPUTE)}")
    if setting != "auto":
        return lambda tokens: 1.0 if setting == "always" else 0.0

    def share(tokens: int) -> float:
        if limit is None or layers <= 0:
            return 1.0
        # the need grows by one layer's activations per kept layer: the most that fit, host arithmetic
        base, per_layer = need(tokens, 0), need(tokens, 1) - need(tokens, 0)
        kept = layers if per_layer <= 0 else max(0, min(layers, (limit - base) // per_layer))
        return (layers - kept) / layers if base <= limit else 1.0

    return share


def fixed_recompute(setting: str, checkpointing: bool) -> bool:
    """``algorithm.oar.recompute`` as one setting for every pass: ``always`` / ``never``, or the actor's own
    checkpointing under ``auto`` (where ranks must agree pass by pass, as Ulysses' recomputed collectives need, or where
    the runtime's memory is not known to the adapter: OpenRLHF's DeepSpeed actor)."""
    return {"always": True, "never": False}.get(setting, checkpointing)


def attribution_need(kind: str, shape: ModelShape, *, host: str | None = None, margin: float = 1.5
                     ) -> Callable[[int, int], int]:
    """(tokens, kept layers) -> the bytes an attribution pass of ``kind`` is planned at: ``margin`` × its estimate,
    and the estimate of the ``host`` pass it runs inside (the old-log-prob forward when read from it: that pass's
    logits are alive during its backward)."""
    def need(tokens: int, kept: int) -> int:
        own = pass_bytes(kind, tokens, shape, kept_layers=kept, logit_positions=8)
        return int(margin * (own + (pass_bytes(host, tokens, shape) if host else 0)))

    return need


def recompute_policy(setting: str, shape: ModelShape | None, kind: str, device: torch.device, train_tokens: int, *,
                     train_checkpointing: bool = True, grad_bytes: int = 0, host: str | None = None,
                     headroom: float = 0.9, margin: float = 1.5) -> Callable[[int], float]:
    """:func:`recompute_choice` of an attribution pass of ``kind`` on a model of ``shape``, bounded by verl's update:
    a pass keeps the activations of as many layers as keep :func:`attribution_need` (``host``: the pass it runs
    inside, counted with it) within the update's activation peak at ``train_tokens`` tokens per micro-batch plus
    ``grad_bytes`` (the parameter gradients the update holds beside them, freed while attribution runs), and within
    ``headroom`` × the accelerator's free memory (read now). Never above the update's peak; an unknown shape
    recomputes every layer under ``auto``."""
    if shape is None:
        return recompute_choice(setting, lambda tokens, kept: 0, None, 0)
    limit = pass_bytes(PassKind.UPDATE, train_tokens, shape, checkpointing=train_checkpointing) + grad_bytes
    free = free_accelerator_bytes(device)
    if free is not None:
        limit = min(limit, int(headroom * free))
    return recompute_choice(setting, attribution_need(kind, shape, host=host, margin=margin), limit, shape.layers)
