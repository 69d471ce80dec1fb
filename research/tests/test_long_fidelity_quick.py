"""The long-row fidelity study's quick mode: a random tiny model samples its rows, every compared method is scored,
timed against the training step and measured by the library's fidelity metric against the free controls (random,
position, entropy) with the candidate-independent gain; the cache makes a second run resume without recomputing.
Structure and bounds are checked, the numbers of a random model mean nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "tiny", "--rows", "2", "--tokens", "40", "--chunk", "1", "--methods", "oar_g,fisher_k1",
        "--draws", "2", "--random", "4", "--operators", "token,delete", "--fractions", "0.1,0.2"]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "research.long_fidelity", *ARGS, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_long_fidelity_study_quick(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "tiny_40"
    rows = json.loads((run / "rows.json").read_text())
    assert len(rows) == 2 and all(30 <= len(r["response"]) <= 40 for r in rows)  # the model's own 3/4..1 × cap
    summary = json.loads((run / "summary_oar_g-fisher_k1.json").read_text())
    assert summary["rows"] == 2 and set(summary["methods"]) == {"oar_g", "fisher_k1"}
    for name, e in summary["methods"].items():
        assert e["cost"] > 0 and math.isfinite(e["cost"])
        assert 0.0 <= e["mass"]["mean"] <= 1.0
        for stat in ("naopc", "suppression"):
            assert e[stat]["rows"] + e[stat]["undefined"] == 2
            if e[stat]["rows"]:
                assert e[stat]["lo"] <= e[stat]["mean"] <= e[stat]["hi"]
    # the paired NAOPC difference from the first method named
    assert "naopc_minus_first" in summary["methods"]["fisher_k1"] and "naopc_minus_first" not in summary["methods"][
        "oar_g"]
    chunks = sorted(run.glob("chunk_*_token-delete_0.1-0.2.json"))
    assert len(chunks) == 2
    for c in map(json.loads, (p.read_text() for p in chunks)):  # scores kept per reasoning token, for later gating
        assert all(len(row) == r for rows_ in c["scores"].values() for row, r in zip(rows_, c["reasoning"]))
        assert set(c["best"]) <= {"oar_g", "fisher_k1"} and len(c["best"]) == 1
    # the gating sweep from the cached scores reproduces the metric's own mass at the paper gate (tau 0.4, beta 2)
    sweep = json.loads((run / "gating_oar_g-fisher_k1.json").read_text())
    assert set(sweep) >= {"tau=0.4,beta=2", "tau=0.8,beta=4"}
    for name, e in summary["methods"].items():
        assert abs(sweep["tau=0.4,beta=2"][name]["mean"] - e["mass"]["mean"]) < 1e-9
    assert all(0.0 <= row[n]["mean"] <= 1.0 for row in sweep.values() for n in ("oar_g", "fisher_k1", "ceiling"))
    # the primary statistic, recomputed by hand from the cached per-row AOPCs: Σ (AOPC − AOPC_control) / Σ AOPC_control
    cached = [json.loads(p.read_text()) for p in chunks]
    for name, e in summary["methods"].items():
        for control in ("random", "position", "entropy"):
            a = [v for c in cached for v in c["aopc"][name][0]]
            k = [v for c in cached for v in c["control_aopc"][control][0]]
            g = e["gain_over"][control]
            assert g["rows"] + g["undefined"] == 2
            if g["rows"]:
                assert abs(g["mean"] - (sum(a) - sum(k)) / sum(k)) < 1e-9 and g["lo"] <= g["mean"] <= g["hi"]
    # the paired comparison of the first method against the others on the same rows, by hand
    a = [v for c in cached for v in c["aopc"]["oar_g"][0]]
    b = [v for c in cached for v in c["aopc"]["fisher_k1"][0]]
    pair = summary["paired"]["oar_g - fisher_k1"]["kl"]
    assert pair["rows"] + pair["undefined"] == 2
    if pair["rows"]:
        assert abs(pair["mean"] - (sum(a) - sum(b)) / sum(b)) < 1e-9
    assert set(summary["controls"]) == {"position", "entropy"} and len(summary["rows_static"]) == 2
    assert summary["naopc_candidates"] == ["oar_g", "fisher_k1"]
    assert "| entropy (control) |" in proc.stdout + (run / "log.txt").read_text()
    stamp = [c.stat().st_mtime_ns for c in chunks]
    again = _run(tmp_path)  # resumes: rows and chunks come from the cache
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [c.stat().st_mtime_ns for c in chunks] == stamp
    assert json.loads((run / "summary_oar_g-fisher_k1.json").read_text()) == summary
    # the committed-results form: the summary and every row's AOPCs (the rows the summary was computed on)
    results = tmp_path / "results.json"
    assert _run(tmp_path, "--results", str(results)).returncode == 0
    kept = json.loads(results.read_text())
    assert kept["summary"] == summary and len(kept["rows"]) == 2 and "--results" in kept["command"]
    assert [r["aopc"]["oar_g"][0] for r in kept["rows"]] == [round(v, 8) for v in a]
    # what mode=auto would decide on these rows: the product's rule on the cached per-row AOPCs (no model pass)
    from research import auto_decisions

    aopc, static, cost, lengths = auto_decisions.merged(run, "_token-delete_0.1-0.2")
    assert set(cost) == {"oar_g", "fisher_k1"} and all(c > 0 for c in cost.values()) and len(lengths) == 2
    for name, e in summary["methods"].items():  # the merged rows are the summary's rows
        assert aopc[name].tolist() == [v for c in cached for v in c["aopc"][name][0]]
    assert auto_decisions.main(["--out", str(tmp_path), "--model", "tiny", "--tokens", "40", "--operators",
                                "token,delete", "--fractions", "0.1,0.2"]) == 0


def test_a_results_file_refreshed_from_its_rows(tmp_path):
    """``--refresh``: a committed results file's ratio-of-sums intervals recomputed from its rows alone (no model),
    the figures unchanged, each one's share of undefined resamples added; a figure its rows do not give is refused."""
    import pytest

    from research.long_fidelity import refresh_results

    src = json.loads((ROOT / "research" / "results" / "fidelity_smollm2_1024.json").read_text())
    for part in ([e["gain_over"] for e in src["summary"]["methods"].values()]
                 + [e["gain_over"] for e in src["summary"]["controls"].values()] + list(src["summary"]["paired"].values())):
        for x in part.values():
            x.pop("dropped", None)  # as written before the field existed
    path = tmp_path / "f.json"
    path.write_text(json.dumps(src))
    dropped = refresh_results(path)
    got = json.loads(path.read_text())["summary"]
    paired = got["paired"]["conservative - fisher_k1_mean"]
    assert paired["kl"]["dropped"] == 0.0 and round(paired["logp"]["dropped"], 2) == 0.31  # issue #68's 31 %
    assert paired["logp"]["mean"] == src["summary"]["paired"]["conservative - fisher_k1_mean"]["logp"]["mean"]
    assert "paired/conservative - fisher_k1_mean/logp: 0.310" in dropped and got["min_gap"] == 1e-6
    src["summary"]["paired"]["conservative - oar_g"]["kl"]["lo"] += 0.01
    path.write_text(json.dumps(src))
    with pytest.raises(ValueError, match="paired/conservative - oar_g/kl lo"):
        refresh_results(path)
