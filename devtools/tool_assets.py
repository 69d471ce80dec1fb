"""Offline assets of the CPU multi-turn run (docs/multi_turn.md): a tiny Qwen2 warm-started to call the calculator
tool (``oar_verl.tools.calculator``) through verl's hermes tool format, the arithmetic data with ``agent_name:
tool_agent``, and the tool config verl loads. Test tooling, not shipped.

Each warm-start transcript is laid out token for token as verl's ``ToolAgentLoop`` builds it on this ChatML template
(``QwenContinuousTokenBuilder``): the chat-templated prompt, the model's tool call and ``<|im_end|>``, then the context
the loop appends (``\\n<|im_start|>tool\\n<result><|im_end|>\\n<|im_start|>assistant\\n``), then the model's final turn
``The answer is <result>.<|im_end|>``; the loss is on the model's two turns only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from oar_verl.quickstart import warm_cache
from oar_verl.quickstart.tiny_assets import build_tiny_qwen2
from oar_verl.quickstart.tokenizers import train_tiny_bpe

DATA_SOURCE = "tiny_arith"  # the arithmetic reward's (oar_verl.quickstart.arith_reward): "The answer is N" scores 1
SETTINGS = {"seed": 0, "steps": 280, "batch": 32, "lr": 3e-3, "hidden": 128, "layers": 2, "vocab": 400, "v": 1}


def problem(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, result) of one two-number sum."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}? Use calc.", f"{a}+{b}", str(a + b)


def tool_call(expr: str) -> str:
    return '<tool_call>{"name": "calc", "arguments": {"expr": "' + expr + '"}}</tool_call>'


def answer(result: str) -> str:
    return f"The answer is {result}."


@dataclass(frozen=True)
class ToolAssets:
    root: Path
    model_dir: Path
    train_file: Path
    test_file: Path
    tool_config: Path


TOOL_CONFIG = """tools:
  - class_name: oar_verl.tools.calculator.CalculatorTool
    config:
      type: native
"""


def _rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        question, _, result = problem(rng)
        rows.append({"data_source": DATA_SOURCE, "agent_name": "tool_agent",
                     "prompt": [{"role": "user", "content": question}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": result},
                     "extra_info": {"split": split, "index": i}})
    return rows


def _warm_start(model_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    rng = random.Random(SETTINGS["seed"])
    examples = [problem(rng) for _ in range(2000)]
    corpus = [f"user\n{q}\nassistant\n{tool_call(e)}\ntool\n{r}\nassistant\n{answer(r)}" for q, e, r in examples]
    tok = train_tiny_bpe(corpus, vocab_size=SETTINGS["vocab"], out_dir=model_dir)
    build_tiny_qwen2(model_dir, tok, seed=SETTINGS["seed"], hidden_size=SETTINGS["hidden"],
                     num_layers=SETTINGS["layers"], initializer_range=0.02)
    tok = AutoTokenizer.from_pretrained(str(model_dir))  # as verl and vLLM load it (Qwen2Tokenizer: digits split)
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    seqs, masks = [], []
    for q, e, r in examples:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        call, ctx = ids(tool_call(e)) + [eos], ids(f"\n<|im_start|>tool\n{r}<|im_end|>\n<|im_start|>assistant\n")
        final = ids(answer(r)) + [eos]
        seqs.append(prompt + call + ctx + final)
        masks.append([0] * len(prompt) + [1] * len(call) + [0] * len(ctx) + [1] * len(final))
    L = max(map(len, seqs))
    x = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)
    m = torch.zeros(len(seqs), L)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, (s, k) in enumerate(zip(seqs, masks)):  # per example
        x[i, :len(s)], m[i, :len(k)], att[i, :len(s)] = torch.tensor(s), torch.tensor(k, dtype=torch.float), 1
    opt = torch.optim.AdamW(model.parameters(), lr=SETTINGS["lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(SETTINGS["seed"])
    model.train()
    for step in range(SETTINGS["steps"]):
        idx = torch.randint(0, len(seqs), (SETTINGS["batch"],), generator=g)
        logits = model(input_ids=x[idx], attention_mask=att[idx]).logits[:, :-1]
        target, weight = x[idx][:, 1:], m[idx][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                               reduction="none").reshape(target.shape)
        loss = (ce * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for group in opt.param_groups:  # linear decay
            group["lr"] = SETTINGS["lr"] * (1 - (step + 1) / SETTINGS["steps"])
    model.eval()
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    (model_dir / "warm_start.json").write_text(json.dumps({"final_loss": float(loss.detach()), **SETTINGS}))


def build_tool_assets(root: str | Path, *, n_train: int = 32, n_test: int = 8) -> ToolAssets:
    """The warm-started model (cached by content, :mod:`oar_verl.quickstart.warm_cache`), the data and the tool
    config under ``root``."""
    import pandas as pd

    root = Path(root)
    model_dir = root / "model"
    warm_cache.materialise(model_dir, name="tool_calc", settings=SETTINGS, code_files=[__file__],
                           build=_warm_start)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, test = data / "train.parquet", data / "test.parquet"
    pd.DataFrame(_rows(n_train, "train", random.Random("tool-train"))).to_parquet(train, index=False)
    pd.DataFrame(_rows(n_test, "test", random.Random("tool-test"))).to_parquet(test, index=False)
    config = root / "calculator.yaml"
    config.write_text(TOOL_CONFIG)
    return ToolAssets(root, model_dir, train, test, config)


if __name__ == "__main__":  # build and sample a few rows: python -m devtools.tool_assets DIR
    import sys

    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    assets = build_tool_assets(sys.argv[1])
    tok = AutoTokenizer.from_pretrained(str(assets.model_dir))
    model = Qwen2ForCausalLM.from_pretrained(str(assets.model_dir), dtype=torch.float32)
    print((assets.model_dir / "warm_start.json").read_text())
    rng = random.Random(5)
    calls = right = 0
    for _ in range(16):  # both turns, the tool's result put in between as the agent loop does
        q, e, r = problem(rng)
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        p = torch.tensor([list(p["input_ids"] if hasattr(p, "keys") else p)])
        out = model.generate(p, max_new_tokens=40, do_sample=True, temperature=1.0, eos_token_id=tok.eos_token_id)
        first = tok.decode(out[0, p.shape[1]:])
        calls += tool_call(e) in first
        ctx = torch.tensor([tok.encode(f"\n<|im_start|>tool\n{r}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)])
        p2 = torch.cat([out, ctx], 1)
        out2 = model.generate(p2, max_new_tokens=20, do_sample=True, temperature=1.0, eos_token_id=tok.eos_token_id)
        second = tok.decode(out2[0, p2.shape[1]:])
        right += answer(r) in second
        print(repr(first), repr(second), "expected", e, r)
    print(f"tool calls right {calls}/16, answers right {right}/16")
