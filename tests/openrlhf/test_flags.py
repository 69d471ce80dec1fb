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
                                          ({"base_estimator": "rloo"}, "--oar.base_estimator")])
def test_bad_oar_values_name_the_flag(values, named):
    with pytest.raises(OpenRLHFArgsError, match=named.replace(".", r"\.")):
        oar_config(values)
