"""GSM8K, MATH and MATH-500 in verl's RL parquet format, with the prompt templates the recipes use.

usage::

    python -m oar_verl.data.prepare gsm8k   --out ~/data/oar/gsm8k     # train.parquet + test.parquet
    python -m oar_verl.data.prepare math    --out ~/data/oar/math      # train.parquet + test.parquet (MATH, 12k/5k)
    python -m oar_verl.data.prepare math500 --out ~/data/oar/math500   # test.parquet (MATH-500)
    # offline: local JSON / JSONL / parquet files with the hub's columns; the split comes from `split=PATH`
    # or from "train"/"test" in the file name
    python -m oar_verl.data.prepare gsm8k --out DIR --input train=gsm8k_train.jsonl --input test=gsm8k_test.jsonl
    # multi-turn with the calculator tool (recipes/gsm8k/run_oar_tools.sh; docs/multi_turn.md): agent_name tool_agent
    python -m oar_verl.data.prepare gsm8k --tools --out ~/data/oar/gsm8k_tools

Without ``--input`` the data come from the Hugging Face hub (``datasets.load_dataset``). Every row has verl's columns
(``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``), as verl's own ``examples/data_preprocess``
scripts write them; what each holds: docs/verl.md, "The recipes' data and reward".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DATASETS",
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "TOOL_AGENT",
    "TOOLS_INSTRUCTION",
    "extract_boxed",
    "gsm8k_ground_truth",
    "load_local",
    "main",
    "prepare",
    "to_verl_rows",
]

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# --tools: rows verl's ToolAgentLoop runs (``agent_name``), with the calculator of recipes/tools/calculator.yaml
# (oar_verl.tools.calculator.CalculatorTool, the tool named ``calc``)
TOOL_AGENT = "tool_agent"
TOOLS_INSTRUCTION = ('Let\'s think step by step; use the calc tool for arithmetic, then output the final answer after '
                     '"####".')


@dataclass(frozen=True)
class DatasetSpec:
    """Where a data set lives on the hub and how its rows become verl rows."""

    data_source: str
    hub_name: str
    hub_config: str | None
    splits: tuple[str, ...]
    question_key: str
    solution_key: str
    instruction: str


DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("openai/gsm8k", "openai/gsm8k", "main", ("train", "test"), "question", "answer",
                         GSM8K_INSTRUCTION),
    "math": DatasetSpec("DigitalLearningGmbH/MATH-lighteval", "DigitalLearningGmbH/MATH-lighteval", None,
                        ("train", "test"), "problem", "solution", MATH_INSTRUCTION),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", "HuggingFaceH4/MATH-500", None, ("test",), "problem",
                           "solution", MATH_INSTRUCTION),
}

# extra_info columns copied when present (the same keys on every row, so parquet gets one struct type)
_EXTRA_KEYS = {"gsm8k": (), "math": ("level", "type"), "math500": ("level", "subject", "unique_id")}


def gsm8k_ground_truth(answer: str) -> str | None:
    """GSM8K's final answer: the text after the last ``####``, commas removed (``"#### 1,000"`` -> ``"1000"``)."""
    if "####" not in answer:
        return None
    value = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return value or None


def extract_boxed(solution: str) -> str | None:
    """Content of the last complete ``\\boxed{…}`` / ``\\fbox{…}`` (balanced braces), or ``\\boxed N`` without
    braces; None if there is none. Uses the trainer's own span finder, so "the answer" means the same thing here."""
    from oar_verl.core.text.answer_patterns import find_answer_span

    raw = solution.encode("utf-8")
    span = find_answer_span(raw, ("boxed",))
    if span is not None:
        return raw[span[1]:span[2]].decode("utf-8")
    marker = solution.rfind("\\boxed ")
    if marker >= 0:  # "\boxed 5" (a few MATH solutions)
        rest = solution[marker + len("\\boxed "):].strip().split()
        if rest:
            return rest[0].rstrip("$.")
    return None


