"""TRL's ``GRPOTrainer`` whose advantages OAR reshapes token by token right after generation (``OARGRPOTrainer``).

TRL computes its group-normalised advantages (B,) in ``_generate_and_score_completions``; this subclass attributes the
rows with a non-zero advantage on the policy (:func:`oar_verl.trl.reshape.reshape_batch`, the core's ``attribute`` and
``reshape``) and hands ``_compute_loss`` (B, C) advantages ``w_t * A`` instead, which every ``loss_type`` of TRL 1.16
consumes as they are (it adds a dimension to 1-D advantages only), with TRL's (B,) ones beside them
(:data:`SEQUENCE_ADVANTAGES`) for the per-sequence metrics TRL computes from them (cispo's clip ratio, vespo's
phi). Everything else is TRL's: generation (its own ``generate``, vLLM server or colocate), rewards, the loss,
accelerate's DDP / FSDP2 / DeepSpeed wrapping, PEFT, checkpoints. The ``oar/*`` metrics go through TRL's ``_metrics``
(its logs and reporters), with ``timing/oar``. Each generation gets its own OAR step (:meth:`OARGRPOTrainer._oar_step`).
"""

from __future__ import annotations

import os
import time
import warnings

import torch
from trl import GRPOConfig, GRPOTrainer

from oar_verl.core.backends.rules import rules_error
from oar_verl.core.checks.mask_token import check_model_mask_token
from oar_verl.core.checks.model_rules import rules_refusal
from oar_verl.core.config import OARConfigError
from oar_verl.core.dumps import DumpSchedule, dump_dir, pick_groups, write_dump
from oar_verl.core.reshaping.metrics import flat_warning
from oar_verl.trl.config import (FIELD_SUPPORT, OARGRPOConfig, OARTRLArgsError, _rename, check_trl_args,
                                 check_trl_version, oar_config_of)
from oar_verl.trl.reshape import TRLReshaped, reshape_batch

__all__ = ["OARGRPOTrainer", "SEQUENCE_ADVANTAGES", "TIMER"]

TIMER = "timing/oar"  # this process's attribution and reshaping seconds per generation batch
SEQUENCE_ADVANTAGES = "oar_sequence_advantages"  # (B,) TRL's advantages, kept in the batch beside the (B, T) ones
# TRL 1.16's metrics that _compute_loss computes per sequence from its (B, 1) advantages, by loss_type
_SEQUENCE_METRICS = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}


