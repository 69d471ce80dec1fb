"""OAR where its users run it: verl's FSDP2 actor with ``OARActorRolloutRefWorker`` as a Ray worker group, one training
step's calls in order, on CUDA (NCCL) or CPU (gloo), measured and checked against the core.

The ``verl-worker`` part of scripts/gpu_check.sh runs :func:`run_variant` once per parameter dtype of FSDP2's mixed
precision (``bf16``: what users train with; ``fp32``: the exactness check) on one model, rows and tokenizer:

1. a Qwen2.5 shape built from a config (random weights, stored in bf16 so both variants hold the same weights), a
   byte-level BPE trained locally on the rows' text, prompts and responses of unequal lengths (2k-4k tokens on the
   GPU) ending in "The answer is N.";
2. the group built as verl's trainers build it (:mod:`devtools.verl_group`): gradient checkpointing, dynamic batch
   sizes (one token budget for training, log-probs and attribution), sdpa attention;
3. what one training step runs: old log-probs -> ``compute_token_importance`` for ``gradient``, ``fisher`` and the
   ``segment`` policy of ``perturbation`` -> the old-log-prob pass again with fisher, conservative and OAR-G's
   teachers read from it (``algorithm.oar.shared_forward``: verl's log-probs unchanged, the separate call's scores;
   OAR-G in bf16 at Spearman >= 0.9, its teachers from another layout) -> the ``oar`` estimator
   (Σw = R, finite weights) -> ``update_actor`` with the reshaped advantages;
4. per call, in the worker process: seconds (device synchronised), peak device memory above the call's start, and in
   attribution every host synchronisation (CUDA's sync debug mode), by the line of ours that caused it;
5. the core on the same weights and rows afterwards, in this process (:func:`oar_verl.core.pipeline.attribute` on the
   Hugging Face model, the worker's token budget): fp32 per-row max |Δ| / max |score| <= 1e-3, bf16 per-row Spearman
   >= 0.98 over the reasoning tokens.

Every process imports this module (Ray unpickles :class:`ProbedWorker` by reference): it must stay importable where
verl is, with the repository root on ``PYTHONPATH``.
"""

from __future__ import annotations

import collections
import importlib.metadata as md
import os
import random
import shutil
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from research.worker_report import SHARED_MODES, shared_call, steady_peak_ratio  # noqa: F401 (re-exported)

MODES = ("gradient", "fisher", "conservative", "segment")  # the attribution calls of the step, in order
# non-tensor flag: the worker takes its fallback for this call (an engine that cannot carry attribution in the pass:
# attribution right after it, in the same call), as Megatron, Ulysses or fused kernels would make it
FALLBACK_KEY = "probe_fallback"
FALLBACK_CALL = "fisher-fallback"
COUNT_SYNCS_KEY = "probe_count_syncs"  # non-tensor flag: count this attribution call's host syncs (slower: untimed)
FP32_TOLERANCE = 1e-3  # per row: max |worker - core| / max |core|
BF16_SPEARMAN = 0.98  # per row, over the reasoning tokens
# OAR-G with its teachers read from another layout than its own passes', against its own call: in bf16 the layout's
# rounding adds to the student-teacher shift it differentiates (0.97 on SmolLM2's rows: docs/method.md §14)
BF16_TEACHER_SPEARMAN = 0.9
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    """The part's inputs: model ``shape`` (research.scaling.SHAPES), response lengths of the rows per variant
    (``bf16``, and the fp32 exactness check, where TF32 is off and the segment policy's R^2 work costs ~10x more:
    shorter rows, cut from the same texts), the token ``budget`` of every pass (training, log-probs, attribution),
    ``repeats`` of each timed call (the first warms; the segment policy runs once)."""

    shape: str
    bf16_lengths: tuple[int, ...]
    fp32_lengths: tuple[int, ...]
    budget: int
    repeats: int = 2

    def lengths(self, variant: str) -> tuple[int, ...]:
        return self.fp32_lengths if variant == "fp32" else self.bf16_lengths


GPU = Plan("qwen2.5-1.5b", (2048, 2560, 3072, 4096), (1024, 1536, 2048, 2560), budget=8192)
TINY = Plan("tiny", (64, 96, 128, 160), (64, 96, 128, 160), budget=512)


