"""OAR through verl 0.9.1's real Megatron engine on CPU, against the core reference on the same checkpoint.

The engine runs in subprocesses with the separate Megatron environment (``bash scripts/setup_mcore_env.sh`` builds
``.venv-mcore``; ``OAR_MCORE_VENV`` points elsewhere) under ``torch.distributed.run`` with gloo, using the test-only
shims of ``cpu_shims.py``. Every layout is compared number by number with :func:`oar_verl.core.methods.attribution.
run_attribution` on the Hugging Face model loaded from the same tiny checkpoint in fp32 (CPU Megatron has already
produced silently wrong, non-causal numbers once: "it runs" proves nothing).

Layouts: TP=PP=1 (one rank), TP=2, TP=2 with sequence parallelism and PP=2 (both with a packed-sequence training
layout, which attribution swaps for the padded one; PP=2 with full activation recomputation), DP=2 with unequal work
per rank (and the distributed optimizer), in fp32; and TP=PP=1 in bf16, the production dtype, against the bf16 error
floor. Cases: OAR-P (with the pad token and the mean embedding as the mask) and OAR-G with every probe, OAR-G with K =
3 noise draws, OAR-P's segment, hierarchical and auto policies, and the second-order (fisher) mode, truncated and
sketched -- the core's methods run unchanged on the engine's backend. In every layout verl's old-log-prob call also
runs with fisher read from it (:mod:`oar_verl.integration.megatron.shared`, in the engine's training layout):
log-probs and entropies bitwise the plain call's, scores the backend's own fisher passes'; and through OAR's worker RPC
over verl's TrainingWorker, where the pass's micro-batch size decides whether it shares, on a fidelity step: every
rank of a model-parallel group measures the entropy control with the entropies verl hands to one of them, the same.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from oar_verl.core.methods.attribution import module_backend, probe_kinds, run_attribution
from oar_verl.core.config import OARConfig
from oar_verl.core.batch.layout import build_attribution_batch, with_segments

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("engine_job.py")
VENV = Path(os.environ.get("OAR_MCORE_VENV", ROOT / ".venv-mcore"))
PYTHON = VENV / "bin" / "python"

pytestmark = [
    pytest.mark.skipif(not PYTHON.exists(), reason=f"no Megatron environment at {VENV}: build it with "
                                                    "`bash scripts/setup_mcore_env.sh` (megatron-core 0.16.1, "
                                                    "mbridge 0.15.1; kept apart from .venv)"),
    pytest.mark.megatron,
    pytest.mark.slow,
]

CASES = [  # chunk / micro-batch sizes that do not divide the row and copy counts: filler rows are exercised
    {"name": "p_lt", "oar": {"mode": "perturbation", "probe": "lt_logits", "chunk_size": 5, "micro_batch_size": 3,
                             "mask": "pad"}},
    # the embedding operator: the first stage's embedding output at the replaced positions set to the table's mean
    {"name": "p_mean", "oar": {"mode": "perturbation", "probe": "as_mean", "chunk_size": 8, "micro_batch_size": 2,
                               "mask": "mean"}},
    {"name": "p_joint_span2", "oar": {"mode": "perturbation", "probe": "as_joint", "chunk_size": 4, "mask_span": 2,
                                      "mask": "pad"}},
    {"name": "g_lt", "oar": {"mode": "gradient", "probe": "lt_logits", "micro_batch_size": 3}},
    {"name": "g_mean", "oar": {"mode": "gradient", "probe": "as_mean", "micro_batch_size": 2}},
    {"name": "g_joint", "oar": {"mode": "gradient", "probe": "as_joint", "micro_batch_size": 4}},
    # the core's engine brings every method to Megatron: K noise draws and the segment-level perturbation policies
    {"name": "g_k3", "oar": {"mode": "gradient", "probe": "as_mean", "noise_samples": 3, "micro_batch_size": 5}},
    {"name": "p_segment", "oar": {"mode": "perturbation", "probe": "as_mean", "perturbation": "segment"}},
    {"name": "p_hier", "oar": {"mode": "perturbation", "probe": "lt_logits", "perturbation": "hierarchical",
                               "refine_share": 0.3, "chunk_size": 5, "mask": "pad"}},
    {"name": "p_auto", "oar": {"mode": "perturbation", "probe": "as_joint", "perturbation": "auto",
                               "exact_max_tokens": 10, "refine_share": 0.5}},
    # OAR-P's masking KL to second order: vocab-parallel top outcomes, gradients projected on e_mask - e_t
    {"name": "f_mean", "oar": {"mode": "fisher", "probe": "as_mean", "fisher_outcomes": 3, "micro_batch_size": 5,
                               "mask": "zero"}},
    {"name": "f_joint", "oar": {"mode": "fisher", "probe": "as_joint", "fisher_outcomes": 2, "mask": "pad"}},
    # the unbiased estimator: top 2 exact, the rest in 2 Rademacher sketches summed over the vocabulary shards
    {"name": "f_sketch", "oar": {"mode": "fisher", "probe": "lt_logits", "fisher_outcomes": 2, "fisher_sketches": 2,
                                 "seed": 3, "micro_batch_size": 3}},
    # conservative propagation (the default): the rules as hooks on megatron-core's layers, both attention rules; and
    # with each layer's norms fused into the next linear, as TransformerEngine's spec lays them out (engine_job's
    # FusedNormLinear): the norm rule then works through the fused module's output, summed over the TP group
    {"name": "c_values", "oar": {"mode": "conservative", "probe": "as_mean", "micro_batch_size": 3}},
    {"name": "c_uniform", "oar": {"mode": "conservative", "probe": "lt_logits", "attention_rule": "uniform"}},
    {"name": "c_fused", "oar": {"mode": "conservative", "probe": "as_joint", "micro_batch_size": 2},
     "fuse_norms": True},
]
B = 4
# rows of each data-parallel rank; DP=2 gets one long-reasoning pair and one short one (unequal copy counts)
ONE_RANK = [list(range(B))]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Qwen2 checkpoint (fp32, tied embeddings, vocabulary 400) and a verl-layout batch."""
    from oar_verl.quickstart.tiny_assets import build_tiny_qwen2, build_tokenizer

    root = tmp_path_factory.mktemp("mcore")
    model_dir = root / "model"
    tok = build_tokenizer(model_dir, seed=0)
    build_tiny_qwen2(model_dir, tok, seed=0)
    V, pad = len(tok), tok.pad_token_id
    g = torch.Generator().manual_seed(1)
    P, T = 7, 24
    p_len = torch.tensor([7, 3, 5, 2])
    r_len = torch.tensor([24, 21, 9, 12])
    reas_len = torch.tensor([17, 15, 4, 8])  # reasoning | marker (2 tokens) | answer (2 tokens) | rest
    cols_p, cols_r = torch.arange(P)[None], torch.arange(T)[None]
    prompt_mask = (cols_p >= P - p_len[:, None]).long()
    response_mask = (cols_r < r_len[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), torch.randint(3, V, (B, P), generator=g), pad)
    responses = torch.where(response_mask.bool(), torch.randint(3, V, (B, T), generator=g), pad)
    reasoning = cols_r < reas_len[:, None]
    answer = (cols_r >= reas_len[:, None] + 2) & (cols_r < reas_len[:, None] + 4)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    segments = torch.where(reasoning, cols_r // 4, -1)  # reasoning segments of 4 tokens (the last may be shorter)
    inputs = {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
              "reasoning": reasoning, "answer": answer, "seeds": seeds, "segments": segments}
    torch.save(inputs, root / "inputs.pt")
    return {"root": root, "model_dir": model_dir, "inputs": inputs, "pad": pad}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(assets, name, *, nproc=1, tp=1, pp=1, sp=False, dtype="float32", remove_padding=False,
               distopt=False, recompute="none", dp_rows=ONE_RANK, cases=CASES, check_bypass=False):
    out_dir = assets["root"] / name
    out_dir.mkdir(exist_ok=True)
    spec = {"model_dir": str(assets["model_dir"]), "inputs": str(assets["root"] / "inputs.pt"), "tp": tp, "pp": pp,
            "sp": sp, "dtype": dtype, "remove_padding": remove_padding, "distopt": distopt, "recompute": recompute,
            "dp_rows": dp_rows, "check_bypass": check_bypass,
            "cases": cases, "out_dir": str(out_dir), "mask_token_id": assets["pad"]}
    (out_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_COMPILE_DISABLE": "1", "TORCHINDUCTOR_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore", "OAR_TEST_SP": "1" if sp else "0",
           # the ranks import this checkout's oar_verl, not the one installed in the Megatron environment
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(JOB), str(out_dir / "spec.json")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(nproc)]
    print(f"\n[{name}] {nproc} rank(s), wall {wall:.1f} s; attribution s per case (rank 0): "
          + ", ".join(f"{k} {v:.2f}" for k, v in ranks[0]["seconds"].items()))
    return ranks


_HF = {}


def reference(assets, rows, case, dtype=torch.float32):
    """The core's OAR on the Hugging Face model of the same checkpoint (fp32), for the given rows."""
    from transformers import AutoModelForCausalLM

    if dtype not in _HF:
        _HF[dtype] = AutoModelForCausalLM.from_pretrained(assets["model_dir"], dtype=dtype,
                                                          attn_implementation="sdpa").eval()
    x = {k: v[rows] for k, v in assets["inputs"].items()}
    cfg = OARConfig.from_mapping(case["oar"])
    batch = with_segments(build_attribution_batch(x["prompts"], x["prompt_mask"], x["responses"], x["response_mask"],
                                                  x["reasoning"], x["answer"], probe_kinds(cfg, 0, len(rows))),
                          x["segments"])
    result = run_attribution(module_backend(_HF[dtype], cfg), batch, cfg, mask_token_id=assets["pad"], seeds=x["seeds"])
    return result.importance.float(), batch


def compare(assets, ranks, rtol, label):
    """Collecting ranks return the importance of their data-parallel shard, others None; each equals the core's."""
    stats = {}
    covered = set()
    for res in ranks:
        if not res["src"]:
            assert all(v is None for v in res["cases"].values()), "a non-collecting rank returned importance"
            continue
        covered.add(res["dp_rank"])
        rows = res["rows"].tolist()
        for case in CASES:
            got = res["cases"][case["name"]]
            ref, batch = reference(assets, rows, case)
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert bool((ref[batch.reasoning_mask] != 0).all()), "reference has zero scores: vacuous comparison"
            assert bool((got[~batch.reasoning_mask] == 0).all()), "importance off the reasoning tokens"
            err = (got - ref).abs()
            scale = ref.abs().max()
            rel = float(err.max() / scale)
            stats[case["name"]] = stats.get(case["name"], [])
            stats[case["name"]].append((float(err.max()), rel, float((err / ref.abs().clamp(min=1e-30))
                                                                     [batch.reasoning_mask].max())))
            assert rel < rtol, f"{label}/{case['name']}: max|diff| {float(err.max()):.3g} = {rel:.3g} of max|ref|"
        compare_fidelity(assets, res, rows, label)
    print(f"[{label}] max abs diff / (max abs diff ÷ max |ref|) / max elementwise rel diff:")
    for k, v in stats.items():
        print(f"   {k:14s} " + " | ".join(f"{a:.2e} / {r:.2e} / {e:.2e}" for a, r, e in v))
    return covered


def compare_fidelity(assets, res, rows, label, rtol=1e-2):
    """The in-step fidelity metric through the engine (``oar_helpers.fidelity_of``) equals the core's on the Hugging
    Face model: AOPC of the ranking and of random rankings, gain and S, row by row."""
    from oar_helpers import fidelity_of

    from oar_verl.core.backends.hf import ModuleBackend
    from oar_verl.core.backends.budget import PassLimits

    reference(assets, rows, CASES[0])  # loads the fp32 model
    x = {k: v[rows] for k, v in assets["inputs"].items()}
    cfg = OARConfig(probe="as_mean")
    batch = build_attribution_batch(x["prompts"], x["prompt_mask"], x["responses"], x["response_mask"],
                                    x["reasoning"], x["answer"], probe_kinds(cfg, 0, len(rows)))
    ref = fidelity_of(ModuleBackend(_HF[torch.float32], PassLimits(10**6)), batch, assets["pad"])
    got = res["fidelity"]
    assert got.shape == ref.shape and bool((got.isnan() == ref.isnan()).all()), (got, ref)
    ok = ~ref.isnan()
    assert bool(ok[0].all()) and float(ref[0].abs().min()) > 0, "vacuous fidelity comparison"
    rel = float(((got - ref).abs()[ok]).max() / ref.abs()[ok].max())
    print(f"[{label}] fidelity (aopc, aopc_random, gain, S) max abs diff ÷ max |ref|: {rel:.2e}")
    assert rel < rtol, f"{label}/fidelity: {got} vs {ref}"


def check_side_effects(ranks):
    for res in ranks:
        c = res["checks"]
        assert c["param_grads_none"], "a parameter has a .grad after attribution"
        assert c["requires_grad_restored"]
        assert c["n_grad_buffers"] > 0 and c["grad_buffers_unchanged"], "attribution touched the grad buffers"
        assert c["optimizer_state_empty"]
        assert c["log_probs_unchanged"], "the engine's log-probs changed"
        assert c["cp_error"] and "context_parallel_size=2" in c["cp_error"], c["cp_error"]
        check_shared(res)
    check_group_fidelity(ranks)


def check_group_fidelity(ranks):
    """The worker's old-log-prob call on a fidelity step (``fidelity_every=1``, entropies computed as verl's trainers
    ask): every rank measured, with the entropy control (verl hands the pass's entropies to one rank of the
    tensor × pipeline group: the others take them from it, or the group's collectives would part), and the ranks of
    a group (one data-parallel rank) measured the same rows to the same numbers; read from the pass (1-row
    micro-batches) and right after it (2-row ones, unless the engine recomputes every layer)."""
    groups: dict[int, list] = {}
    for res in ranks:
        fid = res["shared"]["worker_fidelity"]
        assert sorted(fid) == [1, 2] and all(len(v) == 1 for v in fid.values()), fid
        for records in fid.values():
            (r,) = records
            assert r["entropies"] and bool((~r["aopc_entropy"].isnan()).any()), "no entropy control"
            assert bool((~r["aopc"].isnan()).all()), "a row was not measured"
        groups.setdefault(res["dp_rank"], []).append(fid)
    for members in groups.values():
        for other in members[1:]:
            for mbs, (a,) in members[0].items():
                (b,) = other[mbs]
                for k in a:
                    if k not in ("entropies", "seconds"):
                        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, equal_nan=True, msg=f"{mbs}/{k}")
    print(f"[fidelity step] ranks per model-parallel group: {[len(m) for m in groups.values()]}, entropy control on "
          "every rank, the group's measurements equal")


