"""The mask operator (``algorithm.oar.mask``, oar_verl.core.checks.mask_token): the embedding operators (zero, mean) of OAR-P
and fisher against the float64 per-sequence references of devtools.reference, the resampled tokens' invariants,
and the refusal of mask tokens that end a turn (EOS, chat-template and other special tokens), at start-up and at run
time."""

from __future__ import annotations

import pytest
import torch

from oar_verl.core import OARConfig
from devtools import reference
from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.backends.hf import ModuleBackend, embedding_mean
from oar_verl.core.backends.budget import PassLimits
from oar_verl.core.config import OARConfigError
from oar_verl.core.methods.fisher import fisher
from oar_verl.core.batch.layout import build_attribution_batch, with_segments
from oar_verl.core.methods.mask_operator import mask_replacement, resample_ids
from oar_verl.core.checks.mask_token import check_mask_token, unsafe_mask_reason
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.quickstart.tokenizers import IM_END, IM_START, PAD_TOKEN, train_tiny_bpe
from oar_helpers import run_p

LT_LOGITS, AS_MEAN, AS_JOINT = ProbeKind.LT_LOGITS, ProbeKind.AS_MEAN, ProbeKind.AS_JOINT


# ------------------------------------------------------------------------------------------ embedding operators
@pytest.mark.parametrize("op, kind", [("mean", LT_LOGITS), ("mean", AS_MEAN), ("mean", AS_JOINT), ("zero", AS_MEAN)])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_oar_p_embedding_operators_match_naive(lm64, make_batch, op, prefix_cache, kind):
    rows = make_batch(B=4, P=5, T=9, seed=int(kind) * 7 + prefix_cache)
    batch = build_attribution_batch(*rows, torch.full((4,), kind))
    fast = run_p(lm64, batch, None, PassLimits(10**6, rows=3, copies=3), prefix_cache=prefix_cache, mask=op)
    ref = reference.batch_oar_p(lm64, *rows, kind, op)
    torch.testing.assert_close(fast[:, batch.response_start:].double(), ref, rtol=1e-5, atol=1e-9)
    assert ref.abs().sum() > 0 and bool((fast[~batch.reasoning_mask] == 0).all())
    # the operator changes the scores: not the pad token's numbers under another name
    assert not torch.allclose(ref, reference.batch_oar_p(lm64, *rows, kind, 0))


