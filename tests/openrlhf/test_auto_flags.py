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
        out.append(types.SimpleNamespace(sequences=seq, attention_mask=torch.ones_like(seq), action_mask=am,
                                         advantages=adv, returns=adv.clone(), labels=None))
    return out


def _tiny(texts):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oar_verl.quickstart.tokenizers import train_tiny_bpe

    tok = train_tiny_bpe([t for pair in texts for t in pair] * 40, vocab_size=300)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).double().eval()
    return tok, model


TEXTS = [("What is 3 plus 4?", "3 plus 4 is 7. The answer is 7."), ("What is 3 plus 4?", "3 and 4 make 8. "
          "The answer is 8."), ("What is 5 plus 1?", "5 plus 1 is 6. The answer is 6."),
         ("What is 5 plus 1?", "1 more than 5 is 6. The answer is 6.")]


def test_the_actor_side_calibrates_decides_and_measures_the_in_step_fidelity():
    """One rank (no process group): AutoStep scores the candidates on the replay buffer's attributable rows and
    decides; the next step attributes with the decision and measures nothing; reshape_replay_buffer logs the in-step
    fidelity as verl does, with the entropy control of the measured rows; the selector's state survives a checkpoint
    round trip."""
    import torch

    from oar_verl.openrlhf.auto import AutoStep
    from oar_verl.openrlhf.reshape import reshape_replay_buffer

    tok, model = _tiny(TEXTS)
    cfg = oar_config({"mode": "auto", "auto_candidates": ["gradient", "fisher"], "auto_default": "fisher", "auto_rows": 2, "auto_prompts": 1,
                      "auto_every": 2, "auto_fallback": "best", "probe": "as_mean", "fidelity_every": 1})
    items = _items(tok, TEXTS, [1.0, -1.0, 0.5, -0.5])
    asked = []

    def ents(idx):  # the policy's entropies by item index, as oar_verl.openrlhf.entropy gives them (checked against
        asked.append(list(idx))  # OpenRLHF's own Actor in tests/openrlhf/openrlhf_job.py)
        out = []
        for i in idx:
            logp = torch.log_softmax(model(items[i].sequences[None]).logits[0].double(), -1)
            start = int(items[i].action_mask.nonzero()[0])
            out.append(-(logp.exp() * logp).sum(-1)[start: start + int(items[i].action_mask.sum())].detach())
        return out

    auto = AutoStep(cfg)
    plan = auto.plan(items, 1)
    assert [(c.mode, rows.tolist()) for c, rows in plan] == [("fisher", [True] * 4)] and auto.calibrating
    lines = auto.measure(items, model, tok, 1, max_tokens=None, entropies=ents)
    assert len(lines) == 1 and "DECIDED" in lines[0], lines
    m = auto.metrics(1)
    assert m["oar/auto/all/decided"] == 1 and m["oar/auto/all/rows"] == 4 and m["oar/auto/all/prompts"] == 2
    assert m["oar/auto/calibrating"] == 1 and "oar/auto/all/gain/gradient/random_lo" in m
    assert "oar/auto/all/gain/gradient/entropy_lo" in m and asked == [[0, 1, 2, 3]]  # the measured rows only
    auto.note_update(2.0, sum(int(it.sequences.numel()) for it in items))
    plan = auto.plan(items, 2)
    assert not auto.calibrating and auto.measure(items, model, tok, 2, max_tokens=None) == []
    assert [c.mode for c, _ in plan] == [auto.selector.mode("all")] and auto.update_spt > 0
    resumed = AutoStep(cfg)
    assert "resumed from the checkpoint" in resumed.load_state_dict(auto.state_dict())
    assert resumed.selector.modes() == auto.selector.modes() and not resumed.selector.calibrating(2)
    auto.plan(items, 3)  # the re-check, with a cost now
    auto.measure(items, model, tok, 3, max_tokens=None)
    assert auto.calibrating and 0 < auto.metrics(3)["oar/auto/all/cost/gradient"] < float("inf")
    got = reshape_replay_buffer(items, model, tok, cfg, 2, max_tokens=None, plan=plan, entropies=ents).metrics
    assert got["oar/fidelity/rows"] == 4 and got["timing/oar_fidelity"] > 0
    assert all(k in got for k in ("oar/fidelity/aopc", "oar/fidelity/gain_over_random",
                                  "oar/fidelity/gain_over_position", "oar/fidelity/gain_over_entropy"))


def test_rows_inside_and_past_the_window_are_decided_apart():
    """With a sliding window, each band calibrates and decides on its own rows; a band on the plain-GRPO fallback is
    in no plan entry (its items keep their advantages) while the other band's rows are reshaped."""
    import torch

    from oar_verl.openrlhf.auto import AutoStep, item_lengths
    from oar_verl.openrlhf.reshape import reshape_replay_buffer

    long = [(p, r + " So " + r) for p, r in TEXTS]  # the same problems, twice the response
    tok, model = _tiny(TEXTS + long)
    items = _items(tok, TEXTS + long, [1.0, -1.0, 0.5, -0.5] * 2)
    lengths = item_lengths(items)
    window = int(lengths[:4].max())
    assert bool((lengths[4:] > window).all())
    cfg = oar_config({"mode": "auto", "auto_candidates": ["gradient"], "auto_rows": 4, "auto_prompts": 2,
                      "auto_every": 5, "auto_fallback": "grpo", "probe": "as_mean", "fidelity_rows": 8})
    auto = AutoStep(cfg, window)
    assert auto.bands(items) == ("inside",) * 4 + ("past",) * 4
    auto.plan(items, 1)
    lines = auto.measure(items, model, tok, 1, max_tokens=None)
    assert sorted(line.split("]")[0] for line in lines) == ["oar auto [inside", "oar auto [past"], lines
    m = auto.metrics(1)
    assert m["oar/auto/inside/rows"] == 4 and m["oar/auto/past/rows"] == 4
    # force one band onto the fallback and the other onto the candidate: only the latter's rows are reshaped
    auto.selector._bands["inside"]["mode"], auto.selector._bands["past"]["mode"] = "grpo", "gradient"
    plan = auto.plan(items, 2)
    assert [(c.mode, rows.tolist()) for c, rows in plan] == [("gradient", [False] * 4 + [True] * 4)]
    before = [it.advantages.clone() for it in items]
    res = reshape_replay_buffer(items, model, tok, cfg, 2, max_tokens=None, plan=plan)
    assert res.attributed.tolist() == [False] * 4 + [True] * 4
    assert all(torch.equal(it.advantages, b) for it, b in zip(items[:4], before[:4]))
    assert any(not torch.equal(it.advantages, b) for it, b in zip(items[4:], before[4:]))
