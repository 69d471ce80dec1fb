"""Start-up checks (oar_verl.integration.startup) on a minimal config: what each engine refuses, named by key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from oar_verl.integration.estimator import OARSetupError
from oar_verl.integration.startup import validate_oar_setup


def config(strategy: str, **oar):
    return OmegaConf.create({"algorithm": {"adv_estimator": "oar", "oar": oar},
                             "actor_rollout_ref": {"actor": {"strategy": strategy}, "model": {}}, "trainer": {}})


def test_megatron_runs_every_method_and_refuses_unsupported_layouts():
    # the one attribution engine runs K noise draws and every perturbation policy on Megatron as on FSDP
    assert validate_oar_setup(config("megatron", mode="gradient", noise_samples=4)).noise_samples == 4
    for policy in ("exact", "segment", "hierarchical", "auto"):
        assert validate_oar_setup(config("megatron", mode="perturbation", perturbation=policy)).perturbation == policy
    bad = config("megatron", mode="gradient")
    bad.actor_rollout_ref.actor.megatron = {"context_parallel_size": 2}
    with pytest.raises(OARSetupError, match=r"actor_rollout_ref\.actor\.megatron\.context_parallel_size=2: OAR "
                                            r"attribution does not support context parallelism"):
        validate_oar_setup(bad)