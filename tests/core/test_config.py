"""OARConfig: presets, probe schedule, and every invalid value named with its key and allowed range (types and ranges
at construction, names and their combinations at the start-up check, oar_verl.core.checks.startup.check_config)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from oar_verl.core.checks.startup import check_config
from oar_verl.core.config import OARConfig, OARConfigError


def test_defaults_and_presets():
    cfg = OARConfig()
    assert (cfg.mode, cfg.tau, cfg.beta, cfg.floor, cfg.probe) == ("conservative", 0.4, 2.0, 0.1, "auto")
    off = OARConfig(preset="official_code")
    assert (off.tau, off.beta) == (0.25, 1.0)
    assert OARConfig(preset="official_code", tau=0.5).tau == 0.5  # explicit values win over the preset


def test_from_omegaconf_and_roundtrip():
    dc = OmegaConf.create({"mode": "perturbation", "tau": 0.3, "answer_patterns": ["gsm8k", r"Final: (?P<answer>\d+)"]})
    cfg = OARConfig.from_mapping(dc)
    assert cfg.mode == "perturbation" and cfg.answer_patterns == ("gsm8k", r"Final: (?P<answer>\d+)")
    assert OARConfig.from_mapping(cfg.to_dict()) == cfg
    assert OARConfig.from_mapping(None) == OARConfig()


def test_probe_schedule():
    cfg = OARConfig(probe_warmup_steps=3)
    assert [cfg.probe_for_step(s) for s in range(5)] == ["lt_logits"] * 3 + ["as_mean"] * 2
    assert OARConfig(probe="as_joint").probe_for_step(0) == "as_joint"


@pytest.mark.parametrize("values,message", [
    ({"mode": "grad"}, r"algorithm\.oar\.mode='grad' is not allowed; choose one of: conservative, fisher, gradient, "
                          r"path, perturbation"),
    ({"mode": 3}, r"algorithm\.oar\.mode=3 must be a name"),
    ({"probe": None}, r"algorithm\.oar\.probe=None must be a name"),
    ({"tau": 1.0}, r"algorithm\.oar\.tau=1\.0 is out of range: must satisfy 0\.0 <= tau < 1\.0"),
    ({"tau": -0.1}, r"algorithm\.oar\.tau=-0\.1 is out of range"),
    ({"tau": float("nan")}, r"algorithm\.oar\.tau=nan must be a finite number"),
    ({"tau": "0.4"}, r"algorithm\.oar\.tau='0\.4' must be a finite number"),
    ({"beta": -1}, r"algorithm\.oar\.beta=-1 is out of range: must satisfy 0\.0 <= beta"),
    ({"floor": 0.0}, r"algorithm\.oar\.floor=0\.0 is out of range: must satisfy 0\.0 < floor <= 1\.0"),
    ({"probe": "mean"}, r"algorithm\.oar\.probe='mean' is not allowed; choose one of: auto, lt_logits, as_mean, "
                        r"as_joint"),
    ({"probe_warmup_steps": -1}, r"algorithm\.oar\.probe_warmup_steps=-1 is out of range"),
    ({"probe_warmup_steps": 2.5}, r"algorithm\.oar\.probe_warmup_steps=2\.5 must be an integer"),
    ({"target": "gold"}, r"algorithm\.oar\.target='gold' is not allowed"),
    ({"noise_std": 0}, r"algorithm\.oar\.noise_std=0 is out of range: must satisfy 0\.0 < noise_std"),
    ({"noise_samples": 0}, r"algorithm\.oar\.noise_samples=0 is out of range: must be an integer >= 1"),
    ({"noise_samples": 2.0}, r"algorithm\.oar\.noise_samples=2\.0 must be an integer >= 1"),
    ({"chunk_size": 0}, r"algorithm\.oar\.chunk_size=0 is out of range"),
    ({"micro_batch_size": True}, r"algorithm\.oar\.micro_batch_size=True must be an integer"),
    ({"mask": "token", "mask_token_id": -3}, r"algorithm\.oar\.mask_token_id=-3 is out of range"),
    ({"mask": "eos"}, r"algorithm\.oar\.mask='eos' is not allowed; choose one of: mean, zero, resample, pad, token"),
    ({"mask": "token"}, r"algorithm\.oar\.mask=token needs algorithm\.oar\.mask_token_id \(a plain token id\); or "
                        r"choose algorithm\.oar\.mask=mean\|zero\|resample\|pad$"),
    ({"mask_token_id": 5}, r"algorithm\.oar\.mask_token_id=5 is used only with algorithm\.oar\.mask=token \(got "
                           r"algorithm\.oar\.mask='mean'\)"),
    ({"mask": "pad", "mask_token_id": 5}, r"algorithm\.oar\.mask_token_id=5 is used only with algorithm\.oar\.mask="
                                          r"token"),
    ({"mode": "fisher", "mask": "resample"}, r"algorithm\.oar\.mask=resample is not allowed with algorithm\.oar\."
                                             r"mode=fisher .*choose algorithm\.oar\.mask=mean\|zero\|pad\|token"),
    ({"apply_to": "wrong"}, r"algorithm\.oar\.apply_to='wrong' is not allowed; choose one of: all, negative, positive"),
    ({"attention_rule": "probabilities"}, r"algorithm\.oar\.attention_rule='probabilities' is not allowed; choose one "
                                          r"of: values, uniform"),
    ({"base_estimator": "oar"}, r"algorithm\.oar\.base_estimator cannot be 'oar'"),
    ({"signed_scores": "sign"}, r"algorithm\.oar\.signed_scores='sign' is not allowed; choose one of: clamp, "
                                r"signed, magnitude, rank"),
    ({"answer_patterns": []}, r"algorithm\.oar\.answer_patterns must be a non-empty list"),
    ({"answer_patterns": ["(unclosed"]}, r"neither a built-in pattern .* nor a usable answer regex"),
    ({"answer_patterns": [r"\d+"]}, r"needs a named group \(\?P<answer>"),
    ({"preset": "fast"}, r"algorithm\.oar\.preset='fast' is not allowed"),
    ({"mask_span": 0}, r"algorithm\.oar\.mask_span=0 is out of range"),
    ({"prefix_cache": "yes"}, r"algorithm\.oar\.prefix_cache must be true or false"),
    ({"dump_every": -1}, r"algorithm\.oar\.dump_every=-1 is out of range"),
    ({"dump_groups": 0}, r"algorithm\.oar\.dump_groups=0 is out of range"),
    ({"dump_dir": 3}, r"algorithm\.oar\.dump_dir must be a path string or null"),
    ({"perturbation": "fast"}, r"algorithm\.oar\.perturbation='fast' is not allowed; choose one of: exact, segment, "
                               r"hierarchical, auto"),
    ({"perturbation": "hierarchical", "mask_span": 4},
     r"algorithm\.oar\.mask_span=4 applies to algorithm\.oar\.perturbation=exact only"),
    ({"segment_split": "("}, r"algorithm\.oar\.segment_split='\(' is neither a built-in rule \(line, sentence\) "),
    ({"segment_split": ""}, r"algorithm\.oar\.segment_split must be line, sentence or a regex"),
    ({"segment_min_tokens": 0}, r"algorithm\.oar\.segment_min_tokens=0 is out of range"),
    ({"segment_min_tokens": 16, "segment_max_tokens": 8}, r"algorithm\.oar\.segment_max_tokens=8 is out of range: "
                                                          r"must be an integer >= 16"),
    ({"refine_share": 0.0}, r"algorithm\.oar\.refine_share=0\.0 is out of range: must satisfy 0\.0 < refine_share "
                            r"<= 1\.0"),
    ({"refine_share": 1.5}, r"algorithm\.oar\.refine_share=1\.5 is out of range"),
    ({"exact_max_tokens": -1}, r"algorithm\.oar\.exact_max_tokens=-1 is out of range"),
    ({"tua": 0.3}, r"unknown key\(s\) algorithm\.oar\.tua; allowed:"),
    ({"fisher_outcomes": -1}, r"algorithm\.oar\.fisher_outcomes=-1 is out of range"),
    ({"fisher_sketches": -1}, r"algorithm\.oar\.fisher_sketches=-1 is out of range"),
    ({"fisher_sketches": 1.5}, r"algorithm\.oar\.fisher_sketches=1\.5 must be an integer"),
    ({"fisher_outcomes": 0}, r"algorithm\.oar\.fisher_outcomes=0 needs algorithm\.oar\.fisher_sketches >= 1"),
    ({"fisher_outcomes": 0, "fisher_sketches": 0}, r"fisher_outcomes=0 needs .*fisher_sketches=0 set "
                                                   r"algorithm\.oar\.fisher_outcomes >= 1"),
])
def test_invalid_values_name_the_key(values, message):
    with pytest.raises(OARConfigError, match=message):
        check_config(OARConfig.from_mapping(values))


@pytest.mark.parametrize("values", [{"mode": "grad"}, {"probe": "mean"}, {"mask": "eos"}, {"perturbation": "fast"},
                                    {"mask": "token"}, {"mode": "fisher", "mask": "resample"},
                                    {"answer_patterns": [r"\d+"]}, {"segment_split": "("}])
def test_names_are_checked_at_start_up_not_at_construction(values):
    """A name is checked against its registry by check_config, the one start-up check every entry point runs; the
    config itself (a leaf) checks types and ranges only."""
    cfg = OARConfig.from_mapping(values)
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\."):
        check_config(cfg)


def test_the_config_is_a_leaf():
    """core/config.py imports nothing of the package but (at most) the leaf registry: the registries' facts reach the
    configuration only through the start-up check."""
    import ast
    from pathlib import Path

    from oar_verl.core import config

    tree = ast.parse(Path(config.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("oar_verl")} <= {"oar_verl.core.registry"}


def test_trainer_yaml_lists_every_key_with_its_default():
    """``oar_trainer.yaml`` declares every ``algorithm.oar.*`` key (overrides need no ``+``) with OARConfig's default:
    a key added to one and not the other fails here, not at a user's first override."""
    from pathlib import Path

    from omegaconf import OmegaConf

    yaml = Path(__file__).parents[2] / "oar_verl" / "integration" / "config" / "oar_trainer.yaml"
    declared = OmegaConf.to_container(OmegaConf.load(yaml).algorithm.oar)
    defaults = OARConfig.from_mapping({"preset": "paper"}).to_dict()
    defaults["tau"] = defaults["beta"] = None  # the YAML leaves them to the preset
    assert declared == defaults


