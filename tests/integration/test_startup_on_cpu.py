"""Start-up checks (oar_verl.integration.startup, and OpenRLHF's oar_verl.openrlhf.checks: both run
oar_verl.core.checks.startup.startup_checks) on a minimal config: what each engine refuses, named by key."""

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
    # attribution's recompute is the engine's own there: forcing it would be a silent no-op
    with pytest.raises(OARSetupError, match=r"algorithm\.oar\.recompute=never: the Megatron engine recomputes as "
                                            r"its own settings say .* keep auto"):
        validate_oar_setup(config("megatron", mode="fisher", recompute="never"))
    assert validate_oar_setup(config("megatron", mode="fisher", recompute="auto")).recompute == "auto"


def test_megatron_runs_the_default_on_dense_models_and_refuses_it_on_experts(tmp_path):
    """conservative (the default) has Megatron rules for dense layers: a dense model's config.json (or none) passes,
    a mixture of experts is refused before Ray starts, naming the key and what to set."""
    import json

    assert validate_oar_setup(config("megatron")).mode == "conservative"
    for name, model in (("dense", {"model_type": "qwen2"}), ("moe", {"model_type": "qwen3_moe", "num_experts": 8})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(model))
    dense, moe = config("megatron"), config("megatron")
    dense.actor_rollout_ref.model.path = str(tmp_path / "dense")
    moe.actor_rollout_ref.model.path = str(tmp_path / "moe")
    assert validate_oar_setup(dense).mode == "conservative"
    with pytest.raises(OARSetupError, match=r"algorithm\.oar\.mode=conservative \(the key's default\) on the Megatron "
                                            r"engine: .* mixture of 8 experts\); set algorithm\.oar\.mode to one of"):
        validate_oar_setup(moe)
    moe.algorithm.oar.mode = "fisher"
    assert validate_oar_setup(moe).mode == "fisher"


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_refuses_the_default_on_a_model_its_rules_do_not_cover(tmp_path, strategy):
    """On FSDP the Hugging Face rules must cover the policy's modules (built on the meta device from config.json before
    Ray starts): a mixture of experts, a fused q/k/v attention are refused naming the model type and fisher; a dense
    Qwen2 passes; the Megatron engine's own rules are not judged by the Hugging Face modules (Phi-3's fused q/k/v is
    Megatron's own layout)."""
    from devtools.family_matrix import tiny_config
    from oar_verl.core.config import OARConfigError

    for model_type in ("qwen2", "qwen3_moe", "phi3"):
        tiny_config(model_type).save_pretrained(tmp_path / model_type)
    dense, moe, phi3 = (config(strategy) for _ in range(3))
    dense.actor_rollout_ref.model.path = str(tmp_path / "qwen2")
    moe.actor_rollout_ref.model.path = str(tmp_path / "qwen3_moe")
    phi3.actor_rollout_ref.model.path = str(tmp_path / "phi3")
    assert validate_oar_setup(dense).mode == "conservative"
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mode=conservative \(the key's default\) on "
                                             r"model_type=qwen3_moe: .* mixture of 4 experts.*set algorithm\.oar\.mode "
                                             r"to one of .*fisher"):
        validate_oar_setup(moe)
    with pytest.raises(OARConfigError, match=r"model_type=phi3: .*attention without separate q/k/v projections"):
        validate_oar_setup(phi3)
    phi3.algorithm.oar.mode = "fisher"
    assert validate_oar_setup(phi3).mode == "fisher"
    on_megatron = config("megatron")
    on_megatron.actor_rollout_ref.model.path = str(tmp_path / "phi3")
    assert validate_oar_setup(on_megatron).mode == "conservative"


def test_fused_kernels_are_refused_on_every_engine():
    """verl's fused forward hands back log-probs without logits, which every mode's probe reads."""
    for strategy in ("fsdp", "fsdp2", "megatron"):
        bad = config(strategy, mode="gradient")
        bad.actor_rollout_ref.model.use_fused_kernels = True
        with pytest.raises(OARSetupError, match=r"actor_rollout_ref\.model\.use_fused_kernels=True: .* without "
                                                "logits"):
            validate_oar_setup(bad)


