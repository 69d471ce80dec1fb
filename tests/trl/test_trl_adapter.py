"""The TRL adapter without a training run (the fast lane): OARGRPOConfig's fields and refusals, the reshape against the
core on the very rows the trainer reshapes (every mode), Σw = R, zero-advantage rows untouched, and TRL 1.16's
``_compute_loss`` on (B, T) advantages for every ``loss_type`` (and the sequence-level invariance behind a refusal)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

trl = pytest.importorskip("trl", reason="needs TRL 1.16: runs in .venv-trl (tests/trl/test_trl_env.py, "
                                            "scripts/setup_trl_env.sh)")

from oar_verl.core import OARConfig, oar_advantages  # noqa: E402
from oar_verl.core.config import OARConfigError  # noqa: E402
from oar_verl.trl import OARGRPOConfig, OARGRPOTrainer, OARTRLArgsError  # noqa: E402
from oar_verl.trl.config import check_trl_version  # noqa: E402
from oar_verl.trl.reshape import reshape_batch  # noqa: E402

pytestmark = pytest.mark.trl
CPU = dict(use_cpu=True, bf16=False, report_to=[])
MODES = ("conservative", "gradient", "perturbation", "fisher", "path")


def test_every_core_key_is_a_field_with_the_cores_default_and_help(tmp_path):
    cfg = OARGRPOConfig(output_dir=str(tmp_path), **CPU)
    fields = {f.name: f for f in dataclasses.fields(OARGRPOConfig)}
    for f in dataclasses.fields(OARConfig):
        if f.name == "prefix":
            continue
        ours = fields["oar_" + f.name]
        value = getattr(cfg, "oar_" + f.name)
        assert (tuple(value) if isinstance(value, list) else value) == f.default, f.name
        assert f.metadata["help"] in ours.metadata["help"].replace("%%", "%")  # argparse's escape of '%'
    assert cfg.oar() == OARConfig()  # the core's config, from the fields' defaults
    assert cfg.beta == 0.0 and cfg.seed == 42  # TRL's own beta and seed stay TRL's
    assert type(pickle.loads(pickle.dumps(cfg))) is OARGRPOConfig  # TRL saves its args with checkpoints


def test_the_argument_parser_takes_the_oar_fields(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(OARGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--oar_mode", "fisher", "--oar_tau", "0.3",
         "--oar_answer_patterns", "boxed", "gsm8k"])
    assert args.oar() == OARConfig(mode="fisher", tau=0.3, answer_patterns=("boxed", "gsm8k"))


@pytest.mark.parametrize("field,value,allowed", [
    ("oar_mode", "bogus", "conservative"),
    ("oar_tau", 1.5, "tau < 1.0"),
    ("oar_floor", 0.0, "floor <= 1.0"),
    ("oar_mask", "bad", "mean, zero"),
    ("oar_probe", "nope", "lt_logits"),
    ("oar_apply_to", "some", "negative"),
    ("oar_noise_samples", 0, ">= 1"),
    ("oar_recompute", "maybe", "always"),
    ("oar_answer_patterns", ["(no group)"], "answer"),
    ("oar_mode", "auto", "conservative, gradient"),
    ("oar_target", "reference", "response"),
    ("oar_base_estimator", "rloo", "'grpo'"),
    ("oar_fidelity_every", 2, "allowed: 0"),
    ("use_liger_kernel", True, "use_liger_kernel=False"),
    ("importance_sampling_level", "sequence", "'cispo' or 'vespo'"),
    ("loss_type", "bogus", "grpo, bnpo, dr_grpo, dapo, luspo, sapo, cispo, vespo"),
    ("scale_rewards", "bogus", "group, batch, none"),
])
def test_a_bad_field_is_refused_at_construction_naming_it(tmp_path, field, value, allowed):
    with pytest.raises((OARConfigError, OARTRLArgsError)) as err:
        OARGRPOConfig(output_dir=str(tmp_path), **CPU, **{field: value})
    assert field in str(err.value) and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize("loss", ["cispo", "vespo"])
def test_a_sequence_level_ratio_is_accepted_where_the_weights_matter(tmp_path, loss):
    cfg = OARGRPOConfig(output_dir=str(tmp_path), **CPU, importance_sampling_level="sequence", loss_type=loss)
    assert cfg.importance_sampling_level == "sequence"


def test_an_untested_trl_is_refused_unless_allowed():
    assert check_trl_version("1.16.0") == "1.16.0"
    with pytest.raises(OARTRLArgsError, match="OAR_TRL_ALLOW_UNTESTED"):
        check_trl_version("1.17.0", allow_untested=False)
    with pytest.warns(UserWarning):
        check_trl_version("1.17.0", allow_untested=True)


# ---- the reshape on TRL's padded rows, against the core on the same (prompt, response) rows

def _batch(tok):
    """TRL's padded batch of 2 groups x 3: group 0 with rewards that differ, group 1 all equal (zero advantage); one
    completion masked out (TRL's mask_truncated_completions)."""
    prompts = ["3 + 4 =", "12 + 30 ="]
    texts = ["I add 3 and 4 to get 7. The answer is 7.", "3 plus 4 is 8. The answer is 8.",
             "First 3, then 4 more. #### 7", "12 and 30 make 42. The answer is 42.",
             "Adding gives 42. The answer is 42.", "30 + 12 = 42 #### 42"]
    p = [torch.tensor(tok(prompts[i // 3])["input_ids"]) for i in range(6)]
    c = [torch.tensor(tok(t)["input_ids"] + [tok.eos_token_id]) for t in texts]
    P, C = max(map(len, p)), max(map(len, c)) + 2  # TRL pads to the longest (pad_to_multiple_of: more)
    pad = tok.pad_token_id
    prompt_ids = torch.full((6, P), pad)
    prompt_mask = torch.zeros(6, P, dtype=torch.long)
    completion_ids = torch.full((6, C), pad)
    completion_mask = torch.zeros(6, C, dtype=torch.long)
    for i in range(6):
        prompt_ids[i, P - len(p[i]):], prompt_mask[i, P - len(p[i]):] = p[i], 1
        completion_ids[i, :len(c[i])], completion_mask[i, :len(c[i])] = c[i], 1
    completion_mask[2] = 0  # truncated and masked out: no token carries an advantage
    advantages = torch.tensor([1.1547, -0.5774, -0.5774, 0.0, 0.0, 0.0])
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages), p, c


@pytest.mark.parametrize("mode", MODES)
def test_the_reshape_equals_the_cores_on_the_same_rows(policy, mode):
    model, tok = policy
    batch, prompts, completions = _batch(tok)
    cfg = OARConfig(mode=mode)
    out = reshape_batch(model, tok, cfg, 1, **batch)
    adv, mask = out.advantages, batch["completion_mask"].bool()
    assert adv.shape == batch["completion_ids"].shape and adv.dtype == torch.float32
    # the core on the same rows (the masked-out completion has no token to reshape: not given to the core)
    live = [0, 1, 3, 4, 5]
    core = oar_advantages(model, [prompts[i] for i in live], [completions[i] for i in live],
                          batch["advantages"][live], tok, cfg, 1)
    width = core.advantages.shape[1]
    # fp32 attention over different paddings and pass packings, amplified by the per-row min-max normalisation of the
    # scores (the OpenRLHF adapter's bound, docs/openrlhf.md)
    diff = float((adv[live, :width] - core.advantages.float()).abs().max())
    print(f"{mode}: max abs diff {diff:.2e}")
    assert diff < 1e-3
    assert not adv[live, width:].any() and not adv[~mask].any()  # nothing off the completion tokens
    # Σw = R: each reshaped row keeps its advantage mass
    w = out.reshaped.token_weights
    rows = w.reshaped.any(-1)
    assert rows[:2].all(), "the non-zero advantage rows with tokens are reshaped"
    r = w.reshaped.sum(-1).double()
    assert torch.allclose((w.weights * w.reshaped).sum(-1).double()[rows], r[rows], rtol=1e-5)
    assert torch.allclose((adv * mask).sum(-1)[:2], batch["advantages"][:2] * mask[:2].sum(-1), rtol=1e-4)
    assert (w.weights[rows] != 1).any(), "the weights move credit"
    # zero-advantage group untouched, the masked-out row carries nothing, nothing attributed there
    assert not adv[3:].any() and not adv[2].any()
    assert not out.attribution.attributed[2:].any()
    assert out.metrics["oar/adv_mass_rel_err"] < 1e-6 and out.metrics["oar/reshaped_seq_frac"] == pytest.approx(2 / 6)


# ---- TRL's own loss on (B, T) advantages

@pytest.fixture(scope="module")
def trainer(tiny_assets, tmp_path_factory, policy):
    from datasets import Dataset

    model, tok = policy
    args = OARGRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), **CPU, per_device_train_batch_size=6,
                         num_generations=3, max_completion_length=16)
    data = Dataset.from_list([{"prompt": "1 + 1 ="}] * 6)
    return OARGRPOTrainer(model=str(tiny_assets.model_dir), reward_funcs=lambda completions, **k: [0.0] * len(
        completions), args=args, train_dataset=data, processing_class=tok)


def _loss_grad(trainer, inputs) -> torch.Tensor:
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo"])
def test_every_loss_type_takes_token_advantages(trainer, policy, loss_type):
    """TRL 1.16 adds a dimension to 1-D advantages only: (B, T) ones reach the per-token loss as they are. Under
    token-level ratios the reshaped advantages change the gradient; under a sequence-level ratio they change it for
    cispo / vespo only (the others are refused at construction: OAR would change nothing)."""
    _, tok = policy
    batch, _, _ = _batch(tok)
    batch["completion_mask"][2, :5] = 1
    out = reshape_batch(trainer.model, tok, trainer.oar_cfg, 1, **batch)
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    trainer.loss_type, trainer.current_gradient_accumulation_steps = loss_type, 1  # set by TRL's training loop
    trainer.model.train()
    for level in ("token", "sequence"):
        trainer.importance_sampling_level = level
        plain = _loss_grad(trainer, {**inputs, "advantages": batch["advantages"]})
        broadcast = _loss_grad(trainer, {**inputs, "advantages": batch["advantages"][:, None] *
                                         batch["completion_mask"]})
        shaped = _loss_grad(trainer, {**inputs, "advantages": out.advantages})
        scale = float(plain.norm())
        assert float((plain - broadcast).norm()) < 1e-5 * scale, "(B,) and its (B, T) broadcast: the same loss"
        moved = float((plain - shaped).norm()) > 1e-3 * scale
        invariant = level == "sequence" and loss_type not in ("cispo", "vespo")
        assert moved != invariant, (loss_type, level)
    trainer.importance_sampling_level, trainer.loss_type = "token", "dapo"


# ---- every GRPOConfig field: one table (config.FIELD_SUPPORT), the docs' copy, the refusals it drives

def test_every_grpo_config_field_is_in_the_support_table_and_the_docs_show_it():
    from pathlib import Path

    from trl import GRPOConfig

    from oar_verl.trl.config import FIELD_SUPPORT, NO_EFFECT, REFUSED, WORKS, support_table

    fields = {f.name for f in dataclasses.fields(GRPOConfig) if not f.name.startswith("oar_")}
    assert set(FIELD_SUPPORT) == fields, (sorted(fields - set(FIELD_SUPPORT)), sorted(set(FIELD_SUPPORT) - fields))
    for name, s in FIELD_SUPPORT.items():
        assert s.status in (WORKS, REFUSED, NO_EFFECT), name
        assert (s.refused is not None) == (s.status == REFUSED), name
        assert s.status != REFUSED or "Allowed: " in s.why, name
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    start, end = "<!-- trl-fields -->\n", "\n<!-- /trl-fields -->"
    assert start in doc and end in doc, "docs/trl.md holds the field table between its markers"
    table = doc[doc.index(start) + len(start):doc.index(end)]
    assert table == support_table(), "docs/trl.md's field table differs from config.FIELD_SUPPORT: paste support_table()"
    rows = {n.strip("` "): line.split(" | ")[1] for line in table.splitlines()[2:]
            for n in line.split(" | ")[0].strip("| ").split(", ")}
    assert rows == {n: s.status for n, s in FIELD_SUPPORT.items()}


@pytest.mark.parametrize("extra,setting,allowed", [
    (dict(top_entropy_quantile=0.8), "top_entropy_quantile=0.8", "Allowed: 1.0"),
    (dict(torch_compile=True), "torch_compile=True", "torch_compile=False"),
    (dict(model_init_kwargs={"tp_plan": "auto"}), "model_init_kwargs", "Allowed: any other loading keyword"),
    (dict(fsdp="full_shard", fsdp_config={"version": 1}), "fsdp_config['version']=1", "Allowed: FSDP2"),
])
def test_a_refused_trl_setting_names_itself_and_the_allowed_values(tmp_path, extra, setting, allowed):
    with pytest.raises(OARTRLArgsError) as err:
        OARGRPOConfig(output_dir=str(tmp_path), **CPU, **extra)
    assert setting in str(err.value) and allowed in str(err.value), str(err.value)


def test_fsdp2_is_accepted_and_accelerates_fsdp1_config_refused(tmp_path, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    from oar_verl.trl.config import check_trl_args

    assert OARGRPOConfig(output_dir=str(tmp_path), **CPU, fsdp="full_shard").fsdp  # transformers' default: FSDP2
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp1.yaml` sets
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(OARTRLArgsError, match="fsdp_version=1.*Allowed: FSDP2"):
        OARGRPOConfig(output_dir=str(tmp_path), **CPU)
    monkeypatch.setenv("FSDP_VERSION", "2")
    cfg = OARGRPOConfig(output_dir=str(tmp_path), **CPU)
    cfg.parallelism_config = ParallelismConfig(tp_size=2)
    with pytest.raises(OARTRLArgsError, match="parallelism_config with {'tp_size': 2}.*Allowed: None"):
        check_trl_args(cfg)


# ---- the trainer's construction checks on the loaded policy

def _tiny_trainer(model, tok, tmp_path, **args):
    from datasets import Dataset

    cfg = OARGRPOConfig(output_dir=str(tmp_path), **CPU, **{**dict(per_device_train_batch_size=3, num_generations=3,
                                                                    max_completion_length=8), **args})
    return OARGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(i % 3) for i in range(len(
        completions))], args=cfg, train_dataset=Dataset.from_list([{"prompt": "1 + 1 ="}] * 6), processing_class=tok)


def test_a_multimodal_model_is_refused_under_every_mode(tiny_assets, policy, tmp_path):
    """TRL feeds a VLM's images to the loss; attribution would not see them. A processor (TRL's VLM path) is refused
    before the model loads; a model whose config has a vision tower, whatever the mode (fisher included)."""
    from transformers import (Qwen2AudioProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              WhisperFeatureExtractor)

    _, tok = policy
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(), tokenizer=tok)
    with pytest.raises(OARTRLArgsError, match="multimodal .its processing_class is a processor .Qwen2AudioProcessor"):
        _tiny_trainer(str(tiny_assets.model_dir), processor, tmp_path)
    vlm = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2)))
    for mode in ("fisher", "gradient"):
        with pytest.raises(OARTRLArgsError, match="multimodal .its config has vision_config.*Allowed: a text-only"):
            _tiny_trainer(vlm, tok, tmp_path, oar_mode=mode)


def test_a_pad_token_that_is_a_generation_eos_in_memory_is_refused(tiny_assets, tmp_path):
    """The EOS ids come from TRL's own ``eos_token_ids`` (the loaded model's generation config), not only a local
    generation_config.json: a hub model's is not on disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar_verl.core.checks.mask_token import check_model_mask_token

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), dtype=torch.float32)
    end = next(i for i in range(len(tok)) if i not in tok.all_special_ids and tok.convert_ids_to_tokens(i).isalpha())
    model.generation_config.eos_token_id = [tok.eos_token_id, end]  # in memory only, as a hub id's would be
    tok.pad_token = tok.convert_ids_to_tokens(end)
    cfg = OARConfig(mode="perturbation", mask="pad")
    assert check_model_mask_token(cfg, str(tiny_assets.model_dir), tok) == end, "the on-disk config alone passes it"
    with pytest.raises(OARConfigError, match=f"oar_mask=pad: the mask token {end} .*end-of-sequence"):
        _tiny_trainer(model, tok, tmp_path, oar_mode="perturbation", oar_mask="pad")


# ---- two generations in one optimizer step: each its own OAR step and dump

def test_generations_within_one_optimizer_step_get_distinct_steps_and_dumps(tiny_assets, policy, tmp_path):
    import json

    _, tok = policy
    trainer = _tiny_trainer(str(tiny_assets.model_dir), tok, tmp_path, gradient_accumulation_steps=2,
                            steps_per_generation=1, max_steps=2, oar_dump_every=1, save_strategy="no",
                            logging_steps=1)
    assert trainer._oar_per_step == 2
    trainer.train()
    logged = [h["oar/global_step"] for h in trainer.state.log_history if "oar/global_step" in h]
    assert logged == [1.5, 3.5], "2 optimizer steps x 2 generations: OAR steps 1, 2 then 3, 4 (logged as means)"
    dumps = sorted((tmp_path / "oar_dumps").glob("step_*.jsonl"))
    assert [p.name for p in dumps] == [f"step_{i}.jsonl" for i in (1, 2, 3, 4)]
    assert [{json.loads(line)["step"] for line in p.read_text().splitlines()} for p in dumps] == [{1}, {2}, {3}, {4}]


def test_a_generation_serving_two_optimizer_steps_still_dumps(tiny_assets, policy, tmp_path):
    """num_iterations=2: a generation every second optimizer step, so OAR's steps are 1, 3 (global_step + 1 at each
    generation) and never a multiple of oar_dump_every=2: the first step past each multiple is due."""
    import json

    _, tok = policy
    trainer = _tiny_trainer(str(tiny_assets.model_dir), tok, tmp_path, num_iterations=2, max_steps=4,
                            oar_dump_every=2, save_strategy="no", logging_steps=1)
    trainer.train()
    dumps = sorted((tmp_path / "oar_dumps").glob("step_*.jsonl"))
    assert [p.name for p in dumps] == ["step_3.jsonl"]
    assert {json.loads(line)["step"] for line in dumps[0].read_text().splitlines()} == {3}
    dumps[0].unlink()  # train() again: a new launch from step 0 dumps afresh
    trainer.train()
    assert [p.name for p in sorted((tmp_path / "oar_dumps").glob("step_*.jsonl"))] == ["step_3.jsonl"]


# ---- TRL's per-sequence metrics read TRL's own (B,) advantages

@pytest.mark.parametrize("loss_type,key", [("cispo", "cispo_clip_ratio"), ("vespo", "vespo/phi_seq_mean")])
def test_per_sequence_metrics_equal_trls_on_its_own_advantages(trainer, policy, loss_type, key):
    from trl import GRPOTrainer

    from oar_verl.trl.trainer import SEQUENCE_ADVANTAGES

    _, tok = policy
    batch, _, _ = _batch(tok)
    batch["advantages"][:3] = torch.tensor([1.0, -0.5, -0.5])
    out = reshape_batch(trainer.model, tok, trainer.oar_cfg, 1, **batch)
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    inputs["num_items_in_batch"] = batch["completion_mask"].sum()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].shape[1])
    shift = torch.tensor([0.05, -0.05, 0.0, -0.03, 0.04, 0.02])[:, None]  # per-row policy drift since sampling
    inputs["old_per_token_logps"] = logps - shift
    epsilon_high = trainer.epsilon_high
    trainer.loss_type, trainer.current_gradient_accumulation_steps = loss_type, 1
    trainer.importance_sampling_level, trainer.epsilon_high = "sequence", 1.0
    trainer.model.train()
    try:
        def metric(compute, advantages, **extra):
            compute(trainer.model, {**inputs, "advantages": advantages, **extra})
            return trainer._metrics["train"][key][-1]

        plain = metric(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), batch["advantages"])
        ours = metric(trainer._compute_loss, out.advantages, **{SEQUENCE_ADVANTAGES: batch["advantages"]})
        per_token = metric(trainer._compute_loss, out.advantages)  # no sequence advantages: TRL reads (B, T)
    finally:
        trainer.importance_sampling_level, trainer.loss_type = "token", "dapo"
        trainer.epsilon_high = epsilon_high
    assert ours == pytest.approx(plain, abs=1e-6)
    assert abs(per_token - plain) > 1e-3, "the (B, T) advantages alone give another metric: the test can fail"
