"""Start-up checks (oar_verl.integration.startup) on a minimal config: what each engine refuses, named by key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from oar_verl.integration.estimator import OARSetupError
from oar_verl.integration.startup import validate_oar_setup


def config(strategy: str, **oar):
    return OmegaConf.create({"algorithm": {"adv_estimator": "oar", "oar": oar},
                             "actor_rollout_ref": {"actor": {"strategy": strategy}, "model": {}}, "trainer": {}})


def test_megatron_refuses_several_oar_g_noise_samples():
    with pytest.raises(OARSetupError, match=r"algorithm\.oar\.noise_samples=4 is not supported on the Megatron engine "
                                            r"yet .* set algorithm\.oar\.noise_samples=1"):
        validate_oar_setup(config("megatron", mode="gradient", noise_samples=4))
    assert validate_oar_setup(config("megatron", mode="gradient", noise_samples=1)).noise_samples == 1
    # FSDP runs K draws; OAR-P ignores the key (like noise_std and seed), on either engine
    assert validate_oar_setup(config("fsdp2", mode="gradient", noise_samples=4)).noise_samples == 4
    assert validate_oar_setup(config("megatron", mode="perturbation", noise_samples=4)).mode == "perturbation"
