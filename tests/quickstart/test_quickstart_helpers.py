"""Pieces of the CPU quickstart that run in seconds (the quickstart itself runs end to end in CI)."""

from __future__ import annotations

from oar_verl import integration
from oar_verl.quickstart import main as quickstart
from oar_verl.quickstart.tiny_assets import build_tiny_assets


def test_answer_format_warm_up_learns_and_saves(tmp_path):
    assets = build_tiny_assets(tmp_path / "assets", seed=0)  # its own copy: the warm-up rewrites the model
    weights = assets.model_dir / "model.safetensors"
    before = weights.read_bytes()
    result = quickstart.teach_answer_format(assets.model_dir, steps=40, batch_size=16)
    assert result["loss_last"] < 0.5 * result["loss_first"]
    assert weights.read_bytes() != before  # saved back where verl and vLLM will load it
    assert isinstance(result["example_response"], str) and "End with: #### N" in result["example_prompt"]


def test_format_examples_match_the_reward():
    import random

    from oar_verl.quickstart import arith_reward

    rng = random.Random(0)
    for style in ("sentence", "hashes"):
        messages, response = quickstart._format_example(rng, style)
        truth = response.split(" is ", 1)[1].split(".", 1)[0]
        assert arith_reward.compute_score("x", response, truth) == 1.0
        assert ("The answer is" in response) == (style == "sentence")


def test_train_examples_are_the_rl_prompts_with_their_right_answers(tmp_path):
    import pandas as pd

    from oar_verl.quickstart import arith_reward

    assets = build_tiny_assets(tmp_path / "assets", seed=0)
    train = pd.read_parquet(assets.train_file)
    examples = quickstart.train_examples(assets.train_file)
    assert len(examples) == len(train) == 32
    for (messages, response), row in zip(examples, train.itertuples()):
        assert messages == [dict(m) for m in row.prompt]  # exactly what the trainer will prompt with
        assert arith_reward.compute_score(row.data_source, response, row.reward_model["ground_truth"]) == 1.0
        assert ("The answer is" in response) == (row.extra_info["answer_style"] == "sentence")


def test_summary():
    metrics = [{"step": 1, "critic/score/mean": 0.1, "timing_s/oar": 0.5, "timing_s/oar_in_old_log_prob": 0.0,
                "timing_s/oar_total": 0.5, "timing_s/step": 20.0},
               {"step": 2, "critic/score/mean": 0.3, "timing_s/oar": 0.5, "timing_s/oar_in_old_log_prob": 0.0,
                "timing_s/oar_total": 0.5, "timing_s/step": 5.0}]
    text = quickstart.summarize(metrics)
    assert "reward 0.100 -> 0.300" in text and "10.0% of the step time after step 1 (timing_s/oar_total" in text
    assert "step 2/5: reward 0.300" in quickstart._step_line(metrics[1], 5)


def test_the_share_of_the_step_is_what_attribution_cost_wherever_it_ran():
    """With the method read from verl's old-log-prob pass (the default shared forward), most of attribution runs
    inside that call (timing_s/oar_in_old_log_prob: OAR-G's noisy passes, the backwards), not in the step's own part
    (timing_s/oar): the per-step line, the table and the closing share quote the total (timing_s/oar_total), the
    issue's quickstart step of 0.06 s + 0.40 s in a 3.2 s step being 14 %, not the 2 % its step-side part alone
    reads."""
    step = {"critic/score/mean": 0.5, "timing_s/oar": 0.06, "timing_s/oar_in_old_log_prob": 0.40,
            "timing_s/oar_total": 0.46, "timing_s/old_log_prob": 0.6, "timing_s/step": 3.2}
    metrics = [{"step": 1, **step, "timing_s/step": 30.0}, {"step": 2, **step}, {"step": 3, **step}]
    assert abs(quickstart.oar_share(metrics[1]) - 0.46 / 3.2) < 1e-12
    assert "OAR 0.46 s (14.4%)" in quickstart._step_line(metrics[1], 3)
    text = quickstart.summarize(metrics)
    assert "OAR attribution took 14.4% of the step time after step 1, 87% of it inside verl's old-log-prob call" in text
    row = next(line for line in text.splitlines() if line.startswith("   2 "))
    assert "0.46" in row and row.rstrip().endswith("14.4%")  # the "oar s" column and the share: the total
    assert "2.7%" not in text and "1.9%" not in text


def test_trainer_overrides_compose_against_the_oar_config(tmp_path):
    """The quickstart's own overrides (CPU settings, OAR mode, token dumps) name real keys of the config tree."""
    import os

    from hydra import compose, initialize_config_dir

    from oar_verl.quickstart.tiny_assets import TinyAssets

    assets = TinyAssets(tmp_path, tmp_path / "model", tmp_path / "train.parquet", tmp_path / "test.parquet", 26)
    overrides = quickstart.trainer_overrides(assets, tmp_path / "out", str(tmp_path / "ray"), mode="perturbation",
                                             steps=3, extra=["algorithm.oar.chunk_size=16"])
    config_dir = os.path.join(os.path.dirname(integration.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="oar_trainer", overrides=overrides)
    assert cfg.algorithm.adv_estimator == "oar" and cfg.algorithm.oar.mode == "perturbation"
    assert cfg.algorithm.oar.dump_every == 1 and cfg.algorithm.oar.dump_groups == 4
    assert cfg.algorithm.oar.dump_dir == str(tmp_path / "out" / "oar_dumps")
    assert cfg.trainer.total_training_steps == 3 and cfg.algorithm.oar.chunk_size == 16


def test_validation_line_reads_verls_first_and_last_validation():
    key = "val-core/last_digit/reward/mean@4"
    metrics = [{"step": 0, key: 0.375}, {"step": 1, "critic/score/mean": 0.4},
               {"step": 30, "critic/score/mean": 0.9, key: 0.8125, "val-aux/last_digit/score/std@4": 0.1}]
    assert quickstart.validation_line(metrics) == f"validation success ({key}): 0.375 at step 0 -> 0.812 at step 30"
    assert quickstart.validation_line([{"step": 1, "critic/score/mean": 0.4}]) is None


def test_python_m_quickstart_exits_with_the_quickstart_s_status():
    """``python -m oar_verl.quickstart`` ends with main()'s status: a failed trainer run (main() returns 1) must not
    exit 0 (it did: ``__main__`` dropped the status, so a script saw success after a crash)."""
    import subprocess
    import sys

    code = ("import runpy, oar_verl.quickstart.main as m; m.main = lambda *a, **k: 3; "
            "runpy.run_module('oar_verl.quickstart', run_name='__main__')")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 3


def test_the_quickstart_runs_the_product_s_default_mode():
    from oar_verl.core.config import OARConfig

    assert quickstart.mode_label("gradient") == "OAR-G" and quickstart.mode_label("perturbation") == "OAR-P"
    assert quickstart.mode_label(OARConfig().mode) == f"OAR ({OARConfig().mode})"
