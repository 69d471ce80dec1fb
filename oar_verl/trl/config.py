"""TRL's ``GRPOConfig`` with OAR's keys as ``oar_<key>`` fields (``OARGRPOConfig``), built from the core's config.

Every field of :class:`oar_verl.core.config.OARConfig` (``algorithm.oar.<key>`` under verl, ``--oar.<key>`` under
OpenRLHF) becomes ``oar_<key>`` here, with the same default and help text (the prefix keeps the names apart from
TRL's own ``beta`` and ``seed``); tuple-valued keys are lists, as TRL's argument parser takes them. The class is
built from the core's fields, so a key added there appears here without being retyped.

Construction validates the OAR keys (ranges and registered names: :func:`~oar_verl.core.checks.startup.check_config`)
and the TRL settings OAR cannot be sound with (:func:`check_trl_args`); errors name the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Callable
from typing import Any

from trl import GRPOConfig

from oar_verl.core.checks.versions import check_tested_release
from oar_verl.core.config import OARConfig, OARConfigError

__all__ = ["FIELD_PREFIX", "FIELD_SUPPORT", "NO_EFFECT", "OARGRPOConfig", "OARTRLArgsError", "REFUSED", "Support",
           "TESTED_TRL", "WORKS", "check_trl_args", "check_trl_version", "oar_config_of", "support_table"]

TESTED_TRL = "1.16"  # the release line the trainer is tested against (tests/trl, docs/trl.md)
ALLOW_UNTESTED_ENV = "OAR_TRL_ALLOW_UNTESTED"
FIELD_PREFIX = "oar_"
_ERROR_PREFIX = "__oar_trl__"  # the prefix OARConfig's messages carry, rewritten to the TRL field names


class OARTRLArgsError(ValueError):
    """A TRL setting OAR cannot run with; the message names the field and the allowed values."""


def check_trl_version(version: str | None = None, *, allow_untested: bool | None = None) -> str:
    """Refuse a TRL outside the tested release line (:data:`TESTED_TRL`); ``OAR_TRL_ALLOW_UNTESTED=1`` turns the
    refusal into a warning. The trainer relies on ``GRPOTrainer._generate_and_score_completions`` returning the
    local ``advantages`` beside ``completion_mask``, and on ``_compute_loss`` taking (B, T) advantages."""
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("trl")
    return check_tested_release(version, TESTED_TRL, framework="TRL", extra="trl", allow_env=ALLOW_UNTESTED_ENV,
                                allow_untested=allow_untested, error=OARTRLArgsError, digits=2)


def _rename(message: str) -> str:
    """OARConfig's ``<prefix>.<key>`` names as this config's ``oar_<key>`` fields."""
    return re.sub(re.escape(_ERROR_PREFIX) + r"\.(\w+)", lambda m: FIELD_PREFIX + m.group(1), message)


# ---- every TRL 1.16 GRPOConfig field, as OAR takes it: the one source of docs/trl.md's table and of the refusals

WORKS, REFUSED, NO_EFFECT = "works with OAR", "refused at construction", "no effect on OAR"
# loss types whose gradient a mass-preserving token reshaping cannot change under a sequence-level ratio: their
# per-token loss is f(s) * A_t with s one ratio per sequence and every w_t > 0, so Σ_t f(s) w_t A = f(s) A Σ_t w_t =
# f(s) A T, exactly GRPO's (OpenRLHF's GSPO, refused there likewise); cispo and vespo multiply A_t by each token's own
# log-probability, where the weights matter
SEQUENCE_INVARIANT_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo")
# TRL 1.16's enumerated settings (its _compute_loss and advantage code raise on anything else, but only at the first
# step, after a generation and OAR's attribution): checked at construction
ALLOWED_VALUES = {"loss_type": SEQUENCE_INVARIANT_LOSSES + ("cispo", "vespo"),
                  "scale_rewards": ("group", "batch", "none")}
_TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class Support:
    """How OAR takes a group of ``GRPOConfig`` fields.

    Attributes:
        status: :data:`WORKS`, :data:`REFUSED` (some values; the others work) or :data:`NO_EFFECT`.
        why: one sentence; for :data:`REFUSED`, what is refused, why, and ``Allowed: ...``.
        refused: for :data:`REFUSED`, ``args -> the refused setting as text`` (None when the args are allowed).
    """

    status: str
    why: str
    refused: Callable[[Any], str | None] | None = None


def _sequence_invariant(args) -> str | None:
    level, loss = getattr(args, "importance_sampling_level", "token"), getattr(args, "loss_type", "dapo")
    return (f"importance_sampling_level={level!r} with loss_type={loss!r}"
            if level == "sequence" and loss in SEQUENCE_INVARIANT_LOSSES else None)


def _fsdp1(args) -> str | None:
    """FSDP1 from the args (``fsdp`` with ``fsdp_config['version'] = 1``) or from ``accelerate launch``'s config
    (``ACCELERATE_USE_FSDP`` with ``FSDP_VERSION`` 1, accelerate's default)."""
    if getattr(args, "fsdp", None):
        version = int((getattr(args, "fsdp_config", None) or {}).get("version", 2))  # transformers 5's default: 2
        return f"fsdp={args.fsdp!r} with fsdp_config['version']={version}" if version == 1 else None
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in _TRUE and os.environ.get("FSDP_VERSION", "1") == "1":
        return "accelerate's fsdp_version=1 (ACCELERATE_USE_FSDP with FSDP_VERSION=1: accelerate's FSDP1 config)"
    return None


def _model_parallel(args) -> str | None:
    pc = getattr(args, "parallelism_config", None)
    sizes = {k: getattr(pc, k, 1) or 1 for k in ("tp_size", "cp_size", "sp_size")} if pc is not None else {}
    split = {k: v for k, v in sizes.items() if v > 1}
    return f"parallelism_config with {split}" if split else None


def _tp_load(args) -> str | None:
    kw = getattr(args, "model_init_kwargs", None) or {}
    keys = [k for k in ("tp_plan", "tp_size", "device_mesh") if kw.get(k) is not None]
    return f"model_init_kwargs with {keys}" if keys else None


def _flag(name: str) -> Callable[[Any], str | None]:
    return lambda args: f"{name}={getattr(args, name)!r}" if getattr(args, name, None) else None


def _below_one(args) -> str | None:
    q = getattr(args, "top_entropy_quantile", 1.0)
    return f"top_entropy_quantile={q!r}" if q < 1.0 else None


_GEN = "generation only: OAR runs on TRL's batch after it, whichever engine made it"
_VLLM = _GEN + " (vLLM is not exercised on CPU)"
_SUPPORT: tuple[tuple[tuple[str, ...], Support], ...] = (
    # -- refused values
    (("importance_sampling_level",), Support(REFUSED, (
        "'sequence' with loss_type grpo, bnpo, dr_grpo, dapo, luspo or sapo: one ratio s per sequence makes the "
        "per-token loss f(s)·A_t, and OAR keeps each row's Σ_t A_t, so the gradient is GRPO's whatever the weights "
        "(OAR would cost its passes and change nothing). Allowed: 'token' (any loss_type), or 'sequence' with "
        "loss_type 'cispo' or 'vespo'"), _sequence_invariant)),
    (("top_entropy_quantile",), Support(REFUSED, (
        "< 1.0: TRL's loss drops the low-entropy tokens with a mask it computes in _compute_loss from the current "
        "policy, after OAR kept each row's advantage mass, so the loss would see another mass per row than GRPO's "
        "while oar/adv_mass_rel_err reads ~1e-9 (reshaping after the mask needs the loss's own forward, and the mask "
        "moves with every update). Allowed: 1.0"), _below_one)),
    (("use_liger_kernel",), Support(REFUSED, (
        "True: Liger's kernels replace the model's norms, MLPs and rotary embedding, which OAR's attribution passes "
        "(and the default mode's rules) run through; untested with OAR. Allowed: use_liger_kernel=False"),
        _flag("use_liger_kernel"))),
    (("fsdp", "fsdp_config"), Support(REFUSED, (
        "FSDP1 (fsdp_config['version']=1, or accelerate's FSDP config with fsdp_version: 1, as TRL's fsdp1.yaml): "
        "untested with OAR's collective attribution passes. Allowed: FSDP2 (fsdp_config['version']=2, "
        "transformers' default; accelerate's fsdp_version: 2), DeepSpeed, DDP"), _fsdp1)),
    (("parallelism_config",), Support(REFUSED, (
        "tp_size, cp_size or sp_size > 1: the model or the sequence split over processes, which the attribution "
        "passes do not assemble. Allowed: None, or data-parallel sizes only (dp_replicate_size, dp_shard_size)"),
        _model_parallel)),
    (("torch_compile",), Support(REFUSED, (
        "True: accelerate compiles the model (or its regions in place), and OAR's hooks and backward passes through "
        "compiled modules are untested. Allowed: torch_compile=False"), _flag("torch_compile"))),
    (("model_init_kwargs",), Support(REFUSED, (
        "tp_plan / tp_size / device_mesh (a tensor-parallel model at load): the attribution passes do not assemble "
        "sharded activations. Allowed: any other loading keyword (dtype, attn_implementation, quantisation, ...)"),
        _tp_load)),
    # -- works with OAR
    (("loss_type",), Support(WORKS, (
        "every loss consumes the (B, T) advantages (tested on TRL's _compute_loss); cispo's and vespo's "
        "per-sequence metrics are computed on TRL's (B,) advantages, as TRL logs them; see importance_sampling_level "
        "for the refused pairs"))),
    (("epsilon", "epsilon_high", "delta", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
      "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold"), Support(WORKS, (
        "per-token clipping and masks read A_t, whose sign is A's (every weight > 0: oar_floor > 0)"))),
    (("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
      "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap"), Support(WORKS, (
        "a positive ratio per token or sequence times the per-token loss, independent of the advantages (vLLM is not "
        "exercised on CPU)"))),
    (("reward_weights", "multi_objective_aggregation", "scale_rewards"), Support(WORKS, (
        "they make TRL's base advantage A, which OAR redistributes (oar_base_estimator: grpo)"))),
    (("num_generations", "mask_truncated_completions", "max_completion_length", "pad_to_multiple_of",
      "max_tool_calling_iterations"), Support(WORKS, (
        "the batch OAR reads: groups of num_generations rows, masked-out completions keep A and are not attributed, "
        "padding and tool output (tool_mask 0) carry no advantage"))),
    (("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
      "num_iterations"), Support(WORKS, (
        "per_device_train_batch_size × the longest row is one attribution pass's token budget; every generation "
        "gets its own OAR step (global_step × r + k + 1, r = ⌈gradient_accumulation_steps / "
        "(steps_per_generation × num_iterations)⌉, k its index in the optimizer step; r = 1: TRL's "
        "global_step + 1)"))),
    (("gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
      "activation_checkpointing_kwargs"), Support(WORKS, (
        "oar_recompute=auto recomputes layers in the attribution passes when either checkpointing is on (tested: "
        "gradient_checkpointing)"))),
    (("deepspeed", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
      "ddp_static_graph", "ddp_timeout", "local_rank", "accelerator_config", "ds3_gather_for_generation"),
     Support(WORKS, (
        "DDP (tested on 2 gloo processes) and DeepSpeed ZeRO-2/3 (the reshape on the sharded module tested; the "
        "trainer under DeepSpeed needs an accelerator); the passes are aligned over the processes"))),
    (("bf16", "fp16", "tf32", "cast_lm_head_to_fp32", "use_cpu", "trust_remote_code", "use_cache", "full_determinism",
      "neftune_noise_alpha", "disable_dropout"), Support(WORKS, (
        "the policy OAR attributes on, in eval mode outside autocast (no dropout, no NEFTune noise); a model the "
        "mode's rules do not cover is refused at trainer construction"))),
    (("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs",
      "cache_implementation", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
      "use_transformers_paged"), Support(WORKS, _GEN)),
    (("use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
      "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
      "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size"), Support(WORKS, _VLLM)),
    (("output_dir", "report_to", "resume_from_checkpoint", "save_steps", "save_strategy"), Support(WORKS, (
        "oar/* metrics go through TRL's logs and reporters; dumps default to <output_dir>/oar_dumps; a resumed run "
        "continues OAR's step with TRL's global_step (tested)"))),
    # -- no effect on OAR
    (("beta", "use_bias_correction_kl", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
      "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
      "entropy_target", "router_aux_loss_coef"), Support(NO_EFFECT, (
        "loss terms without the advantages (KL to the reference, entropy bonus, MoE router loss)"))),
    (("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
      "optim_args", "optim_target_modules", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
      "num_train_epochs", "max_steps", "seed", "data_seed", "auto_find_batch_size", "average_tokens_across_devices",
      "torch_empty_cache_steps", "label_smoothing_factor", "torch_compile_backend", "torch_compile_mode",
      "liger_kernel_config"), Support(NO_EFFECT, (
        "the optimiser, schedule and run length; TRL's seed (OAR's noise seeds are oar_seed's); the compile and Liger "
        "options act only with torch_compile / use_liger_kernel, refused"))),
    (("shuffle_dataset", "train_sampling_strategy", "length_column_name", "remove_unused_columns", "ignore_data_skip",
      "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
      "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order"),
     Support(NO_EFFECT, "the data loading before generation")),
    (("eval_strategy", "eval_steps", "eval_delay", "eval_on_start", "eval_accumulation_steps",
      "eval_do_concat_batches", "eval_use_gather_object", "per_device_eval_batch_size", "num_generations_eval",
      "prediction_loss_only", "batch_eval_metrics", "include_for_metrics", "label_names", "metric_for_best_model",
      "greater_is_better", "load_best_model_at_end", "bf16_full_eval", "fp16_full_eval", "do_train", "do_eval",
      "do_predict"), Support(NO_EFFECT, "evaluation computes TRL's loss on its own advantages; OAR runs in training")),
    (("save_total_limit", "save_on_each_node", "save_only_model", "enable_jit_checkpoint",
      "restore_callback_states_from_checkpoint", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token",
      "hub_private_repo", "hub_always_push", "hub_revision", "logging_steps", "logging_strategy",
      "logging_first_step", "log_level", "log_level_replica", "log_on_each_node",
      "logging_nan_inf_filter", "disable_tqdm", "debug", "skip_memory_metrics", "include_num_input_tokens_seen",
      "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "log_completions",
      "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo"),
     Support(NO_EFFECT, "saving, the hub and logging (TRL's completion log shows its own advantages A)")),
)
FIELD_SUPPORT: dict[str, Support] = {name: s for names, s in _SUPPORT for name in names}
"""Every field of TRL 1.16's ``GRPOConfig`` (TrainingArguments' included) -> how OAR takes it (docs/trl.md's table:
:func:`support_table`; the refusals of :func:`check_trl_args`)."""


def support_table() -> str:
    """docs/trl.md's field table, one row per group of :data:`FIELD_SUPPORT` (markdown)."""
    rows = ["| fields | with OAR | why / allowed |", "|---|---|---|"]
    for names, s in _SUPPORT:
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {s.status} | {s.why} |")
    return "\n".join(rows)


UNSUPPORTED_OAR = {  # OAR keys whose machinery this adapter does not carry: value refused -> why
    ("mode", "auto"): "mode=auto's calibration (docs/auto.md) runs in the verl and OpenRLHF trainers only; choose "
                      "one of conservative, gradient, perturbation, fisher, path",
    ("target", "reference"): "target=reference needs each row's ground truth, which TRL's batch does not carry to "
                             "the trainer; use response",
}


def check_trl_args(args) -> None:
    """Refuse TRL settings under which OAR would silently do nothing, break its promises or run untested, and OAR
    keys this adapter does not carry; the message names the field and the allowed values.

    Raises:
        OARTRLArgsError: a refused value of :data:`FIELD_SUPPORT` (its ``why`` is the message); a value of
            :data:`ALLOWED_VALUES` outside TRL's set;
            ``oar_base_estimator`` other than ``grpo`` (TRL computes the base advantage itself);
            ``oar_fidelity_every`` > 0 (the in-step fidelity is not wired into TRL's step); the keys of
            :data:`UNSUPPORTED_OAR`.
    """
    for _, support in _SUPPORT:
        setting = support.refused(args) if support.refused is not None else None
        if setting:
            raise OARTRLArgsError(f"{setting}: {support.why}")
    for field, allowed in ALLOWED_VALUES.items():
        value = getattr(args, field, allowed[0])
        if value not in allowed:
            raise OARTRLArgsError(f"{field}={value!r}: TRL 1.16 would fail on it at the first step, after a "
                                  f"generation; allowed: {', '.join(allowed)}")
    base = getattr(args, FIELD_PREFIX + "base_estimator", "grpo")
    if base != "grpo":
        raise OARTRLArgsError(f"{FIELD_PREFIX}base_estimator={base!r}: under TRL the base advantage is TRL's own "
                              "(scale_rewards, multi_objective_aggregation); allowed: 'grpo'")
    if getattr(args, FIELD_PREFIX + "fidelity_every", 0):
        raise OARTRLArgsError(f"{FIELD_PREFIX}fidelity_every={getattr(args, FIELD_PREFIX + 'fidelity_every')!r}: "
                              "the in-step fidelity is not wired into TRL's step; allowed: 0 (measure offline with "
                              "oar_verl.core.fidelity.fidelity_report, docs/fidelity.md)")
    for (key, value), why in UNSUPPORTED_OAR.items():
        if getattr(args, FIELD_PREFIX + key, None) == value:
            raise OARTRLArgsError(f"{FIELD_PREFIX}{key}={value!r}: {why}")


def oar_config_of(args) -> OARConfig:
    """The core's :class:`OARConfig` from a config's ``oar_<key>`` fields (a plain ``GRPOConfig``: the defaults),
    checked against the registries; errors name the ``oar_<key>`` field."""
    from oar_verl.core.checks.startup import check_config

    values = {f.name: getattr(args, FIELD_PREFIX + f.name) for f in dataclasses.fields(OARConfig)
              if f.name != "prefix" and hasattr(args, FIELD_PREFIX + f.name)}
    try:
        return check_config(OARConfig.from_mapping(values, prefix=_ERROR_PREFIX))
    except OARConfigError as e:
        raise OARConfigError(_rename(str(e))) from None


def _oar_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """``(oar_<key>, type, field)`` for every key of :class:`OARConfig`, with its default and help text."""
    hints = typing.get_type_hints(OARConfig)
    out = []
    for f in dataclasses.fields(OARConfig):
        if f.name == "prefix":
            continue
        # argparse %-formats help texts (TRL's TrlParser, HfArgumentParser): the core's '%' as '%%'
        help_text = f.metadata["help"].replace("%", "%%")
        kind, meta = hints[f.name], {"help": f"OAR: {help_text} (oar_verl's `{f.name}` key)"}
        if isinstance(f.default, tuple):  # TRL's parser takes lists; a mutable default needs a factory
            default = list(f.default)
            field = dataclasses.field(default_factory=lambda d=default: list(d), metadata=meta)
            kind = list[str]
        else:
            field = dataclasses.field(default=f.default, metadata=meta)
        out.append((FIELD_PREFIX + f.name, kind, field))
    return out


def _post_init(self) -> None:
    GRPOConfig.__post_init__(self)
    oar_config_of(self)
    check_trl_args(self)


def _oar(self) -> OARConfig:
    """The core's :class:`OARConfig` of these fields."""
    return oar_config_of(self)


OARGRPOConfig = dataclasses.make_dataclass(
    "OARGRPOConfig", _oar_fields(), bases=(GRPOConfig,),
    namespace={"__module__": __name__, "__post_init__": _post_init, "oar": _oar, "__doc__": (
        "TRL's GRPOConfig with OAR's keys as `oar_<key>` fields (the core's names, defaults and help: "
        "oar_verl.core.config.OARConfig; docs/config.md). Use it in place of GRPOConfig with OARGRPOTrainer; "
        "construction refuses invalid OAR values and TRL settings OAR cannot run with, naming the field.")})
