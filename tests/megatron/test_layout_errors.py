"""Megatron layouts OAR refuses are named in the error (no megatron-core needed)."""

from __future__ import annotations

from oar_verl.integration.megatron import megatron_layout_error


def test_layout_errors_name_the_setting():
    assert megatron_layout_error({"context_parallel_size": 1}) is None
    assert "context_parallel_size=2" in megatron_layout_error({"context_parallel_size": 2})
    assert "virtual_pipeline_model_parallel_size=2" in megatron_layout_error(
        {"virtual_pipeline_model_parallel_size": 2})
    assert "use_fused_kernels" in megatron_layout_error({"use_fused_kernels": True})
    assert "dynamic_context_parallel" in megatron_layout_error({"dynamic_context_parallel": True})
    assert "mtp" in megatron_layout_error({}, mtp_enabled=True)


def test_conservative_is_refused_at_startup_on_a_mixture_of_experts():
    """The rules know dense layers: on Megatron a propagation-rules method passes start-up on a dense model (or an
    unread config) and is refused on a mixture of experts, naming the key and what to set."""
    from oar_verl.core.config import OARConfig
    from oar_verl.integration.megatron.layout_checks import megatron_mode_error

    dense, moe = {"model_type": "qwen2", "hidden_size": 64}, {"model_type": "qwen3_moe", "num_experts": 8}
    assert megatron_mode_error({"mode": "conservative"}) is None
    assert megatron_mode_error({"mode": "conservative"}, dense) is None
    assert megatron_mode_error({"mode": "gradient"}, moe) is None
    assert "mixture of 8 experts" in megatron_mode_error({"mode": "conservative"}, moe)
    assert "(the key's default)" in megatron_mode_error({"mode": "conservative"}, moe)
    assert megatron_mode_error({"mode": "auto", "auto_candidates": ["fisher", "conservative"]}, moe) is not None
    assert megatron_mode_error({"mode": "auto", "auto_candidates": ["fisher"], "auto_default": "fisher"}, moe) is None
    # the mode auto attributes with before its first decision is checked too
    assert "auto_default" in megatron_mode_error({"mode": "auto", "auto_candidates": ["fisher"],
                                                  "auto_default": "conservative"}, {"n_routed_experts": 64})
    assert "set algorithm.oar.mode to one of" in megatron_mode_error(OARConfig().to_dict(), moe)
    assert "auto_candidates=[fisher,gradient]" in megatron_mode_error({**OARConfig().to_dict(), "mode": "auto"},
                                                                      {"num_local_experts": 8})
