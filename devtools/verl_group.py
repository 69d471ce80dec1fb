"""verl's actor worker group, built the way verl's trainers build it, on CPU ranks or CUDA GPUs (development tooling).

* :func:`trainer_config` -- verl's ``ppo_trainer`` config composed with Hydra for an FSDP2 actor: the parameter dtype
  of its mixed precision, the padded layout with sdpa (Ulysses: remove-padding with the CPU stand-in attention),
  gradient checkpointing and dynamic batch sizes on request;
* :func:`rows_tensordict` -- token rows in verl's V1 layout (nested, no padding), as the actor's RPCs read them;
* :func:`actor_group` -- Ray up, the actor role spawned through ``create_colocated_worker_cls`` + ``spawn``
  (gloo on CPU, NCCL on CUDA), the model initialised, Ray shut down on the way out.

Used by the worker-group jobs of tests/integration (CPU) and by ``research.verl_worker`` (the ``verl-worker`` part of
scripts/gpu_check.sh, CPU and CUDA). Imports verl: on CPU the verl CPU platform must be selected in the environment
before this module is imported (``oar_verl.quickstart.launcher.cpu_env``).
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

ACTOR = "actor_rollout_ref.actor"
PARAM_DTYPES = ("fp32", "bf16")  # FSDP2 mixed precision: the dtype the forward and backward compute in


def trainer_config(model_dir: str, *, n_ranks: int = 1, batch_size: int, micro_batch_size: int, sp: int = 1,
                   param_dtype: str = "fp32", token_budget: int | None = None, checkpointing: bool = False,
                   packed: bool | None = None, strategy: str = "fsdp2", extra: Sequence[str] = ()):
    """verl's ``ppo_trainer`` config for an FSDP2 actor on ``n_ranks`` ranks (rollout named vllm, never started).

    Args:
        batch_size: rows of a step, in one mini-batch.
        micro_batch_size: rows of a rank's pass in training and log-probs (without ``token_budget``).
        sp: > 1: Ulysses sequence parallelism of that size (remove-padding layout).
        packed: verl's remove-padding layout (``use_remove_padding``; default: with sequence parallelism), its rows
            packed end to end, with the CPU stand-in attention ``ulysses_sdpa`` (a packed-sequence sdpa without a
            group); else verl's padded layout with sdpa (flash-attn is not needed on either device).
        param_dtype: FSDP2 mixed precision's parameter dtype, ``fp32`` or ``bf16`` (reduce and buffers stay fp32;
            the master weights and optimizer are fp32 either way, as in verl's default for the actor).
        token_budget: dynamic batch sizes: tokens of one training and one log-prob pass per GPU.
        checkpointing: gradient checkpointing of the actor.
        strategy: ``fsdp2`` or ``fsdp`` (FSDP1, verl's default; on CPU ranks with :mod:`devtools.fsdp1_cpu` loaded).
        extra: further Hydra overrides.
    """
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"strategy must be fsdp or fsdp2, got {strategy!r}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")
    packed = sp > 1 if packed is None else packed
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.use_remove_padding={packed}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={'ulysses_sdpa' if packed else 'sdpa'}",
        f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size={sp}",
        f"{ACTOR}.strategy={strategy}", f"{ACTOR}.fsdp_config.strategy={strategy}", f"{ACTOR}.use_torch_compile=False",
        f"+{ACTOR}.fsdp_config.mixed_precision.param_dtype={param_dtype}",
        *(f"+{ACTOR}.fsdp_config.mixed_precision.{k}_dtype=fp32" for k in ("reduce", "buffer")),
        f"{ACTOR}.ppo_mini_batch_size={batch_size}", f"{ACTOR}.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size}",
        "actor_rollout_ref.rollout.name=vllm", f"trainer.n_gpus_per_node={n_ranks}",
        f"data.train_batch_size={batch_size}", *extra]
    if checkpointing:
        overrides.append("actor_rollout_ref.model.enable_gradient_checkpointing=True")
    if token_budget is not None:
        overrides += [f"{ACTOR}.use_dynamic_bsz=True", f"{ACTOR}.ppo_max_token_len_per_gpu={token_budget}",
                      f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={token_budget}"]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def rows_tensordict(prompts: Sequence, responses: Sequence):
    """verl's V1 layout (nested, no padding) of B (prompt, response) token rows (lists or 1-D tensors of ids), as
    ``compute_log_prob`` and ``compute_token_importance`` read it: ``input_ids``, ``position_ids``, ``prompts``,
    ``responses``, ``response_mask`` and ``loss_mask`` (the response tokens of each whole sequence)."""
    from tensordict import TensorDict

    def nested(rows):
        return torch.nested.as_nested_tensor([torch.as_tensor(r) for r in rows], layout=torch.jagged)

    prompts, responses = [torch.as_tensor(p) for p in prompts], [torch.as_tensor(r) for r in responses]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    return TensorDict({"input_ids": nested(ids), "position_ids": nested([torch.arange(len(x)) for x in ids]),
                       "prompts": nested(prompts), "responses": nested(responses),
                       "response_mask": nested([torch.ones(len(r)) for r in responses]),
                       "loss_mask": nested([torch.cat([torch.zeros(len(p)), torch.ones(len(r))])
                                            for p, r in zip(prompts, responses)])}, batch_size=[len(ids)])


@contextmanager
def actor_group(worker_cls: type, config, ray_tmp: str, n_ranks: int = 1, device: str = "cpu",
                num_cpus: int = 4) -> Iterator[RayWorkerGroup]:
    """Ray up (``num_cpus`` CPUs, one GPU a rank on ``device="cuda"``, no dashboard, temp dir ``ray_tmp``),
    ``n_ranks`` ranks of ``worker_cls`` in the ``actor`` role of ``config.actor_rollout_ref``, model initialised; Ray
    shut down on the way out."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    gpu = device == "cuda"
    ray.init(num_cpus=num_cpus, num_gpus=n_ranks if gpu else None, include_dashboard=False, _temp_dir=ray_tmp)
    try:
        pool = RayResourcePool([n_ranks], use_gpu=gpu, max_colocate_count=1)
        class_dict = {"actor": RayClassWithInitArgs(cls=ray.remote(worker_cls), config=config.actor_rollout_ref,
                                                    role="actor")}
        group = RayWorkerGroup(pool, create_colocated_worker_cls(class_dict=class_dict), device_name=device)
        wg = group.spawn(prefix_set=class_dict.keys())["actor"]
        wg.init_model()
        yield wg
    finally:
        ray.shutdown()
