"""The SmolLM2 learning harness (research/smol_learning.py, issue #69): the device command dry-run end to end on the
CPU with a random tiny Llama (scripts/smol_learning.sh --tiny, the GPU machine's packages only), the default's
advantages read from the old-log-prob pass on written rows (Σw = R, the core's own attribution), GRPO's advantage and
the loss against verl's, the analysis on known curves, and the protocol page quoting the module's numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from research import REPO
from research import smol_learning as sl
from research import smol_task

DOC = REPO / "research" / "docs" / "learning_smollm2.md"


# ---------------------------------------------------------------------------------------------------------------------
# The device command, dry-run
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``bash scripts/smol_learning.sh OUT --tiny --device cpu`` (the device's script), with every distribution the GPU
    machine lacks hidden (devtools.gpu_bundle's blocker, no bundle: the harness needs no verl, Ray or OmegaConf)."""
    from devtools import gpu_bundle, smol_carry

    out = tmp_path_factory.mktemp("smol_learning")
    block = tmp_path_factory.mktemp("block")
    (block / "sitecustomize.py").write_text(gpu_bundle.blocker(smol_carry.CARRIED, bundle=False))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(block), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "smol_learning.sh"), str(out), "--tiny", "--device", "cpu",
                           "--threads", "1"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    logs = (out / "seeds.log").read_text() if (out / "seeds.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return out, proc.stdout


def test_dry_run_writes_every_step_of_both_arms_in_lockstep(dry_run):
    out, stdout = dry_run
    assert "decision:" in stdout
    assert sorted(f.name for f in out.iterdir()) == ["processes.json", "results.json", "seeds.log", "steps.jsonl"]
    runs = sl.read_steps(out / sl.STEPS)
    assert sorted(runs) == list(sl.TINY.seeds)
    for s in sl.TINY.seeds:
        got = runs[s]
        assert got["start"]["tiny"] and got["start"]["protocol"]["s_max"] == sl.TINY.s_max
        assert got["end"] == {**got["end"], "event": "done", "steps": sl.TINY.s_max, "reason": "s_max"}
        for arm in sl.ARMS:
            assert sorted(got["steps"][arm]) == list(range(1, sl.TINY.s_max + 1))
            for rec in got["steps"][arm].values():
                assert len(rec["rewards"]) == sl.TINY.rollouts
                assert rec["success"] == pytest.approx(np.mean(rec["rewards"]))
                assert set(rec["seconds"]) == {"generate", "log_prob", "attribution", "update", "step"}
                assert 0 < rec["response_tokens"] <= sl.TINY.max_new_tokens
        g, d = got["steps"]["grpo"][1], got["steps"]["default"][1]
        assert g["responses_sha"] == d["responses_sha"] and g["rewards"] == d["rewards"]  # step 1: the same rollouts
        for rec in got["steps"]["default"].values():  # Σw = R on every row the default reshaped
            assert rec["w_sum_err"] <= 1e-4 and rec["reshaped_rows"] >= 0


def test_dry_run_analysis_has_every_key(dry_run):
    out, _ = dry_run
    r = json.loads((out / "results.json").read_text())
    assert {"seeds_counted", "seeds_dropped", "s_prime", "auc", "d", "mean_d", "ci95", "p", "decision", "verdict",
            "inconclusive", "criteria", "final_success", "per_seed", "protocol", "processes"} <= set(r)
    assert r["seeds_counted"] == list(sl.TINY.seeds) and r["s_prime"] == sl.TINY.s_max and r["tiny"]
    assert set(r["criteria"]) == {"1_too_few_seeds_or_steps", "2_grpo_did_not_learn", "3_an_arm_collapsed"}
    assert r["criteria"]["1_too_few_seeds_or_steps"]["holds"] and r["decision"] == "inconclusive"  # 2 seeds, 2 steps
    assert all(v["step1_identical"] for v in r["per_seed"].values())
    assert r["processes"]["returncodes"] == {str(s): 0 for s in sl.TINY.seeds}


# ---------------------------------------------------------------------------------------------------------------------
# The default's advantages, read from the old-log-prob pass
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_advantages_conserve_mass_and_equal_the_cores_own_attribution(dtype):
    """fp32 (the CPU run) and a bf16 module with fp32 buffers (what ``load`` makes on CUDA): the default's advantages
    read from the old-log-prob pass, then one update through fp32 master weights."""
    from oar_verl.core.config import OARConfig
    from oar_verl.core.pipeline import attribute, reshape

    model, tok, eot, _ = sl.load(True, "cpu")
    if dtype == torch.bfloat16:
        wide = {n: b.detach().clone() for n, b in model.named_buffers()}
        model = model.to(dtype)
        for n, b in model.named_buffers():
            b.data = wide[n]
    setting = smol_task.SETTINGS[sl.PROTOCOL.setting]
    ps = smol_task.problems(setting, 2, seed=1001)
    ids = smol_task.prompt_ids(tok, setting, ps)
    texts = [ps[0].solution, ps[0].solution.replace(f"is {ps[0].answer}.", f"is {ps[0].answer + 1}."),
             ps[1].solution, "I am not sure."]
    rows = [0, 0, 1, 1]
    prompts = [torch.tensor(ids[i]) for i in rows]
    responses = [torch.tensor(tok.encode(t, add_special_tokens=False) + [eot]) for t in texts]
    r = sl.make_rollouts(tok, prompts, responses, [ps[i].answer for i in rows], rows, "cpu")
    assert r.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    base = sl.grpo_advantage(r.rewards, r.uids)
    p = sl.TINY
    old, adv, res, seconds = sl.default_advantages(model, tok, r, base, 1, p)
    assert torch.equal(old, sl.log_prob_pass(model, r, p))  # the pass's log-probs are the plain pass's
    w, reshaped = res.token_weights.weights, res.token_weights.reshaped
    for i in range(3):  # rows with an answer span: Σw = R over their reasoning tokens, Â = w · A
        assert reshaped[i].any()
        assert float(w[i][reshaped[i]].sum()) == pytest.approx(int(reshaped[i].sum()), rel=1e-5)
    assert not reshaped[3].any() and torch.all(w[3][r.response_mask[3]] == 1)  # no span: GRPO's uniform weights
    assert torch.allclose(adv, w * base[:, None] * r.response_mask, atol=1e-6)
    cfg = OARConfig(mode=p.mode)
    own = attribute(model, prompts, responses, tok, cfg, 1)  # the method's own passes, not read from the pass
    theirs = reshape(base, own, cfg, response_mask=r.response_mask)
    assert own.reasoning_mask.sum() > 0
    assert torch.allclose(theirs.token_weights.weights, w, atol=1e-5 if dtype == torch.float32 else 2e-2)
    policy = sl.Policy(model, p)
    before = [q.detach().clone() for q in policy.master]
    loss, norm = sl.update(policy, r, old, adv, p)
    assert norm > 0 and policy.mixed == (dtype != torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.master))
    assert all(torch.equal(q, m.to(q.dtype)) for q, m in zip(policy.params, policy.master))
    assert all(m.dtype == torch.float32 for m in policy.master) and model.dtype == dtype
    rec = sl.default_weights(tok, r, res, base)
    assert rec["reshaped_rows"] == 3 and rec["w_sum_err"] < 1e-4 and np.isfinite(rec["w_intermediate"])
    mid, fin = sl.digit_tokens(tok, responses[0].tolist())
    first = ps[0].solution.split("\n")[0].split("= ")[1]
    assert tok.decode(responses[0][mid]).strip() == first and tok.decode(responses[0][fin]).strip() == str(ps[0].answer)


