"""Credit-assignment study: GRPO vs OAR-G vs OAR-P vs token-entropy weighting on the last-digit task, many seeds.

The task (:mod:`oar_verl.quickstart.last_digit`) has one decisive reasoning token per response among ~20 free ones, and a
tiny Qwen2 warm-started to ~0.4 success, so GRPO itself learns within the step budget. verl's trainer costs minutes
of Ray and vLLM start-up per run on CPU, so the seeds run in a minimal GRPO loop here that uses the same pieces as
the OAR trainer step for everything between the rollouts and the loss:

* rollouts: temperature-1 sampling with a KV cache (:func:`research.task.sample_ids`), ``rollout_n`` per prompt;
* base advantage: verl's ``compute_grpo_outcome_advantage`` (through :func:`oar_verl.integration.estimator
  .base_advantage`, as the ``oar`` estimator calls it);
* attribution: :func:`oar_verl.core.preprocess.prepare_attribution` + :func:`oar_verl.core.methods.attribution
  .run_attribution` on the rows with a non-zero advantage (what the OAR worker runs);
* reshaping: the ``oar`` estimator's :func:`oar_verl.integration.estimator.compute_oar`;
* loss: verl's ``compute_policy_loss_vanilla`` with ``seq-mean-token-mean`` (one on-policy update per step: the
  published loss set-up, no KL, no entropy bonus), AdamW and gradient clipping as verl's FSDP actor.

``entropy`` and ``position`` are non-outcome controls (the free alternatives a user would pick, issue #36): the same
gating and mass preservation, with each token's policy entropy, or its position (the latest reasoning token highest),
as its importance. ``--verl-check`` runs verl's real trainer (``python -m oar_verl.main``) for one step per OAR mode with
token dumps and shows that this loop gives the same importance, weights and advantages for those rollouts.

usage: python -m research.credit [--quick] [--seeds N] [--steps N] [--methods grpo,oar_g,oar_p,fisher,entropy,position]
                                   [--verl-check] [--out DIR] [--docs] [--report-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from oar_verl.core.reshaping.gating import SIGNED_SCORES
from oar_verl.quickstart import last_digit as credit_task
from oar_verl.quickstart import last_digit_reward
from research import REPO, digit_task, task
from research.common import bootstrap_ci, finish_figure, nanmean, permutation_p, progress

METHODS = ("grpo", "oar_g", "oar_p", "fisher", "conservative", "entropy", "position")
DEFAULT_METHODS = ("grpo", "oar_g", "oar_p", "entropy")  # the study's protocol; fisher on request (--methods)
LABELS = {"grpo": "GRPO", "oar_g": "OAR-G", "oar_p": "OAR-P", "fisher": "OAR fisher",
          "conservative": "OAR conservative", "entropy": "entropy weights", "position": "position weights"}
COLORS = {"grpo": "tab:gray", "oar_g": "tab:orange", "oar_p": "tab:blue", "fisher": "tab:purple",
          "conservative": "tab:red", "entropy": "tab:green", "position": "tab:olive"}
MODES = {"oar_g": "gradient", "oar_p": "perturbation", "fisher": "fisher", "conservative": "conservative"}
# the task the runs use (--task): the product's last-digit module, or a research.digit_task.DigitTask with the
# decisive token early or in the middle; both offer the same names
TASK = credit_task
ROLES = ("decisive", "decoy", "filler", "answer")


@dataclass
class Settings:
    seeds: int
    steps: int
    prompts_per_step: int  # prompts per step (GRPO groups)
    rollout_n: int  # responses per prompt
    lr: float
    eval_every: int
    val_repeats: int  # samples of each of the 15 validation prompts
    warm_steps: int  # supervised warm-start steps
    target: float  # the accuracy "steps to reach" is measured at
    max_new_tokens: int = 48
    threads: int = 1


# lr tuned on GRPO alone (seed 0, 40 steps; research/docs/evidence.md §3): 1e-3 oscillates and can collapse, 1e-4 learns
# without saturating, 3e-4 learns fastest while staying stable
QUICK = Settings(seeds=2, steps=6, prompts_per_step=8, rollout_n=8, lr=3e-4, eval_every=3, val_repeats=4,
                 warm_steps=300, target=0.5)
FULL = Settings(seeds=5, steps=40, prompts_per_step=8, rollout_n=8, lr=3e-4, eval_every=5, val_repeats=16,
                warm_steps=400, target=0.8)


# ---------------------------------------------------------------------------------------------------------------------
# Assets
# ---------------------------------------------------------------------------------------------------------------------


def build_assets(root: Path, s: Settings, *, log) -> dict:
    """The warm-started model (:func:`oar_verl.quickstart.last_digit.warm_start`) under ``root``: its path and numbers."""
    return TASK.warm_start(root, warm_steps=s.warm_steps, max_new_tokens=s.max_new_tokens, log=log)


def load_model(model_dir: str):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tok


# ---------------------------------------------------------------------------------------------------------------------
# One step of the loop
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    prompts: list[tuple[int, int]]  # (K, T) per row
    batch: task.VerlBatch  # (B, P) prompts left-padded, (B, T) responses right-padded
    rewards: torch.Tensor  # (B,)
    uids: np.ndarray  # (B,) prompt group ids


def encode_prompts(tok, prompts: list[tuple[int, int]]) -> list[list[int]]:
    return task.encode(tok, TASK.examples_for(prompts))[0]


def rollout(model, tok, prompts: list[tuple[int, int]], n: int, gen: torch.Generator, max_new_tokens: int) -> Rollouts:
    rows = [p for p in prompts for _ in range(n)]
    ids = encode_prompts(tok, rows)
    b = task.verl_batch(ids, [[tok.eos_token_id]] * len(rows), tok.pad_token_id)
    responses = task.sample_ids(model, tok.eos_token_id, b.prompts, b.prompt_mask, max_new_tokens=max_new_tokens,
                                temperature=1.0, generator=gen)
    return make_rollouts(tok, rows, ids, responses, np.array([i // n for i in range(len(rows))], dtype=object))


def make_rollouts(tok, rows, prompt_ids, responses, uids) -> Rollouts:
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    rewards = torch.tensor([TASK.reward(t, p) for t, p in zip(texts, rows)])
    return Rollouts(rows, task.verl_batch(prompt_ids, responses, tok.pad_token_id), rewards, uids)


def algorithm_config(method: str, seed: int, signed_scores: str = "clamp"):
    """verl's ``algorithm`` section as the OAR trainer sees it: GRPO base advantage, OAR defaults (paper gating,
    probe ``auto``), the mode of ``method``, ``algorithm.oar.seed`` = the run's seed, and
    ``algorithm.oar.signed_scores`` (``--signed-scores``; always set, so the studies' runs do not move with the
    product's default: their default is ``clamp``, the treatment every study before evidence §10 ran)."""
    from omegaconf import OmegaConf

    oar = {"mode": MODES.get(method, "gradient"), "seed": seed, "signed_scores": signed_scores}
    return OmegaConf.create({"adv_estimator": "oar" if method != "grpo" else "grpo", "norm_adv_by_std_in_grpo": True,
                             "oar": oar})


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropy of the policy's next-token distribution from (B, T, V) logits."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class Advantages:
    advantages: torch.Tensor  # (B, T) what the loss uses
    weights: torch.Tensor  # (B, T) OAR weights (1 for GRPO)
    importance: torch.Tensor  # (B, T) raw importance (0 for GRPO)
    reasoning: torch.Tensor  # (B, T) bool
    attributed: torch.Tensor  # (B,) bool rows reshaped (GRPO: the rows OAR would reshape)
    seconds: float  # attribution time


def compute_advantages(method: str, model, tok, r: Rollouts, step: int, algo) -> Advantages:
    """The advantages verl's OAR trainer step gives ``r`` at global step ``step`` (see the module docstring)."""
    import verl  # noqa: F401  (first: importing verl loads the OAR plugin, which imports the estimator module)
    from oar_verl.core.methods.attribution import module_backend, run_attribution
    from oar_verl.core.preprocess import prepare_attribution
    from oar_verl.core.text.spans import locate_answer_spans
    from oar_verl.core.batch.selection import rows_to_reshape, sequence_advantage
    from oar_verl.integration.estimator import base_advantage, read_oar_config

    b = r.batch
    mask = b.response_mask
    scores = _last_token_scores(r)
    cfg = read_oar_config(algo)
    base = base_advantage(scores, mask, r.uids, algo, cfg)
    spans = locate_answer_spans(b.responses, mask, tok, cfg.answer_patterns)
    B, T = mask.shape
    wanted = rows_to_reshape(sequence_advantage(base[0], mask), cfg.apply_to)
    if method == "grpo":  # w = 1 on the rows OAR would reshape
        return Advantages(base[0], mask.float(), torch.zeros(B, T), spans.reasoning_mask & mask.bool(), wanted, 0.0)
    importance = torch.zeros(B, T)
    reasoning = spans.reasoning_mask.clone()
    t0 = time.perf_counter()
    rows = wanted.nonzero().squeeze(1).tolist()
    if rows and method == "entropy":
        with torch.no_grad():
            importance = token_entropy(task.response_logits(model, b)) * mask
    elif rows and method == "position":  # recency: the later a reasoning token, the more credit (no model pass)
        importance = (reasoning & mask.bool()).float().cumsum(-1) * reasoning
    elif rows:
        lens = mask.sum(-1).tolist()
        plens = b.prompt_mask.sum(-1).tolist()
        P = b.prompts.shape[1]
        prepared = prepare_attribution([b.prompts[i, P - plens[i]:] for i in rows],
                                       [b.responses[i, :lens[i]] for i in rows], tok, cfg, step)
        with torch.no_grad() if cfg.mode == "perturbation" else torch.enable_grad():
            res = run_attribution(module_backend(model, cfg), prepared.batch, cfg, mask_token_id=prepared.mask_token_id,
                                  seeds=prepared.seeds)
        for j, (i, imp) in enumerate(zip(rows, prepared.response_importance(res.importance))):
            importance[i, :len(imp)] = imp
            reasoning[i, :len(imp)] = prepared.spans.reasoning_mask[j, :len(imp)]
    seconds = time.perf_counter() - t0
    out = reshape(r, algo, importance, reasoning & mask.bool(), wanted, base=base)
    return Advantages(out.advantages, out.token_weights.weights, importance, reasoning & mask.bool(), wanted, seconds)


def _last_token_scores(r: Rollouts) -> torch.Tensor:
    """(B, T) token scores as verl's reward manager writes them: the reward on the last response token."""
    mask = r.batch.response_mask
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    scores[torch.arange(len(mask)), mask.sum(-1) - 1] = r.rewards.float()
    return scores


def reshape(r: Rollouts, algo, importance: torch.Tensor, reasoning: torch.Tensor, attributed: torch.Tensor, *,
            base=None):
    """verl's OAR estimator (gating and mass-preserving reshaping) on given (B, T) ``importance`` and ``reasoning``
    masks: the step after attribution, so the verl check can gate verl's own dumped importance."""
    from oar_verl.integration.estimator import compute_oar

    return compute_oar(_last_token_scores(r), r.batch.response_mask, r.uids, algo, importance, reasoning,
                       attributed=attributed, base=base)


def policy_forward(model, b: task.VerlBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probabilities of the response tokens (with the graph) and (B, T) policy entropy (detached)."""
    logits = task.response_logits(model, b)
    logp = torch.log_softmax(logits, -1).gather(-1, b.responses[..., None]).squeeze(-1)
    return logp, token_entropy(logits.detach())


@functools.cache
def _actor_config():
    """The actor keys verl's vanilla policy loss reads (PPO clip 0.2, no dual-clip: the published set-up)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 1e9,
                             "global_batch_info": {}})


