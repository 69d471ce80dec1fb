"""Data preparation on small local fixture files -> verl parquet that verl's own RLHFDataset loads.

The fixtures are a handful of records in the hub's column layout (GSM8K as JSONL, MATH as JSON, MATH-500 as parquet),
written here; no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from oar_verl.data import prepare as prep

GSM8K_RECORDS = [
    {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = <<3*4=12>>12\n#### 12"},
    {"question": "A car costs $1,000 more than a bike at $500. Cost of the car?",
     "answer": "500 + 1000 = 1500\n#### 1,500"},
    {"question": "What is 10 minus 12?", "answer": "10 - 12 = -2\n#### -2"},
    {"question": "A malformed record.", "answer": "no final answer marker"},
]
MATH_RECORDS = [
    {"problem": "Compute $\\frac{2}{4}$.", "solution": "We simplify: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Solve $x^2=1$.", "solution": "First $\\boxed{1}$ is a root; all roots: $\\boxed{\\{-1,1\\}}$.",
     "level": "Level 2", "type": "Algebra"},
    {"problem": "Simplify $\\sqrt{18}$.", "solution": "$\\sqrt{18} = \\fbox{3\\sqrt{2}}$", "level": "Level 3",
     "type": "Algebra"},
    {"problem": "No box here.", "solution": "The answer is 5.", "level": "Level 1", "type": "Algebra"},
]
MATH500_RECORDS = [
    {"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$", "answer": "2", "subject": "Prealgebra",
     "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Evaluate $\\lceil 2.5 \\rceil$.", "solution": "It is $\\boxed{3}$.", "answer": "3",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
]


@pytest.fixture
def fixture_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "gsm8k_train.jsonl").write_text("\n".join(json.dumps(r) for r in GSM8K_RECORDS) + "\n")
    (src / "gsm8k_test.jsonl").write_text(json.dumps(GSM8K_RECORDS[0]) + "\n")
    (src / "math.json").write_text(json.dumps({"rows": MATH_RECORDS}))
    pd.DataFrame(MATH500_RECORDS).to_parquet(src / "math500.parquet", index=False)
    return src


def test_ground_truth_extraction():
    assert prep.gsm8k_ground_truth("so #### 1,000") == "1000"
    assert prep.gsm8k_ground_truth("no marker") is None
    assert prep.extract_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert prep.extract_boxed(r"\boxed{\{-1,1\}}") == r"\{-1,1\}"
    assert prep.extract_boxed(r"nested \boxed{x^{2}+\sqrt{3}}") == r"x^{2}+\sqrt{3}"
    assert prep.extract_boxed(r"no braces: \boxed 5$.") == "5"
    assert prep.extract_boxed(r"unclosed \boxed{5") is None


def test_prepare_local_files(fixture_files, tmp_path):
    out = tmp_path / "out"
    assert prep.main(["gsm8k", "--out", str(out / "gsm8k"), "--input", str(fixture_files / "gsm8k_train.jsonl"),
                      "--input", f"test={fixture_files / 'gsm8k_test.jsonl'}"]) == 0
    assert prep.main(["math", "--out", str(out / "math"), "--input", f"train={fixture_files / 'math.json'}"]) == 0
    assert prep.main(["math500", "--out", str(out / "math500"), "--input", str(fixture_files / "math500.parquet")]) == 0

    gsm = pd.read_parquet(out / "gsm8k" / "train.parquet")
    assert list(gsm.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert [r["ground_truth"] for r in gsm["reward_model"]] == ["12", "1500", "-2"]  # malformed record skipped
    assert set(gsm["data_source"]) == {"openai/gsm8k"}
    content = gsm["prompt"][0][0]["content"]
    assert gsm["prompt"][0][0]["role"] == "user"
    assert content.startswith("Tom has 3 bags") and content.endswith(prep.GSM8K_INSTRUCTION)
    assert gsm["reward_model"][0]["style"] == "rule" and gsm["extra_info"][1]["split"] == "train"

    math = pd.read_parquet(out / "math" / "train.parquet")
    assert [r["ground_truth"] for r in math["reward_model"]] == [r"\frac{1}{2}", r"\{-1,1\}", r"3\sqrt{2}"]
    assert math["prompt"][0][0]["content"].endswith("put your final answer within \\boxed{}.")
    assert math["extra_info"][2]["type"] == "Algebra"

    m500 = pd.read_parquet(out / "math500" / "test.parquet")
    assert [r["ground_truth"] for r in m500["reward_model"]] == ["2", "3"]
    assert set(m500["data_source"]) == {"HuggingFaceH4/MATH-500"}


def test_verl_rl_dataset_loads_the_parquet(fixture_files, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from oar_verl.quickstart.tiny_assets import build_tokenizer

    written = {}
    for name, arg in [("gsm8k", f"train={fixture_files / 'gsm8k_train.jsonl'}"),
                      ("math", f"train={fixture_files / 'math.json'}"),
                      ("math500", str(fixture_files / "math500.parquet"))]:
        written.update({f"{name}/{k}": v for k, v in prep.prepare(name, tmp_path / name, [arg]).items()})
    tokenizer = build_tokenizer()
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 1024, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "truncation": "error", "return_raw_chat": True,
                               "cache_dir": str(tmp_path / "cache")})
    files = [str(p) for p in written.values()]
    dataset = RLHFDataset(data_files=files, tokenizer=tokenizer, config=config)
    assert len(dataset) == 3 + 3 + 2
    row = dataset[0]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["ground_truth"] == "12"
    assert row["raw_prompt"][0]["role"] == "user"
    sources = {dataset[i]["data_source"] for i in range(len(dataset))}
    assert sources == {"openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}


def test_cli_offline_without_input_explains(tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "oar_verl.data.prepare", "math500", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert "--input test=PATH" in proc.stderr, proc.stderr[-2000:]


def test_unknown_split_is_an_error(fixture_files, tmp_path):
    with pytest.raises(ValueError, match="cannot tell the split"):
        prep.prepare("math", tmp_path, [str(fixture_files / "math.json")])
