"""TRL's ``GRPOTrainer`` whose advantages OAR reshapes token by token right after generation (``OARGRPOTrainer``).

TRL computes its group-normalised advantages (B,) in ``_generate_and_score_completions``; this subclass attributes the
rows with a non-zero advantage on the policy (:func:`oar_verl.trl.reshape.reshape_batch`, the core's ``attribute`` and
``reshape``) and hands ``_compute_loss`` (B, C) advantages ``w_t * A`` instead, which every ``loss_type`` of TRL 1.16
consumes as they are (it adds a dimension to 1-D advantages only). Everything else is TRL's: generation (its own
``generate``, vLLM server or colocate), rewards, the loss, accelerate's DDP / FSDP2 / DeepSpeed wrapping, PEFT,
checkpoints. The ``oar/*`` metrics go through TRL's ``_metrics`` (its logs and reporters), with ``timing/oar``.
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
from oar_verl.core.dumps import due as dump_due
from oar_verl.core.dumps import dump_dir, pick_groups, write_dump
from oar_verl.core.reshaping.metrics import flat_warning
from oar_verl.trl.config import OARGRPOConfig, _rename, check_trl_args, check_trl_version, oar_config_of
from oar_verl.trl.reshape import TRLReshaped, reshape_batch

__all__ = ["OARGRPOTrainer", "TIMER"]

TIMER = "timing/oar"  # this process's attribution and reshaping seconds per generation batch


def _policy(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM a wrapper holds (DDP, a DeepSpeed engine); FSDP2 and PEFT models are used as they are."""
    while type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine") and hasattr(model, "module"):
        model = model.module
    return model


class OARGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with OAR's per-token advantages; takes the same arguments, with ``args`` an
    :class:`~oar_verl.trl.config.OARGRPOConfig` (a plain ``GRPOConfig`` runs OAR's defaults, with a warning).

    Raises (at construction, before any step):
        OARConfigError / OARTRLArgsError: an OAR key out of range, a TRL setting OAR cannot run with, an unsafe mask
            token of the policy's tokenizer, a mode whose rules do not cover the model; each names the field.
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
        super().__init__(model, reward_funcs, args, *a, **kw)
        self._oar_flat_warned = False
        self._oar_check_model()

    # -- start-up checks on the built policy
    def _oar_check_model(self) -> None:
        """The model-dependent start-up checks: the mask token (tokenizer, generation config) and the default mode's
        rules against the policy's modules."""
        cfg, model = self.oar_cfg, _policy(self.model)
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        try:
            check_model_mask_token(cfg, path if path and os.path.isdir(path) else None, self._oar_tokenizer())
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
        step = int(self.state.global_step) + 1  # resumed runs continue the probe schedule and the noise seeds
        model = _policy(self.model)
        longest = output["prompt_ids"].shape[1] + output["completion_ids"].shape[1]
        res = reshape_batch(model, self._oar_tokenizer(), self.oar_cfg, step, prompt_ids=output["prompt_ids"],
                            prompt_mask=output["prompt_mask"], completion_ids=output["completion_ids"],
                            completion_mask=output["completion_mask"], advantages=output["advantages"],
                            tool_mask=output.get("tool_mask"),
                            max_tokens=self.args.per_device_train_batch_size * longest,
                            checkpointing=bool(self.args.gradient_checkpointing))
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
        if dump_due(self.oar_cfg, step) and self.accelerator.is_main_process:
            self._oar_dump(step, output, res)
        return output

    def _oar_dump(self, step: int, output: dict, res: TRLReshaped) -> None:
        """The main process's attributed prompt groups of this step as token records (``oar_dump_every``), in the
        core's dump format (``python -m oar_verl.viz.heatmap``); default folder ``<output_dir>/oar_dumps``."""
        cfg, att, reshaped = self.oar_cfg, res.attribution, res.reshaped
        B = att.attributed.shape[0]
        first = self.accelerator.process_index * B  # TRL's groups: num_generations consecutive rows over processes
        uids = ((torch.arange(B) + first) // self.num_generations).numpy()
        rows = pick_groups(uids, att.attributed, cfg.dump_groups)
        mask = att.response_mask
        seq = (reshaped.base_advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        rewards = self._oar_rewards(first, B)
        write_dump(dump_dir(cfg, self.args.output_dir) / f"step_{step}.jsonl", step, rows, uids, rewards, seq,
                   output["completion_ids"].cpu(), mask, att.importance, reshaped.token_weights.weights,
                   att.reasoning_mask, att.answer_mask, att.span_found, self._oar_tokenizer())

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

