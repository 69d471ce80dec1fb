"""scripts/gpu_check.sh in its tiny CPU mode, on an interpreter that cannot import verl, vLLM or Ray (the bare GPU
machine has none of them): it completes, its JSON holds every part's points with the fields the table reads, and a
second call skips the parts already written (resumable). Timings are recorded, never compared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("verl", "vllm", "ray")

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


def _run(tmp_path: Path, out: Path) -> subprocess.CompletedProcess:
    block = tmp_path / "block"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(block), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "OAR_BLOCKED_LOG": str(tmp_path / "blocked.log"), "OAR_PROGRESS": "1"}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_tiny_cpu_without_verl(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, out)
    probe = subprocess.run([sys.executable, "-c", "import verl"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "block"),
                                "OAR_BLOCKED_LOG": str(tmp_path / "probe.log")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "blocked" not in proc.stderr
    # the blocker works (the probe could not import verl) and nothing in the check asked for verl / vLLM / Ray
    assert probe.returncode != 0 and "absent on the bare GPU machine" in probe.stderr, probe.stderr[-2000:]
    assert not (tmp_path / "blocked.log").exists(), (tmp_path / "blocked.log").read_text()

    res = json.loads((out / "gpu_check.json").read_text())
    meta = res["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "bfloat16" and meta["torch"] and meta["date"]
    assert set(res["parts"]) == {"attribution-tiny", "long-tiny"}
    for name, part in res["parts"].items():
        assert part["status"] == "done" and part["skipped_lengths"] == [], (name, part.get("status"))
        assert [p["length"] for p in part["points"]] == [64, 128]
        assert (out / "parts" / f"{name}.json").exists()

    for p in res["parts"]["attribution-tiny"]["points"]:
        assert p["train_seconds"] > 0 and p["budget"] == p["rows"] * (128 + p["length"])
        for name in ("oar_g_k1", "oar_g_k4", "fisher_k1", "oar_p_exact"):
            e = p[name]
            assert math.isfinite(e["vs_train_time"]) and e["vs_train_time"] > 0, (name, e)
            assert math.isfinite(e["vs_train_peak"]) and e["vs_train_peak"] >= 0, (name, e)
        exact = p["oar_p_exact"]
        # three passes of the exact method measured, the rest extrapolated: the sample is a strict part of the work
        assert exact["extrapolated"] and 0 < exact["sampled_fraction"] < 1
        assert exact["seconds"] > exact["measured_seconds"]
        assert exact["copies"] == p["length"] - 4  # reasoning = response - marker (2) - answer (2)

    for p in res["parts"]["long-tiny"]["points"]:
        pol = p["policies"]
        assert set(pol) == {"exact", "segment", "hierarchical 0.05", "hierarchical 0.1", "hierarchical 0.2"}
        assert pol["exact"]["copies"] == p["length"] - 4
        # the cost of a policy is its recomputed tokens: the segment pass, plus (hierarchical) a growing share of the
        # segments token by token (with one segment in a short row that can exceed exact: not compared)
        work = [pol[k]["recomputed_tokens"] for k in ("segment", "hierarchical 0.05", "hierarchical 0.1",
                                                      "hierarchical 0.2")]
        assert work == sorted(work) and work[0] < work[1] and work[0] < pol["exact"]["recomputed_tokens"], work
        assert all(math.isfinite(e["vs_train"]) and e["vs_train"] > 0 for e in pol.values())
    first = res["parts"]["long-tiny"]["points"][0]
    assert first["segment_measured_seconds"] > 0  # the segment policy also run in full at the first length

    assert [(r["shape"], r["length"]) for r in res["table"]] == [("tiny", 64), ("tiny", 128)]
    for r in res["table"]:
        assert not r["errors"]
        assert all(k in r for k in ("train_seconds", "oar_g_k1", "oar_g_k4", "fisher_k1", "oar_p_exact",
                                    "segment_time", "hierarchical_time"))
    assert (out / "gpu_check.md").stat().st_size > 0

    # resumable: a second call skips both parts (their JSON exists) and rewrites the summary from them
    stamps = {f.name: f.stat().st_mtime_ns for f in (out / "parts").glob("*.json") if "partial" not in f.name}
    again = _run(tmp_path, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {f.name: f.stat().st_mtime_ns for f in (out / "parts").glob("*.json") if "partial" not in f.name} == stamps
    assert json.loads((out / "gpu_check.json").read_text())["table"] == res["table"]