def mode_label(cfg: dict) -> str:
    """The step's name of an attribution call's OARConfig values (:data:`MODES`)."""
    return "segment" if cfg.get("perturbation") == "segment" else cfg["mode"]


def oar_config(mode: str, budget: int):
    """The OARConfig of one attribution call (``segment``: OAR-P's segment policy, sentences of 8-64 tokens)."""
    from oar_verl.core.config import OARConfig

    policy = {"mode": "perturbation", "perturbation": "segment"} if mode == "segment" else {"mode": mode}
    return OARConfig(**policy, probe="as_mean", max_token_len_per_gpu=budget)


# ---------------------------------------------------------------------------------------------------------------------
# Inputs: model, tokenizer, rows
# ---------------------------------------------------------------------------------------------------------------------


def sentence(rng: random.Random, i: int) -> str:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return (f"Step {i}: we add {a} and {b}, which gives {a + b}; then we check the sum against the previous line "
            f"and keep {rng.choice(['the result', 'the carry', 'both numbers'])} for the next step.")


def build_inputs(out_dir: Path, plan: Plan, lengths, seed: int = 0) -> tuple[str, list[list[int]], list[list[int]]]:
    """The model directory (Qwen2.5 ``plan.shape`` with random weights in bf16, and a BPE trained on the rows' text)
    and each row's prompt ids (chat template) and response ids (reasoning cut to the row's length, then "The answer
    is N." and EOS)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from oar_verl.quickstart.tokenizers import train_tiny_bpe
    from research import scaling

    rng = random.Random(seed)
    texts = [" ".join(sentence(rng, i) for i in range(400)) for _ in range(len(lengths))]
    model_dir = out_dir / "model"
    if not model_dir.exists():  # built beside it, then renamed: a stopped build leaves no half model behind
        building = out_dir / f"model.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        train_tiny_bpe(texts + ["What is 12 plus 30? The answer is 42."], vocab_size=1024, out_dir=building)
        layers, hidden, heads, kv, head_dim, inter, vocab, tied = scaling.SHAPES[plan.shape]
        cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                          tie_word_embeddings=tied, max_position_embeddings=32768, dtype="bfloat16")
        torch.manual_seed(seed)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(building, safe_serialization=True)
        del model
        building.rename(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = [], []
    for i, (n, text) in enumerate(zip(lengths, texts)):
        answer = 100 + 17 * i
        prompts.append(tok.apply_chat_template([{"role": "user", "content": f"Add the numbers, row {i}. End with: "
                                                 "The answer is N."}], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
        tail = tok.encode(f" The answer is {answer}.", add_special_tokens=False) + [tok.eos_token_id]
        reasoning = tok.encode(text, add_special_tokens=False)
        if len(reasoning) < n - len(tail):
            raise ValueError(f"row {i}: {len(reasoning)} reasoning tokens, {n - len(tail)} needed")
        responses.append(reasoning[: n - len(tail)] + tail)
    return str(model_dir), prompts, responses


# ---------------------------------------------------------------------------------------------------------------------
# The worker, measured
# ---------------------------------------------------------------------------------------------------------------------


def _sync_site(stack: list[traceback.FrameSummary]) -> str:
    """Where a host synchronisation came from: the innermost frame in this project's code (else verl's, else the
    innermost), as ``path:line (function)``."""
    for wanted in ("oar_verl", "verl"):
        for frame in reversed(stack):
            parts = Path(frame.filename).parts
            if wanted in parts:
                rel = "/".join(parts[parts.index(wanted):])
                return f"{rel}:{frame.lineno} ({frame.name})"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.name})"


class CallProbe:
    """Seconds, peak device memory above the start and (on CUDA, ``count_syncs``) host synchronisations of one call."""

    def __init__(self, device: torch.device, count_syncs: bool):
        self.cuda = device.type == "cuda"
        self.count_syncs = count_syncs and self.cuda
        self.syncs: collections.Counter = collections.Counter()

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        if self.count_syncs:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._show
            torch.cuda.set_sync_debug_mode("warn")
        self.start = time.perf_counter()
        return self

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self.syncs[_sync_site(traceback.extract_stack()[:-1])] += 1

    def __exit__(self, *exc):
        if self.count_syncs:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        self.peak = (torch.cuda.max_memory_allocated() - self.base) if self.cuda else None
        return False

    def record(self) -> dict:
        return {"seconds": self.seconds, "peak_bytes": self.peak, "base_bytes": getattr(self, "base", None),
                "syncs": dict(self.syncs) if self.count_syncs else None}


def loaded_distributions() -> list[str]:
    """The installed distributions this process has imported modules from (what a bundle must hold or the machine
    have). A top-level name several distributions share (a namespace such as ``google``) counts only for those whose
    recorded files were loaded."""
    owners = md.packages_distributions()
    files = {os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    tops = {name.partition(".")[0] for name, m in list(sys.modules.items()) if getattr(m, "__file__", None)}
    found = set()
    for top in tops:
        dists = owners.get(top, [])
        if len(dists) == 1:
            found.add(dists[0])
            continue
        for name in dists:  # a shared namespace: whose files are loaded
            dist = md.distribution(name)
            if any(os.path.realpath(dist.locate_file(f)) in files for f in dist.files or () if f.suffix == ".py"):
                found.add(name)
    return sorted(found)


def _probed_worker():
    """:class:`ProbedWorker`, defined on first use (it subclasses the verl worker: importing verl is deferred so the
    module imports without it, e.g. in gpu_check's planner)."""
    from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register

    from oar_verl.integration.fields import CONFIG_KEY, SHARED_KEY
    from oar_verl.integration.worker import OARActorRolloutRefWorker

    actor_mesh = make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")

    class ProbedWorker(OARActorRolloutRefWorker):
        """The OAR worker with each call of the step measured in its own process (:class:`CallProbe`)."""

        def _probe(self, name, fn, data, count_syncs=False):
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
            with CallProbe(device, count_syncs) as probe:
                out = fn(data)
            self.__dict__.setdefault("_oar_probes", []).append({"call": name, **probe.record()})
            return out

        @register(dispatch_mode=actor_mesh)
        def compute_log_prob(self, data):
            from unittest import mock

            from verl.utils import tensordict_utils as tu

            shared = tu.get(data, SHARED_KEY)  # the pass with a method read from it
            if tu.pop(data, FALLBACK_KEY, default=False):
                with mock.patch.object(OARActorRolloutRefWorker, "_shared_pass_error",
                                       lambda *args: "the fallback, forced by the probe"):
                    return self._probe(FALLBACK_CALL, super().compute_log_prob, data)
            name = "compute_log_prob" if shared is None else shared_call(shared[CONFIG_KEY]["mode"])
            return self._probe(name, super().compute_log_prob, data)

        @register(dispatch_mode=actor_mesh)
        def compute_token_importance(self, data):
            from verl.utils import tensordict_utils as tu

            count = bool(tu.pop(data, COUNT_SYNCS_KEY, default=False))  # the warm-up call counts, the rest are timed
            return self._probe(mode_label(tu.get(data, CONFIG_KEY)), super().compute_token_importance, data,
                               count_syncs=count)

        @register(dispatch_mode=actor_mesh)
        def update_actor(self, data):
            return self._probe("update_actor", super().update_actor, data)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def probe_records(self):
            return {"calls": self.__dict__.get("_oar_probes", []), "distributions": loaded_distributions(),
                    "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    ProbedWorker.__module__, ProbedWorker.__qualname__ = __name__, "ProbedWorker"
    return ProbedWorker


def __getattr__(name: str):
    if name == "ProbedWorker":  # Ray pickles the class by reference: every process resolves it here
        cls = _probed_worker()
        globals()["ProbedWorker"] = cls
        return cls
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------------------------------
# One variant: the step through the group, then the core on the same weights
# ---------------------------------------------------------------------------------------------------------------------


def update_tensordict(prompts, responses, pad_id: int, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      batch_size: int):
    """The update's input as verl's trainers hand it over: left-padded prompts, right-padded responses (B, T) with the
    old log-probs and advantages, through verl's ``left_right_2_no_padding``, and the mini-batch keys."""
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    P, T = max(map(len, prompts)), max(map(len, responses))
    p_ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])
    r_ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in responses])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    r_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    attention = torch.cat([p_mask, r_mask], 1)
    batch = DataProto.from_dict(tensors={
        "input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "prompts": p_ids, "responses": r_ids,
        "response_mask": r_mask, "old_log_probs": old_log_probs * r_mask, "advantages": advantages * r_mask})
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, temperature=1.0, calculate_entropy=False, distillation_use_topk=False,
                         distillation_only=False, global_batch_size=batch_size, mini_batch_size=batch_size, epochs=1,
                         seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return data


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged).to_padded_tensor(0.0)