@pytest.mark.parametrize("policy", ["segment", "hierarchical"])
def test_segment_policies_with_the_mean_embedding_match_naive(lm64, make_batch, policy):
    rows = make_batch(B=3, P=4, T=12, seed=5)
    reasoning = rows[4]
    segments = torch.where(reasoning, torch.arange(12)[None] // 3, -1)  # segments of 3 reasoning tokens
    batch = with_segments(build_attribution_batch(*rows, torch.full((3,), AS_MEAN)), segments)
    cfg = OARConfig(mode="perturbation", perturbation=policy, refine_share=0.4, mask="mean")
    got = run_attribution(module_backend(lm64, cfg, limits=PassLimits(10**6, copies=3)), batch, cfg).importance
    want = torch.zeros(rows[2].shape, dtype=torch.float64)
    for b in range(3):
        ids, reas, answer, p = reference._row(*rows, b)
        seg = segments[b, : int(rows[3][b].sum())]
        segs = [[p + int(i) for i in (seg == k).nonzero().squeeze(1)] for k in range(int(seg.max()) + 1)]
        segs = [s for s in segs if s]
        if policy == "segment":
            scores = reference.oar_p_segments(lm64, ids, reas, answer, AS_MEAN, "mean", segs)
        else:
            scores = reference.oar_p_hierarchical(lm64, ids, reas, answer, AS_MEAN, "mean", segs, 0.4)
        want[b, : len(ids) - p] = scores[p:]
    torch.testing.assert_close(got[:, batch.response_start:].double(), want, rtol=1e-5, atol=1e-9)
    assert want.abs().sum() > 0


@pytest.mark.parametrize("op", ["zero", "mean"])
@pytest.mark.parametrize("kind", [AS_MEAN, AS_JOINT])
@pytest.mark.parametrize("shared", [True, False])
def test_fisher_embedding_operators_match_the_reference(lm64, make_batch, op, kind, shared):
    rows = make_batch(B=4, P=4, T=9, seed=3)
    batch = build_attribution_batch(*rows, torch.full((4,), int(kind)))
    backend = ModuleBackend(lm64, PassLimits(10**6))
    backend.shared_backwards = shared
    got, _ = fisher(backend, batch, mask_replacement(backend, batch, op, None, None), outcomes=3)
    ref = reference.batch_fisher(lm64, *rows, kind, op, 3)
    torch.testing.assert_close(got[:, batch.response_start:].double(), ref, rtol=1e-6, atol=1e-12)
    assert bool((ref != 0).sum() > 10)
    cfg = OARConfig(mode="fisher", mask=op, fisher_outcomes=3)  # the configured path builds the same replacement
    via_cfg = run_attribution(module_backend(lm64, cfg), batch, cfg).importance
    torch.testing.assert_close(via_cfg, got)


def test_mean_embedding_is_what_the_scaled_embedding_outputs(lm64):
    emb = lm64.get_input_embeddings()
    torch.testing.assert_close(embedding_mean(lm64), emb(torch.arange(emb.weight.shape[0])).mean(0))
    torch.testing.assert_close(embedding_mean(lm64).double(), reference.mask_vector(lm64, "mean"))
    emb.embed_scale = 3.0  # Gemma's scaled embedding: the module's output, not the raw table
    try:
        torch.testing.assert_close(embedding_mean(lm64), 3.0 * emb.weight.mean(0))
    finally:
        del emb.embed_scale


# ------------------------------------------------------------------------------------------------------ resample
def test_resample_draws_from_the_row_and_ignores_the_layout(make_batch):
    rows = make_batch(B=5, P=4, T=10, seed=11)
    batch = build_attribution_batch(*rows, torch.full((5,), AS_MEAN))
    seeds = torch.arange(5) * 1000 + 7
    ids = resample_ids(batch, seeds)
    torch.testing.assert_close(ids, resample_ids(batch, seeds))  # deterministic
    mask = batch.reasoning_mask
    assert bool((ids[~mask] == batch.input_ids[~mask]).all())
    for b in range(5):  # every draw is one of the row's own reasoning tokens
        own = set(batch.input_ids[b][mask[b]].tolist())
        assert set(ids[b][mask[b]].tolist()) <= own
    assert bool((ids[mask] != batch.input_ids[mask]).any())  # a draw, not the identity
    # a row's draws do not depend on the other rows, its padding or its place in the batch
    sub = [3, 1]
    sub_batch = build_attribution_batch(*(r[sub] for r in rows), torch.full((2,), AS_MEAN))
    sub_ids = resample_ids(sub_batch, seeds[sub])
    for i, b in enumerate(sub):
        torch.testing.assert_close(sub_ids[i][sub_batch.reasoning_mask[i]], ids[b][mask[b]])


def test_oar_p_resample_is_layout_invariant(lm64, make_batch):
    rows = make_batch(B=4, P=4, T=9, seed=13)
    batch = build_attribution_batch(*rows, torch.full((4,), AS_MEAN))
    seeds = torch.arange(4) + 100
    cfg = OARConfig(mode="perturbation", mask="resample")
    a = run_attribution(module_backend(lm64, cfg, limits=PassLimits(10**6, copies=2)), batch, cfg, seeds=seeds)
    cfg_nc = OARConfig(mode="perturbation", mask="resample", prefix_cache=False)
    b = run_attribution(module_backend(lm64, cfg_nc, limits=PassLimits(10**6, copies=5)), batch, cfg_nc, seeds=seeds)
    torch.testing.assert_close(a.importance, b.importance, rtol=1e-6, atol=1e-12)
    one = build_attribution_batch(*(r[2:3] for r in rows), torch.full((1,), AS_MEAN))
    alone = run_attribution(module_backend(lm64, cfg), one, cfg, seeds=seeds[2:3]).importance
    torch.testing.assert_close(alone[0, one.response_start:], a.importance[2, batch.response_start:],
                               rtol=1e-6, atol=1e-12)
    assert a.importance.abs().sum() > 0


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_bpe(["the answer is 42. so we add 3 and 4."] * 4, vocab_size=300)


def _with(tok, **specials):
    """A copy of ``tok`` with other special tokens (the same vocabulary and chat template)."""
    kwargs = {"eos_token": tok.eos_token, "pad_token": tok.pad_token, **specials}
    return tok.__class__(tokenizer_object=tok.backend_tokenizer, chat_template=tok.chat_template, **kwargs)


def test_a_pad_that_is_the_eos_is_refused(tokenizer):
    tok = _with(tokenizer, pad_token=IM_END)  # SmolLM2: pad = <|im_end|> = eos
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=pad: the mask token \d+ \('<\|im_end\|>'.*"
                                             r"end-of-sequence.*algorithm\.oar\.mask=mean\|zero\|resample.*"
                                             r"algorithm\.oar\.mask_token_id=<a plain token>"):
        check_mask_token(OARConfig(mode="perturbation", mask="pad"), tok)


def test_end_of_turn_and_other_special_tokens_are_refused(tokenizer):
    start = tokenizer.convert_tokens_to_ids(IM_START)
    assert "chat template" in unsafe_mask_reason(tokenizer, start)
    # an end-of-turn token that is not the tokenizer's eos: in the chat template
    tok = _with(tokenizer, eos_token=PAD_TOKEN)
    assert "chat template" in unsafe_mask_reason(tok, tok.convert_tokens_to_ids(IM_END))
    # the generation config's extra eos ids (Qwen2.5-Instruct: <|endoftext|> is one)
    pad = tokenizer.pad_token_id
    assert "end-of-sequence" in unsafe_mask_reason(tokenizer, pad, eos_ids=[pad])
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=pad"):
        check_mask_token(OARConfig(mode="fisher", mask="pad"), tokenizer, eos_ids=[pad])
    # a bos that is no eos and not in the template is still structure
    tok = _with(tokenizer, bos_token=PAD_TOKEN, pad_token=None)
    assert "special token" in unsafe_mask_reason(tok, tok.convert_tokens_to_ids(PAD_TOKEN))
    assert "outside" in unsafe_mask_reason(tokenizer, len(tokenizer) + 5)
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=token: the mask token .*mask_token_id="):
        check_mask_token(OARConfig(mode="perturbation", mask="token", mask_token_id=start), tokenizer)


def test_safe_mask_tokens_pass(tokenizer):
    # the tiny tokenizers' pad <|endoftext|> is a dedicated pad: no eos, not in the chat template
    assert check_mask_token(OARConfig(mode="perturbation", mask="pad"), tokenizer) == tokenizer.pad_token_id
    plain = tokenizer.encode("the", add_special_tokens=False)[0]
    cfg = OARConfig(mode="perturbation", mask="token", mask_token_id=plain)
    assert check_mask_token(cfg, tokenizer) == plain
    tok = _with(tokenizer, mask_token="<|mask|>")  # a dedicated mask token (an added special token)
    assert unsafe_mask_reason(tok, tok.mask_token_id) is None
    # operators that insert no token, and OAR-G, need none
    assert check_mask_token(OARConfig(mode="perturbation"), _with(tokenizer, pad_token=IM_END)) is None
    assert check_mask_token(OARConfig(mode="gradient", mask="pad"), _with(tokenizer, pad_token=IM_END)) is not None


def test_the_template_check_reads_what_the_template_writes_not_its_jinja_source(tokenizer):
    from oar_verl.core.checks.mask_token import template_token_ids

    # `_` and `[` are in the Jinja source (add_generation_prompt, message['role']) but the template never writes them
    for text in ("_", "["):
        (tid,) = tokenizer.encode(text, add_special_tokens=False)
        assert unsafe_mask_reason(tokenizer, tid) is None
    # what it writes: the role markers, the role names and the separator
    written = template_token_ids(tokenizer)
    for text in (IM_START, IM_END, "\n"):
        assert tokenizer.convert_tokens_to_ids(text) in written or tokenizer.encode(text, add_special_tokens=False)[
            0] in written
    # a template whose role marker is plain text (no special token): the marker's tokens are refused
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token,
                                chat_template="{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + "
                                              "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '### assistant: ' }}"
                                              "{% endif %}")
    hashes = plain.encode("###", add_special_tokens=False)
    assert all("chat template" in unsafe_mask_reason(plain, t) for t in hashes)
    # a template that refuses a system turn is read from the next probe conversation
    strict = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token,
                                 chat_template="{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system')"
                                               " }}{% endif %}" + tokenizer.chat_template)
    assert strict.convert_tokens_to_ids(IM_END) in template_token_ids(strict)
    # no template: nothing written; a template that renders nothing usable: None (the special-token check still runs)
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token)
    assert template_token_ids(bare) == set()
    broken = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token,
                                 chat_template="{{ raise_exception('never') }}")
    assert template_token_ids(broken) is None
    assert unsafe_mask_reason(broken, broken.encode("the", add_special_tokens=False)[0]) is None
    # named templates (a dict, here without a "default"): every one is rendered, what any of them writes is refused
    named = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token)
    named.chat_template = {"chat": tokenizer.chat_template, "tool_use": plain.chat_template}
    written = template_token_ids(named)
    assert tokenizer.convert_tokens_to_ids(IM_END) in written and set(hashes) <= written
    assert "chat template" in unsafe_mask_reason(named, hashes[0])


