"""One TRL GRPO run on CPU for the TRL tests and the cost measurement: OAR's trainer (or TRL's plain one) on a tiny
offline Qwen2, a toy reward, TRL's own ``generate`` path; single-process, or one of N processes started by
``torch.distributed.run`` / ``accelerate launch`` (gloo: accelerate picks it on CPU).

usage: python tests/trl/trl_job.py MODEL_DIR OUT_DIR '{"oar_mode": "gradient", ...}'   (JSON: config overrides; keys
       "plain": true runs TRL's GRPOTrainer, "lora": rank runs a PEFT LoRA policy, "resume": true resumes from the
       last checkpoint in OUT_DIR). Rank 0 writes OUT_DIR/log_history.json (TRL's logs) and OUT_DIR/summary.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

# the answer pattern the toy task's completions end with: the last 1-3 non-space characters of the completion (the
# random tiny policy writes no arithmetic; any completion then has an answer span and reasoning before it)
ANSWER = r"(?P<answer>\S{1,3})\s*$"


def reward(completions, **kwargs):
    """A toy reward that varies within each group: the completion's character codes summed, mod 3."""
    return [float(sum(map(ord, c)) % 3) for c in completions]


def main(model_dir: str, out: str, overrides: dict) -> None:
    from trl import GRPOConfig, GRPOTrainer

    from oar_verl.trl import OARGRPOConfig, OARGRPOTrainer

    plain, lora, resume = overrides.pop("plain", False), overrides.pop("lora", 0), overrides.pop("resume", False)
    steps = overrides.pop("max_steps", 2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": f"{a} + {b} ="} for a in range(8) for b in range(4)])
    base = dict(output_dir=out, use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=16, max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
                seed=0, learning_rate=1e-4)
    if not plain:
        base.update(oar_answer_patterns=[ANSWER])
    base.update(overrides)
    config, trainer_cls = (GRPOConfig, GRPOTrainer) if plain else (OARGRPOConfig, OARGRPOTrainer)
    args = config(**base)
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=int(lora), lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trainer_cls(model=model_dir, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          peft_config=peft)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if resume else None)
    wall = time.perf_counter() - t0
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"wall_s": wall, "world_size": trainer.accelerator.num_processes,
                       "model": type(trainer.model).__name__, "wrapped": type(trainer.model_wrapped).__name__,
                       "global_step": trainer.state.global_step, "torch_threads": torch.get_num_threads()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
