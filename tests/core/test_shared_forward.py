"""Attribution read from a forward the caller runs anyway (oar_verl.core.backends.shared): the same scores as the
method's own passes, in padded and packed layouts, with and without recompute; the forward's logits unchanged."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig, module_backend, run_attribution
from oar_verl.core.backends.base import frozen_parameters
from oar_verl.core.backends.budget import row_spans
from oar_verl.core.backends.memory import ModelShape, PassKind, pass_bytes, recompute_choice, recompute_policy
from oar_verl.core.backends.shared import ForwardLayout
from oar_verl.core.batch.layout import build_attribution_batch
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.methods.attribution import shared_attribution, shared_modes

MASK = 5


def mixed_batch(make_batch, seed: int = 3):
    rows = make_batch(B=5, P=4, T=12, seed=seed)
    kinds = torch.tensor([ProbeKind.AS_MEAN, ProbeKind.LT_LOGITS, ProbeKind.AS_JOINT, ProbeKind.AS_MEAN,
                          ProbeKind.LT_LOGITS])
    return build_attribution_batch(*rows, kinds)


def padded_forwards(model, batch, shared, rows_per_forward: int = 2):
    """The caller's forwards: rows in column windows, ``rows_per_forward`` a forward; returns their logits."""
    out = []
    for r in torch.arange(batch.input_ids.shape[0]).split(rows_per_forward):
        inputs = batch.model_inputs(r)
        with shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
            out.append(model(**inputs, use_cache=False).logits)
    return torch.cat(out)


def packed_forward(model, batch, shared, order):
    """verl's layout: the rows ``order`` packed end to end in one (1, total) forward, positions restarting per row."""
    start, end = row_spans(batch.attention_mask)
    ids = torch.cat([batch.input_ids[r, start[r]:end[r]] for r in order.tolist()])[None]
    pos = torch.cat([torch.arange(int(end[r] - start[r])) for r in order.tolist()])[None]
    with shared.forward(ForwardLayout.sequences(order, (end - start)[order], start[order])):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits


CONFIGS = [("fisher", dict(fisher_outcomes=1)), ("fisher", dict(fisher_outcomes=2, fisher_sketches=2)),
           ("conservative", {}), ("conservative", dict(attention_rule="uniform"))]


@pytest.mark.parametrize("mode,keys", CONFIGS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("recompute", [True, False])
def test_shared_forward_equals_the_methods_own_passes(lm64, make_batch, mode, keys, layout, recompute):
    cfg = OARConfig(mode=mode, mask="token", mask_token_id=MASK, **keys)
    batch = mixed_batch(make_batch)
    own = run_attribution(module_backend(lm64, cfg), batch, cfg, mask_token_id=MASK).importance
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: recompute, mask_token_id=MASK)
    with torch.no_grad():  # the caller's old-log-prob pass runs without grad: the shared forward lifts it
        if layout == "padded":
            padded_forwards(lm64, batch, shared)
        else:
            packed_forward(lm64, batch, shared, torch.tensor([3, 0, 4, 1, 2]))
    got = shared.result()
    torch.testing.assert_close(got, own, rtol=1e-9, atol=1e-12)
    assert int((own != 0).sum()) > 10
    assert shared.choices and all(c == recompute for _, c in shared.choices)
    assert all(p.grad is None and p.requires_grad for p in lm64.parameters())


@pytest.mark.parametrize("mode", ["fisher", "conservative"])
def test_the_forward_s_logits_are_unchanged(lm32, make_batch, mode):
    cfg = OARConfig(mode=mode, mask="token", mask_token_id=MASK)
    batch = mixed_batch(make_batch, seed=9)
    with torch.no_grad():
        plain = torch.cat([lm32(**batch.model_inputs(r), use_cache=False).logits
                           for r in torch.arange(batch.input_ids.shape[0]).split(2)])
        shared = shared_attribution(lm32, batch, cfg, lambda tokens: False, mask_token_id=MASK)
        logits = padded_forwards(lm32, batch, shared)
    assert torch.equal(logits, plain)  # bitwise: the caller's log-probs are its own
    assert bool((shared.result() != 0).any())


