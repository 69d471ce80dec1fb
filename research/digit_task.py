"""The credit-assignment task with its decisive token early or in the middle (issue #36 item 5).

The quickstart's *last-digit* task (:mod:`oar_verl.quickstart.last_digit`) puts the one decisive reasoning token at the
end of the reasoning, where a ranking by position alone finds it for free. Here the prompt names which digit decides:

  ``first``:   ``Write K digits. The first one must be above T.``   K in 2..4: the decisive token is the first digit,
               followed by K - 1 decoy digits and their filler;
  ``middle``:  ``Write 3 digits. The second one must be above T.``  the decisive token sits between two decoys.

and the response must end with ``The answer is <that digit>``. Everything else (filler, warm start on uniform random
digits to about 0.4 success, the tiny Qwen2) is the last-digit task's, so the studies differ only in where the decisive
token sits. ``last`` is the product's task itself. :class:`DigitTask` offers what :mod:`research.credit` uses of a task.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from oar_verl.quickstart import last_digit, tiny_assets, tiny_lm, tokenizers, warm_cache
from oar_verl.quickstart.last_digit import CreditExample, digit_token_ids, reasoning_text

__all__ = ["TASKS", "DigitTask", "task"]

_ANSWER_RE = re.compile(r"The answer is (-?\d+)")
ORDINALS = {1: "first", 2: "second"}


@dataclass(frozen=True)
class DigitTask:
    """The task where digit ``index`` (1-based) of ``digit_counts`` digits decides; prompts are (K, T) pairs."""

    name: str
    index: int
    digit_counts: tuple[int, ...]
    thresholds: tuple[int, ...] = last_digit.THRESHOLDS

    @property
    def PROMPTS(self) -> tuple[tuple[int, int], ...]:  # noqa: N802  (the name the study reads off a task)
        return tuple((k, t) for t in self.thresholds for k in self.digit_counts)

    def prompt_text(self, n_digits: int, threshold: int) -> str:
        return f"Write {n_digits} digits. The {ORDINALS[self.index]} one must be above {threshold}."

    def make_example(self, rng: random.Random) -> CreditExample:
        """A well-formed response with uniform digits (correct only when the decisive one is above T): 1-3 filler
        items before each digit, 0-2 after the last one, then ``The answer is <decisive digit>.``"""
        k, t = rng.choice(self.PROMPTS)
        digits = tuple(rng.randrange(10) for _ in range(k))
        response = reasoning_text(rng, digits) + f" The answer is {digits[self.index - 1]}."
        return CreditExample(k, t, digits, self.prompt_text(k, t), response)

    def examples_for(self, prompts) -> list[CreditExample]:
        return [CreditExample(k, t, (), self.prompt_text(k, t), "") for k, t in prompts]

    def reward(self, text: str, prompt: tuple[int, int]) -> float:
        """1.0 when ``text`` writes K digits, states the decisive one in its last ``The answer is N``, and it is
        above T."""
        k, t = prompt
        matches = list(_ANSWER_RE.finditer(text or ""))
        if not matches:
            return 0.0
        digits = [int(c) for c in text[: matches[-1].start()] if c.isdigit()]
        if len(digits) != k:
            return 0.0
        return 1.0 if int(matches[-1].group(1)) == digits[self.index - 1] > t else 0.0

    def token_roles(self, responses: torch.Tensor, response_mask: torch.Tensor, reasoning_mask: torch.Tensor,
                    digit_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, T) bool masks: ``decisive`` (the ``index``-th digit token of the reasoning), ``decoy`` (the other
        reasoning digits), ``filler`` (the other reasoning tokens), ``answer`` (every valid token after the
        reasoning)."""
        digit = torch.isin(responses, digit_ids) & reasoning_mask
        decisive = digit & (digit.long().cumsum(-1) == self.index)
        return {"decisive": decisive, "decoy": digit & ~decisive, "filler": reasoning_mask & ~digit,
                "answer": response_mask.bool() & ~reasoning_mask}

    digit_token_ids = staticmethod(digit_token_ids)

    @torch.no_grad()
    def validate(self, model, tok, repeats: int, gen: torch.Generator,
                 max_new_tokens: int = last_digit.MAX_NEW_TOKENS) -> float:
        """Success rate of temperature-1 samples on every prompt, as many samples as the last-digit task's 15 prompts
        × ``repeats`` (fewer prompts: more repeats each)."""
        prompts = list(self.PROMPTS) * (repeats * max(1, len(last_digit.PROMPTS) // len(self.PROMPTS)))
        ids = tiny_lm.encode(tok, self.examples_for(prompts))[0]
        b = tiny_lm.verl_batch(ids, [[tok.eos_token_id]] * len(prompts), tok.pad_token_id)
        responses = tiny_lm.sample_ids(model, tok.eos_token_id, b.prompts, b.prompt_mask,
                                       max_new_tokens=max_new_tokens, temperature=1.0, generator=gen)
        return sum(self.reward(tok.decode(r, skip_special_tokens=True), p)
                   for r, p in zip(responses, prompts)) / max(len(prompts), 1)

    def warm_start(self, root: str | Path, *, warm_steps: int = last_digit.WARM_STEPS,
                   max_new_tokens: int = last_digit.MAX_NEW_TOKENS, log: Callable[[str], None] = print) -> dict:
        """The last-digit task's warm start (same model, optimiser and steps) on this task's examples, in
        ``root / "model"``, content-keyed in ``$OAR_WARM_CACHE`` like the product's."""
        root = Path(root)
        info_file = root / "warm_start.json"
        if info_file.exists():
            return json.loads(info_file.read_text())

        def build(model_dir: Path) -> None:
            torch.manual_seed(0)
            rng = random.Random("tok-0")
            model, tok = tiny_lm.build_model_dir(model_dir, [self.make_example(rng) for _ in range(4000)], seed=0,
                                                 intermediate_size=256)
            log(f"[{self.name}-digit] warm start: {warm_steps} supervised steps on responses with uniform digits")
            sft = tiny_lm.sft_train(model, tok, self.make_example, steps=warm_steps, batch_size=32, lr=3e-3, seed=0,
                                    warmup=50, answer_weight=5.0, log=log)
            tiny_lm.save_model(model, tok, model_dir)
            acc = self.validate(model, tok, 16, torch.Generator().manual_seed(12345), max_new_tokens)
            (model_dir / last_digit.WARM_INFO).write_text(json.dumps(
                {"sft_steps": sft["steps"], "sft_seconds": sft["seconds"], "sft_loss": sft["loss"],
                 "val_success_t1": acc, "params": sum(p.numel() for p in model.parameters())}))

        hit = warm_cache.materialise(root / "model", name=f"{self.name}-digit-warm", log=log, build=build,
                                     settings={"task": self.name, "warm_steps": warm_steps,
                                               "max_new_tokens": max_new_tokens},
                                     code_files=[__file__, last_digit.__file__, tiny_lm.__file__,
                                                 tiny_assets.__file__, tokenizers.__file__])
        info = {"model_dir": str(root / "model"), **json.loads((root / "model" / last_digit.WARM_INFO).read_text()),
                "from_cache": hit}
        log(f"[{self.name}-digit] warm-started: validation success at T=1 {info['val_success_t1']:.3f}")
        info_file.write_text(json.dumps(info, indent=1))
        return info


TASKS = {"first": DigitTask("first", 1, last_digit.DIGIT_COUNTS), "middle": DigitTask("middle", 2, (3,))}


def task(name: str):
    """The task object :mod:`research.credit` runs: ``last`` is the product's module, the others a DigitTask."""
    if name == "last":
        return last_digit
    if name not in TASKS:
        raise ValueError(f"--task: unknown {name!r}; allowed: last, {', '.join(TASKS)}")
    return TASKS[name]