# ---------------------------------------------------------------------------------------------------------------------
# GRPO's advantage and the loss, against verl's
# ---------------------------------------------------------------------------------------------------------------------


def test_grpo_advantage_and_loss_equal_verls():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from omegaconf import OmegaConf

    g = torch.Generator().manual_seed(0)
    B, T = 12, 7
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    uids = np.array([i // 4 for i in range(B)], dtype=object)
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    scores = torch.zeros(B, T)
    scores[torch.arange(B), mask.sum(-1) - 1] = rewards
    theirs, _ = core_algos.compute_grpo_outcome_advantage(scores, mask.float(), uids)
    ours = sl.grpo_advantage(rewards, uids)
    assert torch.allclose(theirs, ours[:, None] * mask, atol=1e-6)
    old = torch.randn(B, T, generator=g) * 0.1 - 2
    logp = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g) * mask
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 1e9,
                            "global_batch_info": {}})
    want, _ = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask.float(), loss_agg_mode="seq-mean-token-mean",
                                                     config=cfg)
    halves = [torch.arange(0, 5), torch.arange(5, B)]  # micro-batches sum to the batch's loss
    got = sum(sl.policy_loss(logp[h], old[h], adv[h], mask[h], 0.2, B) for h in halves)
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# The analysis on known curves
# ---------------------------------------------------------------------------------------------------------------------


