"""What the Ray worker-group jobs of this folder share (``detach_worker_job.py``, ``worker_group_job.py``).

verl's trainer config and the actor's worker group as verl's trainers spawn it (:mod:`devtools.verl_group`, shared
with the GPU check's ``verl-worker`` part), the jobs' prompts and their tokens, and the copies a job saves.

A job runs as a script (this folder first on ``sys.path``) in the process its test started with the CPU platform's
environment (``cpu_env()``), which must be set before verl is first imported: here, on importing this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from devtools.verl_group import actor_group, trainer_config  # noqa: F401  (the jobs' group, as verl builds it)

PROMPTS = ["What is 3 plus 4?", "What is 12 plus 30?", "Add 5 and 9.", "What is 7 plus 8?"]


def tokenized(model_dir: str, responses: Sequence[str], prompts: Sequence[str] = PROMPTS):
    """The model's tokenizer, each prompt's ids under its chat template (generation prompt added) and each response's
    ids with EOS last (lists of ints)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for p in prompts]
    response_ids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    return tok, prompt_ids, response_ids


def saved(value: torch.Tensor):
    """A copy to save: a nested tensor as the list of its rows, another tensor cloned."""
    return [t.clone() for t in value.unbind()] if getattr(value, "is_nested", False) else value.clone()