def _policy(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM a wrapper holds (DDP, a DeepSpeed engine); FSDP2 and PEFT models are used as they are."""
    while type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine") and hasattr(model, "module"):
        model = model.module
    return model


def _multimodal(model, processing_class) -> str | None:
    """Why the policy is multimodal, as TRL 1.16 detects it (a ``ProcessorMixin`` as ``processing_class``: its
    ``_is_vlm``, which feeds the images to the loss) or as the model's config says (a vision or audio sub-config);
    None for a text-only model (``model`` a path: its config is not read here)."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        return f"its processing_class is a processor ({type(processing_class).__name__}), TRL's vision-language path"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    sub = [k for k in ("vision_config", "audio_config") if getattr(getattr(base, "config", None), k, None) is not None]
    return f"its config has {sub[0]}" if sub else None


def _refuse_multimodal(model, processing_class) -> None:
    why = _multimodal(model, processing_class)
    if why:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise OARTRLArgsError(
            f"model {name!r} is multimodal ({why}): TRL hands its images (pixel_values, image_grid_thw, ...) to the "
            "loss's forward, but OAR's attribution passes run on the token ids alone, so every oar_mode would "
            "attribute the completion without the images. Allowed: a text-only causal LM with its tokenizer as "
            "processing_class")


class OARGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with OAR's per-token advantages; takes the same arguments, with ``args`` an
    :class:`~oar_verl.trl.config.OARGRPOConfig` (a plain ``GRPOConfig`` runs OAR's defaults, with a warning).

    Raises (at construction, before any step):
        OARConfigError / OARTRLArgsError: an OAR key out of range, a TRL setting OAR cannot run with (FSDP1 from
            accelerate's config included), a multimodal model, an unsafe mask token of the policy's tokenizer, a mode
            whose rules do not cover the model; each names the field (or the model) and what is allowed.
    """

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, *a, **kw):
        check_trl_version()
        if args is None:  # TRL's own default, as OAR's config
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model") or "model"
            args = OARGRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        elif not isinstance(args, OARGRPOConfig):
            warnings.warn("OARGRPOTrainer got a plain GRPOConfig: OAR runs with its defaults (use OARGRPOConfig to "
                          "set the oar_* keys)", stacklevel=2)
            check_trl_args(args)
        self.oar_cfg = oar_config_of(args)
        _refuse_multimodal(model, kw.get("processing_class", a[2] if len(a) > 2 else None))  # before loading it
        super().__init__(model, reward_funcs, args, *a, **kw)
        self._oar_flat_warned = False
        self._oar_logps: list[torch.Tensor] | None = None  # set while _compute_loss runs for a sequence metric
        # OAR steps per optimizer step: ⌈GA / (steps_per_generation × num_iterations)⌉, the most generations in one
        self._oar_per_step = max(1, -(-self.args.gradient_accumulation_steps //
                                      (self.args.steps_per_generation * self.num_iterations)))
        self._oar_launch()
        self._oar_check_model()

    # -- start-up checks on the built policy
    def _oar_check_model(self) -> None:
        """The model-dependent start-up checks: accelerate's FSDP version, a multimodal model, the mask token
        (tokenizer, the EOS ids TRL resolved from the model's generation config) and the default mode's rules against
        the policy's modules."""
        cfg, model = self.oar_cfg, _policy(self.model)
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and getattr(plugin, "fsdp_version", 2) == 1:
            raise OARTRLArgsError(f"accelerate's fsdp_version=1: {FIELD_SUPPORT['fsdp'].why}")
        _refuse_multimodal(model, self.processing_class)  # the processor TRL loaded, the model it loaded
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        try:
            check_model_mask_token(cfg, path if path and os.path.isdir(path) else None, self._oar_tokenizer(),
                                   eos_ids=self.eos_token_ids)
        except OARConfigError as e:
            raise OARConfigError(_rename(str(e))) from None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        reason = rules_error(base, cfg.attention_rule)
        refusal = None if reason is None else rules_refusal(
            cfg, f"on model_type={getattr(base.config, 'model_type', type(base).__name__)}", reason)
        if refusal is not None:
            raise OARConfigError(_rename(refusal))

    def _oar_tokenizer(self):
        return getattr(self.processing_class, "tokenizer", None) or self.processing_class

    # -- the hook: right after TRL's generation and advantages
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: TRL's loss on its own advantages
            return output
        t0 = time.perf_counter()
        step = self._oar_step()
        model = _policy(self.model)
        longest = output["prompt_ids"].shape[1] + output["completion_ids"].shape[1]
        res = reshape_batch(model, self._oar_tokenizer(), self.oar_cfg, step, prompt_ids=output["prompt_ids"],
                            prompt_mask=output["prompt_mask"], completion_ids=output["completion_ids"],
                            completion_mask=output["completion_mask"], advantages=output["advantages"],
                            tool_mask=output.get("tool_mask"),
                            max_tokens=self.args.per_device_train_batch_size * longest,
                            checkpointing=bool(self.args.gradient_checkpointing or
                                               getattr(self.args, "activation_checkpointing", None)))
        output[SEQUENCE_ADVANTAGES] = output["advantages"]
        output["advantages"] = res.advantages
        metrics = dict(res.metrics)
        metrics[TIMER] = time.perf_counter() - t0
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        warning = None if self._oar_flat_warned else flat_warning(res.metrics, step)
        if warning:
            self._oar_flat_warned = True
            if self.accelerator.is_main_process:
                print(warning, flush=True)
        if self.accelerator.is_main_process:  # it dumps its own rows
            due = self._oar_dumps.take(step, bool(res.attribution.attributed.any()))
            if due is not None:
                self._oar_dump(step, output, res, due)
        return output

    def _oar_launch(self) -> None:
        """OAR's state of one ``train()`` call: a second call (a resume from an earlier checkpoint) starts afresh."""
        self._oar_last = (-1, 0)  # (global_step, index in it) of the last generation reshaped
        self._oar_dumps = DumpSchedule(self.oar_cfg.dump_every, "oar_dump_every", " on the main process",
                                       "its prompt groups' rewards tied")

    def train(self, *args, **kwargs):
        self._oar_launch()
        return super().train(*args, **kwargs)

    def _oar_step(self) -> int:
        """This generation's OAR step (probe schedule, noise seeds, dump file): ``global_step × r + k + 1``, r =
        ⌈gradient_accumulation_steps / (steps_per_generation × num_iterations)⌉ (at most that many generations fall
        in one optimizer step), k this generation's index in its optimizer step. r = 1 (TRL's default): TRL's
        ``global_step + 1``. Distinct for every generation; a resumed run starts at an optimizer step's boundary
        (k = 0), so it continues the numbering from TRL's restored ``global_step`` with nothing else to persist."""
        gs = int(self.state.global_step)
        k = self._oar_last[1] + 1 if self._oar_last[0] == gs else 0
        if k >= self._oar_per_step:  # TRL generated more often than its schedule allows: numbers would collide
            raise RuntimeError(f"generation {k + 1} in optimizer step {gs}, more than the {self._oar_per_step} that "
                               "gradient_accumulation_steps / (steps_per_generation × num_iterations) allows")
        self._oar_last = (gs, k)
        return gs * self._oar_per_step + k + 1

    # -- TRL's per-sequence metrics on its own (B,) advantages
    def _get_per_token_logps_and_entropies(self, *a, **kw):
        out = super()._get_per_token_logps_and_entropies(*a, **kw)
        if self._oar_logps is not None:
            self._oar_logps.append(out[0].detach())
        return out

    def _compute_loss(self, model, inputs):
        """TRL's loss on the (B, T) advantages; cispo's / vespo's per-sequence metric (:data:`_SEQUENCE_METRICS`),
        which TRL computes from its (B, 1) advantages, recomputed on the batch's :data:`SEQUENCE_ADVANTAGES` as TRL
        computes it on a plain batch (the (B, T) ones would make it a per-token mean)."""
        seq = inputs.get(SEQUENCE_ADVANTAGES)
        inputs = {k: v for k, v in inputs.items() if k != SEQUENCE_ADVANTAGES}
        key = _SEQUENCE_METRICS.get(self.loss_type)
        if seq is None or key is None:
            return super()._compute_loss(model, inputs)
        self._oar_logps = []
        try:
            loss = super()._compute_loss(model, inputs)
            logps = self._oar_logps[0]
        finally:
            self._oar_logps = None
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][key][-1] = self._oar_sequence_metric(inputs, logps, seq)
        return loss

    def _oar_sequence_metric(self, inputs: dict, per_token_logps: torch.Tensor, seq: torch.Tensor) -> float:
        """TRL 1.16's ``cispo_clip_ratio`` / ``vespo/phi_seq_mean`` (``_compute_loss``'s metric block) on (B, 1)
        advantages ``seq``; ``per_token_logps`` (B, T) the loss's own, detached."""
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
        old = inputs.get("old_per_token_logps")
        log_ratio = per_token_logps - (per_token_logps if old is None else old)
        adv = seq[:, None]
        if self.loss_type == "cispo":
            if self.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            x = ((torch.exp(log_ratio) > self.epsilon_high) & (adv > 0)).float()
        else:
            x = self.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"), k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos, k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg)
        if x.shape[1] == 1:  # TRL's global_masked_mean: one value per sequence, or per masked token
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            local = torch.stack([(x * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _oar_dump(self, step: int, output: dict, res: TRLReshaped, due: int) -> None:
        """The main process's attributed prompt groups of this step as token records (``oar_dump_every``; ``due``: the
        due step it stands in for), in the core's dump format (``python -m oar_verl.viz.heatmap``); default folder
        ``<output_dir>/oar_dumps``."""
        cfg, att, reshaped = self.oar_cfg, res.attribution, res.reshaped
        B = att.attributed.shape[0]
        first = self.accelerator.process_index * B  # TRL's groups: num_generations consecutive rows over processes
        uids = ((torch.arange(B) + first) // self.num_generations).numpy()
        rows = pick_groups(uids, att.attributed, cfg.dump_groups)
        own = res.model_mask  # the model's tokens; the response's others are context (tool outputs: "turn" -1)
        seq = (reshaped.base_advantages * own).sum(-1) / own.sum(-1).clamp(min=1)
        rewards = self._oar_rewards(first, B)
        write_dump(dump_dir(cfg, self.args.output_dir) / f"step_{step}.jsonl", step, rows, uids, rewards, seq,
                   output["completion_ids"].cpu(), own, att.importance, reshaped.token_weights.weights,
                   att.reasoning_mask, att.answer_mask, att.span_found, self._oar_tokenizer(),
                   valid=att.response_mask, due_step=due)

    def _oar_rewards(self, first: int, rows: int) -> torch.Tensor:
        """(rows,) this process's rewards of the batch just scored, from TRL's completion log (every process's
        rewards per function, appended last; weighted and summed as TRL sums them); NaN where not logged."""
        logged = self._logs["rewards"]
        total = rows * self.accelerator.num_processes
        if not logged or any(len(logged[n]) < total for n in self.reward_func_names):
            return torch.full((rows,), float("nan"))
        per_func = torch.tensor([list(logged[n])[-total:] for n in self.reward_func_names]).T  # (total, F)
        rewards = (per_func * self.reward_weights.cpu()[None, :]).nansum(-1)
        return rewards[first: first + rows]

