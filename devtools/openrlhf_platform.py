"""A CPU platform for OpenRLHF 0.11.2: its real ``train_ppo_ray`` loop on a machine without a GPU.

OpenRLHF's Ray + DeepSpeed + vLLM loop assumes CUDA in a handful of places. This module replaces each of them at run
time, from outside OpenRLHF (no file of OpenRLHF is edited), the way :mod:`oar_verl.quickstart.platform` does for verl.
Development tooling only: the OpenRLHF glue (:mod:`oar_verl.openrlhf`) never imports it. Load it in **every** process
(driver and Ray workers) before OpenRLHF's modules: :func:`main` starts Ray with :func:`install` as the workers'
``worker_process_setup_hook``.

What stands in for what (OpenRLHF 0.11.2 file:line in the installed wheel):

1. ``torch.cuda.set_device`` / ``synchronize`` / ``empty_cache`` are no-ops and ``torch.cuda.current_device`` is the
   CPU (``utils/deepspeed/deepspeed.py:97,614,633``, ``trainer/ray/ppo_actor.py:171,600-605,627``); the replay
   buffer, which formats ``cuda:<index>`` into a device it does not use for training, gets the CPU
   (``trainer/ppo_utils/replay_buffer.py:40``);
2. ``init_device_mesh("cuda", ...)`` builds its mesh on the CPU (``utils/deepspeed/deepspeed.py:104``); DeepSpeed's
   CPU accelerator picks gloo for ``deepspeed.init_distributed``;
3. DeepSpeed's fused Adam is a CUDA kernel (its CPU build is compiled on first use): torch's AdamW stands in
   (``torch_adam`` in the DeepSpeed optimizer config); under ZeRO-3 parameter lists are gathered one parameter at a
   time (:func:`sequential_gathers`: DeepSpeed's coalesced gather is not complete on gloo when it returns);
4. vLLM engines (``trainer/ray/vllm_engine.py:273``, bf16 and vLLM 0.29's API) are replaced by
   :class:`HFRolloutEngine`, OpenRLHF's own rollout actor class with Hugging Face ``generate`` in place of vLLM: the
   same ``generate_responses`` and agent executor (so rewards come from ``--reward.remote_url`` or
   ``--train.agent_func_path`` exactly as with vLLM);
5. the weight sync to the engines (NCCL or CUDA-IPC, ``trainer/ray/ppo_actor.py:108-150,409-490``) goes through
   Ray's object store: rank 0 gathers the parameters (every rank takes part under ZeRO-3) and sends them; with LoRA
   (``--ds.lora.rank``) each adapted layer is sent merged (base weight + peft's ``get_delta_weight``) under the
   model's own names. OpenRLHF 0.11.2 itself sends peft's parameter names (``base_model.model...``,
   ``...base_layer.weight``, ``...lora_A...``) to vLLM's ``update_weight``, which this platform does not reproduce.

Ray is started with as many placeholder GPU resources as the actor group asks for (OpenRLHF places its actors in
``{"GPU": 1}`` bundles), so its own placement code runs unchanged, and with the environment OpenRLHF's own
``ray.init`` gives its workers (``cli/train_ppo_ray.py:21-31``), ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` included:
tensors a worker sends arrive as views into Ray's object store.

Checks of this platform, printed with the ``[oar-cpu]`` prefix (the tests read them), that leave OpenRLHF's behaviour
unchanged:

* every parameter of every model OpenRLHF loads from a path (``openrlhf.models.Actor``), gathered under ZeRO-3, right
  after the load and, for the policy, at the top of its first ``fit`` (before OAR's reshape): all finite, or the run
  stops naming them;
* at each OAR write-back (:func:`oar_verl.openrlhf.reshape.assign_reshaped`): how many items' advantages arrived
  zero-copy, and that those tensors are unchanged afterwards (the adapter assigns new ones);
* with ``OAR_CPU_RAY_PY_MODULES=1`` the ``oar_verl`` package reaches the workers through the Ray ``runtime_env``
  (``py_modules``), as on a cluster where it is not installed on every node, and each worker prints where it imported
  ``oar_verl`` from.

    python -m devtools.openrlhf_platform --oar.mode=gradient <OpenRLHF train_ppo_ray flags>
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

_INSTALLED = "_oar_openrlhf_cpu"


def _no_op(name: str):
    """A distinct no-op per replaced torch function (torch._dynamo maps torch's functions one to one)."""

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    no_op.__name__ = no_op.__qualname__ = name
    return no_op


def _cpu_device(*args: Any, **kwargs: Any) -> torch.device:
    return torch.device("cpu")


def install() -> None:
    """Part 1-3 and 5 in this process (idempotent). Call before OpenRLHF's modules are imported."""
    if getattr(torch, _INSTALLED, False):
        return
    setattr(torch, _INSTALLED, True)
    for name in ("set_device", "synchronize", "empty_cache"):
        setattr(torch.cuda, name, _no_op(name))
    torch.cuda.current_device = _cpu_device

    import torch.distributed.device_mesh as device_mesh

    init_device_mesh = device_mesh.init_device_mesh

    def cpu_device_mesh(device_type: str, *args: Any, **kwargs: Any):
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = cpu_device_mesh

    from openrlhf.trainer.ppo_utils import replay_buffer
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils.deepspeed import deepspeed as ds_strategy

    ds_strategy.init_device_mesh = cpu_device_mesh
    buffer_init = replay_buffer.NaiveReplayBuffer.__init__

    def buffer_on_cpu(self, *args: Any, **kwargs: Any) -> None:
        torch.cuda.current_device = lambda: 0  # formatted into "cuda:0", a device the buffer only stores
        try:
            buffer_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = _cpu_device
        self.target_device = torch.device("cpu")

    replay_buffer.NaiveReplayBuffer.__init__ = buffer_on_cpu

    train_config = ds_strategy.DeepspeedStrategy.get_ds_train_config
    eval_config = ds_strategy.DeepspeedStrategy.get_ds_eval_config

    def torch_adam(self, *args: Any, **kwargs: Any) -> dict:
        config = sequential_gathers(train_config(self, *args, **kwargs))
        if config.get("optimizer", {}).get("type") == "AdamW":
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    def eval_on_cpu(self, *args: Any, **kwargs: Any) -> dict:
        return sequential_gathers(eval_config(self, *args, **kwargs))

    ds_strategy.DeepspeedStrategy.get_ds_train_config = torch_adam
    ds_strategy.DeepspeedStrategy.get_ds_eval_config = eval_on_cpu
    ppo_actor.ActorPPOTrainer._init_vllm_sync_group = _no_op("_init_vllm_sync_group")
    ppo_actor.ActorPPOTrainer.broadcast_to_vllm = _broadcast_through_ray
    _install_checks()


def gathered_nonfinite(model: torch.nn.Module) -> tuple[int, list[str]]:
    """(parameters, names of those holding a non-finite value), each gathered in full under ZeRO-3 (every rank of
    the model's group must call it together)."""
    import deepspeed

    bad, n = [], 0
    for name, param in model.named_parameters():
        n += 1
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            if not torch.isfinite(param.data.float()).all():
                bad.append(name)
    return n, bad


def _report_params(model: torch.nn.Module, when: str) -> None:
    n, bad = gathered_nonfinite(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dtype = next(model.parameters()).dtype
    if rank == 0 or bad:
        print(f"[oar-cpu] rank {rank}: {n} gathered {dtype} parameters {when}, non-finite: {bad or 'none'}",
              flush=True)
    if bad:
        raise FloatingPointError(f"[oar-cpu] rank {rank}: non-finite parameters {when}: {bad}")


_ZERO_COPY_STORAGES: set[int] = set()  # storage addresses of the tensors Ray deserialised zero-copy in this process


_RAY_DESERIALIZE = None


def _recorded_zero_copy(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Ray's zero-copy tensor deserializer, recording where the tensors it returns live."""
    tensor = _RAY_DESERIALIZE(*args, **kwargs)
    _ZERO_COPY_STORAGES.add(tensor.untyped_storage().data_ptr())
    return tensor


def _install_checks() -> None:
    """The checks listed in the module docstring (parameters after load / before the first fit, zero-copy items)."""
    import os

    from openrlhf.models import Actor
    from ray._private import tensor_serialization_utils as tsu

    actor_init = Actor.__init__

    def checked_init(self, pretrain_or_model, *args: Any, **kwargs: Any) -> None:
        actor_init(self, pretrain_or_model, *args, **kwargs)
        if isinstance(pretrain_or_model, str):
            _report_params(self.model, f"after OpenRLHF's load of {os.path.basename(pretrain_or_model)}")

    Actor.__init__ = checked_init

    global _RAY_DESERIALIZE
    _RAY_DESERIALIZE = tsu._zero_copy_tensors_deserializer
    # the sender's reducer names this function in the pickle (by module path: it is module-level, so the receiver
    # runs its own copy of this module and records into its own set)
    tsu._zero_copy_tensors_deserializer = _recorded_zero_copy

    from oar_verl.openrlhf import reshape

    # Ray ships the OAR actor class by value: its fit is not patchable here, but the module functions it calls are
    # looked up by name when the class arrives, after this hook ran
    reshape_buffer = reshape.reshape_replay_buffer
    checked_models: set[int] = set()

    def checked_reshape(items, model, *args: Any, **kwargs: Any):
        if id(model) not in checked_models:  # the first fit of this actor, before any OAR code touches the model
            checked_models.add(id(model))
            _report_params(model, "before the first fit")
        return reshape_buffer(items, model, *args, **kwargs)

    reshape.reshape_replay_buffer = checked_reshape

    assign = reshape.assign_reshaped

    def checked_assign(items, *args: Any, **kwargs: Any) -> None:
        old = [it.advantages for it in items]
        zero_copy = sum(int(t.untyped_storage().data_ptr() in _ZERO_COPY_STORAGES) for t in old)
        before = [t.clone() for t in old]
        assign(items, *args, **kwargs)
        untouched = all(torch.equal(a, b) for a, b in zip(old, before))
        replaced = all(it.advantages is not t for it, t in zip(items, old))
        print(f"[oar-cpu] write-back: RAY_ENABLE_ZERO_COPY_TORCH_TENSORS="
              f"{os.environ.get('RAY_ENABLE_ZERO_COPY_TORCH_TENSORS', '')}, items {len(items)}, zero-copy "
              f"{zero_copy}, received tensors untouched {untouched}, replaced {replaced} (zero-copy tensors received "
              f"in this process: {len(_ZERO_COPY_STORAGES)})", flush=True)

    reshape.assign_reshaped = checked_assign
    import oar_verl

    if os.environ.get("OAR_CPU_RAY_PY_MODULES") == "1":
        print(f"[oar-cpu] worker {os.getpid()}: oar_verl from {os.path.dirname(oar_verl.__file__)}", flush=True)


def sequential_gathers(config: dict) -> dict:
    """ZeRO-3 on gloo: gather parameter lists one parameter at a time (``allgather_sequential``).

    DeepSpeed 0.19.6's coalesced gather (``runtime/zero/partition_parameters.py``, ``_allgather_params_coalesced``)
    launches one asynchronous all-gather per parameter and waits on the last handle only, relying on a CUDA stream to
    order the others, and skips its fallback synchronize on a "synchronized" device such as the CPU. Gloo runs the
    async collectives of a process group on a pool of threads, so the earlier gathers can still be writing when the
    caller uses the buffers. Under ``GatheredParameters(..., modifier_rank=0)`` (transformers' ZeRO-3 checkpoint load,
    one module at a time: e.g. a biased Linear's weight and bias) rank 0 then loads the checkpoint into a buffer that
    a late gather overwrites with the uninitialised partitions, and broadcasts that: a parameter with garbage (at times
    NaN) right after the load (docs/openrlhf.md, "The bf16 ZeRO-3 NaN"). CUDA/NCCL keeps the coalesced path.
    """
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        zero["allgather_sequential"] = True
    return config


def _broadcast_through_ray(self) -> None:
    """The actor's weights to every rollout engine through Ray's object store (all ranks call it together)."""
    import deepspeed
    import ray

    model = self.actor.model.module if hasattr(self.actor.model, "module") else self.actor.model
    rank0 = torch.distributed.get_rank() == 0
    stage3 = self.strategy.args.ds.zero_stage == 3
    modules = dict(model.named_modules())
    state = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:  # LoRA (--ds.lora.rank): the engine gets the merged weight of the base layer below
            continue
        owner = modules.get(name.rsplit(".", 2)[0]) if ".base_layer." in name else None
        lora = owner if owner is not None and hasattr(owner, "get_delta_weight") and name.endswith(".weight") else None
        extra = [p for n, p in lora.named_parameters() if ".lora_" in n or n.startswith("lora_")] if lora else []
        with deepspeed.zero.GatheredParameters([param, *extra], enabled=stage3):
            if rank0:
                value = param.data.detach().to(torch.float32).clone()
                for adapter in (getattr(lora, "active_adapters", None) or []):
                    value += lora.get_delta_weight(adapter).to(torch.float32)
                # peft's names (base_model.model.<name>, <layer>.base_layer.<param>) -> the model's own
                state[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value
    if rank0:
        ref = ray.put(state)
        ray.get([engine.update_weights.remote(ref) for engine in self.vllm_engines])
    torch.distributed.barrier()


def _rollout_actor_class():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, _load_agent_executor
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    class HFRolloutEngineImpl(RolloutRayActor.__ray_actor_class__):
        """OpenRLHF's rollout actor with Hugging Face ``generate`` (fp32, CPU) in place of the vLLM engine."""

        def __init__(self, model: str, seed: int, agent_func_path: str | None = None,
                     remote_rm_url: str | None = None):
            from transformers import AutoModelForCausalLM, GenerationConfig

            self.executor = (_load_agent_executor(agent_func_path) if agent_func_path
                             else SingleTurnAgentExecutor(remote_rm_url))
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
            self.model.eval()
            eos = GenerationConfig.from_pretrained(model).eos_token_id
            self.eos = set(eos if isinstance(eos, list) else [eos])
            self.generator = torch.Generator().manual_seed(seed)
            self.updates = 0

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            """A vLLM-shaped result (``outputs[0].token_ids``, ``finish_reason``) for one sampled continuation."""
            torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=self.generator)))
            ids = torch.tensor([prompt_token_ids], dtype=torch.long)
            sample = sampling_params.temperature > 0
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=sample,
                    temperature=sampling_params.temperature if sample else None,
                    top_p=sampling_params.top_p if sample else None,
                    top_k=sampling_params.top_k if sample and sampling_params.top_k > 0 else None,
                    max_new_tokens=sampling_params.max_tokens, min_new_tokens=sampling_params.min_tokens,
                    pad_token_id=next(iter(self.eos)), eos_token_id=sorted(self.eos))
            tokens = out[0, ids.shape[1]:].tolist()
            stop = next((i for i, t in enumerate(tokens) if t in self.eos), None)
            if stop is not None:  # vLLM keeps the stop token in token_ids
                tokens = tokens[: stop + 1]
            finish = "stop" if stop is not None else "length"
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason=finish, logprobs=None)])

        def get_num_unfinished_requests(self) -> int:
            return 0

        def update_weights(self, state: dict) -> int:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise KeyError(f"rollout engine: unknown parameters {unexpected[:5]}")
            self.updates += 1
            print(f"[oar-cpu] rollout engine: weights from the actor, update {self.updates}", flush=True)
            return self.updates

        async def sleep(self, level: int = 1) -> None:
            return None

        async def wake_up(self, tags=None) -> None:
            return None

        async def reset_prefix_cache(self) -> None:
            return None

    return HFRolloutEngineImpl