def check_shared(res, rtol=1e-4):
    """verl's old-log-prob call with fisher read from it: log-probs and entropies bitwise the plain call's, on every
    rank that has outputs, and the scores the backend's own fisher passes' (to 1e-4 of the largest: the own passes
    run the padded layout, the packed one sums in another order; measured ≤ 7e-6, 0 where both are padded)."""
    shared = res["shared"]
    assert shared["has_outputs"] or not res["src"]
    assert all(shared["log_probs_equal"]) and all(shared["entropy_equal"]), shared
    assert all(len(c) > 0 for c in shared["choices"]), "the call ran no micro-batch"
    assert max(shared["rel"]) < rtol, shared["rel"]
    # the same through OAR's worker RPC over verl's TrainingWorker: micro-batches of the update's size share, larger
    # ones only under the engine's full recompute (else the fallback: attribution right after the pass). Log-probs to
    # fp32 rounding: with its parameters frozen the pass runs Megatron's frozen-weight linear, and torch.matmul folds a
    # one-row [s, 1, h] input into one matrix product or not by the weight's requires_grad (measured 1.2e-5 at TP=2
    # with one-row micro-batches, 0 elsewhere; TransformerEngine's GEMMs on a GPU do not go through torch.matmul)
    for mbs, got in shared["worker"].items():
        assert got["collecting"] or not res["src"], got
        if got["collecting"]:
            want = 1.0 if mbs == 1 or shared["recompute"] == "full" else 0.0
            assert got["shared"] == want and got["nonzero"] > 8, (mbs, got)
            assert got["log_probs_diff"] <= 5e-5 and got["entropy_diff"] <= 5e-5 and got["rel"] < rtol, (mbs, got)
    print(f"[shared pass] through the worker: {shared['worker']}")
    print(f"[shared pass] scores vs the own passes, max|diff| ÷ max|own|: {shared['rel']}")


