"""The `oar` estimator in verl's registry: GRPO equivalence, helpful errors, invariants (no Ray, no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


# Runs in a fresh interpreter that imports verl and nothing of ours: `oar` can only be registered there by verl loading
# the `verl.plugins` entry point that pyproject.toml declares.
_REGISTRY_PROBE = """
import json, sys
import verl
from verl.trainer.ppo import core_algos
try:
    fn = core_algos.get_adv_estimator_fn("oar")
    found = f"{fn.__module__}.{fn.__qualname__}"
except ValueError:
    found = None
print(json.dumps({"oar": found, "plugin_loaded": "oar_verl.integration.plugin" in sys.modules}))
"""


def _probe_registry(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_registered_through_entry_point():
    """A process that imports only verl finds `oar` (the entry point loaded our plugin), and with verl's own switch
    for entry-point discovery off the same probe does not (so the probe can fail when the entry point is missing)."""
    with_plugins = _probe_registry(VERL_USE_EXTERNAL_PLUGINS="auto", VERL_USE_EXTERNAL_MODULES="")
    assert with_plugins == {"oar": f"{compute_oar_advantage.__module__}.{compute_oar_advantage.__qualname__}",
                            "plugin_loaded": True}
    without_plugins = _probe_registry(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="")
    assert without_plugins == {"oar": None, "plugin_loaded": False}


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
    """verl's own compute_advantage (legacy path) reaches the estimator inside a scope; the scope supplies the
    importance and receives the result."""
    rewards, mask, index = batch(seed=3)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": index})
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(0)) * mask
    attributed = torch.ones(len(mask), dtype=torch.bool)
    with handoff.scope(handoff.EstimatorInputs(imp, mask.bool(), attributed, mask)) as opened:
        out = compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    expect = compute_oar(rewards, mask, index, algo(), imp, mask.bool())
    torch.testing.assert_close(out.batch["advantages"], expect.advantages)
    assert opened.taken and opened.result is not None
    torch.testing.assert_close(opened.result.advantages, expect.advantages)
    assert handoff.current() is None  # closed on exit
    # outside a scope the estimator explains how to run OAR
    with pytest.raises(OARSetupError, match="python -m oar_verl.main"):
        compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())


def test_rows_without_reasoning_keep_their_advantage_and_are_counted():
    """The worker gives a row without an answer span no reasoning token (docs/method.md §2): through verl's own
    compute_advantage that row keeps its base advantage bit for bit, the others are reshaped (Σw = R), and the
    result's ``oar/*`` metrics count it (oar/no_reasoning_seq_frac, the step's report reads them)."""
    rewards, mask, index = batch(B=9, T=7, seed=3)
    rewards[:, :] = 0.0
    lens = mask.sum(-1).long()
    rewards[torch.arange(9), lens - 1] = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1, 1])  # group 3 agrees: A = 0
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": index})
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(0)) * mask
    reasoning = mask.bool().clone()
    no_span = torch.zeros(9, dtype=torch.bool)
    no_span[[1, 3]] = True  # rows 1 (A < 0) and 3 (A > 0)
    reasoning[no_span] = False
    attributed = torch.ones(9, dtype=torch.bool)
    with handoff.scope(handoff.EstimatorInputs(imp, reasoning, attributed, mask)) as opened:
        out = compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    base = opened.result.base_advantages
    adv = out.batch["advantages"]
    assert torch.equal(adv[no_span], base[no_span]) and (base[no_span] != 0).any(-1).all()
    assert torch.equal(adv[6:], base[6:]) and (base[6:] == 0).all()  # zero advantage: untouched
    torch.testing.assert_close((adv * mask).sum(-1), (base * mask).sum(-1), rtol=1e-5, atol=1e-5)
    assert opened.result.token_weights.reshaped.any(-1).tolist() == [True, False, True, False, True, True] + [False] * 3
    m = opened.result.metrics()
    assert m["oar/no_reasoning_seq_frac"] == 2 / 9 and m["oar/reshaped_seq_frac"] == 4 / 9


def test_handoff_refuses_another_batch_and_nesting_and_closes_on_errors():
    rewards, mask, index = batch(seed=4)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": index})
    ones = torch.ones(len(mask), dtype=torch.bool)
    wider = torch.nn.functional.pad(mask, (0, 1), value=1.0)  # another batch: a different shape
    with pytest.raises(RuntimeError, match="not the batch"):
        with handoff.scope(handoff.EstimatorInputs(torch.zeros_like(wider), wider.bool(), ones, wider)):
            compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    assert handoff.current() is None
    shorter = mask.clone()
    shorter[:, 0] = 0  # tokens the estimator sees that the importance was not computed for
    with pytest.raises(RuntimeError, match="not the batch"):
        with handoff.scope(handoff.EstimatorInputs(torch.zeros_like(mask), mask.bool(), ones, shorter)):
            compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    with handoff.scope(handoff.EstimatorInputs(torch.zeros_like(mask), mask.bool(), ones, mask)):
        with pytest.raises(RuntimeError, match="do not nest"):
            with handoff.scope(handoff.EstimatorInputs(torch.zeros_like(mask), mask.bool(), ones, mask)):
                pass


def test_rejected_tokens_still_pair_rows():
    """verl's rollout rejection sampling may mask tokens out before the advantage step: a subset of the attributed
    response mask is the same batch."""
    rewards, mask, index = batch(seed=6)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask.clone()},
                               non_tensors={"uid": index})
    data.batch["response_mask"][1] = 0  # a rejected sequence
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(2)) * mask
    ones = torch.ones(len(mask), dtype=torch.bool)
    with handoff.scope(handoff.EstimatorInputs(imp, mask.bool(), ones, mask)) as opened:
        out = compute_advantage(data, adv_estimator="oar", num_repeat=3, config=algo())
    assert opened.taken and torch.equal(out.batch["advantages"][1], torch.zeros_like(mask[1]))


def test_the_step_base_advantage_is_used_only_for_its_own_rewards():
    rewards, mask, index = batch(seed=8)
    imp = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(5)) * mask
    ones = torch.ones(len(mask), dtype=torch.bool)
    base = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    inputs = handoff.EstimatorInputs(imp, mask.bool(), ones, mask, rewards, base[0] * 7, base[1] * 7)  # marked
    with handoff.scope(inputs):
        adv, _ = compute_oar_advantage(rewards, mask, index, algo())
    expect = compute_oar(rewards, mask, index, algo(), imp, mask.bool(), base=(base[0] * 7, base[1] * 7))
    torch.testing.assert_close(adv, expect.advantages)  # reused: no second base-estimator call
    with handoff.scope(inputs):  # other rewards (e.g. a KL penalty added by verl): computed afresh
        adv, _ = compute_oar_advantage(rewards * 0.5, mask, index, algo())
    torch.testing.assert_close(adv, compute_oar(rewards * 0.5, mask, index, algo(), imp, mask.bool()).advantages)


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
