"""compute_token_importance on a real Ray worker group (FSDP2, gloo) equals the core functions on the same model.

Two data-parallel ranks hold sequences of different lengths (so they need different numbers of forwards): the call
must finish (no collective hang) and agree with the single-rank group and with the core reference. Under Ulysses the
ranks of a sequence-parallel group measure the step's fidelity alike, with the entropies verl hands to one of them.
``fisher`` runs in the CPU smoke run of gpu_check's verl-worker part (one rank, a whole training step, the GPU
machine's packages only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oar_verl.core.methods.attribution import module_backend, pass_limits, run_attribution
from oar_verl.core.config import OARConfig
from oar_verl.core.preprocess import prepare_attribution
from oar_verl.quickstart.launcher import CPU_PLATFORM_MODULE, cpu_env, new_ray_temp_dir
from oar_helpers import count_passes

JOB = Path(__file__).with_name("worker_group_job.py")


def run_job(model_dir, tmp_path, n_ranks, mode, target="response", sp=1, packed=False, strategy="fsdp2"):
    out = tmp_path / f"imp_{mode}_{n_ranks}_{target}_{sp}_{int(packed)}_{strategy}.pt"
    env = {**os.environ, **cpu_env(), "VERL_USE_EXTERNAL_PLUGINS": "none",
           # the CPU stand-ins for Ulysses attention and FSDP1's module-state sync (development tooling, not in the
           # wheel) in every process
           "VERL_USE_EXTERNAL_MODULES": f"{CPU_PLATFORM_MODULE},devtools.ulysses_attention,devtools.fsdp1_cpu",
           # the job's worker class (job_support.FidelityRecordingWorker), which Ray's workers import by name
           "PYTHONPATH": os.pathsep.join(p for p in (str(JOB.parent), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(JOB), str(model_dir), str(out), str(n_ranks), mode,
                           new_ray_temp_dir(), target, str(sp), str(int(packed)), strategy], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def core_reference(model_dir, res):
    """The same rows through the core alone: prepare_attribution + run_attribution on the Hugging Face model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = OARConfig.from_mapping(res["config"])
    prepared = prepare_attribution(res["prompts"], res["responses"], tok, cfg, 3,
                                   ground_truths=res["truths"] if cfg.target == "reference" else None)
    result = run_attribution(module_backend(model, cfg), prepared.batch, cfg, mask_token_id=prepared.mask_token_id, seeds=prepared.seeds)
    ref = padded(prepared.response_importance(result.importance))
    assert prepared.answer_probe.all()  # as_mean on a found span: every probe read answer tokens
    rounds = []  # what each rank needs: rank r holds rows [2r, 2r + 2)
    for r in range(2):
        half = prepare_attribution(res["prompts"][2 * r: 2 * r + 2], res["responses"][2 * r: 2 * r + 2], tok, cfg, 3,
                                   ground_truths=res["truths"][2 * r: 2 * r + 2] if cfg.target == "reference" else None)
        own = run_attribution(module_backend(model, cfg), half.batch, cfg, mask_token_id=half.mask_token_id, seeds=half.seeds).passes
        if cfg.perturbation == "exact":  # what the policy ran is what the planner counts
            assert own == count_passes(half.batch, cfg, pass_limits(cfg))
        rounds.append(own)
    return ref, prepared.spans, rounds, result


