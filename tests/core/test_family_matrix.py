"""The model-family matrix (docs/method.md §13; devtools/family_matrix.py): every decoder family verl trains through
FSDP × every shipped mode, on tiny models from transformers' own config classes. Each cell either runs correctly — the
forward's values bitwise unchanged under the conservative rules, relevance conserved in float64, the shared read
(:mod:`oar_verl.core.backends.shared`) equal to the method's own passes — or is refused at start-up, naming the model
type, the key and the modes that work there. Never a silent half-rule."""

from __future__ import annotations

import pytest
import torch

from devtools import family_matrix
from devtools.family_matrix import FAMILIES, tiny_model
from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.families import post_head_transform
from oar_verl.core.backends.rules import conservative_rules, rules_error
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.checks.model_rules import model_rules_error
from oar_verl.core.checks.startup import startup_checks
from oar_verl.core.config import OARConfigError
from oar_verl.core.methods.attribution import shared_attribution
from oar_helpers import relevance_and_target

# the families the conservative rules cover (the matrix's ✓ cells); every other one is refused at start-up
RULED = {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "granite", "olmo2", "smollm3"}
OTHER_MODES = ("fisher", "gradient", "perturbation", "path")


@pytest.fixture(scope="module")
def models():
    cache: dict[str, torch.nn.Module] = {}

    def get(model_type: str):
        if model_type not in cache:
            model = tiny_model(model_type)
            for p in model.parameters():
                p.requires_grad_(False)
            cache[model_type] = model
        return cache[model_type]

    return get


def rows(seed: int = 3):
    """Five rows of mixed lengths and probes (every row with reasoning and an answer span)."""
    from conftest import random_batch

    batch = random_batch(B=6, P=4, T=12, seed=seed)
    keep = batch[4].any(-1) & batch[5].any(-1)
    picked = tuple(t[keep][:5] for t in batch)
    kinds = torch.tensor([ProbeKind.AS_MEAN, ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN,
                          ProbeKind.LT_LOGITS][: picked[0].shape[0]])
    return build_attribution_batch(*picked, kinds)


def tolerance(model) -> dict:
    return dict(rtol=1e-9, atol=1e-12) if next(model.parameters()).dtype == torch.float64 else dict(rtol=2e-4,
                                                                                                        atol=1e-6)


def test_the_docs_table_is_the_matrix():
    assert family_matrix.main(["--check"]) == 0, f"run {family_matrix.COMMAND}"


def test_the_matrix_names_every_family_the_issue_asks_for():
    assert {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3", "granite",
            "deepseek_v3", "gpt_oss"} <= set(FAMILIES)
    assert RULED < set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_rules_cover_the_family_or_it_is_refused(models, model_type):
    assert (rules_error(models(model_type)) is None) == (model_type in RULED)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_the_rules_do_not_cover_is_refused_at_startup(models, model_type, tmp_path):
    """From the model directory's config.json alone (the driver, before Ray): naming the model type, the key and the
    modes that work; with ``mode=auto`` listing conservative likewise; a mode without the rules passes."""
    family_matrix.tiny_config(model_type).save_pretrained(tmp_path)
    error = model_rules_error(OARConfig(), str(tmp_path))
    if model_type in RULED:
        assert error is None
        return
    assert f"model_type={model_type}" in error and "algorithm.oar.mode=conservative (the key's default)" in error
    assert "set algorithm.oar.mode to one of" in error and "fisher" in error
    with pytest.raises(OARConfigError, match=f"model_type={model_type}"):
        startup_checks(OARConfig(), model_path=str(tmp_path))
    auto = OARConfig(mode="auto", auto_candidates=("fisher", "conservative"), auto_default="fisher")
    assert "auto_candidates" in model_rules_error(auto, str(tmp_path))
    assert model_rules_error(OARConfig(mode="fisher"), str(tmp_path)) is None