def policy_loss(logp: torch.Tensor, b: task.VerlBatch, advantages: torch.Tensor) -> torch.Tensor:
    """verl's vanilla PPO policy loss of one on-policy update (old log-probs = ``logp`` detached), aggregated
    ``seq-mean-token-mean``, from (B, T) log-probabilities of :func:`policy_forward`."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    loss, _ = compute_policy_loss_vanilla(logp.detach(), logp, advantages, b.response_mask,
                                          loss_agg_mode="seq-mean-token-mean", config=_actor_config())
    return loss


def gradient_shares(model, logp: torch.Tensor, b: task.VerlBatch, advantages: torch.Tensor,
                    roles: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Where the policy gradient of one step goes, per token role: the share of the loss's advantage mass
    Σ|Â_t|/n_i and the share of the gradient norm (‖g_role‖ / Σ_roles ‖g_role‖, g_role the gradient of the loss
    restricted to that role's tokens). ``logp`` is the step's :func:`policy_forward` output; its graph is kept for
    the update."""
    mask = b.response_mask.float()
    per_token = advantages.abs() * mask / mask.sum(-1, keepdim=True).clamp(min=1)
    total = float(per_token.sum()) or 1.0
    mass = {k: float((per_token * m).sum()) / total for k, m in roles.items()}
    norms = {}
    params = [p for p in model.parameters() if p.requires_grad]
    for k, m in roles.items():
        grads = torch.autograd.grad(policy_loss(logp, b, advantages * m), params, allow_unused=True,
                                    retain_graph=True)
        norms[k] = math.sqrt(sum(float((g * g).sum()) for g in grads if g is not None))
    z = sum(norms.values()) or 1.0
    return {"mass": mass, "grad_norm": {k: v / z for k, v in norms.items()}}


