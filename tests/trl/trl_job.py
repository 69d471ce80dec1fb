"""One TRL GRPO run on CPU for the TRL tests and the cost measurement: OAR's trainer (or TRL's plain one) on a tiny
offline Qwen2, a toy reward, TRL's own ``generate`` path; single-process, or one of N processes started by
``torch.distributed.run`` / ``accelerate launch`` (gloo: accelerate picks it on CPU).

With ``"tool": true`` the run calls a real tool through TRL's own tool loop (``tools=[add]``): the policy's chat
template becomes TRL's Qwen2.5 one (ChatML with tool calls, which TRL can parse), the prompts are conversational, and
a ``rollout_func`` opens every completion with a call of ``add`` on the prompt's numbers (the tiny random policy
writes no tool call of its own); TRL then runs ``add``, appends its output (``tool_mask`` 0) and samples the next
turn with its own ``generate``. Every row of every step then holds a tool output. A spy around the adapter's
``reshape_batch`` (the real one, called as the trainer calls it) appends, per call and process, what it did on the
tool tokens to OUT_DIR/tool_rows_rank{R}.jsonl (:func:`tool_record`).

usage: python tests/trl/trl_job.py MODEL_DIR OUT_DIR '{"oar_mode": "gradient", ...}'   (JSON: config overrides; keys
       "plain": true runs TRL's GRPOTrainer, "lora": rank runs a PEFT LoRA policy, "resume": true resumes from the
       last checkpoint in OUT_DIR, "tool": true the tool run above). Rank 0 writes OUT_DIR/log_history.json (TRL's
       logs) and OUT_DIR/summary.json.
"""

from __future__ import annotations

import functools
import json
import os
import re
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
    """A toy reward that varies within each group: the completion's character codes summed, mod 3 (a conversational
    completion: its messages' contents)."""
    texts = [c if isinstance(c, str) else "".join(str(m.get("content") or "") for m in c) for c in completions]
    return [float(sum(map(ord, t)) % 3) for t in texts]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.
    """
    return a + b


def tool_rollout(prompts: list, trainer) -> dict:
    """TRL's ``rollout_func``: each prompt (conversational, one per completion) rendered by the chat template, and a
    completion that calls ``add`` on the prompt's two numbers, ended by the EOS (a forced first turn, the model's tokens
    to TRL: ``tool_mask`` 1; TRL's tool loop parses it, runs the tool and samples the next turn). The tools' schema is left out of the prompt: it would take
    the tiny BPE past the model's 512 positions."""
    tok = trainer.processing_class
    prompt_ids, completion_ids = [], []
    for p in prompts:
        prompt_ids.append(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        a, b = map(int, re.findall(r"\d+", p[-1]["content"]))
        call = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        completion_ids.append(tok.encode(call, add_special_tokens=False) + [tok.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def tool_record(res, completion_mask: torch.Tensor, tool_mask: torch.Tensor | None) -> dict:
    """What one ``reshape_batch`` call did on the tool tokens (valid completion tokens with ``tool_mask`` 0): their
    count, the largest |advantage|, |w| (0: outside the loss mask, as padding) and |importance| on them, how many are
    reasoning, answer or reshaped tokens, and the largest |Σw - R| / R over a reshaped row's reasoning tokens (the
    model's own)."""
    valid = res.attribution.response_mask.to(completion_mask.device) & completion_mask.bool()
    tool = (valid & ~tool_mask.bool()) if tool_mask is not None else torch.zeros_like(valid)
    tool = tool.cpu()
    att, w = res.attribution, res.reshaped.token_weights
    on = (lambda t: float(t.abs()[tool].max()) if bool(tool.any()) else 0.0)
    R = w.reshaped.sum(-1).double()
    mass = (torch.where(w.reshaped, w.weights.double(), 0.0).sum(-1) - R).abs() / R.clamp(min=1)
    return {"tool_tokens": int(tool.sum()), "model_tokens": int(res.model_mask.sum()),
            "rows_with_tool": int(tool.any(-1).sum()), "attributed": int(att.attributed.sum()),
            "adv_max_abs": on(res.advantages.cpu().double()), "weight_max_abs": on(w.weights.double()),
            "importance_max_abs": on(att.importance.double()),
            "reasoning_or_answer": int(((att.reasoning_mask | att.answer_mask | w.reshaped) & tool).sum()),
            "mass_rel_err_max": float(mass.max()) if mass.numel() else 0.0}


def spy_reshape(out: str, rank: int) -> None:
    """Wrap the trainer's ``reshape_batch`` (the real one runs) to append :func:`tool_record` of every call."""
    import oar_verl.trl.trainer as trainer_module

    real = trainer_module.reshape_batch

    @functools.wraps(real)
    def spied(*args, **kwargs):
        res = real(*args, **kwargs)
        with open(os.path.join(out, f"tool_rows_rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(tool_record(res, kwargs["completion_mask"], kwargs.get("tool_mask"))) + "\n")
        return res

    trainer_module.reshape_batch = spied


def main(model_dir: str, out: str, overrides: dict) -> None:
    from trl import GRPOConfig, GRPOTrainer

    from oar_verl.trl import OARGRPOConfig, OARGRPOTrainer

    plain, lora, resume = overrides.pop("plain", False), overrides.pop("lora", 0), overrides.pop("resume", False)
    steps, tool = overrides.pop("max_steps", 2), overrides.pop("tool", False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": f"{a} + {b} ="} for a in range(8) for b in range(4)])
    extra = {}
    if tool:
        from trl.chat_template_utils import qwen2_5_chat_template

        tok.chat_template = qwen2_5_chat_template  # TRL's Qwen2.5 template: tool calls it renders and parses
        data = data.map(lambda x: {"prompt": [{"role": "user", "content": x["prompt"]}]})
        extra = {"tools": [add], "rollout_func": tool_rollout}
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's experimental-feature warning
        spy_reshape(out, int(os.environ.get("RANK", "0")))
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
                          peft_config=peft, **extra)
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
