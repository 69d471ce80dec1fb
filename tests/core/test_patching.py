"""Attributes patched for a block and restored exactly (oar_verl.core.backends.patching): what an instance held
before (a kernel Liger bound there, a method verl bound on a worker group) is what it holds after; what was not there
is gone again; on error too."""

from __future__ import annotations

import types

import pytest
import torch

from oar_verl.core.backends.patching import patched_attributes


def test_an_instance_attribute_is_put_back_and_an_absent_one_removed():
    norm = torch.nn.RMSNorm(4)
    bound = types.MethodType(lambda self, x: x * 2, norm)
    norm.forward = bound
    linear = torch.nn.Linear(2, 2)
    with patched_attributes(norm, forward=lambda x: x), patched_attributes(linear, forward=lambda x: x):
        assert norm(torch.ones(4)).sum() == 4 and torch.equal(linear(torch.ones(2)), torch.ones(2))
    assert norm.__dict__["forward"] is bound  # the very object, not deleted
    assert "forward" not in linear.__dict__  # the class's forward shows through again


def test_nested_patches_of_one_name_restore_in_order_and_errors_restore_too():
    owner = types.SimpleNamespace(step="verl's")
    with pytest.raises(RuntimeError, match="boom"):
        with patched_attributes(owner, step="outer"):
            with patched_attributes(owner, step="inner", extra=1):
                assert (owner.step, owner.extra) == ("inner", 1)
                raise RuntimeError("boom")
    assert owner.step == "verl's" and not hasattr(owner, "extra")


def test_a_module_global_is_restored():
    import oar_verl.core.backends.rules as rules

    original = rules.linear_rule
    with patched_attributes(rules, linear_rule=None):
        assert rules.linear_rule is None
    assert rules.linear_rule is original