def test_rows_the_caller_did_not_run_score_zero(lm64, make_batch):
    cfg = OARConfig(mode="fisher", mask="token", mask_token_id=MASK)
    batch = mixed_batch(make_batch)
    own = run_attribution(module_backend(lm64, cfg), batch, cfg, mask_token_id=MASK).importance
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: True, mask_token_id=MASK)
    r = torch.tensor([1, 3])
    inputs = batch.model_inputs(r)
    with shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
        lm64(**inputs, use_cache=False)
    got = shared.result()
    torch.testing.assert_close(got[r], own[r], rtol=1e-9, atol=1e-12)
    assert bool((got[torch.tensor([0, 2, 4])] == 0).all())


def test_methods_with_their_own_passes_are_refused_by_name(lm64, make_batch):
    assert set(shared_modes()) == {"fisher", "conservative"}
    assert set(shared_modes(teacher=True)) == {"fisher", "conservative", "gradient"}
    for mode in ("perturbation", "path"):
        with pytest.raises(ValueError, match=rf"mode={mode} cannot read .* the modes that can: gradient, "
                                             "conservative, fisher"):
            shared_attribution(lm64, mixed_batch(make_batch), OARConfig(mode=mode), lambda tokens: True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("samples", [1, 3])
def test_oar_g_with_teachers_read_from_the_forward_equals_its_own_passes(lm64, make_batch, layout, samples):
    """OAR-G's clean teachers read from the caller's forward (``SharedTeacher``): the same scores as its own teacher
    passes, with one and several noise draws; the forward's logits and the parameters untouched."""
    cfg = OARConfig(mode="gradient", noise_samples=samples)
    batch = mixed_batch(make_batch)
    seeds = torch.arange(5, dtype=torch.long) * 7919 + 11
    own = run_attribution(module_backend(lm64, cfg), batch, cfg, seeds=seeds).importance
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: True, seeds=seeds)
    with torch.no_grad():
        if layout == "padded":
            logits = padded_forwards(lm64, batch, shared)
            plain = torch.cat([lm64(**batch.model_inputs(r), use_cache=False).logits
                               for r in torch.arange(5).split(2)])
            assert torch.equal(logits, plain)
        else:
            packed_forward(lm64, batch, shared, torch.tensor([3, 0, 4, 1, 2]))
    assert shared.choices == []  # nothing recomputed: no backward ran through the caller's forward
    got = run_attribution(module_backend(lm64, cfg), batch, cfg, seeds=seeds, teachers=shared.teachers()).importance
    torch.testing.assert_close(got, own, rtol=1e-9, atol=1e-12)
    assert int((own != 0).sum()) > 10
    assert all(p.grad is None and p.requires_grad for p in lm64.parameters())


def test_oar_g_teachers_of_rows_the_caller_did_not_run_are_an_error(lm64, make_batch):
    cfg = OARConfig(mode="gradient")
    batch = mixed_batch(make_batch)
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: True)
    r = torch.tensor([1, 3])
    inputs = batch.model_inputs(r)
    with torch.no_grad(), shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
        lm64(**inputs, use_cache=False)
    with pytest.raises(RuntimeError, match=r"held no forward of rows \[0, 2, 4\] whose clean teacher OAR-G"):
        shared.teachers()
    with pytest.raises(RuntimeError, match="ran no forward"):
        with shared.forward(ForwardLayout.padded(r, inputs["attention_mask"], 0)):
            pass


@pytest.mark.parametrize("keys", [{"mode": "fisher"}, {"mode": "fisher", "fisher_outcomes": 2, "fisher_sketches": 1},
                                  {"mode": "conservative"}])
def test_a_methods_declared_columns_are_its_targets(lm64, make_batch, keys):
    """``Method.shared_columns`` (what an engine with one backward per forward, Megatron's, decides by) is the loss
    columns of the target the method builds."""
    from oar_verl.core.methods.attribution import METHODS

    cfg = OARConfig(**keys, mask_token_id=MASK)
    shared = shared_attribution(lm64, mixed_batch(make_batch), cfg, lambda tokens: True, mask_token_id=MASK)
    assert shared.target.columns == METHODS.get(cfg.mode).shared_columns(cfg)


def test_a_block_without_a_forward_is_an_error(lm64, make_batch):
    cfg = OARConfig(mode="fisher", mask="token", mask_token_id=MASK)
    shared = shared_attribution(lm64, mixed_batch(make_batch), cfg, lambda tokens: True, mask_token_id=MASK)
    r = torch.tensor([0])
    with pytest.raises(RuntimeError, match="ran no forward"):
        with shared.forward(ForwardLayout.padded(r, torch.ones(1, 3, dtype=torch.long), 0)):
            pass
    assert all(p.requires_grad for p in lm64.parameters())  # everything restored on the way out