def _curves(n_seeds=8, steps=20, grpo=(0.3, 0.5), default=(0.3, 0.6), jitter=0.01):
    rng = np.random.default_rng(0)
    out = {}
    for s in range(1, n_seeds + 1):
        out[s] = {"grpo": list(np.linspace(*grpo, steps) + rng.normal(0, jitter, steps)),
                  "default": list(np.linspace(*default, steps) + rng.normal(0, jitter, steps))}
    return out


def test_analysis_decides_faster_when_every_seed_agrees():
    r = sl.analyse_curves(_curves(), {})
    assert r["s_prime"] == 20 and r["seeds_counted"] == list(range(1, 9))
    assert r["p"] == pytest.approx(2 / 256) and r["mean_d"] > 0 and r["ci95"][0] > 0
    assert not r["inconclusive"] and r["decision"] == "the default learns faster"
    assert r["verdict"] == "faster (p 0.008)"
    assert not any(c["holds"] for c in r["criteria"].values())
    slower = sl.analyse_curves(_curves(default=(0.3, 0.4)), {})
    assert slower["decision"] == "the default learns slower" and slower["verdict"].startswith("slower")


def test_analysis_inconclusive_criteria_each():
    few = sl.analyse_curves(_curves(), {7: "exit code 1", 8: "error: boom", 6: "exit code 137"})
    assert few["seeds_counted"] == [1, 2, 3, 4, 5] and set(few["seeds_dropped"]) == {"6", "7", "8"}
    assert few["criteria"]["1_too_few_seeds_or_steps"]["holds"] and few["decision"] == "inconclusive"
    short = sl.analyse_curves({s: {a: c[a][:9] for a in c} for s, c in _curves().items()}, {})
    assert short["s_prime"] == 9 and short["criteria"]["1_too_few_seeds_or_steps"]["holds"]
    flat = sl.analyse_curves(_curves(grpo=(0.3, 0.32)), {})
    assert flat["criteria"]["2_grpo_did_not_learn"]["holds"] and flat["decision"] == "inconclusive"
    assert flat["decision_if_conclusive"] == "the default learns faster"
    collapsed = _curves(default=(0.3, 0.0))
    for s in (1, 2, 3, 4):
        collapsed[s]["default"][-5:] = [0.0] * 5
    c = sl.analyse_curves(collapsed, {})
    assert c["criteria"]["3_an_arm_collapsed"]["holds"] and c["criteria"]["3_an_arm_collapsed"]["seeds_below"][
        "default"] >= 4
    uneven = _curves()
    uneven[3]["grpo"] = uneven[3]["grpo"][:15]  # a seed cut by the deadline: S' is the fewest steps
    uneven[3]["default"] = uneven[3]["default"][:14]
    assert sl.analyse_curves(uneven, {})["s_prime"] == 14
    none = sl.analyse_curves({1: {"grpo": [], "default": []}}, {})
    assert none["s_prime"] == 0 and none["verdict"] == "undefined" and none["decision"] == "inconclusive"
    one = sl.analyse_curves({1: _curves()[1]}, {})
    assert one["verdict"] == "one run" and one["p"] is None


