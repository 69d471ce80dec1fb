"""The *digit-sum* task: a synthetic verifiable task with planted causal tokens, shared by the studies.

Prompt:   ``Start at 7. Write 3 digits, then add them up.``
Response: ``okay so 4 let me see hmm 9 right 2 well The answer is 22.``       (style ``spaced``)
          ``okay so4 let me see hmm9 right2 well The answer is 22.``          (style ``attached``)

The response writes K digits (its own choice) inside filler text and ends with ``The answer is N.``, N = S + sum of
the digits. The reward (:mod:`research.digit_sum_reward`) checks exactly that. So, of the reasoning tokens, the K
digit tokens are the only ones the final answer depends on (the *causal* tokens); the filler words and phrases are
irrelevant to it by construction. Filler mixes single random words (high entropy: the "forking" tokens an entropy
heuristic ranks first) with fixed multi-word phrases (low entropy after their first word).

Two text styles. In ``spaced`` text the Qwen2 pre-tokenizer splits `` 4`` into a space token and a digit token, so a
space token precedes every digit: a *cue* token that a model may use to read the digit that follows (masking it can
change the answer although the task's answer does not depend on it). In ``attached`` text a digit follows its filler
word directly (``so4`` -> `` so``, ``4``), so no input token other than the digits themselves marks where an operand
is: the fidelity benchmark uses ``attached``; the learning study ran on ``spaced`` (the reward is the same).

Everything is built offline in seconds: a byte-level BPE tokenizer trained on task text (every filler word is one
token; the Qwen2 tokenizer class that verl and vLLM load splits digits into single tokens), a tiny Qwen2 from a config,
and plain-torch supervised training. No verl import here.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from oar_verl.quickstart import tiny_lm
from oar_verl.quickstart.last_digit import filler
# the task-independent pieces, used by the studies as ``task.<name>``
from oar_verl.quickstart.tiny_lm import (VerlBatch, encode, generate, response_logits, sample_ids,  # noqa: F401
                                  save_model, verl_batch)
from research.digit_sum_reward import score_response
DIGIT_COUNTS = (2, 3, 4)
DATA_SOURCE = "digit_sum"
STYLES = ("spaced", "attached")


@dataclass(frozen=True)
class Example:
    start: int
    digits: tuple[int, ...]
    prompt: str
    response: str  # without the EOS token

    @property
    def answer(self) -> int:
        return self.start + sum(self.digits)

    @property
    def ground_truth(self) -> str:
        return f"{self.start},{len(self.digits)}"


def prompt_text(start: int, n_digits: int) -> str:
    return f"Start at {start}. Write {n_digits} digits, then add them up."


def make_example(rng: random.Random, start: int | None = None, n_digits: int | None = None,
                 style: str = "spaced") -> Example:
    """One prompt with a correct response: 1-3 filler items before each digit, 0-2 after the last one."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    start = rng.randrange(10) if start is None else start
    n_digits = rng.choice(DIGIT_COUNTS) if n_digits is None else n_digits
    digits = tuple(rng.randrange(10) for _ in range(n_digits))
    parts: list[str] = []
    for d in digits:
        parts += filler(rng, rng.randint(1, 3))
        if style == "attached":
            parts[-1] += str(d)
        else:
            parts.append(str(d))
    parts += filler(rng, rng.randint(0, 2))
    response = " ".join(parts) + f" The answer is {start + sum(digits)}."
    return Example(start, digits, prompt_text(start, n_digits), response)