def to_verl_rows(name: str, records: Iterable[Mapping], split: str, tools: bool = False) -> tuple[list[dict], int]:
    """Convert source records to verl rows (``tools``: for verl's tool agent loop, with the calculator instruction).

    Returns:
        ``(rows, skipped)``: records without an extractable answer are skipped and counted.
    """
    spec = DATASETS[name]
    rows, skipped = [], 0
    for record in records:
        question = str(record[spec.question_key]).strip()
        solution = str(record.get(spec.solution_key) or "")
        if name == "gsm8k":
            truth = gsm8k_ground_truth(solution)
        elif name == "math500" and record.get("answer"):
            truth = str(record["answer"]).strip()
        else:
            truth = extract_boxed(solution)
        if not question or not truth:
            skipped += 1
            continue
        extra = {"split": split, "index": len(rows), "question": question, "solution": solution}
        extra.update({k: str(record.get(k, "")) for k in _EXTRA_KEYS[name]})
        row = {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": f"{question} {TOOLS_INSTRUCTION if tools else spec.instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": extra,
        }
        if tools:
            row["agent_name"] = TOOL_AGENT
        rows.append(row)
    return rows, skipped


def load_local(path: str | os.PathLike) -> list[dict]:
    """Records of a local ``.json`` (a list, or ``{"data"|"rows"|"<split>": [...]}``), ``.jsonl`` or ``.parquet``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    if suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: expected a JSON list of records or an object holding exactly one list")
            data = lists[0]
        return list(data)
    raise ValueError(f"{path}: unsupported file type {suffix!r} (use .json, .jsonl or .parquet)")


def _split_of(spec_arg: str, valid: tuple[str, ...]) -> tuple[str, Path]:
    """``"train=path"`` -> ("train", path); a bare path -> the split named in its file name."""
    if "=" in spec_arg and spec_arg.split("=", 1)[0] in valid:
        split, path = spec_arg.split("=", 1)
        return split, Path(path)
    path = Path(spec_arg)
    named = [s for s in valid if s in path.name.lower()]
    if len(named) == 1:
        return named[0], path
    if len(valid) == 1:
        return valid[0], path
    raise ValueError(f"cannot tell the split of {spec_arg!r}: name it as one of {[f'{s}=PATH' for s in valid]}")


def _load_hub(spec: DatasetSpec, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(spec.hub_name, spec.hub_config, split=split)
    except Exception as exc:  # offline, no hub access, renamed data set...
        raise RuntimeError(f"could not load {spec.hub_name} ({split}) from the Hugging Face hub: {exc}\n"
                           f"offline? pass local files with --input {split}=PATH (.json/.jsonl/.parquet)") from exc
    return [dict(r) for r in ds]


def prepare(name: str, out_dir: str | os.PathLike, inputs: list[str] | None = None,
            max_samples: int | None = None, tools: bool = False) -> dict[str, Path]:
    """Write ``<out_dir>/<split>.parquet`` for every split of ``name`` (given by ``inputs``, else from the hub).

    Returns:
        ``{split: parquet path}``.
    """
    import pandas as pd

    spec = DATASETS[name]
    if inputs:
        sources = {}
        for arg in inputs:
            split, path = _split_of(arg, spec.splits)
            sources.setdefault(split, []).extend(load_local(path))
    else:
        sources = {split: _load_hub(spec, split) for split in spec.splits}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, records in sources.items():
        if max_samples:
            records = records[:max_samples]
        rows, skipped = to_verl_rows(name, records, split, tools)
        if not rows:
            raise ValueError(f"{name}/{split}: no usable records (all {skipped} lacked a question or an answer)")
        path = out_dir / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        written[split] = path
        note = f", skipped {skipped} without an answer" if skipped else ""
        print(f"[prepare] {name}/{split}: {len(rows)} rows -> {path}{note}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--out", required=True, help="output folder (gets <split>.parquet)")
    parser.add_argument("--input", action="append", default=None, metavar="[SPLIT=]PATH",
                        help="local .json/.jsonl/.parquet instead of the hub (repeatable)")
    parser.add_argument("--max-samples", type=int, default=None, help="keep the first N records of each split")
    parser.add_argument("--tools", action="store_true",
                        help="rows for verl's tool agent loop (agent_name tool_agent) with the calculator instruction")
    args = parser.parse_args(argv)
    try:
        prepare(args.dataset, args.out, args.input, args.max_samples, args.tools)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"[prepare] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
