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
        assert f.metadata["help"] in ours.metadata["help"]
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

@pytest.fixture(scope="module")
def policy(tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), dtype=torch.float32).eval()
    return model, tok


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
