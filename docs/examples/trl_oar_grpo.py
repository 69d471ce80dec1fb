"""OAR in TRL's GRPO, complete: a model, an arithmetic data set, a reward, ``OARGRPOConfig`` and ``OARGRPOTrainer``.

    python docs/examples/trl_oar_grpo.py [MODEL] [--output_dir DIR] [--max_steps N] [--oar_mode MODE]

MODEL is a hub id or a local folder (default: $OAR_EXAMPLE_MODEL, else Qwen/Qwen2.5-0.5B-Instruct). fp32 on a CPU,
bf16 on a GPU. The same reward from the command line, with this folder as the working directory:
``python -m oar_verl.trl.grpo --reward_funcs trl_oar_grpo.reward ...`` (docs/trl.md). tests/trl/test_trl_script.py
runs this file for one step on a tiny offline Qwen2.
"""

from __future__ import annotations

import argparse
import os
import random
import re

ANSWER = re.compile(r"The answer is (-?\d+)")


def arithmetic(n: int = 64, seed: int = 0):
    """``n`` chat prompts "What is a plus b?" with their ``solution`` (TRL's column name for the reference answer)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}? End with: The answer is N."}],
                     "solution": str(a + b)})
    return Dataset.from_list(rows)


def reward(completions, solution, **kwargs) -> list[float]:
    """1 for the right final ``The answer is N``; else 0.1 x the completion's share of digits, so that a group with no
    right answer still ranks its completions. ``completions``: strings, or one-message lists for chat prompts."""
    scores = []
    for completion, truth in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        found = ANSWER.findall(text)
        right = bool(found) and found[-1] == str(truth)
        scores.append(1.0 if right else 0.1 * sum(c.isdigit() for c in text) / max(len(text), 1))
    return scores


def main(argv: list[str] | None = None) -> None:
    import torch

    from oar_verl.trl import OARGRPOConfig, OARGRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.environ.get("OAR_EXAMPLE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct"))
    parser.add_argument("--output_dir", default="oar-grpo-arithmetic")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--oar_mode", default="conservative")
    cli = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    args = OARGRPOConfig(
        output_dir=cli.output_dir, max_steps=cli.max_steps, learning_rate=1e-6, logging_steps=1, report_to="none",
        per_device_train_batch_size=8, num_generations=8, max_completion_length=128, bf16=gpu, use_cpu=not gpu,
        oar_mode=cli.oar_mode,  # OAR's keys: every oar_<key> of docs/config.md, e.g. oar_tau, oar_answer_patterns
    )
    trainer = OARGRPOTrainer(model=cli.model, reward_funcs=reward, args=args, train_dataset=arithmetic())
    trainer.train()
    trainer.save_model(cli.output_dir)


if __name__ == "__main__":
    main()