def test_recompute_choice_on_both_sides_of_its_threshold():
    shape = ModelShape(28, 3584, 18944, 28, 4, 128, 152064)

    def need(tokens, kept):
        return pass_bytes(PassKind.INPUT_GRADIENT, tokens, shape, kept_layers=kept, logit_positions=8)

    assert need(4096, 0) == pass_bytes(PassKind.INPUT_GRADIENT, 4096, shape, checkpointing=True, logit_positions=8)
    assert need(4096, 28) == pass_bytes(PassKind.INPUT_GRADIENT, 4096, shape, logit_positions=8)
    auto = recompute_choice("auto", need, need(4096, 28), 28)
    assert auto(4096) == 0.0 and auto(4097) > 0.0  # keeps every layer exactly while they fit
    # between the two: as many layers kept as fit, the others recomputed
    auto = recompute_choice("auto", need, need(4096, 10), 28)
    assert auto(4096) == 18 / 28 and need(4096, 10) <= need(4096, 10) < need(4096, 11)
    assert recompute_choice("auto", need, need(4096, 0) - 1, 28)(4096) == 1.0  # not even the inputs fit: all
    assert recompute_choice("auto", need, None, 28)(16) == 1.0  # no known bound: the safe side
    assert recompute_choice("always", need, 0, 28)(16) == 1.0 and recompute_choice("never", need, 0, 28)(10**6) == 0.0
    with pytest.raises(ValueError, match="algorithm.oar.recompute='sometimes' is not allowed; choose one of: auto, "
                                         "always, never"):
        recompute_choice("sometimes", need, 0, 28)


def test_recompute_policy_is_bounded_by_the_update():
    shape = ModelShape(28, 3584, 18944, 28, 4, 128, 152064)
    cpu = torch.device("cpu")
    update = pass_bytes(PassKind.UPDATE, 8192, shape, checkpointing=True)
    assert update < pass_bytes(PassKind.TRAINING, 8192, shape, checkpointing=True)  # no fp32 copy of every logit
    for host in (None, PassKind.LOG_PROB):
        need = lambda t, k: 1.5 * (pass_bytes(PassKind.INPUT_GRADIENT, t, shape, kept_layers=k, logit_positions=8)
                                   + (pass_bytes(host, t, shape) if host else 0))
        policy = recompute_policy("auto", shape, PassKind.INPUT_GRADIENT, cpu, 8192, host=host)
        for tokens in (1024, 4096, 8192):
            share = policy(tokens)
            kept = round(28 * (1 - share))
            assert share == 1.0 or need(tokens, kept) <= update, (host, tokens, share)
            assert kept == 28 or need(tokens, kept + 1) > update, (host, tokens, share)
        assert policy(1024) < policy(8192)  # longer rows keep fewer layers
    # read from the old-log-prob pass, its logits live beside attribution's activations: fewer layers kept
    alone = recompute_policy("auto", shape, PassKind.INPUT_GRADIENT, cpu, 8192)
    inside = recompute_policy("auto", shape, PassKind.INPUT_GRADIENT, cpu, 8192, host=PassKind.LOG_PROB)
    assert all(inside(t) > alone(t) for t in (2048, 4096))
    with_grads = recompute_policy("auto", shape, PassKind.INPUT_GRADIENT, cpu, 8192, grad_bytes=15 * 2**30)
    assert with_grads(8192) < alone(8192)  # the update's gradients are free while attribution runs
    assert recompute_policy("auto", None, PassKind.INPUT_GRADIENT, cpu, 8192)(1) == 1.0