def check_fidelity(model_dir, res):
    """Each rank's ``oar_fidelity_*`` (fidelity_rows=1: its first row with reasoning tokens) equal the core's
    step_fidelity on its rows, NaN on its other row; the ranks' pass counts differ (aligned by filler passes, or the
    call would hang)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar_verl.core.fidelity import default_min_gap
    from oar_verl.core.fidelity.step import step_fidelity
    from oar_verl.core.methods.mask_operator import mask_replacement

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = OARConfig.from_mapping(res["config"])
    assert cfg.fidelity_every == 1 and cfg.fidelity_rows == 1
    ref, passes = {}, []
    for r in range(2):  # rank r holds rows [2r, 2r + 2)
        half = prepare_attribution(res["prompts"][2 * r: 2 * r + 2], res["responses"][2 * r: 2 * r + 2], tok, cfg, 3)
        backend = module_backend(model, cfg)
        imp = run_attribution(backend, half.batch, cfg, mask_token_id=half.mask_token_id, seeds=half.seeds).importance
        rep = mask_replacement(backend, half.batch, cfg.mask, half.mask_token_id, half.seeds)  # the run's operator
        got = step_fidelity(backend, half.batch, imp, cfg, 3, replacement=rep, min_gap=default_min_gap(model))
        passes.append(float(got["passes"][0]))
        for k, v in got.items():
            ref[k] = torch.cat([ref[k], v]) if k in ref else v
    assert passes[0] != passes[1], passes
    for k in ("aopc", "aopc_random", "suppression"):
        got = res["fidelity"][k]
        assert got.isnan().tolist() == ref[k].isnan().tolist(), (k, got, ref[k])
        assert [int((~got[2 * r: 2 * r + 2].isnan()).sum()) for r in range(2)] == [1, 1]  # one row per rank
        torch.testing.assert_close(got, ref[k], rtol=1e-2, atol=1e-6, equal_nan=True, msg=k)
    assert (res["fidelity"]["seconds"] > 0).all()


def padded(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged).to_padded_tensor(0.0)


def check_shared(res):
    """fisher read from verl's old-log-prob pass (the job's gradient run): every row read from it, verl's log-probs
    bitwise, the scores of fisher's own call. OAR-G with its clean teachers read from the pass: verl's log-probs
    bitwise, on the marked rows the scores of OAR-G's own call (same seeds; the teacher from verl's layout), nothing
    on a rank's unmarked rows (a rank with none marked runs its first row, unread, so that the ranks' passes align).
    Each rank's attribution seconds inside the old-log-prob call come back with every one of its rows (``oar_seconds``,
    > 0: fisher's backwards, OAR-G's teacher reads and noisy passes, its fidelity measurement); the calls of
    ``compute_token_importance`` report 0 there (the step's own timer holds them)."""
    assert res["shared"].tolist() == [1.0] * 4
    width = len(res["shared_seconds"]) // res["ranks"]  # data-parallel ranks' rows (an SP group holds the same)
    for key in ("shared_seconds", "teacher_seconds"):
        seconds = res[key]
        assert bool((seconds > 0).all()), (key, seconds)
        assert all(len(set(seconds[r * width:(r + 1) * width].tolist())) == 1 for r in range(res["ranks"])), seconds
    assert res["fisher_seconds"].tolist() == [0.0] * 4 and res["seconds"].tolist() == [0.0] * 4
    for a, b in zip(res["log_probs_before"], res["shared_log_probs"]):
        assert torch.equal(a, b)
    own = padded(res["fisher_importance"])
    assert int((own != 0).sum()) > 10
    torch.testing.assert_close(padded(res["shared_importance"]), own, rtol=1e-4, atol=1e-5 * float(own.abs().max()))
    assert res["teacher_shared"].tolist() == [1.0] * 4
    for a, b in zip(res["log_probs_before"], res["teacher_log_probs"]):
        assert torch.equal(a, b)
    marked = res["teacher_rows"].bool()
    oar_g, taught = padded(res["token_importance"]), padded(res["teacher_importance"])
    torch.testing.assert_close(taught[marked], oar_g[marked], rtol=2e-3, atol=5e-5 * float(oar_g.abs().max()))
    assert int((taught[marked] != 0).sum()) > 10
    fillers = [2 * r for r in range(len(marked) // 2) if not marked[2 * r: 2 * r + 2].any()]
    assert all(not bool(taught[i].any()) for i in range(len(marked)) if not marked[i] and i not in fillers)
    if res["config"].get("fidelity_every") == 1:  # measured on each rank's first marked row
        width = len(marked) // res["ranks"]  # data-parallel ranks (a sequence-parallel group holds the same rows)
        first = [r * width + int(marked[r * width:(r + 1) * width].nonzero()[0]) for r in range(res["ranks"])]
        assert (~res["teacher_fidelity"].isnan()).nonzero().flatten().tolist() == first


def check_rank_fidelity(res, sp):
    """Every rank's in-step fidelity measurements (``job_support.FidelityRecordingWorker``, OAR-G's run): in the
    old-log-prob call (verl's trainers' ``calculate_entropy=True``) every rank measured the entropy control with the
    pass's entropies, although verl hands the pass's outputs to one rank of a sequence-parallel group only; in
    ``compute_token_importance`` with the batch's entropies where the job gave them (SP); and the ``sp`` ranks of each
    group measured the same rows to the same numbers (one removal set more on a rank would have hung the call)."""
    records = res["rank_fidelity"]
    assert len(records) == res["ranks"] * sp
    for rank in records:
        assert [r["call"] for r in rank] == ["compute_token_importance", "compute_log_prob"], rank
        imp, logp = rank
        assert logp["entropies"] and imp["entropies"] == (sp > 1)
        assert bool((~logp["aopc_entropy"].isnan()).any()), "the entropy control was not measured"
        assert int((~logp["aopc"].isnan()).sum()) >= 1
    for g in range(res["ranks"]):
        group = records[g * sp:(g + 1) * sp]
        for other in group[1:]:
            for a, b in zip(group[0], other):
                for k in a:
                    if k in ("call", "entropies"):
                        assert a[k] == b[k], k
                    elif k != "seconds":
                        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("mode,target", [("gradient", "response"), ("gradient_k3", "response"),
                                         ("perturbation", "response"), ("perturbation", "reference"),
                                         ("hierarchical", "response")])
def test_two_ranks_equal_one_rank_and_core(tiny_assets, tmp_path, mode, target):
    # OAR-G with three draws on verl's FSDP1 engine (strategy=fsdp, verl's default), the others on FSDP2
    strategy = "fsdp" if mode == "gradient_k3" else "fsdp2"
    two = run_job(tiny_assets.model_dir, tmp_path, 2, mode, target, strategy=strategy)
    ref, spans, rounds, result = core_reference(tiny_assets.model_dir, two)
    got = padded(two["token_importance"])
    assert got.shape == ref.shape
    assert (ref != 0).sum() > 10  # not vacuous
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(padded(two["reasoning"]).bool(), spans.reasoning_mask)
    assert two["span_found"].bool().tolist() == spans.found.tolist() == [True, True, True, True]
    assert two["answer_probe"].bool().all()  # as_mean read answer tokens on every row
    # each rank reports the passes it needed under the token budget: the ranks differ, and the call still finished
    # (the short rank padded its collectives to the long rank's count)
    assert two["rounds"].tolist() == [rounds[0]] * 2 + [rounds[1]] * 2 and rounds[0] != rounds[1], (two["rounds"],
                                                                                                   rounds)
    # attribution leaves the policy as it was: the engine's log-probs are bit-identical before and after
    for a, b in zip(two["log_probs_before"], two["log_probs_after"]):
        assert torch.equal(a, b)
    if mode.startswith("gradient") or mode == "fisher":  # gradient passes: no masked copies
        assert (two["copies"] == -1).all()
    else:  # the masked copies and token-level-scored tokens of every row, as the core counts them
        assert two["copies"].tolist() == result.copies.float().tolist()
        assert two["refined"].tolist() == result.refined.float().tolist()
        if mode == "hierarchical":  # part of every long row refined, in fewer copies than tokens
            assert (two["refined"] < result.reasoning).any() and (two["copies"] < result.reasoning).any()
    if mode.startswith("gradient"):  # fisher read from the pass on two ranks whose micro-batches differ in length
        check_shared(two)
    if mode == "gradient":  # the step's fidelity, measured by each rank on its first row, equals the core's
        check_fidelity(tiny_assets.model_dir, two)
        check_rank_fidelity(two, 1)
    if mode == "gradient":  # one rank (under the same budget): same result (noise is seeded per sequence, not rank),
        # in verl's remove-padding layout (users' usual one: rows packed end to end; another attention kernel, hence
        # the sequence-parallel test's tolerance), where fisher also reads from the packed old-log-prob pass
        one = run_job(tiny_assets.model_dir, tmp_path, 1, mode, packed=True)
        torch.testing.assert_close(padded(one["token_importance"]), got, rtol=2e-3,
                                   atol=5e-5 * float(ref.abs().max()))
        check_shared(one)
        check_rank_fidelity(one, 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gradient", "perturbation", "hierarchical"])
def test_sequence_parallel_group_attributes_sharded_and_equals_core(tiny_assets, tmp_path, mode):
    """Ulysses SP=2 through verl's own FSDP engine and sequence-parallel machinery (the ranks hold 1/2 of every pass;
    the CPU stand-in attention replaces flash-attn, which needs CUDA): the same numbers as the unsharded core; and
    fisher read from verl's sharded old-log-prob pass gives verl's log-probs and the fisher call's scores, with verl's
    bucket padding making each rank's shard longer than its micro-batch's tokens (the layout OAR once refused); OAR-G's
    in-step fidelity with the entropy control in that pass, the same on both ranks (it hung: rank 1 got no outputs)."""
    two = run_job(tiny_assets.model_dir, tmp_path, 2, mode, sp=2)
    ref, spans, _, result = core_reference(tiny_assets.model_dir, two)
    got = padded(two["token_importance"])
    assert (ref != 0).sum() > 10
    # fp32 models, another attention kernel (float64: tests/core, to 1e-6): OAR-G's smallest scores are differences of
    # nearly equal probe values, and a fresh environment moved one of them by 2.4e-5 of the largest score with the
    # code before and after the attribution engine alike (the same number): hence 5e-5 of the largest
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=5e-5 * float(ref.abs().max()))
    for a, b in zip(two["log_probs_before"], two["log_probs_after"]):
        assert torch.equal(a, b)
    if mode == "gradient":  # fisher read from the sharded old-log-prob pass: verl's log-probs, the fisher call's scores
        check_shared(two)
        check_rank_fidelity(two, 2)
    # the ranks ran the sharded passes (each holding half of every pass), not whole sequences each
    from transformers import AutoTokenizer

    from oar_verl.core.backends.ulysses import SequenceShards

    cfg = OARConfig.from_mapping(two["config"])
    prepared = prepare_attribution(two["prompts"], two["responses"], AutoTokenizer.from_pretrained(
        tiny_assets.model_dir), cfg, 3)
    if mode == "hierarchical":  # two levels, each sharded; the copies are the core's
        assert two["copies"].tolist() == result.copies.float().tolist()
        return
    sharded = count_passes(prepared.batch, cfg, pass_limits(cfg), SequenceShards(None, 0, 2))
    assert two["rounds"].tolist() == [sharded] * 4


@pytest.mark.slow
def test_gpu_check_verl_worker_part_on_cpu(tmp_path):
    """The verl-worker part of scripts/gpu_check.sh, which the GPU figures come from, as its CPU smoke run: verl's
    FSDP2 group with OAR's worker through one training step (old log-probs, gradient / fisher / conservative / segment
    attribution, the oar estimator, update_actor), dynamic batch sizes and gradient checkpointing, on the tiny shape in fp32, with
    every distribution the GPU machine would lack hidden in the driver and the Ray worker (the bundle's manifest is
    complete for this path): every check of the part passes, and what it records is there."""
    from devtools.gpu_bundle import CPU_ONLY, allowed, blocker, normalise

    root = Path(__file__).resolve().parents[2]
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(blocker())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(root), os.environ.get("PYTHONPATH", "")]),
           "PYTHON": sys.executable, "OAR_GPU_BUNDLE": str(tmp_path / "no-bundle"), "GPU_CHECK_WORK": str(tmp_path)}
    out = tmp_path / "out"
    # a budget and an estimate of the test's own (the part's hard limit is then 600 s, not a multiple of an estimate a
    # busy machine could exceed)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--tiny", "--parts", "verl-worker",
                           "--lengths", "fp32", "--repeats", "2", "--part-limit-s", "600", "--budget-s", "100000",
                           "--estimate", "verl-worker=300", "--out", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["parts"]["verl-worker"]["status"] == "done"
    (p,) = summary["verl_worker"]
    assert p["param_dtype"] == "fp32" and p["device_name"] == "cpu"
    assert {k for k, c in p["checks"].items() if not c["ok"]} == set(), p["checks"]
    # per mode: agreement and Σw = R; log-probs unchanged; the update's KL; fisher and conservative read from the
    # old-log-prob pass, and OAR-G's teachers: its log-probs bitwise verl's, its scores the method call's (no peaks on
    # CPU); the fallback's (after the pass)
    assert len(p["checks"]) == 4 * 2 + 2 + 3 * 2 + 1
    for mode in ("fisher", "conservative", "gradient"):
        shared = p["shared"][mode]
        assert shared["log_probs_equal"] and set(shared["shared"]) == {1.0}, (mode, shared)
        assert shared["agreement"]["nonzero"] > 50 and max(shared["agreement"]["max_rel_diff"]) <= 1e-3, mode
    for mode in ("gradient", "fisher", "conservative", "segment"):  # conservative: the default mode
        a = p["agreement"][mode]
        assert a["nonzero"] > 50 and max(a["max_rel_diff"]) <= 1e-3, (mode, a)
        assert p["estimator"][mode]["reshaped_rows"] == 4 and p["estimator"][mode]["finite"]
        c = p["calls"][mode]
        assert len(c["seconds_all"]) == 2 and c["seconds"] > 0 and c["vs_update_time"] > 0, (mode, c)
    # the segment policy split the longer rows into several segments (a ranking, not one constant per row)
    assert any(r == r for r in p["agreement"]["segment"]["spearman"]) and max(p["passes"]["segment"]) > 2
    # log-probs: the repeats, then once more after attribution (unchanged)
    assert [len(p["calls"][k]["seconds_all"]) for k in ("compute_log_prob", "update_actor")] == [3, 2]
    assert abs(p["update_metrics"][0]["actor/ppo_kl"]) <= 1e-6 and len(p["update_metrics"]) == 2
    assert p["update_metrics"][1]["actor/ppo_kl"] != 0  # the second update starts from the first one's weights
    # the driver and the Ray worker loaded nothing the GPU machine lacks: the blocker held in both
    machine = allowed() | {normalise(d) for d in CPU_ONLY}
    for key in ("distributions", "worker_distributions"):
        assert {"verl", "ray", "torch"} <= {normalise(d) for d in p[key]}
        assert {normalise(d) for d in p[key]} <= machine, (key, sorted({normalise(d) for d in p[key]} - machine))
    assert "verl's FSDP2 worker group with OAR's worker" in (out / "gpu_check.md").read_text()