def test_signed_scores_are_checked_at_construction():
    """``signed_scores`` (how the gate reads signed scores): the default is the measured choice, ``magnitude``
    (research/docs/evidence.md §10), shared with the gate's functions; a bad value fails when the config is built,
    naming the key and every scaling of the gate's registry."""
    from oar_verl.core.reshaping.gating import SIGNED_SCORES

    import inspect

    from oar_verl.core.reshaping.gating import normalize_scores, oar_token_weights

    assert OARConfig().signed_scores == "magnitude"
    assert {inspect.signature(f).parameters["signed"].default for f in (normalize_scores, oar_token_weights)} == {
        "magnitude"}
    for name in SIGNED_SCORES:
        assert OARConfig.from_mapping({"signed_scores": name}).signed_scores == name
    for bad in ("sign", "", None, 1):
        with pytest.raises(OARConfigError) as e:
            OARConfig.from_mapping({"signed_scores": bad})
        assert str(e.value) == (f"algorithm.oar.signed_scores={bad!r} is not allowed; choose one of: "
                                f"{', '.join(SIGNED_SCORES)}")
    with pytest.raises(OARConfigError, match=r"^--oar\.signed_scores='x' is not allowed"):  # OpenRLHF's prefix
        OARConfig.from_mapping({"signed_scores": "x"}, prefix="--oar")


def test_the_pure_sketch_is_allowed():
    cfg = OARConfig.from_mapping({"mode": "fisher", "fisher_outcomes": 0, "fisher_sketches": 8})
    assert (cfg.fisher_outcomes, cfg.fisher_sketches) == (0, 8)
    assert OARConfig().fisher_sketches == 0  # the truncated estimator by default
