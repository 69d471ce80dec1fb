"""The README's core example ("### The core without verl") runs as written, on a tiny Qwen2 and a locally trained
tokenizer, and ends with per-token advantages that keep each reshaped row's advantage mass (Σw = R)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from oar_verl.quickstart.tokenizers import train_tiny_bpe

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "### The core without verl"

PROMPTS = ["What is 3 plus 4?", "What is 5 plus 1?", "What is 2 plus 2?"]
RESPONSES = [["3 plus 4 is 7. The answer is 7.", "3 plus 4 is 8. The answer is 8."],
             ["5 plus 1 is 6. #### 6", "5 plus 1 is 6, so the sum is 6. #### 6"],  # both right: zero advantage
             ["2 plus 2 is 5. The answer is 5.", "2 and 2 make 4. The answer is 4."]]
REWARDS = [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]


def readme_example() -> str:
    """The first ```python block under the heading, before the next heading."""
    text = README.read_text()
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    after = text.split(HEADING, 1)[1]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match and not re.search(r"^#{1,3} ", after[:match.start()], re.M), f"no ```python block under {HEADING!r}"
    return match.group(1)


def test_readme_core_example_runs_and_preserves_the_advantage_mass(make_lm):
    code = readme_example()
    assert len(code.splitlines()) <= 12, "keep the README's core example short"
    texts = [r for group in RESPONSES for r in group]
    tok = train_tiny_bpe(PROMPTS + texts, vocab_size=300)
    enc = lambda t: torch.tensor(tok.encode(t, add_special_tokens=False))  # noqa: E731
    prompts = [enc(PROMPTS[g]) for g, group in enumerate(RESPONSES) for _ in group]
    responses = [torch.cat([enc(t), torch.tensor([tok.eos_token_id])]) for t in texts]
    scope = {"model": make_lm(torch.float64, vocab=len(tok)), "tokenizer": tok, "prompts": prompts,
             "responses": responses, "rewards": torch.tensor(REWARDS)}
    exec(compile(code, str(README), "exec"), scope)

    out = scope["token_advantages"]
    lengths = torch.tensor([len(r) for r in responses])
    assert out.shape == (len(responses), int(lengths.max()))
    valid = torch.arange(out.shape[1])[None, :] < lengths[:, None]
    assert (out[~valid] == 0).all()
    seq = scope["advantages"]
    assert (out[2:4] == 0).all() and (seq[2:4] == 0).all()  # the agreeing group: never attributed, A = 0
    tw = scope["reshaped"].token_weights
    gated = tw.reshaped
    attributed = seq != 0
    assert gated[attributed].any(-1).all() and not gated[~attributed].any()
    # Σw = R over each reshaped row's reasoning tokens: the row's advantage mass is preserved
    w = tw.weights.double()
    torch.testing.assert_close((w * gated).sum(-1), gated.sum(-1).double(), rtol=0, atol=1e-4)
    torch.testing.assert_close(out.double().sum(-1), seq.double() * lengths.double(), rtol=1e-5, atol=1e-5)
    assert (w[gated] - 1).abs().max() > 1e-3  # the weights are not uniform: the example reshaped something