FP32_RTOL = 2e-3  # fp32 engine vs fp32 HF: different kernels and summation orders only


def test_tp1_pp1(assets):
    ranks = run_layout(assets, "tp1pp1", check_bypass=True)
    assert compare(assets, ranks, FP32_RTOL, "TP=1 PP=1 fp32") == {0}
    check_side_effects(ranks)
    assert ranks[0]["checks"]["has_log_probs"]
    # conservative's rules are hooks on submodules: an MLP whose forward bypasses them (a fused implementation) is
    # refused, not scored without its rule
    assert "ran without calling its" in ranks[0]["checks"]["bypass_error"], ranks[0]["checks"]["bypass_error"]


def test_tp2(assets):
    ranks = run_layout(assets, "tp2", nproc=2, tp=2)
    assert compare(assets, ranks, FP32_RTOL, "TP=2 fp32") == {0}
    check_side_effects(ranks)


def test_tp2_sequence_parallel(assets):
    ranks = run_layout(assets, "tp2sp", nproc=2, tp=2, sp=True, remove_padding=True)
    assert all(r["checks"]["embedding_chunked"] for r in ranks)  # the embedding really output [s/2, b, h] chunks
    assert compare(assets, ranks, FP32_RTOL, "TP=2 SP fp32") == {0}
    check_side_effects(ranks)


