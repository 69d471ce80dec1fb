"""``python -m oar_verl.trl.grpo`` (TRL's GRPO script with OAR's trainer and config) and docs/examples/trl_oar_grpo.py.

Fast, in-process: the parser is TRL's script's plus every ``--oar_<key>``; a bad ``--oar_mode``, an unknown argument or
recipe key exits 2 naming it; the guard that TRL's ``main`` still builds its trainer from ``trl.GRPOTrainer``. Slow, one
subprocess each, one step on the tiny offline Qwen2: the script on a local JSON data set with the docs example's reward
by dotted path and a ``--config`` recipe, and the docs example itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs TRL 1.16: runs in .venv-trl (tests/trl/test_trl_env.py, "
                                  "scripts/setup_trl_env.sh)")

import torch  # noqa: E402

from oar_verl.core.config import OARConfig  # noqa: E402
from oar_verl.trl import OARGRPOConfig  # noqa: E402
from oar_verl.trl import grpo as script  # noqa: E402

pytestmark = pytest.mark.trl
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
ANSWER = r"(?P<answer>\S{1,3})\s*$"  # the random tiny policy writes no arithmetic: its last characters are the answer
CPU = ["--use_cpu", "--bf16", "false"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        script.run(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_help_lists_trls_script_arguments_and_every_oar_field(capsys):
    code, text = _exit(["--help"], capsys)
    assert code == 0
    oar = [f"--oar_{f.name}" for f in dataclasses.fields(OARConfig) if f.name != "prefix"]
    trl_own = ["--dataset_name", "--dataset_config", "--reward_funcs", "--model_name_or_path", "--use_peft",
               "--num_generations", "--loss_type", "--datasets"]
    assert [f for f in oar + trl_own if f not in text] == []
    assert "under 5 % of a 200-step run" in text  # the core's help text, its bare '%' shown as written


def test_parse_gives_oars_config_with_the_values_given(tmp_path):
    script_args, args, model_args, _ = script.parse(
        [*CPU, "--output_dir", str(tmp_path), "--dataset_name", "some/dataset", "--model_name_or_path", "m",
         "--oar_mode", "fisher", "--oar_answer_patterns", "boxed", ANSWER])
    assert isinstance(args, OARGRPOConfig) and script_args.dataset_name == "some/dataset"
    assert args.oar().mode == "fisher" and args.oar().answer_patterns[-1] == ANSWER
    assert model_args.model_name_or_path == "m"


@pytest.mark.parametrize("argv,names", [
    (["--oar_mode", "bogus"], ["oar_mode='bogus'", "conservative"]),
    (["--oar_mode", "auto"], ["oar_mode='auto'", "conservative"]),  # refused by the TRL adapter, not the core
    (["--oar_mdoe", "fisher"], ["unrecognized arguments: --oar_mdoe fisher"]),
])
def test_bad_arguments_exit_2_naming_them(argv, names, tmp_path, capsys):
    code, text = _exit([*CPU, "--output_dir", str(tmp_path), *argv], capsys)
    assert code == 2 and all(n in text for n in names), text
    assert len(text.splitlines()) < 5, "one line, not argparse's usage of every option"


def test_recipe_keys_unknown_fail_and_launch_options_are_skipped_with_a_warning(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\noar_mode: path\noar_mdoe: fisher\n")
    code, text = _exit(["--config", str(recipe)], capsys)
    assert code == 2 and "unknown keys in --config: ['oar_mdoe']" in text, text
    recipe.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\noar_mode: path\nnum_processes: 2\n")
    with pytest.warns(UserWarning, match=r"\['num_processes'\] are `accelerate launch` options"):
        _, args, _, _ = script.parse(["--config", str(recipe), "--oar_tau", "0.3"])
    assert args.oar().mode == "path" and args.oar_tau == 0.3


def test_the_trainer_swap_refuses_a_trl_main_that_would_not_see_it():
    from trl.scripts.grpo import main as trl_main

    script._check_trl_main(trl_main)  # TRL 1.16's: `from trl import GRPOTrainer, ...` inside main

    def other_main(script_args):
        from trl.trainer.grpo_trainer import GRPOTrainer  # would bypass the swap: plain GRPO, silently

        return GRPOTrainer

    with pytest.raises(RuntimeError, match="no longer imports GRPOTrainer from trl"):
        script._check_trl_main(other_main)


def _log_history(out: Path) -> list[dict]:
    (state,) = out.glob("checkpoint-*/trainer_state.json")
    return json.loads(state.read_text())["log_history"]


def _check_oar(step: dict) -> None:
    assert step["oar/global_step"] == 1.0 and step["oar/adv_mass_rel_err"] < 1e-6
    assert step["oar/weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert step["oar/reshaped_seq_frac"] > 0 and step["oar/weight_max"] > 1.0 > step["oar/weight_min"]


@pytest.mark.slow
def test_the_script_trains_one_step_on_a_local_dataset_with_a_dotted_reward_and_a_recipe(tiny_assets, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"What is {a} plus 3? End with: The answer is N.", "solution": str(a + 3)} for a in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"  # TRL's --config: recipe values, the command line over them
    recipe.write_text(f"num_generations: 4\nper_device_train_batch_size: 4\nmax_completion_length: 16\n"
                      f"oar_mode: perturbation\noar_answer_patterns: ['{ANSWER}']\n")
    out = tmp_path / "out"
    argv = ["--config", str(recipe), "--model_name_or_path", str(tiny_assets.model_dir), "--dataset_name", str(data),
            "--reward_funcs", "trl_oar_grpo.reward", "--output_dir", str(out), "--max_steps", "1",
            "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "1", "--report_to", "none",
            "--oar_mode", "gradient", *CPU]
    # TRL's script imports a dotted reward with the working directory on sys.path: the docs example's own reward
    proc = subprocess.run([sys.executable, "-m", "oar_verl.trl.grpo", *argv], cwd=EXAMPLES, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (step,) = [h for h in _log_history(out) if "oar/global_step" in h]
    _check_oar(step)
    assert "rewards/reward/mean" in step  # the reward TRL's script loaded by its dotted path
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert type(args).__name__ == "OARGRPOConfig" and args.oar_mode == "gradient"  # the command line over the recipe
    assert args.num_generations == 4 and (out / "model.safetensors").is_file()  # TRL's main saved the model


@pytest.mark.slow
def test_the_docs_example_runs_one_step(tiny_assets, tmp_path):
    out = tmp_path / "example"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "trl_oar_grpo.py"), str(tiny_assets.model_dir),
                           "--output_dir", str(out), "--max_steps", "1", "--oar_mode", "conservative"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (step,) = [h for h in _log_history(out) if "oar/global_step" in h]  # TRL saves its state at the last step
    assert step["oar/global_step"] == 1.0 and step["oar/adv_mass_rel_err"] < 1e-6
    assert step["oar/attributed_seq_frac"] > 0
    assert (out / "model.safetensors").is_file()