@pytest.mark.parametrize("share", [0.5, 1.0, 0.0])
def test_partial_recompute_keeps_the_scores(lm64, make_batch, share):
    """Checkpointing some of the layers changes what is stored for the backward, never the scores."""
    from oar_verl.core.backends.hf import ModuleBackend
    from oar_verl.core.backends.budget import PassLimits

    cfg = OARConfig(mode="fisher", mask="token", mask_token_id=MASK)
    batch = mixed_batch(make_batch)
    own = run_attribution(module_backend(lm64, cfg), batch, cfg, mask_token_id=MASK).importance
    backend = ModuleBackend(lm64, PassLimits(10**6), checkpointing=lambda tokens: share)
    got = run_attribution(backend, batch, cfg, mask_token_id=MASK).importance
    torch.testing.assert_close(got, own, rtol=1e-9, atol=1e-12)
    assert backend.recomputed == [share]
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: share, mask_token_id=MASK)
    with torch.no_grad():
        padded_forwards(lm64, batch, shared)
    torch.testing.assert_close(shared.result(), own, rtol=1e-9, atol=1e-12)


def test_layouts_name_the_same_tokens():
    """A padded forward in a column window, the same rows packed end to end and right-padded to a width name the same
    (row, column) tokens, each at its own flat position."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    rows = torch.tensor([4, 2])
    padded = ForwardLayout.padded(rows, mask, lo=3)
    packed = ForwardLayout.sequences(rows, torch.tensor([3, 2]), torch.tensor([4, 3]))
    right = ForwardLayout.sequences(rows, torch.tensor([3, 2]), torch.tensor([4, 3]), width=5)
    for other in (packed, right):
        assert torch.equal(padded.row, other.row) and torch.equal(padded.col, other.col)
    assert padded.flat.tolist() == [1, 2, 3, 4, 5] and packed.flat.tolist() == [0, 1, 2, 3, 4]
    assert right.flat.tolist() == [0, 1, 2, 5, 6]


def test_right_padded_forward_equals_the_methods_own_passes(lm64, make_batch):
    """verl's padded layout (rows right-padded to the longest of the micro-batch, real tokens first)."""
    cfg = OARConfig(mode="fisher", mask="token", mask_token_id=MASK)
    batch = mixed_batch(make_batch)
    own = run_attribution(module_backend(lm64, cfg), batch, cfg, mask_token_id=MASK).importance
    shared = shared_attribution(lm64, batch, cfg, lambda tokens: True, mask_token_id=MASK)
    start, end = row_spans(batch.attention_mask)
    order = torch.tensor([2, 4, 0, 1, 3])
    lengths = (end - start)[order]
    width = int(lengths.max())
    ids = torch.zeros(len(order), width, dtype=torch.long)
    mask = torch.arange(width)[None] < lengths[:, None]
    ids[mask] = torch.cat([batch.input_ids[r, start[r]:end[r]] for r in order.tolist()])
    pos = torch.where(mask, torch.arange(width)[None], 0)
    with torch.no_grad(), shared.forward(ForwardLayout.sequences(order, lengths, start[order], width)):
        lm64(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False)
    torch.testing.assert_close(shared.result(), own, rtol=1e-9, atol=1e-12)


def test_shard_start_takes_verl_s_padded_shards_and_refuses_others():
    """Under Ulysses a rank's embedding output is one (1, s) shard of the packed row, s × size >= the forward's tokens:
    verl pads the row to a multiple of the group and, with ``pad_to_length``, of its bucket first, so a shard may hold
    more positions than the forward's real tokens (a check of s <= tokens refused that layout). Not one shard of a
    packed row, or shards that cannot cover the tokens: an error naming the shape (without a process group, this
    rank's verdict alone; on several ranks all raise together: tests/core/sequence_parallel_job.py)."""
    from oar_verl.core.backends.shared import shard_start
    from oar_verl.core.backends.ulysses import SequenceShards

    h = torch.zeros(1, 64, 3)  # a bucket of 128 positions over 2 ranks, for a micro-batch of 23 real tokens
    assert shard_start(SequenceShards(None, 1, 2), h, 23) == 64
    assert shard_start(SequenceShards(None, 0, 2), h[:, :12], 23) == 0  # 23 tokens padded to 24, no bucket
    assert shard_start(None, torch.zeros(3, 9, 3), 20) == 0  # no sequence parallelism: the whole forward
    with pytest.raises(RuntimeError, match=r"23 packed tokens reached the embedding as \(1, 11\)"):
        shard_start(SequenceShards(None, 1, 2), h[:, :11], 23)  # 22 positions over the group: tokens lost
    with pytest.raises(RuntimeError, match=r"as \(2, 32\)"):
        shard_start(SequenceShards(None, 0, 2), torch.zeros(2, 32, 3), 23)  # padded rows, not one packed row