def estimator_checks(importance: list[torch.Tensor], reasoning: list[torch.Tensor], responses) -> dict:
    """The ``oar`` estimator on one method's importance with rewards 1, 0, 1, 0 (one prompt group): per row Σw over
    the reasoning tokens against R, finite weights, and the (B, T) advantages."""
    from omegaconf import OmegaConf

    from oar_verl.integration.estimator import compute_oar

    mask = padded([torch.ones(len(r)) for r in responses])
    rewards = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(responses)), last] = torch.tensor([1.0, 0.0] * (len(responses) // 2)
                                                               + [1.0] * (len(responses) % 2))
    algorithm = OmegaConf.create({"norm_adv_by_std_in_grpo": True, "oar": {"probe": "as_mean"}})
    index = np.array(["p0"] * len(responses), dtype=object)
    reasoning_mask = padded([r.float() for r in reasoning]).bool()
    out = compute_oar(rewards, mask, index, algorithm, padded(importance), reasoning_mask)
    w = out.token_weights.weights
    sums, counts = (w * reasoning_mask).sum(-1), reasoning_mask.sum(-1).float()
    return {"advantages": out.advantages, "weight_sum": sums.tolist(), "reasoning_tokens": counts.tolist(),
            "max_sum_error": float((sums - counts).abs().max()), "finite": bool(torch.isfinite(w).all()),
            "reshaped_rows": int(out.token_weights.reshaped.any(-1).sum())}


def core_reference(model_dir: str, prompts, responses, budget: int, param_dtype: str, device: str) -> dict:
    """The core's importance of the same rows on the same weights (the Hugging Face model in the variant's compute
    dtype, the worker's token budget and memory guard): {mode: [per-row response scores]}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar_verl.core.backends.memory import memory_guard, model_shape
    from oar_verl.core.methods.attribution import module_backend, pass_limits
    from oar_verl.core.pipeline import attribute

    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if param_dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in model.parameters():
        p.requires_grad_(False)
    out = {}
    for mode in MODES:
        cfg = oar_config(mode, budget)
        guard = memory_guard(torch.device(device), model_shape(model), checkpointing=True)

        def backend(prepared, cfg=cfg, guard=guard):
            return module_backend(model, cfg, limits=pass_limits(cfg, budget, guard), checkpointing=True,
                                  pad_id=tok.pad_token_id or 0)

        att = attribute(backend, [torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses], tok, cfg,
                        3, device=device)
        out[mode] = [att.importance[i, :n].float().cpu() for i, n in enumerate(att.lengths)]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def agreement(worker: list[torch.Tensor], core: list[torch.Tensor], reasoning: list[torch.Tensor]) -> dict:
    """Per row: max |Δ| / max |core| over the response, and Spearman's rho over the reasoning tokens."""
    from research.common import spearman

    rel, rho = [], []
    for w, c, m in zip(worker, core, reasoning):
        scale = float(c.abs().max())
        rel.append(float((w - c).abs().max()) / scale if scale > 0 else float("inf"))
        m = m.bool()
        rho.append(spearman(w[m].double().numpy(), c[m].double().numpy()))
    return {"max_rel_diff": rel, "spearman": rho, "nonzero": int(sum(int((c != 0).sum()) for c in core))}


def run_variant(plan: Plan, param_dtype: str, device: str, work: Path, log=print) -> dict:
    """One variant of the part (see the module docstring); returns its point (JSON-ready)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from devtools.verl_group import actor_group, rows_tensordict, trainer_config
    from oar_verl.integration.fields import CONFIG_KEY, SHARED_KEY, STEP_KEY
    from oar_verl.quickstart.launcher import new_ray_temp_dir

    t0 = time.perf_counter()
    model_dir, prompts, responses = build_inputs(work, plan, plan.lengths(param_dtype))
    build_s = time.perf_counter() - t0
    n = len(responses)
    cfg = trainer_config(model_dir, batch_size=n, micro_batch_size=1, param_dtype=param_dtype,
                         token_budget=plan.budget, checkpointing=True,
                         extra=["actor_rollout_ref.actor.optim.lr=1e-6"])
    point: dict = {"length": param_dtype, "param_dtype": param_dtype, "shape": plan.shape,
                   "response_lengths": [len(r) for r in responses], "prompt_lengths": [len(p) for p in prompts],
                   "budget": plan.budget, "repeats": plan.repeats, "inputs_seconds": build_s}
    worker_cls = sys.modules[__name__].ProbedWorker
    t1 = time.perf_counter()
    with actor_group(worker_cls, cfg, new_ray_temp_dir(), 1, device, num_cpus=min(8, os.cpu_count() or 1)) as wg:
        point["group_seconds"] = time.perf_counter() - t1
        log(f"[verl-worker {param_dtype}] group up in {point['group_seconds']:.0f} s")
        rows = rows_tensordict(prompts, responses)
        logp_data = rows.clone()
        tu.assign_non_tensor(logp_data, temperature=1.0, compute_loss=False, calculate_entropy=False)
        for _ in range(plan.repeats):
            log_probs = wg.compute_log_prob(logp_data.clone())["log_probs"]
        worker_imp, masks = {}, {}
        for mode in MODES:
            data = rows.clone()
            tu.assign_non_tensor(data, **{CONFIG_KEY: oar_config(mode, plan.budget).to_dict(), STEP_KEY: 3})
            for i in range(calls_of(mode, plan.repeats)):  # the first warms up and counts host syncs
                call = data.clone()
                tu.assign_non_tensor(call, **{COUNT_SYNCS_KEY: i == 0})
                out = wg.compute_token_importance(call)
            worker_imp[mode] = [r.float() for r in out["token_importance"].unbind()]
            masks[mode] = [r.bool() for r in out["oar_reasoning_mask"].unbind()]
            point.setdefault("passes", {})[mode] = out["oar_passes"].tolist()
            log(f"[verl-worker {param_dtype}] {mode} done")
        point["shared"], shared_imp = {}, {}
        for mode in SHARED_MODES:  # the same pass, with the method read from it
            shared_data = logp_data.clone()
            tu.assign_non_tensor(shared_data, **{SHARED_KEY: {CONFIG_KEY: oar_config(mode, plan.budget).to_dict(),
                                                              STEP_KEY: 3}})
            for _ in range(plan.repeats):
                shared = wg.compute_log_prob(shared_data.clone())
            point["shared"][mode] = {
                "log_probs_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(
                    log_probs.unbind(), shared["log_probs"].unbind())),
                "log_probs_equal": all(torch.equal(a, b) for a, b in zip(log_probs.unbind(),
                                                                         shared["log_probs"].unbind())),
                "recomputed": shared["oar_recomputed"].tolist(), "shared": shared["oar_shared"].tolist()}
            shared_imp[mode] = [r.float() for r in shared["token_importance"].unbind()]
        fallback_data = logp_data.clone()  # once: the fallback of an engine that cannot carry it
        tu.assign_non_tensor(fallback_data, **{SHARED_KEY: {CONFIG_KEY: oar_config("fisher", plan.budget).to_dict(),
                                                            STEP_KEY: 3}})
        tu.assign_non_tensor(fallback_data, **{FALLBACK_KEY: True})
        fallback = wg.compute_log_prob(fallback_data)
        point["fallback"] = {"log_probs_equal": all(torch.equal(a, b) for a, b in zip(
            log_probs.unbind(), fallback["log_probs"].unbind())), "shared": fallback["oar_shared"].tolist()}
        fallback_imp = [r.float() for r in fallback["token_importance"].unbind()]
        log("[verl-worker %s] fisher, conservative and OAR-G's teachers read from the old-log-prob pass (and the "
            "fallback) done" % param_dtype)
        after = wg.compute_log_prob(logp_data.clone())["log_probs"]
        point["log_probs_unchanged"] = all(torch.equal(a, b) for a, b in zip(log_probs.unbind(), after.unbind()))
        checks = {mode: estimator_checks(worker_imp[mode], masks[mode], responses) for mode in MODES}
        # the old log-probs of the responses as verl's trainers slice them from the pass's output
        old = no_padding_2_padding(log_probs, logp_data).float()
        update = update_tensordict(prompts, responses, 0, old, checks["gradient"]["advantages"], n)
        point["update_metrics"] = []
        for _ in range(plan.repeats):  # the first update starts from the old log-probs' weights: PPO's KL is ~0
            metrics = wg.update_actor(update.clone())["metrics"]
            point["update_metrics"].append({k: float(np.mean(v)) if isinstance(v, list) else float(v)
                                            for k, v in metrics.items() if isinstance(v, (int, float, list))})
        records = wg.probe_records()[0]
    point["estimator"] = {m: {k: v for k, v in c.items() if k != "advantages"} for m, c in checks.items()}
    point["device_name"] = records["device_name"]
    point["worker_distributions"] = records["distributions"]
    point["calls"] = summarise_calls(records["calls"])
    t2 = time.perf_counter()
    core = core_reference(model_dir, prompts, responses, plan.budget, param_dtype, device)
    point["core_seconds"] = time.perf_counter() - t2
    point["agreement"] = {m: agreement(worker_imp[m], core[m], masks[m]) for m in MODES}
    for mode in SHARED_MODES:
        point["shared"][mode]["agreement"] = agreement(shared_imp[mode], worker_imp[mode], masks[mode])
    point["fallback"]["agreement"] = agreement(fallback_imp, worker_imp["fisher"], masks["fisher"])
    point["distributions"] = loaded_distributions()
    point["checks"] = verdicts(point)
    return point


def calls_of(mode: str, repeats: int) -> int:
    """Attribution calls of one mode: ``repeats`` (the first warms up and counts host syncs); the segment policy, a
    hundred passes a call, at most two."""
    return min(repeats, 2) if mode == "segment" else repeats


def summarise_calls(calls: list[dict]) -> dict:
    """Per call of the step (log-probs, each attribution mode, update): the median seconds of the calls after the
    first (warm, and uninstrumented: the first attribution call counts host syncs), the last call's peak device memory
    (absolute, and above its start; the update's with the optimizer's state already allocated, as in every later
    step), the host syncs by site, every call's seconds and peaks, and the ratios to ``update_actor`` and to the
    old-log-prob pass."""
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for c in calls:  # each record is named by its call (an attribution call by its mode)
        by[c["call"]].append(c)
    out = {}
    for name, cs in by.items():
        last, timed = cs[-1], (cs[1:] if len(cs) > 1 else cs)
        out[name] = {"seconds": float(np.median([c["seconds"] for c in timed])),
                     "seconds_all": [c["seconds"] for c in cs], "syncs": cs[0]["syncs"],
                     "peak_bytes": last["peak_bytes"], "peak_bytes_all": [c["peak_bytes"] for c in cs],
                     "absolute_peak_bytes": None if last["peak_bytes"] is None
                     else last["peak_bytes"] + last["base_bytes"]}
    update, logp = out["update_actor"], out["compute_log_prob"]
    logp["vs_update_time"] = logp["seconds"] / update["seconds"]
    for mode in MODES:
        e = out[mode]
        e["vs_update_time"] = e["seconds"] / update["seconds"]
        e["vs_log_prob_time"] = e["seconds"] / logp["seconds"]
        steady_peak(e, update)
    for e in (out[shared_call(m)] for m in SHARED_MODES if shared_call(m) in out):  # what reading it adds, × update
        e["added_vs_update_time"] = (e["seconds"] - logp["seconds"]) / update["seconds"]
        steady_peak(e, update)
    return out


def steady_peak(e: dict, update: dict) -> None:
    """Record :func:`steady_peak_ratio` on ``e`` where both peaks were measured (CUDA)."""
    if e["peak_bytes"] is not None and update["absolute_peak_bytes"] is not None:
        e["vs_update_peak"] = steady_peak_ratio(e, update)


def verdicts(point: dict) -> dict:
    """Each target of the part as pass / fail with its figure."""
    from oar_verl.core.methods.attribution import METHODS
    bf16 = point["param_dtype"] == "bf16"
    out = {}
    for mode, a in point["agreement"].items():
        if bf16:  # a row of one segment has constant scores (no ranking): there the scores themselves must agree
            rho = [r if r == r else (1.0 if d <= 1e-2 else 0.0) for r, d in zip(a["spearman"], a["max_rel_diff"])]
            worst = min(rho)
            out[f"{mode}: worker = core (Spearman >= {BF16_SPEARMAN} per row)"] = (worst >= BF16_SPEARMAN, worst)
        else:
            worst = max(a["max_rel_diff"])
            out[f"{mode}: worker = core (max rel diff <= {FP32_TOLERANCE:g} per row)"] = (worst <= FP32_TOLERANCE, worst)
        est = point["estimator"][mode]
        out[f"{mode}: Σw = R, finite"] = (est["finite"] and est["max_sum_error"] <= 1e-3 * max(est["reasoning_tokens"]),
                                          est["max_sum_error"])
        peak = point["calls"][mode].get("vs_update_peak")
        if peak is not None:
            out[f"{mode}: peak <= update_actor's"] = (peak <= 1.0, peak)
    out["log-probs unchanged by attribution"] = (point["log_probs_unchanged"], None)
    for mode, sh in point.get("shared", {}).items():  # read from the pass: verl's log-probs, the method call's scores
        name = shared_call(mode)
        if bf16:
            out[f"{name}: log-probs = the pass alone (max |Δ| <= 1e-2)"] = (
                sh["log_probs_max_abs_diff"] <= 1e-2, sh["log_probs_max_abs_diff"])
            rho = [r if r == r else (1.0 if d <= 1e-2 else 0.0)
                   for r, d in zip(sh["agreement"]["spearman"], sh["agreement"]["max_rel_diff"])]
            bar = BF16_TEACHER_SPEARMAN if METHODS.get(mode).shared_teacher else BF16_SPEARMAN
            out[f"{name} = {mode} (Spearman >= {bar} per row)"] = (min(rho) >= bar, min(rho))
        else:
            out[f"{name}: log-probs = the pass alone (bitwise)"] = (sh["log_probs_equal"], sh["log_probs_max_abs_diff"])
            worst = max(sh["agreement"]["max_rel_diff"])
            out[f"{name} = {mode} (max rel diff <= {FP32_TOLERANCE:g} per row)"] = (worst <= FP32_TOLERANCE, worst)
        peak = point["calls"].get(name, {}).get("vs_update_peak")
        if peak is not None:
            out[f"{name}: peak <= update_actor's"] = (peak <= 1.0, peak)
    fb = point.get("fallback")
    if fb is not None:  # attribution right after the pass, in the same call: the fisher call's own code path
        a = fb["agreement"]
        worst = min(r if r == r else 1.0 for r in a["spearman"]) if bf16 else max(a["max_rel_diff"])
        ok = worst >= BF16_SPEARMAN if bf16 else worst <= FP32_TOLERANCE
        bound = f"Spearman >= {BF16_SPEARMAN}" if bf16 else f"max rel diff <= {FP32_TOLERANCE:g}"
        out[f"fisher-fallback: log-probs bitwise, scores = fisher ({bound})"] = (
            fb["log_probs_equal"] and set(fb["shared"]) == {0.0} and ok, worst)
    kl = abs(point["update_metrics"][0].get("actor/ppo_kl", float("nan")))
    if not bf16:  # the first update's own log-probs equal the old ones: the handed-over rows are aligned
        out["first update: |PPO KL| <= 1e-6 (old log-probs aligned)"] = (kl <= 1e-6, kl)
    return {k: {"ok": bool(ok), "value": v} for k, (ok, v) in out.items()}
