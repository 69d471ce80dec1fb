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


def test_an_unsafe_mask_token_of_the_model_dir_is_refused(tmp_path):
    """mask=pad / mask=token: the model's tokenizer and generation config are read at start-up (docs/method.md §3)."""
    from transformers import GenerationConfig

    from oar_verl.core.config import OARConfigError
    from oar_verl.cpu.tokenizers import train_tiny_bpe

    tokenizer = train_tiny_bpe(["the answer is 42."] * 4, vocab_size=280)

    def config(**oar):
        return OmegaConf.create({"algorithm": {"adv_estimator": "oar", "oar": oar},
                                 "actor_rollout_ref": {"actor": {"strategy": "fsdp"}, "model": {"path": str(tmp_path)}},
                                 "trainer": {}})

    tokenizer.save_pretrained(str(tmp_path))
    assert validate_oar_setup(config(mode="perturbation", mask="pad")).mask == "pad"  # a dedicated pad
    # the generation config lists the pad among its eos ids (as Qwen2.5-Instruct's does)
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id]).save_pretrained(str(tmp_path))
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=pad: the mask token .*end-of-sequence"):
        validate_oar_setup(config(mode="perturbation", mask="pad"))
    assert validate_oar_setup(config(mode="perturbation")).mask == "mean"  # the default inserts no token
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=resample is not allowed with "
                                             r"algorithm\.oar\.mode=fisher"):
        validate_oar_setup(config(mode="fisher", mask="resample"))
    # OpenRLHF's entry point reads the policy's directory the same way, naming its flag
    from types import SimpleNamespace

    from oar_verl.core.config import OARConfig
    from oar_verl.openrlhf.checks import OpenRLHFArgsError, check_mask_token_flags

    args = SimpleNamespace(actor=SimpleNamespace(model_name_or_path=str(tmp_path)))
    with pytest.raises(OpenRLHFArgsError, match=r"--oar\.mask=pad: the mask token .*--oar\.mask=mean\|zero\|resample"):
        check_mask_token_flags(args, OARConfig.from_mapping({"mode": "perturbation", "mask": "pad"}, prefix="--oar"))
    check_mask_token_flags(args, OARConfig.from_mapping({"mode": "perturbation"}, prefix="--oar"))
