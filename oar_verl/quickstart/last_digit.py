"""The *last-digit* task of the CPU quickstart: a credit-assignment task on which GRPO itself learns, and its warm
start (research/docs/evidence.md §3 studies it).

Prompt:   ``Write 3 digits. The last one must be above 5.``
Response: ``okay so4 let me see hmm9 right7 well The answer is 7.``

The response writes K digits (its own choice), each attached to a filler word, among free filler text, and ends with
``The answer is N``. It is correct when N is the last digit written and that digit is above T
(:mod:`oar_verl.quickstart.last_digit_reward`). So, of the ~12 reasoning tokens, exactly one decides the reward (the *decisive*
token, the last digit); the other K-1 digits (*decoys*) and the filler are free, and the answer copies the decisive
token. A model warm-started on responses with uniformly random digits writes a last digit above T with probability
(9 - T) / 10, so over T in 3..7 it starts near 0.4 and RL has one thing to learn: raise the last digit, in
proportion to T. Text style ``attached`` (no space token before a digit, see research/task.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from oar_verl.quickstart import tiny_assets
from oar_verl.quickstart import tiny_lm
from oar_verl.quickstart import tokenizers
from oar_verl.quickstart import warm_cache

from oar_verl.quickstart.last_digit_reward import score_response

FILLER_WORDS = ("so", "well", "hmm", "okay", "right", "now", "then", "next", "yes", "sure", "fine", "good", "look",
                "wait", "ah", "oh", "maybe", "also", "and", "ok")
FILLER_PHRASES = ("let me see", "one more", "I think", "here we go", "keep going", "step by step", "not sure yet",
                  "moving on")

DATA_SOURCE = "last_digit"
DIGIT_COUNTS = (2, 3, 4)
THRESHOLDS = (3, 4, 5, 6, 7)
PROMPTS = tuple((k, t) for t in THRESHOLDS for k in DIGIT_COUNTS)  # the 15 distinct prompts


@dataclass(frozen=True)
class CreditExample:
    n_digits: int
    threshold: int
    digits: tuple[int, ...]
    prompt: str
    response: str  # without the EOS token

    @property
    def ground_truth(self) -> str:
        return f"{self.n_digits},{self.threshold}"


def filler(rng: random.Random, n: int) -> list[str]:
    """``n`` filler items: single random words (high entropy: the "forking" tokens an entropy heuristic ranks first)
    or fixed multi-word phrases (low entropy after their first word)."""
    return [rng.choice(FILLER_PHRASES) if rng.random() < 0.3 else rng.choice(FILLER_WORDS) for _ in range(n)]


def prompt_text(n_digits: int, threshold: int) -> str:
    return f"Write {n_digits} digits. The last one must be above {threshold}."


def make_example(rng: random.Random, n_digits: int | None = None, threshold: int | None = None) -> CreditExample:
    """One prompt with a well-formed response whose digits are uniform (correct only when the last is above T):
    1-3 filler items before each digit, 0-2 after the last one, then ``The answer is <last digit>.``"""
    n_digits = rng.choice(DIGIT_COUNTS) if n_digits is None else n_digits
    threshold = rng.choice(THRESHOLDS) if threshold is None else threshold
    digits = tuple(rng.randrange(10) for _ in range(n_digits))
    response = reasoning_text(rng, digits) + f" The answer is {digits[-1]}."
    return CreditExample(n_digits, threshold, digits, prompt_text(n_digits, threshold), response)


def reasoning_text(rng: random.Random, digits: Sequence[int]) -> str:
    """The reasoning of a response writing ``digits``: 1-3 filler items before each digit (attached to the last
    item), 0-2 after the last one."""
    parts: list[str] = []
    for d in digits:
        parts += filler(rng, rng.randint(1, 3))
        parts[-1] += str(d)
    parts += filler(rng, rng.randint(0, 2))
    return " ".join(parts)


def make_examples(n: int, seed: int | str) -> list[CreditExample]:
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(n)]


def reward(text: str, prompt: tuple[int, int]) -> float:
    """The task's reward of a decoded response to prompt (K, T)."""
    return score_response(text, *prompt)


