"""Attribution's seconds where it runs inside a pass that runs anyway (issue #57 item 4: the cost shown is the cost
paid): the shared readers (oar_verl.core.backends.shared) time their own work -- fisher's and conservative's
backwards, OAR-G's probe reads -- and not the caller's forward, with the accelerator synchronised at each timed
segment's two ends only (a fake accelerator counts the waits here; on a GPU they make the seconds the device's).

What the worker returns (``oar_seconds``) and the step logs from it (``timing_s/oar_in_old_log_prob``,
``timing_s/oar_total``): test_step_on_cpu.py, test_worker_group_on_cpu.py (verl's worker group) and the e2e runs.
"""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig, prepare_attribution
from oar_verl.core.backends.shared import ForwardLayout, SharedTeacher, Stopwatch
from oar_verl.core.methods.attribution import shared_attribution
from oar_helpers import text_lm

PROMPTS = ["What is 3 plus 4?", "What is 5 plus 1?", "What is 2 plus 2?", "What is 9 plus 1?"]
RESPONSES = ["3 plus 4 is 7. The answer is 7.", "5 plus 1 is 6. #### 6", "2 and 2 make 4, so the answer is 4.",
             "9 plus 1 is ten. The answer is 10."]
SLOW_FORWARD_S = 0.4  # the caller's forward, slowed down: none of it may count as attribution's


class FakeClock:
    """The readers' clock (``time.perf_counter`` as oar_verl.core.backends.shared reads it), controlled by the test:
    each reading advances it by a microsecond, :meth:`advance` by what a slow step takes, so that no verdict depends on
    how busy the machine is."""

    def __init__(self, monkeypatch):
        import types

        import oar_verl.core.backends.shared as shared

        self.now = 0.0
        monkeypatch.setattr(shared, "time", types.SimpleNamespace(perf_counter=self))

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def setup():
    tok, model = text_lm([*PROMPTS, *RESPONSES] * 40)
    enc = lambda t: torch.tensor(tok.encode(t, add_special_tokens=False))  # noqa: E731
    return tok, model, [enc(p) for p in PROMPTS], [torch.cat([enc(r), torch.tensor([tok.eos_token_id])])
                                                   for r in RESPONSES]


class FakeAccelerator:
    """``torch.accelerator`` as on a machine with one: counts the synchronisations asked for."""

    def __init__(self, monkeypatch):
        self.waits = 0
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "synchronize", self.synchronize)

    def synchronize(self, device=None):
        self.waits += 1


def slow_forwards(model, prepared, shared, clock: FakeClock, rows_per_forward=2) -> float:
    """The caller's forwards (padded rows, ``rows_per_forward`` a forward), each slowed by SLOW_FORWARD_S on
    ``clock``; their seconds on it."""
    batch = prepared.batch
    handle = model.register_forward_pre_hook(lambda module, args: clock.advance(SLOW_FORWARD_S))
    start = clock()
    try:
        with torch.no_grad():  # as verl's old-log-prob pass runs
            for r in torch.arange(batch.input_ids.shape[0]).split(rows_per_forward):
                inputs = batch.model_inputs(r)
                with shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
                    model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return clock() - start


@pytest.mark.parametrize("mode", ["fisher", "conservative", "gradient"])
def test_a_shared_reader_times_its_own_work_not_the_forward(setup, monkeypatch, mode):
    """fisher / conservative: their backwards; OAR-G (``SharedTeacher``): its probe reads. > 0, below the forwards'
    own time (each forward sleeps longer than everything the reader does), and two accelerator waits per forward:
    one timed segment each, none per token."""
    tok, model, prompts, responses = setup
    cfg = OARConfig(mode=mode, probe="as_mean")
    prepared = prepare_attribution(prompts, responses, tok, cfg, 3)
    shared = shared_attribution(model, prepared.batch, cfg, lambda tokens: False,
                                mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
    assert isinstance(shared, SharedTeacher) == (mode == "gradient")
    assert shared.seconds == 0.0
    accelerator = FakeAccelerator(monkeypatch)
    wall = slow_forwards(model, prepared, shared, FakeClock(monkeypatch))
    assert 0.0 < shared.seconds < SLOW_FORWARD_S, shared.seconds
    assert wall > 2 * SLOW_FORWARD_S + shared.seconds
    assert accelerator.waits == 2 * 2  # two forwards, a timed segment each


def test_a_stopwatch_sums_its_blocks_and_waits_at_their_ends(monkeypatch):
    time = FakeClock(monkeypatch)
    clock = Stopwatch()
    with clock():  # no accelerator here: nothing to wait for
        time.advance(0.05)
    accelerator = FakeAccelerator(monkeypatch)
    with clock():
        time.advance(0.05)
    assert accelerator.waits == 2 and 0.1 <= clock.seconds < 1.0
