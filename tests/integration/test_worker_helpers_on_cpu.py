"""Token dumps for heatmaps: group selection and the JSONL record layout."""

from __future__ import annotations

import json

import numpy as np
import torch

from oar_verl.core.config import OARConfig
from oar_verl.integration import dumps
from oar_verl.quickstart.tiny_assets import build_tokenizer


def _written(every, attributed, key="algorithm.oar.dump_every", where=""):
    """(step, due step) of each dump a run with ``attributed`` = {step: bool} writes."""
    schedule = dumps.DumpSchedule(every, key, where)
    return [(s, d) for s, a in attributed.items() if (d := schedule.take(s, a)) is not None]


def test_dump_dir(tmp_path):
    assert dumps.dump_dir(OARConfig(dump_every=3), str(tmp_path)) == tmp_path / "oar_dumps"
    assert dumps.dump_dir(OARConfig(dump_dir="x/y"), str(tmp_path)).as_posix() == "x/y"


def test_dumps_on_every_multiple_and_a_due_step_without_attributed_rows_passes_its_dump_on(capsys):
    """dump_every=2 over steps 1-9 with nothing attributed at steps 2, 3, 6 and 7: step 4 writes the dump due at
    step 2 (one dump, not one per due step passed on), step 8 the one due at 6; the log says so once, at the due
    step, naming the key as the user sets it."""
    everything = {s: True for s in range(1, 10)}
    assert _written(3, everything) == [(3, 3), (6, 6), (9, 9)]
    assert _written(0, everything) == []
    attributed = {1: True, 2: False, 3: False, 4: True, 5: True, 6: False, 7: False, 8: True, 9: True}
    assert _written(2, attributed) == [(4, 2), (8, 6)]
    said = capsys.readouterr().out
    assert "no row reshaped from its scores at step 2" in said and "at step 6 (" in said
    assert "step 3 " not in said and "step 4 " not in said  # said once, at the due step
    assert "(algorithm.oar.dump_every=2)" in said
    assert _written(1, attributed, "oar_dump_every", " on the main process") == [(1, 1), (4, 2), (5, 5), (8, 6), (9, 9)]
    said = capsys.readouterr().out
    assert "no row reshaped from its scores on the main process at step 2" in said and "(oar_dump_every=1)" in said


def test_steps_that_skip_numbers_or_resume_still_dump():
    """TRL's OAR steps skip numbers where a generation serves several optimizer steps (1, 3, 5, ...): the first step
    at or past each multiple is due. A resumed run starts at its checkpoint's step + 1."""
    odd = {s: True for s in range(1, 12, 2)}
    assert _written(2, odd) == [(3, 3), (5, 5), (7, 7), (9, 9), (11, 11)]
    assert _written(4, odd) == [(5, 5), (9, 9)]
    assert _written(5, {s: True for s in range(11, 21)}) == [(15, 15), (20, 20)]
    assert _written(4, {s: s != 5 for s in range(1, 12, 2)}) == [(7, 5), (9, 9)]


def test_a_step_number_going_back_starts_the_schedule_afresh():
    """A second launch from an earlier step on the same schedule (TRL: ``train()`` again, resuming an earlier
    checkpoint): the dump waiting from the first is dropped, never recorded as due after the step that writes it."""
    schedule = dumps.DumpSchedule(5, "oar_dump_every")
    first = [(s, schedule.take(s, s != 10)) for s in range(1, 11)]
    assert [w for w in first if w[1] is not None] == [(5, 5)]  # step 10 tied: its dump waits
    again = [(s, schedule.take(s, True)) for s in range(5, 11)]
    assert [w for w in again if w[1] is not None] == [(5, 5), (10, 10)]


def test_a_dump_passed_on_records_its_due_step(tmp_path):
    tok = build_tokenizer(seed=0)
    ids = torch.tensor([tok.encode("The answer is 4.", add_special_tokens=False)])
    T = ids.shape[1]
    ones, zeros = torch.ones(1, T), torch.zeros(1, T)
    uids = np.array(["a"], dtype=object)
    for step, due, want in ((4, 2, {"due_step": 2}), (4, 4, {}), (4, None, {})):
        path = dumps.write_dump(tmp_path / f"s{step}_{due}.jsonl", step, [0], uids, torch.ones(1), torch.ones(1), ids,
                                ones, zeros, ones, ones, zeros, torch.ones(1, dtype=torch.bool), tok, due_step=due)
        record = json.loads(path.read_text())
        assert {k: record[k] for k in record if k == "due_step"} == want and record["step"] == 4


def test_pick_groups_takes_whole_groups():
    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    attributed = torch.tensor([False, False, True, True, True, False])
    assert dumps.pick_groups(uids, attributed, 1) == [2, 3]
    assert dumps.pick_groups(uids, attributed, 2) == [2, 3, 4, 5]


def test_write_dump_records(tmp_path):
    tok = build_tokenizer(seed=0)
    texts = ["2 plus 3 is 5. The answer is 5.", "The answer is 4."]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    T = max(map(len, ids))
    responses = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T)
    for i, r in enumerate(ids):
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    w = torch.rand(2, T) * mask
    # OAR-G's scores are often ~1e-7: the dump must hold them to float32 precision, not to a number of decimals
    importance = w * 10.0 ** torch.randint(-9, 2, (2, T))
    path = dumps.write_dump(tmp_path / "d" / "step_3.jsonl", 3, [0, 1], np.array(["u", "u"], dtype=object),
                            torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), responses, mask, importance, w,
                            mask.bool(), torch.zeros(2, T, dtype=torch.bool), torch.tensor([True, False]), tok)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["sample"] for r in recs] == [0, 1]
    assert "".join(recs[0]["tokens"]) == texts[0] and "".join(recs[1]["tokens"]) == texts[1]
    assert len(recs[1]["weight"]) == len(ids[1]) and recs[0]["span_found"] and not recs[1]["span_found"]
    assert not list(tmp_path.glob("d/*.tmp"))
    for i, r in enumerate(recs):
        assert torch.equal(torch.tensor(r["importance"], dtype=torch.float32), importance[i, :len(r["importance"])])


def test_the_old_log_prob_entropies_are_read_from_either_trainer():
    """The worker reads verl's old-log-prob entropies as one 1-D tensor per response: nested (the V1 trainers'
    TransferQueue field ``entropy``) or padded and cut by the response mask (``entropys``, which OAR's legacy adapter
    hands over); None when the batch has none (bypass mode: the entropy control is skipped, not faked)."""
    from tensordict import TensorDict

    from oar_verl.integration.worker import response_entropies

    rows = [torch.tensor([0.5, 1.5, 2.5]), torch.tensor([3.0])]
    nested = TensorDict({"entropy": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[2])
    got = response_entropies(nested)
    assert len(got) == 2 and all(torch.equal(g, r) for g, r in zip(got, rows))
    padded = TensorDict({"entropys": torch.tensor([[0.5, 1.5, 2.5], [3.0, 9.0, 9.0]]),
                         "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}, batch_size=[2])
    got = response_entropies(padded)
    assert all(torch.equal(g, r) for g, r in zip(got, rows))
    assert response_entropies(TensorDict({"response_mask": torch.ones(2, 3)}, batch_size=[2])) is None
