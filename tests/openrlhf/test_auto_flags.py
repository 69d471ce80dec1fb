"""``--oar.mode auto`` and ``--oar.fidelity_every`` are accepted by the OpenRLHF entry point (the actor runs them,
oar_verl.openrlhf.auto / reshape), with the auto keys validated naming the flag."""

from __future__ import annotations

import pytest

from oar_verl.openrlhf.train_ppo_ray import OpenRLHFArgsError, oar_config


def test_mode_auto_and_the_in_step_metric_are_accepted_and_validated():
    cfg = oar_config({"mode": "auto", "auto_candidates": ["gradient", "fisher"], "fidelity_every": 2})
    assert (cfg.mode, cfg.auto_candidates, cfg.fidelity_every) == ("auto", ("gradient", "fisher"), 2)
    with pytest.raises(OpenRLHFArgsError, match=r"--oar\.auto_candidates: 'sideways' is not allowed"):
        oar_config({"mode": "auto", "auto_candidates": ["sideways"]})


def _items(tok, texts, advantages):
    """Replay-buffer items as OpenRLHF 0.11 stores them: sequences (L,), action_mask / advantages / returns (L-1,)."""
    import types

    import torch

    out = []
    for (prompt, response), a in zip(texts, advantages):
        p = tok.encode(prompt, add_special_tokens=False)
        r = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
        seq = torch.tensor(p + r)
        am = torch.zeros(len(seq) - 1, dtype=torch.bool)
        am[len(p) - 1:] = True
        adv = torch.where(am, a, 0.0)
        out.append(types.SimpleNamespace(sequences=seq, action_mask=am, advantages=adv, returns=adv.clone(),
                                         labels=None))
    return out


def test_the_actor_side_calibrates_decides_and_measures_the_in_step_fidelity():
    """One rank (no process group): AutoStep scores the candidates on the replay buffer's attributable rows and
    decides; the next step attributes with the decision and measures nothing; reshape_replay_buffer logs the in-step
    fidelity as verl does."""
    import torch

    from oar_verl.openrlhf.auto import AutoStep
    from oar_verl.openrlhf.reshape import reshape_replay_buffer
    from oar_verl.quickstart.tokenizers import train_tiny_bpe

    texts = [("What is 3 plus 4?", "3 plus 4 is 7. The answer is 7."), ("What is 3 plus 4?", "3 and 4 make 8. "
              "The answer is 8."), ("What is 5 plus 1?", "5 plus 1 is 6. The answer is 6."),
             ("What is 5 plus 1?", "1 more than 5 is 6. The answer is 6.")]
    tok = train_tiny_bpe([t for pair in texts for t in pair] * 40, vocab_size=300)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).double().eval()
    cfg = oar_config({"mode": "auto", "auto_candidates": ["gradient", "fisher"], "auto_rows": 2, "auto_prompts": 1,
                      "auto_every": 2, "auto_fallback": "best", "probe": "as_mean", "fidelity_every": 1})
    items = _items(tok, texts, [1.0, -1.0, 0.5, -0.5])
    auto = AutoStep(cfg)
    reshape_cfg, run_cfg = auto.resolved(1)
    assert reshape_cfg.mode == run_cfg.mode == "fisher" and auto.calibrating
    lines = auto.measure(items, model, tok, run_cfg, 1, max_tokens=None)
    assert len(lines) == 1 and "DECIDED" in lines[0], lines
    m = auto.metrics(1)
    assert m["oar/auto/all/decided"] == 1 and m["oar/auto/all/rows"] == 4 and m["oar/auto/all/prompts"] == 2
    assert m["oar/auto/calibrating"] == 1 and "oar/auto/all/gain/gradient/random_lo" in m
    auto.note_update(2.0, sum(int(it.sequences.numel()) for it in items))
    reshape_cfg, run_cfg = auto.resolved(2)
    assert not auto.calibrating and auto.measure(items, model, tok, run_cfg, 2, max_tokens=None) == []
    assert reshape_cfg.mode == auto.selector.mode("all") and auto.update_spt > 0
    reshape_cfg, run_cfg = auto.resolved(3)  # the re-check, with a cost now
    auto.measure(items, model, tok, run_cfg, 3, max_tokens=None)
    assert auto.calibrating and 0 < auto.metrics(3)["oar/auto/all/cost/gradient"] < float("inf")
    got = reshape_replay_buffer(items, model, tok, reshape_cfg, 2, max_tokens=None).metrics
    assert got["oar/fidelity/rows"] == 4 and got["timing/oar_fidelity"] > 0
    assert all(k in got for k in ("oar/fidelity/aopc", "oar/fidelity/gain_over_random",
                                  "oar/fidelity/gain_over_position"))
