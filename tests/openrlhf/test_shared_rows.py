"""Scores read from OpenRLHF's experience-maker forward (oar_verl.openrlhf.shared) equal the replay buffer's own passes.

No OpenRLHF here (the module imports none): the forward is OpenRLHF's ``Actor.forward`` as it calls the model --
padded rows with its position ids, or rows packed end to end (``packing_samples``) -- on a float64 tiny model; the
items are the replay buffer's, split from the forward's rows as OpenRLHF splits them. OpenRLHF's own loop with the
shared forward: tests/openrlhf/test_openrlhf.py (the sync run's decided step).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oar_verl.core.config import OARConfig
from oar_verl.openrlhf.reshape import reshape_replay_buffer
from oar_verl.openrlhf.shared import SharedRows, attributed_forward, batch_items
from oar_helpers import text_lm

PROMPTS = ["What is 3 plus 4?", "What is 5 plus 1?", "What is 2 plus 2?", "What is 9 plus 1?"]
RESPONSES = ["3 plus 4 is 7. The answer is 7.", "5 plus 1 is 6. #### 6", "2 and 2 make 4, so the answer is 4.",
             "9 plus 1 is ten. The answer is 10."]
ADVANTAGES = [1.0, -0.5, 0.0, 2.0]  # the third row has none: left alone either way


@pytest.fixture(scope="module")
def setup():
    tok, model = text_lm([*PROMPTS, *RESPONSES] * 40)
    seqs = [torch.tensor(tok.encode(p + " " + r, add_special_tokens=False) + [tok.eos_token_id]) for p, r in
            zip(PROMPTS, RESPONSES)]
    plen = [len(tok.encode(p, add_special_tokens=False)) for p in PROMPTS]
    L = max(len(s) for s in seqs) + 2  # right padding on every row
    sequences = torch.full((len(seqs), L), tok.pad_token_id)
    attention = torch.zeros(len(seqs), L, dtype=torch.long)
    action = torch.zeros(len(seqs), L - 1, dtype=torch.bool)
    for i, s in enumerate(seqs):  # OpenRLHF's samples: prompt + response, right-padded, action_mask shifted by one
        sequences[i, :len(s)], attention[i, :len(s)] = s, 1
        action[i, plen[i] - 1:len(s) - 1] = True
    return tok, model, sequences, action, attention


def openrlhf_forward(model, sequences, attention, packed):
    """The model call of OpenRLHF's ``Actor.forward``: padded rows with positions from the mask, or packed rows
    (kept apart by their restarting positions, as the flash-attention kernel OpenRLHF packs with keeps them)."""
    if packed:
        real = attention.bool()
        ids = sequences[real][None]
        pos = (attention.cumsum(-1) - 1)[real][None]
        return model(ids, position_ids=pos, use_cache=False).logits
    pos = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    return model(sequences, attention_mask=attention, position_ids=pos, use_cache=False).logits


def buffer(sequences, action, attention, order):
    """The replay buffer's items of rows ``order`` (another order than the forward's, as balance_experiences
    leaves them), with their outcome advantages over the action tokens."""
    items = batch_items(sequences, action, attention)
    out = []
    for i in order:
        it = items[i]
        adv = ADVANTAGES[i] * it.action_mask.double()
        out.append(SimpleNamespace(sequences=it.sequences, action_mask=it.action_mask,
                                   attention_mask=it.attention_mask, advantages=adv, returns=adv.clone(),
                                   labels=None))
    return out


@pytest.mark.parametrize("mode", ["fisher", "conservative"])
@pytest.mark.parametrize("packed", [False, True])
def test_scores_read_from_the_forward_equal_the_items_own_passes(setup, mode, packed):
    tok, model, sequences, action, attention = setup
    cfg = OARConfig(mode=mode, probe="as_mean")
    shared = SharedRows(3, mode)
    logits = []
    with torch.no_grad():
        plain = []  # the same forwards without attribution (the same rows in one batch: bitwise comparable)
        for rows in ([2, 0], [3, 1]):  # two experience batches, rows in the forward's order
            r = torch.tensor(rows)
            plain.append(openrlhf_forward(model, sequences[r], attention[r], packed))
            items = batch_items(sequences[r], action[r], attention[r])
            with attributed_forward(model, tok, cfg, 3, items, attention[r], packed=packed, checkpointing=True,
                                    device=torch.device("cpu")) as read:
                logits.append(openrlhf_forward(model, sequences[r], attention[r], packed))
            shared.rows.update(read.rows)
            assert read.seconds > 0  # attribution's own work inside the forward, kept for fit to report
            shared.seconds += read.seconds
    # OpenRLHF's log-probs come from the same logits as without attribution
    assert all(torch.equal(got, want) for got, want in zip(logits, plain))
    assert len(shared.rows) == 4
    gathered = shared.gathered()  # one rank here: its rows and its seconds
    assert gathered.rows.keys() == shared.rows.keys() and gathered.seconds == shared.seconds > 0
    order = [1, 3, 0, 2]
    own_items, read_items = buffer(sequences, action, attention, order), buffer(sequences, action, attention, order)
    own = reshape_replay_buffer(own_items, model, tok, cfg, 3, max_tokens=64)
    read = reshape_replay_buffer(read_items, model, tok, cfg, 3, max_tokens=64, shared=shared)
    assert read.attributed.tolist() == own.attributed.tolist() == [True, True, True, False]
    torch.testing.assert_close(read.importance, own.importance, rtol=1e-7, atol=1e-12)
    assert int((own.importance != 0).sum()) > 10
    for a, b in zip(read_items, own_items):
        torch.testing.assert_close(a.advantages, b.advantages, rtol=1e-7, atol=1e-12)
    assert read.metrics["oar/shared_forward"] == 1.0 and own.metrics["oar/shared_forward"] == 0.0


def test_an_item_the_forwards_did_not_score_runs_its_own_passes(setup):
    tok, model, sequences, action, attention = setup
    cfg = OARConfig(mode="fisher", probe="as_mean")
    shared = SharedRows(3, "fisher")
    r = torch.tensor([0, 3])  # rows 1 and 2 were scored elsewhere, or not at all
    with torch.no_grad(), attributed_forward(model, tok, cfg, 3, batch_items(sequences[r], action[r], attention[r]),
                                             attention[r], packed=False, checkpointing=False,
                                             device=torch.device("cpu")) as read:
        openrlhf_forward(model, sequences[r], attention[r], packed=False)
    shared.rows.update(read.rows)
    own = reshape_replay_buffer(buffer(sequences, action, attention, range(4)), model, tok, cfg, 3, max_tokens=64)
    mixed = reshape_replay_buffer(buffer(sequences, action, attention, range(4)), model, tok, cfg, 3, max_tokens=64,
                                  shared=shared)
    torch.testing.assert_close(mixed.importance, own.importance, rtol=1e-7, atol=1e-12)
    assert mixed.metrics["oar/shared_forward"] == pytest.approx(2 / 3)  # rows 0 and 3 of the 3 attributed
