"""The entry point's own flag handling (no OpenRLHF needed: runs in the main environment)."""

from __future__ import annotations

import pytest

from oar_verl.openrlhf.train_ppo_ray import OpenRLHFArgsError, oar_config, split_oar_flags


def test_split_oar_flags_both_forms_and_json_values():
    oar, rest, dry = split_oar_flags(["--oar.mode=perturbation", "--actor.model_name_or_path", "m", "--oar.tau", "0.3",
                                      "--oar.answer_patterns=[\"boxed\"]", "--oar.prefix_cache=false", "--oar.dry_run",
                                      "--algo.kl.use_loss"])
    assert oar == {"mode": "perturbation", "tau": 0.3, "answer_patterns": ["boxed"], "prefix_cache": False}
    assert rest == ["--actor.model_name_or_path", "m", "--algo.kl.use_loss"] and dry
    cfg = oar_config(oar)
    assert (cfg.mode, cfg.tau, cfg.answer_patterns, cfg.prefix_cache) == ("perturbation", 0.3, ("boxed",), False)


def test_flag_without_value_is_refused():
    with pytest.raises(OpenRLHFArgsError, match="--oar.tau needs a value"):
        split_oar_flags(["--oar.tau", "--algo.kl.use_loss"])


@pytest.mark.parametrize("values,named", [({"tau": 1.5}, "--oar.tau"), ({"modee": "gradient"}, "--oar.modee"),
                                          ({"dump_every": 3}, "--oar.dump_every"),
                                          ({"base_estimator": "rloo"}, "--oar.base_estimator"),
                                          ({"shared_forward": "yes"}, "--oar.shared_forward"),
                                          ({"recompute": "sometimes"}, "--oar.recompute")])
def test_bad_oar_values_name_the_flag(values, named):
    with pytest.raises(OpenRLHFArgsError, match=named.replace(".", r"\.")):
        oar_config(values)


def test_version_outside_the_tested_release_is_refused_naming_both():
    from oar_verl.openrlhf.checks import TESTED_OPENRLHF, OpenRLHFVersionError, check_openrlhf_version

    assert check_openrlhf_version(TESTED_OPENRLHF, allow_untested=False) == TESTED_OPENRLHF
    with pytest.raises(OpenRLHFVersionError, match=r"OpenRLHF 0\.12\.0 is installed.*tested with OpenRLHF 0\.11\.2"):
        check_openrlhf_version("0.12.0", allow_untested=False)
    with pytest.warns(UserWarning, match="running anyway"):
        assert check_openrlhf_version("0.12.0", allow_untested=True) == "0.12.0"


def test_gspo_is_refused_with_the_reason():
    from types import SimpleNamespace

    from oar_verl.openrlhf.checks import check_policy_loss

    check_policy_loss(SimpleNamespace(actor=SimpleNamespace(policy_loss_type="ppo")))
    with pytest.raises(OpenRLHFArgsError, match=r"--actor\.policy_loss_type=gspo.*one ratio per sequence"):
        check_policy_loss(SimpleNamespace(actor=SimpleNamespace(policy_loss_type="gspo")))


def test_gspo_gradient_is_blind_to_mass_preserving_weights():
    """The reason the refusal gives, checked on OpenRLHF 0.11.2's GSPO formula (models/loss.py, copied in the
    docstring of INVARIANT_LOSSES): the same gradient with and without token weights that keep Σ_t A_t."""
    import torch

    torch.manual_seed(0)
    logp = torch.randn(3, 6, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(3, 6)
    mask = torch.ones(3, 6)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 6)
    w = torch.rand(3, 6) + 0.1
    w = w / w.mean(-1, keepdim=True)  # mass-preserving weights: mean 1 per row

    def grad(a):
        ratio = ((logp - old) * mask).sum(-1) / mask.sum(-1)
        ratio = ratio.exp().unsqueeze(-1) * mask
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        loss = ((loss * mask).sum(-1) / mask.sum(-1)).mean()  # GSPO: per-sample mean
        (g,) = torch.autograd.grad(loss, logp)
        return g

    assert torch.allclose(grad(adv), grad(adv * w), atol=1e-6)
    # a token-level PPO ratio is not blind to them
    ratio = (logp - old).exp()
    g1, g2 = (torch.autograd.grad((-(ratio * a)).mean(), logp, retain_graph=True)[0] for a in (adv, adv * w))
    assert not torch.allclose(g1, g2, atol=1e-3)


def test_oar_flags_in_help():
    import argparse

    from oar_verl.openrlhf.train_ppo_ray import add_oar_arguments

    parser = argparse.ArgumentParser()
    add_oar_arguments(parser)
    add_oar_arguments(parser)  # idempotent
    text = parser.format_help()
    assert "OAR (oar_verl)" in text and "--oar.mode VALUE" in text and "--oar.dry_run" in text
    assert "--oar.dump_every" not in text  # not available with OpenRLHF
    assert "--oar.fidelity_every" in text and "--oar.auto_every" in text  # the in-step metric and mode=auto are
    assert vars(parser.parse_args([])) == {}  # help only: nothing lands on OpenRLHF's args


def test_shared_forward_either_way_and_recompute_follows_the_actor():
    """The experience maker's forward carries fisher / conservative by default (oar_verl.openrlhf.shared), or not;
    ``recompute`` forces or follows the actor's checkpointing (its DeepSpeed memory is not known to the adapter)."""
    from oar_verl.core.backends.memory import fixed_recompute

    assert oar_config({}).shared_forward and not oar_config({"shared_forward": False}).shared_forward
    assert oar_config({"shared_forward": False, "recompute": "never"}).recompute == "never"
    assert [fixed_recompute(s, c) for s in ("auto", "always", "never") for c in (True, False)] == [
        True, False, True, True, False, False]