# ---------------------------------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------------------------------


def run_one(assets: dict, s: Settings, method: str, seed: int, *, log, signed_scores: str = "clamp") -> dict:
    """One training run; ``signed_scores`` is how the gate reads signed scores (``algorithm.oar.signed_scores``),
    kept apart from :class:`Settings` (resumed runs compare ``asdict(Settings)``) and recorded in the run's dict when it
    is not the default ``clamp``."""
    torch.manual_seed(seed)
    model, tok = load_model(assets["model_dir"])
    algo = algorithm_config(method, seed, signed_scores)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.999), weight_decay=0.01)
    digits = TASK.digit_token_ids(tok)
    prompt_rng = np.random.default_rng(seed)  # the same prompt sequence for every method of a seed
    sample_gen = torch.Generator().manual_seed(1000 + seed)
    val_gen = torch.Generator().manual_seed(2000 + seed)
    out = {"method": method, "seed": seed, "val": {"steps": [], "values": []}, "train": []}
    if signed_scores != "clamp":
        out["signed_scores"] = signed_scores
    t_start = time.perf_counter()
    for step in range(0, s.steps + 1):
        if step % s.eval_every == 0 or step == s.steps:
            out["val"]["steps"].append(step)
            out["val"]["values"].append(TASK.validate(model, tok, s.val_repeats, val_gen, s.max_new_tokens))
        if step == s.steps:
            break
        idx = prompt_rng.integers(0, len(TASK.PROMPTS), s.prompts_per_step)
        t0 = time.perf_counter()
        r = rollout(model, tok, [TASK.PROMPTS[i] for i in idx], s.rollout_n, sample_gen, s.max_new_tokens)
        t_roll = time.perf_counter() - t0
        adv = compute_advantages(method, model, tok, r, step + 1, algo)  # verl's global steps count from 1
        roles = TASK.token_roles(r.batch.responses, r.batch.response_mask, adv.reasoning, digits)
        model.train()
        t1 = time.perf_counter()
        logp, entropy = policy_forward(model, r.batch)
        t_shares = time.perf_counter()
        shares = gradient_shares(model, logp, r.batch, adv.advantages, roles) if adv.attributed.any() else None
        t1 += time.perf_counter() - t_shares  # a measurement, not part of the update
        loss = policy_loss(logp, r.batch, adv.advantages)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.eval()
        m = r.batch.response_mask.float()
        w_dec = adv.weights[roles["decisive"] & adv.attributed[:, None]]
        w_fill = adv.weights[roles["filler"] & adv.attributed[:, None]]
        out["train"].append({
            "step": step + 1, "reward": float(r.rewards.mean()), "entropy": float((entropy * m).sum() / m.sum()),
            "response_tokens": float(m.sum(-1).mean()), "rollout_s": t_roll, "attribution_s": adv.seconds,
            "update_s": time.perf_counter() - t1, "w_decisive": float(w_dec.mean()) if len(w_dec) else float("nan"),
            "w_filler": float(w_fill.mean()) if len(w_fill) else float("nan"), "shares": shares})
    out["wall_s"] = time.perf_counter() - t_start
    val = out["val"]
    log(f"[credit] {LABELS[method]} seed {seed}: {out['wall_s']:.0f} s; val "
        + " ".join(f"{st}:{v:.2f}" for st, v in zip(val["steps"], val["values"])))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Statistics and report