def create_hf_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, *args: Any,
                      agent_func_path: str | None = None, remote_rm_url: str | None = None, **kwargs: Any) -> list:
    """Stands in for ``openrlhf.trainer.ray.create_vllm_engines`` (same arguments): ``num_engines`` CPU actors."""
    import ray

    if tensor_parallel_size != 1:
        raise SystemExit("--vllm.tensor_parallel_size: the CPU rollout engines run one model each (set 1)")
    engine = ray.remote(_rollout_actor_class())
    return [engine.options(num_cpus=0, num_gpus=0).remote(pretrain, seed + i, agent_func_path=agent_func_path,
                                                          remote_rm_url=remote_rm_url)
            for i in range(num_engines)]


def _flag(argv: Sequence[str], name: str, default: int) -> int:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(name + "="):
            return int(a.split("=", 1)[1])
    return default


def main(argv: Sequence[str] | None = None) -> None:
    """Start Ray with placeholder GPUs and this platform in every worker, then OAR's OpenRLHF entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    install()
    import openrlhf.trainer.ray as orl_ray
    import ray

    from oar_verl.openrlhf import train_ppo_ray

    gpus = _flag(argv, "--actor.num_gpus_per_node", 8) * _flag(argv, "--actor.num_nodes", 1)
    runtime_env = {"worker_process_setup_hook": "devtools.openrlhf_platform.install",
                   # OpenRLHF's own ray.init sets these three for its workers (cli/train_ppo_ray.py)
                   "env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
                                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS":
                                    os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
                                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                "OAR_CPU_RAY_PY_MODULES": os.environ.get("OAR_CPU_RAY_PY_MODULES", "0")}}
    if os.environ.get("OAR_CPU_RAY_PY_MODULES") == "1":  # oar_verl shipped to the workers, as with `ray job submit`
        import oar_verl

        # this platform (the worker set-up hook) travels with it: neither is installed on the workers
        runtime_env["py_modules"] = [os.path.dirname(oar_verl.__file__), os.path.dirname(os.path.abspath(__file__))]
    ray.init(num_cpus=max(4, gpus + 2), num_gpus=gpus, include_dashboard=False, runtime_env=runtime_env)
    orl_ray.create_vllm_engines = create_hf_engines
    try:
        train_ppo_ray.main(argv)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
