"""scripts/gpu_check.sh on CPU (--tiny), on an interpreter that cannot import verl, vLLM or Ray (the bare GPU machine
has none of them): the parts run most valuable first, the budget skips a part that does not fit and says so, a second
run resumes what was skipped (and only that), a hung part stops at its own limit, and the H100 plan's headline parts
fit the 480 s budget. Timings are recorded, never compared."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("verl", "vllm", "ray")
TINY = ["attribution-tiny-64", "attribution-tiny-128", "precision-tiny-48", "oar_p-tiny", "long-tiny"]
NOT_RUN = "not run (budget), rerun to resume"

# loaded by site at start-up from PYTHONPATH, in the driver and in every part process it starts; it also records what
# was asked for, so a guarded `try: import verl` that would swallow the error still shows up
SITECUSTOMIZE = f"""
import os, sys
class _NoVerl:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            with open(os.environ["OAR_BLOCKED_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"{{name}} is absent on the bare GPU machine")
sys.meta_path.insert(0, _NoVerl())
"""


def _run(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    block = tmp_path / "block"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(block), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "OAR_BLOCKED_LOG": str(tmp_path / "blocked.log"), "OAR_PROGRESS": "1",
           "OAR_GPU_BUNDLE": str(tmp_path / "no-bundle.tar.xz")}  # a bundle in the checkout is not this test's
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--tiny", "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def _started(proc: subprocess.CompletedProcess) -> list[str]:
    """The parts this run started, in the order it started them."""
    return re.findall(r"^\[gpu_check\] (\S+): lengths ", proc.stderr, re.M)


def _stamps(out: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mtime_ns for f in (out / "parts").glob("*.json") if "partial" not in f.name}


def test_plan_order_and_h100_budget():
    from research import gpu_check

    parts = gpu_check.plan()
    assert [p.name for p in parts] == [
        "verl-worker", "attribution-qwen2.5-7b-4096", "attribution-qwen2.5-7b-16384", "precision-qwen2.5-1.5b-2048",
        "oar_p-qwen2.5-7b", "long-qwen2.5-7b", "attribution-qwen2.5-1.5b", "long-qwen2.5-1.5b",
        "attribution-qwen2.5-7b-2048"]
    assert [p.headline for p in parts] == [True] * 4 + [False] * 5
    verl_part, parts = parts[0], parts[1:]
    assert verl_part.kind == "verl-worker" and verl_part.lengths == ("bf16", "fp32")
    assert parts[0].methods == parts[1].methods == ("oar_g_k1", "fisher_k1")
    # as planned on CUDA: each attribution call timed 3 times (the median kept)
    est = {p.name: gpu_check.estimate(p, p.lengths, 1, gpu_check.H100, repeats=3) for p in parts}
    assert all(est[p.name] > gpu_check.estimate(p, p.lengths, 1, gpu_check.H100) for p in parts if p.kind == "attribution")
    # model start-up is part of every estimate: a 7B part never plans under its process + build + warm-up
    assert all(est[p.name] > gpu_check.H100.process_s + gpu_check.H100.warmup_s for p in parts)
    assert est["attribution-qwen2.5-7b-16384"] > est["attribution-qwen2.5-7b-4096"]
    # the headline parts fit one 480 s run with 30 s for the driver's start-up and the summary's reserve, twice over
    headline = sum(est[p.name] for p in parts if p.headline)
    assert 2 * headline + 30 + gpu_check.RESERVE_S <= 480, est
    # the verl-worker part alone fits one run, with the driver's start-up and the reserve, at 1.5x its estimate (on an
    # H100 it took 1.18x: 291 s against 247 s, 2026-11-26)
    verl_est = gpu_check.estimate(verl_part, verl_part.lengths, 1, gpu_check.H100, repeats=3)
    assert 1.5 * verl_est + 30 + gpu_check.RESERVE_S <= 480, verl_est
    # the CI plan is the same parts, in the same order, on the tiny model; verl-worker only when named (its CPU smoke
    # run is tests/integration/test_worker_group_on_cpu.py's)
    assert [p.name for p in gpu_check.plan(tiny=True)] == TINY
    assert [p.kind for p in gpu_check.plan(tiny=True)] == [p.kind for p in parts[:5]]
    assert [p.name for p in gpu_check.plan(tiny=True, verl=True)] == ["verl-worker"] + TINY


def test_no_budget_runs_nothing_and_says_so(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, out, "--budget-s", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _started(proc) == []
    # the plan is printed first, in order, with an estimate for every part
    plan = re.findall(r"^\s+\d+\. (\S+) .* ~\s*(\d+) s", proc.stdout, re.M)
    assert [name for name, _ in plan] == TINY and all(int(s) > 0 for _, s in plan), proc.stdout
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["plan"] == TINY and list(res["parts"]) == TINY
    for name, part in res["parts"].items():
        assert part["status"] == NOT_RUN and part["estimate_s"] > part["time_left_s"], (name, part)
        assert f"[gpu_check] {name}: {NOT_RUN}" in proc.stderr
    assert not list((out / "parts").glob("*.json"))
    assert "Run the same command again to resume" in proc.stdout


def test_the_verl_worker_part_without_verl_says_how_to_get_it(tmp_path):
    """On a machine without verl (no bundle carried), the part is reported with the command that builds the bundle,
    the run goes on with the other parts, and its exit status is not a failure."""
    out = tmp_path / "out"
    proc = _run(tmp_path, out, "--parts", "verl-worker,attribution-tiny-64", "--estimate", "attribution-tiny-64=1e9")
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert parts["verl-worker"]["status"].startswith("not run: needs verl and Ray")
    assert "devtools.gpu_bundle build" in parts["verl-worker"]["status"]
    assert parts["attribution-tiny-64"]["status"] == NOT_RUN
    assert _started(proc) == []


def test_a_hung_part_stops_at_its_limit(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, out, "--parts", "attribution-tiny-64", "--part-limit-s", "1")
    assert proc.returncode == 1, proc.stderr[-3000:]  # a part that did not finish fails the run
    part = json.loads((out / "gpu_check.json").read_text())["parts"]["attribution-tiny-64"]
    assert part["status"] == "stopped at its 1 s limit" and part["seconds"] < 30, part
    assert not (out / "parts" / "attribution-tiny-64.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_budget_and_resume_without_verl(tmp_path):
    out = tmp_path / "out"
    # 1. a budget that holds one part: the rest are skipped, each with its reason, by the recorded rule. The estimates
    # and the budget are the test's, far from any machine's speed (a busy machine once stopped the first part at a
    # 16 s limit that a 30 s budget left it): the first part fits (60 s of 100,000), no other can (10^9 s each), and
    # the first part's own limit is three times its estimate (it takes seconds on an idle machine)
    pinned = [a for n in TINY[1:] for a in ("--estimate", f"{n}=1e9")]
    first = _run(tmp_path, out, "--budget-s", "100000", "--estimate", f"{TINY[0]}=60", *pinned)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    ran = [n for n, p in res["parts"].items() if p["status"] == "done"]
    assert ran == _started(first) == TINY[:1], (ran, first.stderr[-2000:])
    for name in TINY[len(ran):]:
        part = res["parts"][name]
        assert part["status"] == NOT_RUN and part["estimate_s"] > part["time_left_s"], (name, part)
        assert f"[gpu_check] {name}: {NOT_RUN}" in first.stderr

    # 2. a part whose estimate cannot fit is skipped, the smaller parts after it still run, in plan order
    second = _run(tmp_path, out, "--budget-s", "100000", "--estimate", "attribution-tiny-128=1e9")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert _started(second) == [n for n in TINY if n not in ran + ["attribution-tiny-128"]], second.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["parts"]["attribution-tiny-128"]["status"] == NOT_RUN
    assert "Not measured yet: attribution-tiny-128." in second.stdout

    # 3. the next run resumes the skipped part only; the parts written before are not touched
    stamps = _stamps(out)
    assert set(stamps) == {f"{n}.json" for n in TINY if n != "attribution-tiny-128"}
    third = _run(tmp_path, out, "--budget-s", "100000", "--repeats", "2")  # each call timed twice, the median kept
    assert third.returncode == 0, third.stderr[-3000:]
    assert _started(third) == ["attribution-tiny-128"]
    assert {k: v for k, v in _stamps(out).items() if k in stamps} == stamps

    # nothing in the check asked for verl / vLLM / Ray, and the blocker works
    probe = subprocess.run([sys.executable, "-c", "import verl"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "block"),
                                "OAR_BLOCKED_LOG": str(tmp_path / "probe.log")})
    assert probe.returncode != 0 and "absent on the bare GPU machine" in probe.stderr, probe.stderr[-2000:]
    assert not (tmp_path / "blocked.log").exists(), (tmp_path / "blocked.log").read_text()

    res = json.loads((out / "gpu_check.json").read_text())
    meta = res["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "bfloat16" and meta["torch"] and meta["date"]
    assert list(res["parts"]) == TINY
    for name, part in res["parts"].items():
        assert part["status"] == "done" and (out / "parts" / f"{name}.json").exists(), (name, part["status"])
        assert [p["length"] for p in part["points"]] == part["lengths"]

    for name, repeats in (("attribution-tiny-64", 1), ("attribution-tiny-128", 2)):
        (p,) = res["parts"][name]["points"]
        assert p["train_seconds"] > 0 and p["budget"] == p["rows"] * (128 + p["length"])
        assert p["repeats"] == repeats and len(p["train_seconds_all"]) == repeats
        assert p["train_seconds"] == pytest.approx(sorted(p["train_seconds_all"])[0] if repeats == 1
                                                   else sum(p["train_seconds_all"]) / 2)
        assert all(len(p[m]["seconds_all"]) == repeats for m in ("oar_g_k1", "fisher_k1"))
        assert set(p) >= {"oar_g_k1", "fisher_k1"} and "oar_p_exact" not in p
        for m in ("oar_g_k1", "fisher_k1"):
            assert math.isfinite(p[m]["vs_train_time"]) and p[m]["vs_train_time"] > 0, (m, p[m])
            assert math.isfinite(p[m]["vs_train_peak"]) and p[m]["vs_train_peak"] >= 0, (m, p[m])

    (p,) = res["parts"]["precision-tiny-48"]["points"]
    for m in ("oar_g_k1", "fisher_k1"):
        e = p[m]
        assert -1 <= e["spearman"] <= 1 and 0 <= e["top20_overlap"] <= 1 and e["rel_l2_error"] >= 0, (m, e)
    assert [(r["method"], r["length"]) for r in res["precision"]] == [("oar_g_k1", 48), ("fisher_k1", 48)]

    for p in res["parts"]["oar_p-tiny"]["points"]:
        assert set(p) >= {"oar_g_k4", "path_m2", "oar_p_exact"} and "oar_g_k1" not in p
        assert p["path_m2"]["seconds"] > 0 and p["path_m2"]["vs_train_time"] > 0
        exact = p["oar_p_exact"]
        # three passes of the exact method measured, the rest extrapolated: the sample is a strict part of the work
        assert exact["extrapolated"] and 0 < exact["sampled_fraction"] < 1
        assert exact["seconds"] > exact["measured_seconds"]
        assert exact["copies"] == p["length"] - 4  # reasoning = response - marker (2) - answer (2)

    for p in res["parts"]["long-tiny"]["points"]:
        pol = p["policies"]
        assert set(pol) == {"exact", "segment", "hierarchical 0.05", "hierarchical 0.1", "hierarchical 0.2"}
        assert pol["exact"]["copies"] == p["length"] - 4
        work = [pol[k]["recomputed_tokens"] for k in ("segment", "hierarchical 0.05", "hierarchical 0.1",
                                                      "hierarchical 0.2")]
        assert work == sorted(work) and work[0] < work[1] and work[0] < pol["exact"]["recomputed_tokens"], work
        assert all(math.isfinite(e["vs_train"]) and e["vs_train"] > 0 for e in pol.values())
    first_long = res["parts"]["long-tiny"]["points"][0]
    assert first_long["segment_measured_seconds"] > 0  # the segment policy also run in full at the first length

    assert [(r["shape"], r["length"]) for r in res["table"]] == [("tiny", 64), ("tiny", 128)]
    for r in res["table"]:
        assert not r["errors"]
        assert all(k in r for k in ("train_seconds", "oar_g_k1", "fisher_k1", "oar_g_k4", "path_m2", "oar_p_exact",
                                    "segment_time", "hierarchical_time"))
    md = (out / "gpu_check.md").read_text()
    assert md.index("OAR-G K=1") < md.index("bf16 against fp32") < md.index("OAR-G K=4") and "Not measured" not in md

    # 4. a run with nothing left runs nothing and rewrites the same summary from the parts
    stamps = _stamps(out)
    again = _run(tmp_path, out)
    assert again.returncode == 0 and _started(again) == [], again.stderr[-3000:]
    assert _stamps(out) == stamps and json.loads((out / "gpu_check.json").read_text())["table"] == res["table"]