@pytest.mark.parametrize("model_type", sorted(RULED))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_under_the_rules_values_are_bitwise_and_relevance_is_conserved(models, model_type, attention):
    """The forward's logits bitwise those without the rules; under ``attention_rule=values`` (the default) Σ relevance +
    the biases' share = z_a − E_p[z] of the returned (post-head-transformed) logits, float64; ``uniform`` runs, or is
    refused where the attention soft-caps its scores."""
    model = models(model_type)
    model.set_attn_implementation(attention)
    try:
        ids = torch.randint(3, family_matrix.VOCAB, (14,), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            before = model(ids[None]).logits
            with conservative_rules(model):
                inside = model(ids[None]).logits
        assert torch.equal(inside, before)
        for rule in ("values", "uniform"):
            if rules_error(model, rule) is not None:  # Gemma 2's soft-capped scores under uniform: refused
                assert model_type == "gemma2" and rule == "uniform"
                with pytest.raises(ValueError, match="attn_logit_softcapping"), conservative_rules(model, rule):
                    pass
                continue
            relevance, share, target = relevance_and_target(model, ids, 11, int(ids[12]), rule)
            assert abs(relevance) > 1e-6
            if rule == "values":  # uniform splits the softmax by gradient × input: not conservative by design (§13)
                assert relevance + share == pytest.approx(target, rel=1e-6, abs=1e-9)
    finally:
        model.set_attn_implementation("sdpa" if model_type != "gpt_oss" else "eager")


def _shared_scores(model, batch, cfg, **inputs):
    """The method read from the caller's padded forwards (two rows a forward, no grad, as verl's pass runs)."""
    shared = shared_attribution(model, batch, cfg, lambda tokens: True, **inputs)
    with torch.no_grad():
        for r in torch.arange(batch.input_ids.shape[0]).split(2):
            kw = batch.model_inputs(r)
            with shared.forward(ForwardLayout.padded(r, kw["attention_mask"], 0)):
                model(**kw, use_cache=False)
    if hasattr(shared, "result"):
        return shared.result()
    return run_attribution(module_backend(model, cfg), batch, cfg, teachers=shared.teachers(), **inputs).importance


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["conservative", *OTHER_MODES])
def test_every_mode_runs_on_the_family_and_the_shared_read_equals_its_own_passes(models, model_type, mode):
    """Every mode the matrix marks ✓: its own passes give finite scores on reasoning tokens only; where it reads the
    old-log-prob forward (conservative and fisher their scores, OAR-G its clean teachers) the read equals its own
    passes (the post-head soft-cap / scale applied: Gemma 2, Granite, Cohere)."""
    if mode == "conservative" and model_type not in RULED:
        pytest.skip("refused at start-up (test_a_family_the_rules_do_not_cover_is_refused_at_startup)")
    model = models(model_type)
    batch = rows()
    cfg = OARConfig(mode=mode, mask="token", mask_token_id=5) if mode in ("fisher", "perturbation", "path") else \
        OARConfig(mode=mode)
    inputs = dict(mask_token_id=5) if cfg.mask_token_id is not None else dict(
        seeds=torch.arange(batch.input_ids.shape[0], dtype=torch.long) * 7919 + 11)
    own = run_attribution(module_backend(model, cfg), batch, cfg, **inputs).importance
    assert bool(torch.isfinite(own).all()) and bool((own[~batch.reasoning_mask] == 0).all())
    assert int((own != 0).sum()) >= int(batch.reasoning_mask.sum()) // 2
    if mode in ("conservative", "fisher", "gradient"):
        got = _shared_scores(model, batch, cfg, **inputs)
        torch.testing.assert_close(got, own, **tolerance(model))


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere"])
def test_the_shared_read_applies_the_family_s_post_head_transform(models, model_type):
    """Without the family's transform the shared read would explain another distribution than the caller's logits: the
    transform is there and it moves the probe."""
    model = models(model_type)
    transform = post_head_transform(model.config)
    assert transform is not None
    ids = torch.randint(3, family_matrix.VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        head = model.get_output_embeddings()(model.model(ids).last_hidden_state)
        assert torch.equal(transform(head), model(ids).logits)
        assert not torch.allclose(head, model(ids).logits)
