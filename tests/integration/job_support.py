"""What the Ray worker-group jobs of this folder share (``detach_worker_job.py``, ``worker_group_job.py``).

verl's trainer config composed with Hydra for an fp32 FSDP2 actor on CPU ranks, the jobs' prompts and their tokens,
the actor's worker group spawned as verl's trainers spawn it (``create_colocated_worker_cls`` + ``spawn``) with Ray
up around it, and the copies a job saves.

A job runs as a script (this folder first on ``sys.path``) in the process its test started with the CPU platform's
environment (``cpu_env()``), which must be set before verl is first imported: here, on importing this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ray
import torch
from hydra import compose, initialize_config_dir

import verl
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import create_colocated_worker_cls

PROMPTS = ["What is 3 plus 4?", "What is 12 plus 30?", "Add 5 and 9.", "What is 7 plus 8?"]


def trainer_config(model_dir: str, *, n_ranks: int = 1, batch_size: int, micro_batch_size: int, sp: int = 1,
                   extra: Sequence[str] = ()):
    """verl's ``ppo_trainer`` config for an fp32 FSDP2 actor on ``n_ranks`` ranks (rollout named vllm, never started).

    ``batch_size`` rows a step in one mini-batch, ``micro_batch_size`` rows a rank's pass in training and log-probs.
    ``sp`` > 1: Ulysses sequence parallelism of that size in the remove-padding layout with the CPU stand-in
    attention ``ulysses_sdpa``; else verl's padded layout with sdpa. ``extra``: further Hydra overrides.
    """
    actor = "actor_rollout_ref.actor"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.use_remove_padding={sp > 1}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={'ulysses_sdpa' if sp > 1 else 'sdpa'}",
        f"{actor}.fsdp_config.ulysses_sequence_parallel_size={sp}",
        f"{actor}.strategy=fsdp2", f"{actor}.fsdp_config.strategy=fsdp2", f"{actor}.use_torch_compile=False",
        *(f"+{actor}.fsdp_config.mixed_precision.{k}_dtype=fp32" for k in ("param", "reduce", "buffer")),
        f"{actor}.ppo_mini_batch_size={batch_size}", f"{actor}.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
        "actor_rollout_ref.rollout.name=vllm", f"trainer.n_gpus_per_node={n_ranks}",
        f"data.train_batch_size={batch_size}", *extra]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def tokenized(model_dir: str, responses: Sequence[str], prompts: Sequence[str] = PROMPTS):
    """The model's tokenizer, each prompt's ids under its chat template (generation prompt added) and each response's
    ids with EOS last (lists of ints)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for p in prompts]
    response_ids = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    return tok, prompt_ids, response_ids


@contextmanager
def actor_group(worker_cls: type, config, ray_tmp: str, n_ranks: int = 1) -> Iterator[RayWorkerGroup]:
    """Ray up (4 CPUs, no dashboard, temp dir ``ray_tmp``), ``n_ranks`` CPU ranks of ``worker_cls`` in the ``actor``
    role of ``config.actor_rollout_ref``, model initialised; Ray shut down on the way out."""
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=ray_tmp)
    try:
        pool = RayResourcePool([n_ranks], use_gpu=False, max_colocate_count=1)
        class_dict = {"actor": RayClassWithInitArgs(cls=ray.remote(worker_cls), config=config.actor_rollout_ref,
                                                    role="actor")}
        group = RayWorkerGroup(pool, create_colocated_worker_cls(class_dict=class_dict), device_name="cpu")
        wg = group.spawn(prefix_set=class_dict.keys())["actor"]
        wg.init_model()
        yield wg
    finally:
        ray.shutdown()


def saved(value: torch.Tensor):
    """A copy to save: a nested tensor as the list of its rows, another tensor cloned."""
    return [t.clone() for t in value.unbind()] if getattr(value, "is_nested", False) else value.clone()