def test_an_unsafe_mask_token_of_the_model_dir_is_refused(tmp_path):
    """mask=pad / mask=token: the model's tokenizer and generation config are read at start-up (docs/method.md §3)."""
    from transformers import GenerationConfig

    from oar_verl.core.config import OARConfigError
    from oar_verl.quickstart.tokenizers import train_tiny_bpe

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
    from oar_verl.openrlhf.checks import OpenRLHFArgsError, startup_check_flags

    args = SimpleNamespace(actor=SimpleNamespace(model_name_or_path=str(tmp_path)))
    with pytest.raises(OpenRLHFArgsError, match=r"--oar\.mask=pad: the mask token .*--oar\.mask=mean\|zero\|resample"):
        startup_check_flags(args, OARConfig.from_mapping({"mode": "perturbation", "mask": "pad"}, prefix="--oar"))
    assert startup_check_flags(args, OARConfig.from_mapping({"mode": "perturbation"}, prefix="--oar")) == []
    # fisher cannot take resample: the one check names the flags, and offers what fisher takes
    with pytest.raises(OpenRLHFArgsError, match=r"--oar\.mask=resample is not allowed with --oar\.mode=fisher .*"
                                                r"--oar\.mask=mean\|zero\|pad\|token"):
        startup_check_flags(args, OARConfig.from_mapping({"mode": "fisher", "mask": "resample"}, prefix="--oar"))


@pytest.mark.parametrize("response, warned", [(1024, True), (256, False)])
def test_gradient_attribution_past_a_sliding_window_is_warned_of(tmp_path, caplog, response, warned):
    """A gradient method on a local sliding-window model past its window: warned (not refused) by verl's start-up
    and OpenRLHF's entry point (docs/performance.md)."""
    import logging
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig

    from oar_verl.core.config import OARConfig
    from oar_verl.openrlhf.checks import startup_check_flags

    gemma = Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=300, sliding_window=512)
    gemma.save_pretrained(str(tmp_path))
    config = OmegaConf.create({"algorithm": {"adv_estimator": "oar", "oar": {"mode": "gradient"}},
                               "actor_rollout_ref": {"actor": {"strategy": "fsdp"}, "model": {"path": str(tmp_path)}},
                               "data": {"max_prompt_length": 128, "max_response_length": response}, "trainer": {}})
    with caplog.at_level(logging.WARNING, logger="oar_verl.core.checks.sliding_window"):
        assert validate_oar_setup(config).mode == "gradient"  # a warning, not a refusal
    assert ("algorithm.oar.mode=gradient on a model with sliding-window attention" in caplog.text) is warned
    caplog.clear()
    args = SimpleNamespace(actor=SimpleNamespace(model_name_or_path=str(tmp_path)),
                           data=SimpleNamespace(max_len=128 + response))
    with caplog.at_level(logging.WARNING, logger="oar_verl.core.checks.sliding_window"):
        warnings = startup_check_flags(args, OARConfig.from_mapping({"mode": "fisher"}, prefix="--oar"))
    assert len(warnings) == warned
    if warned:
        msg = warnings[0]
        assert "--oar.mode=fisher" in caplog.text and "--oar.mode=perturbation" in caplog.text
        assert "fidelity_report" in msg and "fidelity_every" not in msg  # OpenRLHF has no in-step fidelity


def test_a_bad_name_fails_at_start_up_naming_the_key():
    """Names are checked against the registries by the one start-up check, before any engine setting is read."""
    from oar_verl.core.config import OARConfigError

    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mode='sideways' is not allowed; choose one of: "
                                             r"conservative, fisher, gradient, path, perturbation"):
        validate_oar_setup(config("fsdp", mode="sideways"))
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.perturbation='fast' is not allowed"):
        validate_oar_setup(config("dtensor_magic", mode="perturbation", perturbation="fast"))


@pytest.mark.parametrize("has_value_head", [False, True])
def test_a_trl_without_the_value_head_verl_patches_is_refused_on_fsdp(tmp_path, monkeypatch, has_value_head):
    """verl 0.9.1's FSDP engine imports TRL's AutoModelForCausalLMWithValueHead whenever TRL is importable; TRL 1.16
    (PPO removed) has none, and every actor then failed in its Ray worker. A TRL package on the path without that
    class is refused in the driver, naming the remedy; one with it (older TRL) passes; Megatron is not affected."""
    import sys

    package = tmp_path / "trl"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "9.9.9"\n' +
                                         ("AutoModelForCausalLMWithValueHead = object\n" if has_value_head else ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        if has_value_head:
            assert validate_oar_setup(config("fsdp2")).mode == "conservative"
        else:
            with pytest.raises(OARSetupError,
                               match=r"trl 9\.9\.9 is installed in verl's environment: .*pip uninstall trl"):
                validate_oar_setup(config("fsdp2"))
        assert validate_oar_setup(config("megatron")).mode == "conservative"
    finally:  # the stand-in imported here must not outlive the test (later start-up checks would find it)
        for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
            del sys.modules[name]