def test_run_time_resolution_refuses_too(tokenizer):
    from oar_verl.core.preprocess import prepare_attribution

    tok = _with(tokenizer, pad_token=IM_END)
    prompts = [torch.tensor(tok.encode("so we add", add_special_tokens=False))]
    responses = [torch.tensor(tok.encode("3 and 4. the answer is 42", add_special_tokens=False))]
    with pytest.raises(OARConfigError, match=r"algorithm\.oar\.mask=pad"):
        prepare_attribution(prompts, responses, tok, OARConfig(mode="perturbation", mask="pad"), 0)
    prepared = prepare_attribution(prompts, responses, tok, OARConfig(mode="perturbation"), 0)
    assert prepared.mask_token_id is None  # mean: no token


def test_the_mask_operators_are_a_registry_with_their_facts():
    """What each operator does is read from its registry entry (no name tests): which insert a token, which take
    mask_token_id, which move a masked token to one embedding (what fisher linearises), in registration order."""
    from oar_verl.core.methods.contract import METHODS
    from oar_verl.core.methods.mask_operator import MASK_OPERATORS, operators_for

    facts = {n: (op.inserts_token, op.needs_mask_token_id, op.one_embedding)
             for n in MASK_OPERATORS.names() for op in [MASK_OPERATORS.get(n)]}
    assert facts == {"mean": (False, False, True), "zero": (False, False, True), "resample": (False, False, False),
                     "pad": (True, False, True), "token": (True, True, True)}
    assert list(facts) == ["mean", "zero", "resample", "pad", "token"]
    assert operators_for(METHODS.get("fisher")) == ("mean", "zero", "pad", "token")
    assert operators_for(METHODS.get("perturbation"), inserting=False) == ("mean", "zero", "resample")
    assert operators_for(METHODS.get("fisher"), inserting=False) == ("mean", "zero")
    with pytest.raises(ValueError, match=r"mask=pad needs a mask token: .*use mask=mean\|zero\|resample$"):
        mask_replacement(None, None, "pad", None, None)
    with pytest.raises(ValueError, match=r"algorithm\.oar\.mask='eos' is not a registered mask operator"):
        mask_replacement(None, None, "eos", None, None)


def test_a_masking_method_without_a_token_names_the_operators_it_takes(lm64, make_batch):
    """fisher cannot linearise resample: its error offers the embedding operators only; OAR-P offers resample too."""
    rows = make_batch(B=2, P=3, T=4, seed=4)
    batch = build_attribution_batch(*rows, torch.full((2,), int(AS_MEAN)))
    cfg = OARConfig(mode="fisher", mask="pad")
    with pytest.raises(ValueError, match=r"algorithm\.oar\.mode=fisher needs a mask token: .*"
                                         r"algorithm\.oar\.mask=mean\|zero$"):
        run_attribution(module_backend(lm64, cfg), batch, cfg)
    cfg = OARConfig(mode="perturbation", mask="token", mask_token_id=3)
    with pytest.raises(ValueError, match=r"OAR-P needs a mask token: .*algorithm\.oar\.mask=mean\|zero\|resample$"):
        run_attribution(module_backend(lm64, cfg), batch, cfg)