# ---------------------------------------------------------------------------------------------------------------------


def steps_to_reach(steps: list[int], values: list[float], target: float) -> float:
    """First validation step at which accuracy >= target (NaN if never)."""
    return next((float(st) for st, v in zip(steps, values) if v >= target), float("nan"))


def auc(steps: list[int], values: list[float]) -> float:
    """Area under the validation curve over the step budget, normalised by its length (mean accuracy, trapezoid)."""
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def summarize(runs: list[dict], s: Settings) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    table = {}
    for method, rs in by.items():
        steps = rs[0]["val"]["steps"]
        vals = np.array([r["val"]["values"] for r in rs])
        n = len(rs)
        half = 1.96 * vals.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(vals.shape[1])
        shares = [t["shares"] for r in rs for t in r["train"] if t["shares"]]
        table[method] = {
            "n_seeds": n, "val_steps": steps, "val_mean": vals.mean(0).tolist(), "val_ci95": half.tolist(),
            "start": float(vals[:, 0].mean()), "final": vals[:, -1].tolist(),
            "auc": [auc(steps, v) for v in vals.tolist()],
            "steps_to_target": [steps_to_reach(steps, v, s.target) for v in vals.tolist()],
            "entropy_first": float(np.mean([r["train"][0]["entropy"] for r in rs])),
            "entropy_last": float(np.mean([np.mean([t["entropy"] for t in r["train"][-3:]]) for r in rs])),
            "w_decisive": nanmean([t["w_decisive"] for r in rs for t in r["train"]]),
            "w_filler": nanmean([t["w_filler"] for r in rs for t in r["train"]]),
            "mass": {k: float(np.mean([sh["mass"][k] for sh in shares])) for k in ROLES} if shares else {},
            "grad_norm": {k: float(np.mean([sh["grad_norm"][k] for sh in shares])) for k in ROLES} if shares else {},
            "attribution_s": float(np.mean([t["attribution_s"] for r in rs for t in r["train"]])),
            "step_s": float(np.mean([t["rollout_s"] + t["attribution_s"] + t["update_s"]
                                     for r in rs for t in r["train"]])),
            "wall_s": float(np.mean([r["wall_s"] for r in rs])),
        }
    comparisons = {}
    if "grpo" in table:
        g = table["grpo"]
        for method, row in table.items():
            if method == "grpo":
                continue
            comp = {}
            for metric in ("final", "auc", "steps_to_target"):
                a, b = np.array(row[metric]), np.array(g[metric])
                if not (np.isfinite(a).all() and np.isfinite(b).all()):
                    continue  # a seed never reached the target: no mean
                comp[metric] = {"diff": float(a.mean() - b.mean()),
                                "ci95": bootstrap_ci(a, b) if len(a) > 1 and len(b) > 1 else None,
                                "p_perm": permutation_p(a.tolist(), b.tolist()) if len(a) > 1 and len(b) > 1
                                else None}
            reached = np.array(row["steps_to_target"]), np.array(g["steps_to_target"])
            comp["reached"] = [int(np.isfinite(x).sum()) for x in reached]
            comparisons[method] = comp
    return {"methods": table, "vs_grpo": comparisons}