def make_examples(n: int, seed: int | str, style: str = "spaced") -> list[Example]:
    rng = random.Random(seed)
    return [make_example(rng, style=style) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------------------------------


def build_tokenizer(out_dir: str | Path, *, seed: int = 0, style: str = "spaced", examples: Sequence | None = None):
    """The tiny BPE (:func:`oar_verl.quickstart.tiny_lm.build_tokenizer`) on digit-sum text of ``style`` (or ``examples``)."""
    return tiny_lm.build_tokenizer(out_dir, make_examples(4000, f"tok-{seed}", style) if examples is None else examples)


def build_model_dir(model_dir: str | Path, *, seed: int = 0, style: str = "spaced", examples: Sequence | None = None,
                    **shape):
    """A tiny Qwen2 + tokenizer (:func:`oar_verl.quickstart.tiny_lm.build_model_dir`) on digit-sum text of ``style`` (or
    ``examples``); ``shape``: hidden_size, num_layers, intermediate_size."""
    examples = make_examples(4000, f"tok-{seed}", style) if examples is None else examples
    return tiny_lm.build_model_dir(model_dir, examples, seed=seed, **shape)


def sft_train(model, tokenizer, *, style: str = "spaced", example_fn: Callable | None = None, **kwargs) -> dict:
    """:func:`oar_verl.quickstart.tiny_lm.sft_train` on digit-sum examples of ``style`` (or ``example_fn``)."""
    return tiny_lm.sft_train(model, tokenizer, example_fn or functools.partial(make_example, style=style), **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Training and accuracy
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def answer_accuracy(model, tokenizer, examples: Sequence[Example], batch_size: int = 128) -> float:
    """Share of examples whose answer tokens are all the model's argmax, teacher-forced on the reasoning.

    This is the accuracy of "given this reasoning, state the right sum": what the fidelity benchmark relies on.
    """
    from oar_verl.core.text.spans import locate_answer_spans

    model.eval()
    hits = 0
    for s in range(0, len(examples), batch_size):
        part = examples[s:s + batch_size]
        batch = verl_batch(*encode(tokenizer, part), tokenizer.pad_token_id)
        spans = locate_answer_spans(batch.responses, batch.response_mask, tokenizer, patterns=("answer_is",))
        pred = response_logits(model, batch).argmax(-1)
        ok = ((pred == batch.responses) | ~spans.answer_mask).all(-1) & spans.found
        hits += int(ok.sum())
    return hits / max(len(examples), 1)


@torch.no_grad()
def sampled_accuracy(model, tokenizer, examples: Sequence[Example], *, temperature: float = 1.0,
                     max_new_tokens: int = 48, batch_size: int = 64, seed: int = 0) -> float:
    """Mean reward of the model's own sampled responses (temperature 1 = the RL policy; 0 = greedy)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for s in range(0, len(examples), batch_size):
        part = examples[s:s + batch_size]
        prompts, _ = encode(tokenizer, part)
        batch = verl_batch(prompts, [[tokenizer.eos_token_id]] * len(part), tokenizer.pad_token_id)
        texts = generate(model, tokenizer, batch.prompts, batch.prompt_mask, max_new_tokens=max_new_tokens,
                         temperature=temperature, generator=gen)
        for ex, text in zip(part, texts):
            total += score_response(text, ex.start, len(ex.digits))
    return total / max(len(examples), 1)



# ---------------------------------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------------------------------


WARM_INFO = "warm_start_info.json"  # the warm start's own numbers, kept with its model


def warm_start(model_dir: str | Path, *, warm_steps: int, log: Callable[[str], None] = print) -> bool:
    """A tiny Qwen2 (seed 0, ``spaced`` text) after ``warm_steps`` supervised steps on correct examples (batch 32,
    lr 3e-3, answer tokens weighted 5), saved in ``model_dir`` with its numbers in ``WARM_INFO``: SFT steps, seconds
    and loss, the success rate of its own samples at T = 1 (120) and greedy (30 prompts), the longest prompt.

    The learning study warm-starts from it, and the faithfulness benchmark's quick mode uses the 250-step one, so
    both read one model: built once and keyed by content in ``$OAR_WARM_CACHE``
    (:mod:`oar_verl.quickstart.warm_cache`). Returns True on a cache hit."""
    from oar_verl.quickstart import tiny_assets, tokenizers, warm_cache
    from research import digit_sum_reward

    def build(target: Path) -> None:
        torch.manual_seed(0)
        model, tok = build_model_dir(target, seed=0, intermediate_size=256)
        log(f"[digit-sum] warm start: {warm_steps} supervised steps on correct digit-sum examples (plain torch)")
        sft = sft_train(model, tok, steps=warm_steps, batch_size=32, lr=3e-3, seed=0, warmup=50, answer_weight=5.0,
                        log=log)
        save_model(model, tok, target)
        val_examples = [make_example(random.Random(i), start=i % 10, n_digits=DIGIT_COUNTS[(i // 10) % 3])
                        for i in range(30)] * 4
        warm = {"sft_steps": sft["steps"], "sft_seconds": sft["seconds"], "sft_loss": sft["loss"],
                "sampled_accuracy_t1": sampled_accuracy(model, tok, val_examples, temperature=1.0, seed=0),
                "greedy_accuracy": sampled_accuracy(model, tok, val_examples[:30], temperature=0.0),
                "max_prompt_tokens": max(len(p) for p in encode(tok, val_examples[:30])[0])}
        (target / WARM_INFO).write_text(json.dumps(warm))

    return warm_cache.materialise(model_dir, name="digit-sum-warm", log=log, build=build,
                                  settings={"warm_steps": warm_steps},
                                  code_files=[__file__, digit_sum_reward.__file__, tiny_lm.__file__,
                                              tiny_assets.__file__, tokenizers.__file__])


# ---------------------------------------------------------------------------------------------------------------------
# verl data
# ---------------------------------------------------------------------------------------------------------------------


def write_parquet(data_dir: str | Path, *, n_train: int, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """verl RL parquet (``prompt`` chat list, ``reward_model.ground_truth`` = ``"S,K"``); train/val prompts drawn
    independently (there are only 30 distinct prompts: S in 0..9, K in 2..4)."""
    import pandas as pd

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)

    def rows(n, split):
        rng = random.Random(f"{seed}-{split}")
        out = []
        for i in range(n):
            # cycle through all 30 prompts so every split covers them evenly
            start, n_digits = (i % 10, DIGIT_COUNTS[(i // 10) % len(DIGIT_COUNTS)]) if split == "val" else \
                (rng.randrange(10), rng.choice(DIGIT_COUNTS))
            out.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt_text(start, n_digits)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": f"{start},{n_digits}"},
                "extra_info": {"split": split, "index": i},
            })
        return out

    train, val = data_dir / "train.parquet", data_dir / "val.parquet"
    pd.DataFrame(rows(n_train, "train")).to_parquet(train, index=False)
    pd.DataFrame(rows(n_val, "val")).to_parquet(val, index=False)
    return train, val
