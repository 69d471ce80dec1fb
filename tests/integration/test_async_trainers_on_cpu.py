"""OAR on every V1 trainer mode: the registered OAR trainers, where OAR's layer sits in each, the worker each mode's
actor gets, and attribution under separate_async's π_old weights on a real detachable actor worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

import verl  # noqa: F401  loads the plugin (trainer registration)
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, PPOTrainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker

from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.config import OARConfig
from oar_verl.core.preprocess import prepare_attribution
from oar_verl.quickstart.launcher import cpu_env, new_ray_temp_dir
from oar_verl.integration.trainer_v1 import (OARStepLayer, OARTrainerColocateAsync, OARTrainerSeparateAsync,
                                             OARTrainerSync, oar_trainer_mode)
from oar_verl.integration.worker import OARActorRolloutRefWorker, OARDetachActorWorker, swap_actor_worker

JOB = Path(__file__).with_name("detach_worker_job.py")
VERL_MODES = {"sync": PPOTrainerSync, "colocate_async": PPOTrainerColocateAsync,
              "separate_async": PPOTrainerSeparateAsync}
OAR_TRAINERS = {"sync": OARTrainerSync, "colocate_async": OARTrainerColocateAsync,
                "separate_async": OARTrainerSeparateAsync}


@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_every_v1_mode_has_an_oar_trainer_with_the_layer_inside_verls_old_log_prob_pass(mode):
    oar = TRAINER_REGISTRY["oar_" + mode]
    assert oar is OAR_TRAINERS[mode] and issubclass(oar, VERL_MODES[mode]) and oar.verl_mode == mode
    mro = oar.__mro__
    assert mro.index(VERL_MODES[mode]) < mro.index(OARStepLayer) < mro.index(PPOTrainer)
    # whatever verl's mode does around its old-log-prob pass (separate_async restores the cycle's π_old weights
    # around it), the pass it calls is OAR's: attribution right after PPOTrainer's old log-probs, same weights
    inner = super(VERL_MODES[mode], oar)._compute_old_log_prob
    assert inner is OARStepLayer._compute_old_log_prob
    assert oar_trainer_mode(mode) == oar_trainer_mode("oar_" + mode) == "oar_" + mode


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.v1.trainer_mode='fully_async' has no OAR trainer; choose one of"):
        oar_trainer_mode("fully_async")


def test_each_mode_keeps_its_worker_kind_with_the_attribution_rpc():
    mapping = {Role.ActorRollout: ray.remote(ActorRolloutRefWorker)}
    swap_actor_worker(mapping)
    assert mapping[Role.ActorRollout].__ray_actor_class__ is OARActorRolloutRefWorker
    mapping = {Role.Actor: ray.remote(DetachActorWorker)}  # what separate_async installs
    swap_actor_worker(mapping)
    assert mapping[Role.Actor].__ray_actor_class__ is OARDetachActorWorker
    swap_actor_worker(mapping)  # idempotent
    assert mapping[Role.Actor].__ray_actor_class__ is OARDetachActorWorker

    class Custom(ActorRolloutRefWorker):
        pass

    with pytest.raises(TypeError, match="no attribution worker for"):
        swap_actor_worker({Role.Actor: ray.remote(Custom)})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_separate_async_attributes_with_the_cycles_old_policy(tiny_assets, tmp_path):
    """On verl's detachable actor worker: after one real update (W0 -> W1), the decoupled-mode sequence of a later
    mini-batch (save W1, restore π_old = W0, old log-probs, attribution, restore W1) attributes with W0, reports that
    it matched the old-log-prob pass, and equals the core on the initial checkpoint; attributing after W1 is restored
    is reported as a mismatch and gives other numbers."""
    out = tmp_path / "detach.pt"
    env = {**os.environ, **cpu_env(), "VERL_USE_EXTERNAL_PLUGINS": "none"}
    proc = subprocess.run([sys.executable, str(JOB), str(tiny_assets.model_dir), str(out), new_ray_temp_dir()],
                          env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = torch.load(out)
    inside, outside = res["inside"], res["outside"]
    assert torch.equal(inside["oar_params_fingerprint"], inside["oar_log_prob_params_fingerprint"])  # the metric would read 1
    assert not torch.equal(outside["oar_params_fingerprint"], outside["oar_log_prob_params_fingerprint"])  # ... and here 0
    assert not torch.equal(inside["oar_params_fingerprint"], outside["oar_params_fingerprint"])  # the update changed the weights

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    cfg = OARConfig.from_mapping(res["config"])
    prompts = [p[p != tok.pad_token_id] for p in res["prompts"]]
    responses = [r[: len(t)] for r, t in zip(res["responses"], inside["token_importance"])]
    prepared = prepare_attribution(prompts, responses, tok, cfg, 3)
    ref = prepared.response_importance(run_attribution(module_backend(model, cfg), prepared.batch, cfg, mask_token_id=0,
                                                       seeds=prepared.seeds).importance)
    scale = float(torch.cat(ref).abs().max())
    for got, want in zip(inside["token_importance"], ref):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5 * scale)
    gap = max(float((a - b).abs().max()) for a, b in zip(outside["token_importance"], ref))
    assert gap > 1e-2 * scale  # under W1 the scores are not W0's