def _pm(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def _steps(values) -> str:
    v = np.asarray(values, dtype=float)
    ok = v[np.isfinite(v)]
    return f"{np.median(ok):.0f} ({len(ok)}/{len(v)})" if len(ok) else f"never (0/{len(v)})"


def _weights(method: str, r: dict) -> str:
    return "1 / 1" if method == "grpo" else f"{r['w_decisive']:.2f} / {r['w_filler']:.2f}"


def report(summary: dict, s: Settings, assets: dict) -> str:
    t = summary["methods"]
    order = [m for m in METHODS if m in t]
    run_s = sum(r["wall_s"] * r["n_seeds"] for r in t.values())
    lines = [f"{getattr(TASK, 'name', 'last').capitalize()}-digit task, {t[order[0]]['n_seeds']} seeds × {s.steps} steps, {s.prompts_per_step} prompts × "
             f"{s.rollout_n} rollouts per step, lr {s.lr:g}; validation {15 * s.val_repeats} samples at T = 1 "
             f"every {s.eval_every} steps. Warm start: {assets['sft_steps']} SFT steps, validation success "
             f"{assets['val_success_t1']:.3f}. The runs took {run_s:.0f} s in all.", "",
             f"| method | step 0 | final (mean ± sd) | AUC (mean ± sd) | steps to {s.target:g} (median, reached) | "
             "entropy first → last | mean w decisive / filler | attribution s/step | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in order:
        r = t[m]
        lines.append(f"| {LABELS[m]} | {r['start']:.3f} | {_pm(r['final'])} | {_pm(r['auc'])} | "
                     f"{_steps(r['steps_to_target'])} | {r['entropy_first']:.3f} → {r['entropy_last']:.3f} | "
                     f"{_weights(m, r)} | {r['attribution_s']:.3f} | {r['step_s']:.2f} |")
    if summary["vs_grpo"]:
        lines += ["", "| vs GRPO | Δ final [95 % bootstrap CI] | exact permutation p | Δ AUC [95 % bootstrap CI] | "
                  f"exact permutation p | Δ steps to {s.target:g} (mean) [95 % bootstrap CI] | exact permutation p |",
                  "|---|---|---|---|---|---|---|"]
        for m in order:
            if m not in summary["vs_grpo"]:
                continue
            c = summary["vs_grpo"][m]
            cells = []
            for metric in ("final", "auc", "steps_to_target"):
                x = c.get(metric)
                if x is None:
                    cells += ["–", "–"]
                    continue
                ci = f" [{x['ci95'][0]:+.3f}, {x['ci95'][1]:+.3f}]" if x["ci95"] else ""
                p = f"{x['p_perm']:.3f}" if x["p_perm"] is not None else "–"
                cells += [f"{x['diff']:+.3f}{ci}", p]
            lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    lines += ["", "Where the policy gradient went (mean over steps and seeds; share of the loss's advantage mass | "
              "share of the gradient norm):", "",
              "| method | " + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    for m in order:
        r = t[m]
        if r["mass"]:
            lines.append(f"| {LABELS[m]} | " + " | ".join(f"{r['mass'][k]:.3f} / {r['grad_norm'][k]:.3f}"
                                                          for k in ROLES) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    t = summary["methods"]
    for m in [m for m in METHODS if m in t]:
        r = t[m]
        x, y, h = np.array(r["val_steps"]), np.array(r["val_mean"]), np.array(r["val_ci95"])
        axes[0].plot(x, y, color=COLORS[m], label=f"{LABELS[m]} ({r['n_seeds']} seeds)")
        axes[0].fill_between(x, y - h, y + h, color=COLORS[m], alpha=0.15)
        ent = np.array([[tr["entropy"] for tr in run["train"]] for run in runs if run["method"] == m])
        axes[1].plot(np.arange(1, ent.shape[1] + 1), ent.mean(0), color=COLORS[m], label=LABELS[m])
    axes[0].set(xlabel="step", ylabel="validation success (T = 1)", title=f"{getattr(TASK, 'name', 'last')}-digit task: mean, 95 % CI band")
    axes[1].set(xlabel="step", ylabel="policy entropy (nats/token)", title="entropy of the rollouts")
    finish_figure(fig, axes, path)


# ---------------------------------------------------------------------------------------------------------------------
# verl cross-check
# ---------------------------------------------------------------------------------------------------------------------


def verl_check(assets: dict, out: Path, *, log, prompt: tuple[int, int] = (3, 5), rollout_n: int = 8,
               groups: int = 4, modes=("oar_g", "oar_p"), timeout_s: float = 1200,
               signed_scores: str = "clamp") -> dict:
    """One step of verl's real trainer per OAR mode (every training prompt is ``prompt``, so the dumps' rows are
    reconstructible), then this loop's :func:`compute_advantages` on the dumped rollouts; returns the largest
    differences of importance, weights, base and reshaped advantages."""
    from oar_verl.core.text.token_bytes import token_byte_table
    from oar_verl.quickstart.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo

    model, tok = load_model(assets["model_dir"])
    table = token_byte_table(tok)
    inverse: dict[str, int] = {}
    for i, b in enumerate(table):
        inverse.setdefault(b.decode("utf-8", errors="replace"), i)
    train, val = credit_task.write_parquet(out / "verl_data", n_train=groups * 4, only=prompt)
    results = {}
    for method in modes:
        run_dir = out / "verl_check" / method
        shutil.rmtree(run_dir, ignore_errors=True)
        ray_tmp = new_ray_temp_dir()
        overrides = main_ppo_overrides(
            model_dir=assets["model_dir"], train_file=train, val_file=val, reward_file=last_digit_reward.__file__,
            output_dir=run_dir, ray_temp_dir=ray_tmp, adv_estimator="oar", steps=1, train_batch_size=groups,
            rollout_n=rollout_n, micro_batch_size_per_gpu=16, max_prompt_length=32, max_response_length=48,
            project="oar_credit", experiment=method,
            extra=[f"algorithm.oar.mode={MODES[method]}", "algorithm.oar.dump_every=1",
                   f"algorithm.oar.dump_groups={groups}", f"algorithm.oar.dump_dir={run_dir / 'dumps'}",
                   "algorithm.oar.seed=0", "actor_rollout_ref.rollout.temperature=1.0", "trainer.test_freq=-1",
                   "trainer.val_before_train=False", f"algorithm.oar.signed_scores={signed_scores}"])
        log(f"[credit] verl check: {LABELS[method]}, one step of python -m oar_verl.main")
        try:
            run = run_main_ppo(overrides, output_dir=run_dir, env=cpu_env(file_logger_root=run_dir / "metrics"),
                               project="oar_credit", experiment=method, timeout_s=timeout_s, module="oar_verl.main")
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if run.returncode != 0:
            raise RuntimeError(f"verl check run {method} failed (rc={run.returncode}):\n{run.log_tail(3000)}")
        records = [json.loads(line) for line in (run_dir / "dumps" / "step_1.jsonl").read_text().splitlines()]
        responses = [[inverse[t] for t in rec["tokens"]] for rec in records]
        uid_index = {u: i for i, u in enumerate(dict.fromkeys(rec["uid"] for rec in records))}
        rows = [prompt] * len(records)
        r = make_rollouts(tok, rows, encode_prompts(tok, rows), responses,
                          np.array([uid_index[rec["uid"]] for rec in records], dtype=object))
        if not torch.equal(r.rewards, torch.tensor([rec["reward"] for rec in records])):
            raise RuntimeError("the loop's reward differs from verl's on the dumped responses")
        algo = algorithm_config(method, 0, signed_scores)
        adv = compute_advantages(method, model, tok, r, records[0]["step"], algo)
        mask = r.batch.response_mask.bool()
        verl_imp = torch.zeros(mask.shape)
        verl_w = torch.ones(mask.shape)
        verl_reasoning = torch.zeros(mask.shape, dtype=torch.bool)
        for i, rec in enumerate(records):
            verl_imp[i, :len(rec["importance"])] = torch.tensor(rec["importance"])
            verl_w[i, :len(rec["weight"])] = torch.tensor(rec["weight"])
            verl_reasoning[i, :len(rec["reasoning"])] = torch.tensor(rec["reasoning"], dtype=torch.bool)
        # the gating of verl's own importance: separates the reshaping (must match to the dump's rounding) from the
        # attribution (fp32 rounding between two forwards, which a quantile gate can turn into a flipped token)
        gated = reshape(r, algo, verl_imp, verl_reasoning & mask.bool(), adv.attributed)
        seq_adv = (adv.advantages / adv.weights).masked_fill(~mask, 0).sum(-1) / mask.sum(-1)
        verl_seq = torch.tensor([rec["advantage"] for rec in records])
        scale = float(verl_imp[mask].abs().max()) or 1.0
        results[method] = {
            "rows": len(records), "attributed_rows": int(adv.attributed.sum()),
            "max_rel_importance_diff": float((adv.importance - verl_imp)[mask].abs().max()) / scale,
            "max_weight_diff": float((adv.weights - verl_w)[mask].abs().max()),
            "mean_weight_diff": float((adv.weights - verl_w)[mask].abs().mean()),
            "max_base_advantage_diff": float((seq_adv - verl_seq).abs().max()),
            "max_advantage_diff": float((adv.advantages - verl_w * verl_seq[:, None])[mask].abs().max()),
            "reasoning_mask_equal": bool(torch.equal(adv.reasoning, verl_reasoning & mask.bool())),
            "gating_max_weight_diff": float((gated.token_weights.weights - verl_w)[mask].abs().max()),
            "gating_max_advantage_diff": float((gated.advantages - verl_w * verl_seq[:, None])[mask].abs().max()),
            "verl_wall_s": run.wall_s}
        log(f"[credit] verl check {LABELS[method]}: {json.dumps(results[method])}")
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds × 6 steps (CI)")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1 (to "
                    "split a study over processes; --report-only merges every runs_*.json in --out)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--verl-check", action="store_true", help="also run verl's trainer one step per OAR mode (OAR-G "
                    "only with --quick)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "credit")
    ap.add_argument("--docs", action="store_true", help="also write research/docs/img/credit.png")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from an earlier runs.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--signed-scores", default="clamp", choices=tuple(SIGNED_SCORES),
                    help="how the gate reads signed scores (algorithm.oar.signed_scores); a run with another value "
                    "than clamp records it, writes its own runs_*_signed-<value>.json, and the report and the resume "
                    "take only the runs of this value")
    ap.add_argument("--task", default="last", choices=["last", *digit_task.TASKS],
                    help="which digit decides the reward: the last (the quickstart's task), the first or the middle one")
    args = ap.parse_args(argv)
    if args.verl_check and args.task != "last":
        ap.error("--verl-check runs the quickstart's last-digit task only (--task last)")
    global TASK
    TASK = digit_task.task(args.task)
    s = QUICK if args.quick else FULL
    s = Settings(**{**asdict(s), **{k: v for k, v in (("seeds", args.seeds), ("steps", args.steps), ("lr", args.lr))
                                    if v is not None}})
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; allowed: {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    start = time.perf_counter()
    assets = build_assets(out, s, log=log)
    signed = args.signed_scores
    tag = "" if signed == "clamp" else f"_signed-{signed}"
    runs_file = out / f"runs_{args.first_seed}-{args.first_seed + s.seeds - 1}_{'-'.join(methods)}{tag}.json"

    def this_choice(rs: list[dict]) -> list[dict]:  # the runs of this --signed-scores (clamp runs carry no key)
        return [r for r in rs if r.get("signed_scores", "clamp") == signed]

    if args.report_only:
        runs = this_choice([r for f in sorted(out.glob("runs_*.json")) for r in json.loads(f.read_text())["runs"]])
    else:
        # resumable: a run already in this file (same seeds, methods, settings and --signed-scores) is kept, not run
        # again
        saved = json.loads(runs_file.read_text()) if runs_file.exists() else {}
        runs = this_choice(saved["runs"]) if saved.get("settings") == asdict(s) else []
        done = {(r["seed"], r["method"]) for r in runs}
        units = [(seed, method) for seed in range(args.first_seed, args.first_seed + s.seeds) for method in methods
                 if (seed, method) not in done]
        for seed, method in progress(units, desc="[credit] runs (seed x method)", unit="run"):
            runs.append(run_one(assets, s, method, seed, log=log, signed_scores=signed))
            runs_file.write_text(json.dumps({"settings": asdict(s), "runs": runs}))
    summary = summarize(runs, s)
    if args.verl_check:
        summary["verl_check"] = verl_check(assets, out, log=log, modes=("oar_g",) if args.quick else ("oar_g", "oar_p"),
                                           signed_scores=signed)
    wall = time.perf_counter() - start
    text = report(summary, s, assets)
    if signed != "clamp":
        text += f"\nThe gate read the signed scores by `{signed}` (algorithm.oar.signed_scores; default clamp).\n"
    if "verl_check" in summary:
        text += ("\nverl cross-check (one step of python -m oar_verl.main per mode, the loop on its dumped "
                 "rollouts):\n\n")
        text += "\n".join(f"* {LABELS[m]}: {json.dumps(v)}" for m, v in summary["verl_check"].items()) + "\n"
    (out / "credit.md").write_text(text)
    (out / "credit.json").write_text(json.dumps({"settings": asdict(s), "warm_start": assets, "summary": summary,
                                                 "wall_s": wall, **({} if signed == "clamp" else
                                                                    {"signed_scores": signed})}, indent=1))
    plot(runs, summary, out / "credit.png")
    if args.docs:
        plot(runs, summary, REPO / "research" / "docs" / "img" / "credit.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
