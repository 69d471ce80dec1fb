"""TRL batches whose completions hold tool outputs (TRL's ``tools`` loop, a ``rollout_func``'s ``env_mask``:
``tool_mask`` 0 on them): the adapter gives the core the model's own tokens, so the tool outputs are context
(docs/multi_turn.md) in every mode. Against the core given the same model mask on the same rows; no context token
scored, reshaped, in an answer span (a row whose only answer-pattern match is a tool's output has no span), or
replaced in any pass's input (a spy on the token ids and the input-embedding output every forward reads); Σw = R
over the model's reasoning tokens and the advantage mass kept. The fast lane: no trainer, no subprocess."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="needs TRL 1.16: runs in .venv-trl (tests/trl/test_trl_env.py, "
                                  "scripts/setup_trl_env.sh)")

from trl.trainer.utils import pad  # noqa: E402

from oar_verl.core import OARConfig, attribute  # noqa: E402
from oar_verl.core.pipeline import reshape  # noqa: E402
from oar_verl.trl.reshape import batch_rows, reshape_batch, rows_to_run  # noqa: E402

pytestmark = pytest.mark.trl
# (mode, mask operator): every mode with the default operator (an embedding one), and OAR-P's copies with ids swapped
CASES = [("conservative", "mean"), ("fisher", "mean"), ("gradient", "mean"), ("perturbation", "mean"),
         ("path", "mean"), ("perturbation", "resample")]
ALTERS = ("gradient", "perturbation", "path")  # modes whose passes move reasoning tokens' inputs (noise, copies)
ADVANTAGES = torch.tensor([1.2, -0.6, -0.6, 0.9, -0.45, 0.0])


def tool_batch(tok):
    """TRL's padded batch of 6 rows, each completion built turn by turn as TRL's tool loop builds it (the model's
    turn up to its EOS, the tool's result with the chat template around it, ``tool_mask`` 0, the next turn), padded
    as TRL pads (``tool_mask`` with 1). Each row its own numbers (the spy tells the rows apart by their tokens):

    0: call, tool output, "The answer is 7."     1: call, a tool output "The answer is 9.", a final turn without one
    2: call, tool, call, tool, answer            3: cut inside a tool output that holds an answer
    4: one turn, no tool                         5: masked out (TRL's mask_truncated_completions), zero advantage
    """
    eos = tok.eos_token_id
    enc = (lambda text: tok.encode(text, add_special_tokens=False))
    call = (lambda a, b: enc(f"I add {a} and {b}. <tool_call>add {a} {b}</tool_call>") + [eos])
    tool = (lambda text: enc(f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n"))
    final = (lambda n: enc(f"so the sum is {n}. The answer is {n}.") + [eos])
    layouts = [
        (3, 4, [(call(3, 4), 1), (tool("7"), 0), (final(7), 1)]),
        (5, 6, [(call(5, 6), 1), (tool("11. The answer is 11."), 0), (enc("so that is all") + [eos], 1)]),
        (2, 9, [(call(2, 9), 1), (tool("11"), 0), (call(11, 1), 1), (tool("12"), 0), (final(12), 1)]),
        (8, 1, [(call(8, 1), 1), (tool("9. The answer is 9.")[:9], 0)]),
        (6, 2, [(enc("6 and 2 make 8.") + final(8), 1)]),
        (1, 1, [(call(1, 1), 1), (tool("2"), 0), (final(2), 1)]),
    ]
    prompts, completions, masks = [], [], []
    for a, b, parts in layouts:
        prompts.append(torch.tensor(tok.apply_chat_template([{"role": "user", "content": f"What is {a} plus {b}?"}],
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)))
        completions.append(torch.tensor([t for ids, _ in parts for t in ids]))
        masks.append(torch.tensor([m for ids, m in parts for _ in ids]))
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    tool_mask = pad(masks, padding_value=1, padding_side="right")
    completion_mask[5], tool_mask[5] = 0, 0  # truncated under mask_truncated_completions: TRL zeroes both
    batch = dict(prompt_ids=pad(prompts, padding_value=tok.pad_token_id, padding_side="left"),
                 prompt_mask=pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
                 completion_ids=pad(completions, padding_value=tok.pad_token_id, padding_side="right"),
                 completion_mask=completion_mask, tool_mask=tool_mask, advantages=ADVANTAGES.clone())
    return batch, prompts, completions, masks


class EmbeddingSpy:
    """Every forward of the policy: its token ids, positions and attention mask (the causal LM's inputs) and the
    input-embedding output the first decoder layer reads (after any hook of a mask operator, OAR-G's noise or the
    path's move), on the CPU."""

    def __init__(self, model):
        self.calls, self._inputs = [], None
        self.handles = [model.register_forward_pre_hook(self._at_model, with_kwargs=True),
                        model.model.layers[0].register_forward_pre_hook(self._at_layer, with_kwargs=True)]

    def _at_model(self, module, args, kwargs):
        self._inputs = tuple(kwargs[k].detach().cpu() for k in ("input_ids", "position_ids", "attention_mask"))

    def _at_layer(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.calls.append((*self._inputs, hidden.detach().cpu()))

    def remove(self):
        for h in self.handles:
            h.remove()


def altered_context(spy: EmbeddingSpy, table: torch.Tensor, sequences: list[torch.Tensor],
                    context: list[torch.Tensor]) -> tuple[int, int]:
    """(context positions any forward altered, positions altered in all): each forward row matched to the batch row
    whose tokens it holds (by position; the unique one with the fewest differing ids), a position altered where its
    id differs from that row's or its embedding output from the table's row of its id."""
    bad = moved = 0
    for ids, pos, am, hidden in spy.calls:  # per forward (a handful)
        am = am[:, -ids.shape[1]:].bool()  # a prefix-cache pass: the mask spans the cached columns too
        changed = (hidden != table[ids]).any(-1)
        for j in range(ids.shape[0]):  # per forward row
            real, p = am[j], pos[j]
            fits = [r for r, s in enumerate(sequences) if int(p[real].max()) < len(s)]
            diffs = [int((sequences[r][p[real]] != ids[j][real]).sum()) for r in fits]
            best = min(diffs)
            assert diffs.count(best) == 1, "a forward row that matches two batch rows"
            r = fits[diffs.index(best)]
            alt = (changed[j] | (sequences[r][p.clamp(max=len(sequences[r]) - 1)] != ids[j])) & real
            bad += int((alt & context[r][p.clamp(max=len(sequences[r]) - 1)]).sum())
            moved += int(alt.sum())
    return bad, moved


@pytest.mark.parametrize("mode,mask", CASES)
def test_tool_outputs_are_context_in_every_mode(policy, mode, mask):
    model, tok = policy
    batch, prompts, completions, masks = tool_batch(tok)
    cfg = OARConfig(mode=mode, mask=mask)
    spy = EmbeddingSpy(model)
    try:
        out = reshape_batch(model, tok, cfg, 1, **batch)
    finally:
        spy.remove()
    adv, att, w = out.advantages, out.attribution, out.reshaped.token_weights
    C = adv.shape[1]
    model_mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    valid = batch["completion_mask"].bool()
    context = valid & ~model_mask
    assert context.any(-1).tolist() == [True, True, True, True, False, False]
    assert torch.equal(out.model_mask, model_mask)

    # (a) the core's attribute + reshape given the model mask, on the same rows
    live = [0, 1, 2, 3, 4]
    assert att.attributed.tolist() == [True] * 5 + [False]
    ref = attribute(model, [prompts[i] for i in live], [completions[i] for i in live], tok, cfg, 1,
                    model_masks=[masks[i] for i in live])
    T = ref.importance.shape[1]
    for name in ("reasoning_mask", "answer_mask"):
        assert torch.equal(getattr(att, name)[live, :T], getattr(ref, name)), name
    assert torch.equal(att.span_found[live], ref.span_found)
    assert att.span_found.tolist() == [True, False, True, False, True, False]  # rows 1 and 3: only a tool's span
    base = ADVANTAGES[live, None] * model_mask[live, :T]  # TRL's: its loss masks the tool tokens
    core = reshape(base, ref, cfg, response_mask=model_mask[live, :T])
    # fp32 over different pass packings, amplified by the per-row min-max normalisation (the adapter test's bound)
    assert float((att.importance[live, :T] - ref.importance).abs().max()) < 1e-3 * float(ref.importance.abs().max())
    assert float((adv[live, :T] - core.advantages).abs().max()) < 1e-3
    assert torch.equal(w.reshaped[live, :T], core.token_weights.reshaped)
    assert not adv[:, T:].any() and not adv[5].any()

    # (b) no context token scored, reasoning, in an answer span or reshaped; its advantage TRL's (0), bit for bit
    assert (att.importance[context] == 0).all()
    assert not ((att.reasoning_mask | att.answer_mask | w.reshaped) & context).any()
    assert (adv[context] == 0).all()
    assert (att.importance[att.reasoning_mask] != 0).any()
    for b in (1, 3):  # the only answer-pattern match is inside a tool output: no span, w = 1, GRPO's advantage
        assert not att.reasoning_mask[b].any() and (w.weights[b][model_mask[b]] == 1).all()
        assert torch.equal(adv[b][model_mask[b]], ADVANTAGES[b].expand(int(model_mask[b].sum())))

    # (c) no pass replaced or moved a context token in its input
    P = batch["prompt_ids"].shape[1]
    sequences = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    ctx = [torch.cat([torch.zeros(len(p), dtype=torch.bool), m == 0]) for p, m in zip(prompts, masks)]
    bad, moved = altered_context(spy, model.get_input_embeddings().weight.detach(), sequences, ctx)
    assert spy.calls and P > 0
    assert bad == 0, f"{mode}/{mask}: {bad} context positions replaced or moved in a pass's input"
    assert (moved > 0) == (mode in ALTERS), (mode, moved)

    # (d) Σw = R over each reshaped row's reasoning tokens (the model's), the advantage mass on the model's tokens
    rows = w.reshaped.any(-1)
    assert rows[[0, 2, 4]].all() and not rows[[1, 3, 5]].any()
    R = w.reshaped.sum(-1).double()
    assert ((torch.where(w.reshaped, w.weights.double(), 0.0).sum(-1) - R).abs() <= 1e-6 * R).all()  # fp32 weights
    mass = torch.where(model_mask, adv.double(), 0.0).sum(-1)
    assert (mass - ADVANTAGES.double() * model_mask.sum(-1)).abs().max() <= 1e-6 * C
    assert (w.weights[rows] != 1).any(), "the weights move credit"
    assert out.metrics["oar/adv_mass_rel_err"] < 1e-6
    assert out.metrics["oar/span_found_frac"] == pytest.approx(3 / 5)


def test_without_the_model_mask_the_tool_outputs_answer_is_taken(policy):
    """What the mask prevents: the core not told which tokens are the model's takes a tool's "The answer is" as the
    row's answer and scores the tool's tokens."""
    model, tok = policy
    _, prompts, completions, masks = tool_batch(tok)
    blind = attribute(model, prompts[1:2], completions[1:2], tok, OARConfig(), 1)
    tool = (masks[1] == 0)
    assert bool(blind.span_found[0]) and blind.answer_mask[0, :len(tool)][tool].any()
    assert (blind.importance[0, :len(tool)][tool] != 0).any()


def test_the_filler_row_carries_its_model_mask(policy):
    """A process with no row of its own (the others attribute: the passes are collective) runs a filler row with its
    model mask: the first row with a model token, else row 0 (a masked-out row: its first id as the model's)."""
    _, tok = policy
    batch, _, completions, masks = tool_batch(tok)
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
    rows = batch_rows(*(batch[k] for k in keys))
    none = torch.zeros(0, dtype=torch.long)
    has = rows.loss_mask.any(-1)
    idx, responses, run_masks = rows_to_run(rows, none, has, batch["completion_ids"])
    assert idx == [0] and torch.equal(responses[0], completions[0]) and torch.equal(run_masks[0], masks[0].bool())
    idx, responses, run_masks = rows_to_run(rows, torch.tensor([2, 3]), has, batch["completion_ids"])
    assert idx == [2, 3] and all(torch.equal(m, masks[i].bool()) for m, i in zip(run_masks, idx))
    masked = {k: batch[k][5:] for k in keys}  # only a masked-out row on this process
    rows = batch_rows(*masked.values())
    idx, responses, run_masks = rows_to_run(rows, none, rows.loss_mask.any(-1), masked["completion_ids"])
    assert idx == [0] and len(responses[0]) == 1 and run_masks[0].tolist() == [True]