def token_roles(responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                digit_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, T) bool masks of the response tokens' roles: ``decisive`` (the last digit token of the reasoning),
    ``decoy`` (the other reasoning digits), ``filler`` (the other reasoning tokens) and ``answer`` (every valid token
    after the reasoning: the answer statement and EOS).

    Args:
        responses: (B, T) ids. response_mask: (B, T) 0/1. reasoning_mask: (B, T) bool (the OAR span finder's).
        digit_ids: (10,) the ids of the single-digit tokens.
    """
    valid = response_mask.bool()
    digit = torch.isin(responses, digit_ids) & reasoning_mask
    pos = torch.arange(responses.shape[1]).expand_as(responses)
    last = torch.where(digit, pos, -1).max(-1, keepdim=True).values
    decisive = digit & (pos == last)
    return {"decisive": decisive, "decoy": digit & ~decisive, "filler": reasoning_mask & ~digit,
            "answer": valid & ~reasoning_mask}


def digit_token_ids(tokenizer) -> torch.Tensor:
    """(10,) ids of the tokens ``0``..``9`` (the Qwen2 pre-tokenizer splits digits one per token)."""
    ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError("the tokenizer has no single-token digits")
    return torch.tensor(ids)


def write_parquet(data_dir: str | Path, *, n_train: int, n_val_repeats: int = 1, seed: int = 0,
                  only: tuple[int, int] | None = None) -> tuple[Path, Path]:
    """verl RL parquet (``prompt`` chat list, ``reward_model.ground_truth`` = ``"K,T"``): training prompts drawn at
    random (or all ``only``), validation = the 15 prompts ``n_val_repeats`` times."""
    import pandas as pd

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}-train")

    def row(k: int, t: int, split: str, i: int) -> dict:
        return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt_text(k, t)}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": f"{k},{t}"},
                "extra_info": {"split": split, "index": i}}

    train = [row(*(only or rng.choice(PROMPTS)), "train", i) for i in range(n_train)]
    val = [row(k, t, "val", i) for i, (k, t) in enumerate(list(PROMPTS) * n_val_repeats)]
    paths = data_dir / "train.parquet", data_dir / "val.parquet"
    pd.DataFrame(train).to_parquet(paths[0], index=False)
    pd.DataFrame(val).to_parquet(paths[1], index=False)
    return paths


def examples_for(prompts: Sequence[tuple[int, int]]) -> list[CreditExample]:
    """Placeholder examples carrying only the prompts (for :func:`oar_verl.quickstart.tiny_lm.encode`)."""
    return [CreditExample(k, t, (), prompt_text(k, t), "") for k, t in prompts]


# ---------------------------------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------------------------------

WARM_STEPS = 300  # supervised steps: success near 0.4 at temperature 1, so GRPO groups mix rewards
MAX_NEW_TOKENS = 48
WARM_INFO = "warm_start_info.json"  # the warm start's own numbers, cached with its model


@torch.no_grad()
def validate(model, tok, repeats: int, gen: torch.Generator, max_new_tokens: int = MAX_NEW_TOKENS) -> float:
    """Success rate of temperature-1 samples on the 15 prompts × ``repeats``."""
    prompts = list(PROMPTS) * repeats
    ids = tiny_lm.encode(tok, examples_for(prompts))[0]
    b = tiny_lm.verl_batch(ids, [[tok.eos_token_id]] * len(prompts), tok.pad_token_id)
    responses = tiny_lm.sample_ids(model, tok.eos_token_id, b.prompts, b.prompt_mask, max_new_tokens=max_new_tokens,
                                   temperature=1.0, generator=gen)
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    return sum(reward(t, p) for t, p in zip(texts, prompts)) / max(len(prompts), 1)


def warm_start(root: str | Path, *, warm_steps: int = WARM_STEPS, max_new_tokens: int = MAX_NEW_TOKENS,
               log: Callable[[str], None] = print) -> dict:
    """A tiny Qwen2 warm-started on responses with uniformly random digits, in ``root / "model"`` (reused when
    present, else from the content-keyed cache ``$OAR_WARM_CACHE`` when set: :mod:`oar_verl.quickstart.warm_cache`).

    Returns ``{"model_dir", "sft_steps", "sft_seconds", "sft_loss", "val_success_t1", "params", "from_cache"}``.
    """
    root = Path(root)
    info_file = root / "warm_start.json"
    if info_file.exists():
        log(f"[last-digit] reusing the warm-started model in {root / 'model'}")
        return json.loads(info_file.read_text())

    def build(model_dir: Path) -> None:
        torch.manual_seed(0)
        model, tok = tiny_lm.build_model_dir(model_dir, make_examples(4000, "tok-0"), seed=0, intermediate_size=256)
        log(f"[last-digit] warm start: {warm_steps} supervised steps on responses with uniform random digits")
        sft = tiny_lm.sft_train(model, tok, make_example, steps=warm_steps, batch_size=32, lr=3e-3, seed=0, warmup=50,
                                answer_weight=5.0, log=log)
        tiny_lm.save_model(model, tok, model_dir)
        acc = validate(model, tok, 16, torch.Generator().manual_seed(12345), max_new_tokens)
        warm = {"sft_steps": sft["steps"], "sft_seconds": sft["seconds"], "sft_loss": sft["loss"],
                "val_success_t1": acc, "params": sum(p.numel() for p in model.parameters())}
        (model_dir / WARM_INFO).write_text(json.dumps(warm))

    # keyed on what the warm start depends on: its steps, the generation length of the validation, and the code
    hit = warm_cache.materialise(root / "model", name="last-digit-warm", log=log, build=build,
                                 settings={"warm_steps": warm_steps, "max_new_tokens": max_new_tokens},
                                 code_files=[__file__, tiny_lm.__file__, tiny_assets.__file__, tokenizers.__file__])
    info = {"model_dir": str(root / "model"), **json.loads((root / "model" / WARM_INFO).read_text()),
            "from_cache": hit}
    log(f"[last-digit] warm-started in {info['sft_seconds']:.0f} s{' (earlier, cached)' if hit else ''}: validation "
        f"success at T=1 {info['val_success_t1']:.3f}")
    info_file.write_text(json.dumps(info, indent=1))
    return info
