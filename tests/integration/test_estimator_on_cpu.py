"""The `oar` estimator in verl's registry: GRPO equivalence, helpful errors, invariants (no Ray, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import verl  # noqa: F401  loads the verl.plugins entry point
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.protocol import DataProto

from oar_verl.integration import handoff
from oar_verl.integration.estimator import OARSetupError, compute_oar, compute_oar_advantage


def algo(**oar):
    return OmegaConf.create({"adv_estimator": "oar", "norm_adv_by_std_in_grpo": True, "oar": oar})


def batch(B=6, T=7, group=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    scores = torch.randint(0, 2, (B,), generator=g).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lens - 1] = scores
    index = np.array([f"p{i // group}" for i in range(B)], dtype=object)
    return rewards, mask, index


def test_registered_through_entry_point():
    assert core_algos.get_adv_estimator_fn("oar") is compute_oar_advantage


def test_uniform_importance_equals_grpo():
    rewards, mask, index = batch()
    grpo, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    adv, ret = compute_oar_advantage(rewards, mask, index, algo(), token_importance=torch.ones_like(mask))
    torch.testing.assert_close(adv, grpo)
    torch.testing.assert_close(ret, grpo)


def test_missing_importance_explains_how_to_run():
    rewards, mask, index = batch()
    with pytest.raises(OARSetupError, match="python -m oar_verl.main"):
        compute_oar_advantage(rewards, mask, index, algo())


def test_stock_verl_compute_advantage_gets_importance_through_the_handoff():
    """verl's own compute_advantage (legacy path) reaches the estimator; the handoff supplies the importance."""
    rewards, mask, index = batch(seed=3)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": index})
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(0)) * mask
    handoff.put(handoff.PendingImportance(imp, mask.bool(), torch.ones(len(mask), dtype=torch.bool), mask))
    out = compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    expect = compute_oar(rewards, mask, index, algo(), imp, mask.bool())
    torch.testing.assert_close(out.batch["advantages"], expect.advantages)
    assert handoff.pop_result() is not None
    # a mismatched batch is refused instead of pairing the wrong rows
    handoff.put(handoff.PendingImportance(imp, mask.bool(), torch.ones(len(mask), dtype=torch.bool), mask[:, :-1]))
    with pytest.raises(RuntimeError, match="not the batch"):
        compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())


@pytest.mark.parametrize("apply_to", ["all", "negative", "positive"])
def test_apply_to_and_zero_advantage_rows(apply_to):
    rewards, mask, index = batch(B=9, seed=5)
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(1))
    out = compute_oar(rewards, mask, index, algo(apply_to=apply_to), imp)
    seq = (out.base_advantages * mask).sum(-1)
    keep = {"all": seq == 0, "negative": seq >= 0, "positive": seq <= 0}[apply_to]
    torch.testing.assert_close(out.advantages[keep], out.base_advantages[keep])


def test_other_base_estimator_and_unknown_name():
    rewards, mask, index = batch()
    out = compute_oar(rewards, mask, index, algo(base_estimator="rloo"), torch.ones_like(mask))
    rloo, _ = core_algos.get_adv_estimator_fn("rloo")(token_level_rewards=rewards, response_mask=mask, index=index,
                                                       config=algo())
    torch.testing.assert_close(out.advantages, rloo)
    with pytest.raises(OARSetupError, match="base_estimator='nope' is not a registered"):
        compute_oar(rewards, mask, index, algo(base_estimator="nope"), torch.ones_like(mask))


def test_shape_mismatch_is_a_clear_error():
    rewards, mask, index = batch()
    with pytest.raises(ValueError, match="token_importance has shape"):
        compute_oar(rewards, mask, index, algo(), torch.ones(3, 3))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.9), st.floats(0.0, 4.0))
def test_mass_preserved_and_zero_rows_untouched(seed, tau, beta):
    rewards, mask, index = batch(B=9, T=8, seed=seed)
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(seed)) * 5
    out = compute_oar(rewards, mask, index, algo(tau=tau, beta=beta), imp)
    base, adv = out.base_advantages, out.advantages
    torch.testing.assert_close((adv * mask).sum(-1), (base * mask).sum(-1), rtol=1e-4, atol=1e-4)
    zero = (base * mask).abs().sum(-1) == 0
    assert torch.equal(adv[zero], base[zero])
    assert (torch.sign(adv) == torch.sign(base)).all()  # w > 0: no token flips its advantage's sign