def test_pp2_packed_training_layout_and_recompute(assets):
    # the engine is configured for packed (THD) training and full activation recomputation; attribution runs the
    # padded path and its backward goes through megatron-core's checkpointed layers
    ranks = run_layout(assets, "pp2", nproc=2, pp=2, remove_padding=True, recompute="full")
    assert [r["src"] for r in ranks] == [False, True]  # the last stage collects
    assert compare(assets, ranks, FP32_RTOL, "PP=2 fp32") == {0}
    check_side_effects(ranks)


def test_dp2_unequal_work(assets):
    # rank 0: the two long-reasoning rows (32 masked copies), rank 1: the short ones (12): different micro-batch
    # counts, which the call must equalise (no hang) without changing any number
    ranks = run_layout(assets, "dp2", nproc=2, dp_rows=[[0, 1], [2, 3]], distopt=True)
    assert compare(assets, ranks, FP32_RTOL, "DP=2 fp32") == {0, 1}
    check_side_effects(ranks)


def test_bf16_engine(assets):
    """The production dtype. bf16 has an error floor of its own, so the engine is held to the Hugging Face model run in
    bf16: its error with respect to the fp32 reference may not exceed the HF-bf16 error by more than half (or 5 %),
    and it must stay strongly correlated with the reference. OAR-G draws its noise at ``noise_std_low_precision`` on
    bf16 embedding outputs (docs/method.md §4), so its fp32 reference runs at that σ: the same method point."""
    ranks = run_layout(assets, "bf16", dtype="bfloat16")
    (res,) = ranks
    assert res["src"]
    check_side_effects(ranks)
    rows = res["rows"].tolist()
    print("[TP=1 PP=1 bf16] relative L2 error vs the fp32 reference: Megatron bf16 | HF bf16; Pearson r (Megatron)")
    low = OARConfig().noise_std_low_precision
    for case in CASES:
        fp32 = {**case, "oar": {**case["oar"], "noise_std": low}} if case["oar"]["mode"] == "gradient" else case
        ref, batch = reference(assets, rows, fp32)
        hf16, _ = reference(assets, rows, case, dtype=torch.bfloat16)
        m = batch.reasoning_mask
        got = res["cases"][case["name"]]
        assert bool((got[~m] == 0).all())
        err = float((got - ref)[m].norm() / ref[m].norm())
        err_hf = float((hf16 - ref)[m].norm() / ref[m].norm())
        r = float(torch.corrcoef(torch.stack([got[m], ref[m]]))[0, 1])
        print(f"   {case['name']:14s} {err:.3f} | {err_hf:.3f}; r = {r:.4f}")
        # the fisher mode's AS-Joint score is one signed bf16 gradient projection on e_mask - e_t (a difference of two
        # bf16 embeddings), with no averaging over draws or outcomes: its error spreads wider between kernels; a
        # sketch's gradient is a signed sum over the whole vocabulary (Σ_v s_v √p_v ∇ log p_v, much cancellation),
        # so the bf16 rounding of the logits' gradient weighs more (measured 1.64x HF's error, r = 0.997; the fp32
        # layouts hold it to 1e-6 of the reference)
        # OAR-G at bf16's σ = 5e-2 (noise_std_low_precision) differentiates a shift 50x the paper's σ's, farther from
        # the clean point: the engine's kernels (fused norms, another matmul order) part from HF's more there
        # (measured: g_lt 1.85x and g_mean 1.8x HF's error, r >= 0.994)
        factor = 2.0 if case["name"] in ("f_joint", "f_sketch") or case["oar"]["mode"] == "gradient" else 1.5
        assert err <= max(factor * err_hf, 0.05), f"bf16/{case['name']}: {err:.3f} vs HF bf16 {err_hf:.3f}"
        assert r > 0.9, f"bf16/{case['name']}: correlation {r:.3f}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