def test_analyse_reads_files_cut_short_and_failed_seeds(tmp_path):
    curves = _curves(n_seeds=7, steps=12)
    lines = []
    for s, c in curves.items():
        lines.append(json.dumps({"event": "start", "seed": s, "tiny": False, "load_s": 40.0}))
        for t in range(12):
            for arm in sl.ARMS:
                lines.append(json.dumps({"seed": s, "step": t + 1, "arm": arm, "success": c[arm][t],
                                         "rewards": [], "response_tokens": 50.0, "responses_sha": f"{s}{t}",
                                         "seconds": {"step": 3.0}, "w_sum_err": 0.0}))
        if s == 7:
            lines.append(json.dumps({"event": "error", "seed": 7, "error": "Traceback\nRuntimeError: CUDA OOM"}))
        elif s == 6:
            lines.append('{"seed": 6, "step": 13, "arm": "gr')  # a line cut by the call's end: skipped
        else:
            lines.append(json.dumps({"event": "done", "seed": s, "steps": 12, "reason": "deadline"}))
    (tmp_path / sl.STEPS).write_text("\n".join(lines) + "\n")
    r = sl.analyse(tmp_path)
    assert r["seeds_counted"] == [1, 2, 3, 4, 5, 6] and r["seeds_dropped"] == {"7": "error: RuntimeError: CUDA OOM"}
    assert r["s_prime"] == 12 and json.loads((tmp_path / "results.json").read_text())["s_prime"] == 12
    (tmp_path / "processes.json").write_text(json.dumps({"returncodes": {"5": 1, "8": -9}}))
    r = sl.analyse(tmp_path)
    assert r["seeds_dropped"]["5"] == "exit code 1" and r["seeds_dropped"]["8"] == "exit code -9"  # 8: no line


def test_parse_seeds():
    assert sl.parse_seeds("1-8") == list(range(1, 9)) and sl.parse_seeds("3,1,2-2") == [1, 2, 3]
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError, match="--seeds"):
            sl.parse_seeds(bad)


# ---------------------------------------------------------------------------------------------------------------------
# The page quotes the module's numbers
# ---------------------------------------------------------------------------------------------------------------------


def test_protocol_page_quotes_the_modules_numbers():
    text = " ".join(DOC.read_text().split())
    p = sl.PROTOCOL

    def one(pattern: str) -> tuple[str, ...]:
        m = re.search(pattern, text)
        assert m, f"research/docs/learning_smollm2.md no longer says {pattern!r}"
        return m.groups()

    lo, hi = one(r"\*\*Seeds\.\*\* (\d+)–(\d+), paired")
    assert list(range(int(lo), int(hi) + 1)) == list(p.seeds)
    assert int(one(r"At most S_max = (\d+)")[0]) == p.s_max
    assert float(one(r"stops at (\d+) s of training wall time")[0]) == p.deadline_s
    num = r"(\d+(?:\.\d+)?)"
    lr, b1, b2, clip = one(rf"\*\*([\d.e-]+) for both arms\*\* \(AdamW \({num}, {num}\), no weight decay, "
                           rf"gradient norm clipped at {num}\)")
    assert (float(lr), (float(b1), float(b2)), float(clip), p.weight_decay) == (p.lr, p.betas, p.grad_clip, 0.0)
    assert float(one(r"PPO clip (\d+(?:\.\d+)?)")[0]) == p.clip_ratio
    k, n, total = one(r"Each step uses (\d+) fresh prompts × (\d+) rollouts = (\d+) rollouts")
    assert (int(k), int(n), int(total)) == (p.prompts_per_step, p.rollouts_per_prompt, p.rollouts)
    t, new = one(r"temperature (\d+), ≤ (\d+) tokens")
    assert (float(t), int(new)) == (p.temperature, p.max_new_tokens)
    k2, base = one(r"problems\(setting, (\d+) · S_max, seed=(\d+) \+ s\)")
    assert (int(k2), int(base)) == (p.prompts_per_step, p.prompt_seed_base)
    assert one(r"The task is `(\w+)`")[0] == p.setting == smol_task.CHOSEN
    assert one(r"`mode=(\w+)` with the product's defaults")[0] == p.mode
    assert int(one(r"\(([\d,]+) resamples\)")[0].replace(",", "")) == p.resamples
    assert float(one(r"if p < (\d+(?:\.\d+)?) and mean d > 0")[0]) == p.alpha
    seeds, steps = one(r"Fewer than (\d+) seeds have both arms complete with S' ≥ (\d+)")
    assert (int(seeds), int(steps)) == (p.min_seeds, p.min_steps)
    last, first, gain = one(rf"over the last (\d+) of the S' steps minus that over the first (\d+) is below {num}")
    assert (int(last), int(first), float(gain)) == (p.window, p.window, p.grpo_learn_min)
    w, below = one(r"its success over the last (\d+) steps is below (\d+(?:\.\d+)?) on at least half the seeds")
    assert (int(w), float(below), p.collapse_share) == (p.window, p.collapse_below, 0.5)
