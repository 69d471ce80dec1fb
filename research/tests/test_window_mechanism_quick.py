"""The sliding-window mechanism study's quick mode (research.window_mechanism --quick): a random-init tiny Gemma 3
(sliding, sliding, full; window 16) samples two rows past its window and all four experiments run. Checked: the
outputs' structure, the invariants that hold whatever the model (deletion shortens the row by exactly the count and
moves the answer by it; attention rows sum to 1; a sliding layer's probe pays no attention past its window; the eager
masked forward of (d) gives the product's exact shift of (c); the widened model is another model; a second run
resumes from the cache), the linear prediction of (c) matching exact leave-one-out to first order when the mask
embedding is close to every token's, and the geometry helpers by hand. The numbers of a random model mean nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from oar_verl.core.backends.budget import PassLimits
from research import window_mechanism as wm
from research.long_fidelity import prepared

QUICK = wm.QUICK


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quick run's folder, its row files and their modification times."""
    out = tmp_path_factory.mktemp("wm")
    assert wm.main(["--quick", "--out", str(out)]) == 0
    folder = out / f"tiny_{QUICK['tokens']}"
    files = sorted(folder.glob("row_*.json"))
    return out, folder, [json.loads(p.read_text()) for p in files], [p.stat().st_mtime_ns for p in files]


def test_every_experiment_ran_on_every_row(run):
    _, folder, rows, _ = run
    assert len(rows) == QUICK["rows"]
    for r in rows:
        assert {"a", "b", "c", "d", "f", "scores", "geometry", "location"} <= set(r)
        g = r["geometry"]
        assert r["window"] == QUICK["window"] and r["half"] == QUICK["window"] // 4
        assert g["edge"] == g["answer"] - QUICK["window"] and g["reasoning"] < g["answer"]
        assert g["edge"] - g["half"] >= 0, "the quick rows must reach past the window"
        for name in wm.COMPARED:
            assert len(r["scores"][name]) == g["reasoning"]
            assert 0.0 <= r["location"][name]["edge_band"] <= 1.0
    summary = json.loads((folder / "summary.json").read_text())
    assert set(summary) == {"model", "rows", "b", "c", "d"}
    assert set(summary["c"]) == {"band_top", "band_random", "end_top"}
    tables = (folder / "tables.md").read_text()
    assert all(f"\n({e}) " in tables for e in "abcd")


def test_deletion_shortens_the_row_by_exactly_the_count(run):
    _, _, rows, _ = run
    for r in rows:
        a, g = r["a"], r["geometry"]
        n = len(a["deleted"])
        assert n == g["half"]  # the default count: W/4
        assert a["tokens"][1] == a["tokens"][0] - n and a["reasoning"][1] == g["reasoning"] - n
        assert a["answer"][1] == g["answer"] - n  # everything before the deleted tokens moved n closer
        assert min(a["deleted"]) >= g["edge"] + g["half"] and len(set(a["deleted"])) == n
        # the deleted tokens are the lowest-scored after the band
        ranked = np.asarray(r["scores"][wm.RANKED_BY])
        after_band = ranked[g["edge"] + g["half"]:]
        assert ranked[a["deleted"]].max() <= np.sort(after_band)[n - 1] + 1e-12
        for name in wm.COMPARED:
            e = a["methods"][name]
            assert len(e["scores_after"]) == g["reasoning"] - n
            for key in ("edge_band", "last_quarter"):
                assert 0.0 <= e["before"][key] <= 1.0 and 0.0 <= e["after"][key] <= 1.0
            assert 0.0 <= e["after_on_moved_band"] <= 1.0 and -1.0 <= e["spearman_kept"] <= 1.0
            assert e["before"] == wm.location(ranked if name == wm.RANKED_BY else np.asarray(r["scores"][name]),
                                              wm.Geometry(**g))


def test_the_widened_model_is_another_model(run):
    _, _, rows, _ = run
    for r in rows:
        b, g = r["b"], r["geometry"]
        assert b["kl_window_to_wide"] > 0.0  # the rows reach past the window: the outcome moves
        for state in b["outcome"]:
            assert 0.0 <= state["p_answer"] <= 1.0 and 0.0 < state["p_top"] <= 1.0
        for name in wm.COMPARED:
            assert len(b["scores"][name]) == g["reasoning"] and 0.0 <= b["mass"][name]["edge_band"] <= 1.0
        wide = np.asarray(b["scores"]["oar_g"])
        assert not np.allclose(wide, np.asarray(r["scores"]["oar_g"]))
        for chunk in r["f"].values():  # research.long_fidelity's chunks, with the window and widened
            assert chunk["reasoning"] == [g["reasoning"]] and set(wm.COMPARED) <= set(chunk["aopc"])
            assert set(chunk["control_aopc"]) == {"random", "position", "entropy"}
        # the fidelity part re-scores on the widened model: the same scores as (b)'s
        np.testing.assert_allclose(r["f"]["widened"]["scores"]["oar_g"][0], wide, rtol=1e-6)
        np.testing.assert_allclose(r["f"]["window"]["scores"]["oar_g"][0], r["scores"]["oar_g"], rtol=1e-6)


def test_leave_one_out_groups(run):
    _, _, rows, _ = run
    for r in rows:
        g = r["geometry"]
        band = set(wm.Geometry(**g).band().tolist())
        c = r["c"]
        assert set(c["band_top"]["tokens"]) <= band and set(c["band_random"]["tokens"]) <= band
        assert not set(c["band_top"]["tokens"]) & set(c["band_random"]["tokens"])
        assert all(k >= g["reasoning"] - g["half"] for k in c["end_top"]["tokens"])
        ranked = np.asarray(r["scores"][wm.RANKED_BY])
        top = c["band_top"]["tokens"]
        assert ranked[top].min() >= ranked[sorted(band - set(top))].max()
        for e in c.values():
            assert len(e["exact_kl"]) == len(e["exact_logp"]) == len(e["linear_logp"]) == len(e["tokens"]) == \
                QUICK["group"]
            assert min(e["exact_kl"]) >= 0.0


def test_attention_rows_sum_to_one_and_the_window_holds(run):
    _, _, rows, _ = run
    for r in rows:
        d, c = r["d"], r["c"]
        sliding = [t == "sliding_attention" for t in d["layer_types"]]
        assert len(d["tokens"]) == QUICK["attention"]
        for e in d["tokens"]:
            for state in ("clean", "masked"):
                assert e[state]["row_sum_error"] < 1e-6
                for key in ("probe_self", "probe_neighbours", "boundary_self", "boundary_neighbours"):
                    assert len(e[state][key]) == len(sliding) and min(e[state][key]) >= 0.0
            if not e["in_probe_reach"]:  # past the probe's window a sliding layer reads nothing from the token
                assert all(v == 0.0 for v, s in zip(e["clean"]["probe_self"], sliding) if s)
            # the hand-masked eager forward gives the product's exact shift (outcome_shifts, operator mean)
            exact = c["band_top"]["exact_kl"][c["band_top"]["tokens"].index(e["token"])]
            assert e["kl_eager"] == pytest.approx(exact, rel=1e-4, abs=1e-12)


def test_a_second_run_resumes_from_the_cache(run):
    out, folder, _, mtimes = run
    assert wm.main(["--quick", "--out", str(out)]) == 0
    assert [p.stat().st_mtime_ns for p in sorted(folder.glob("row_*.json"))] == mtimes


def test_the_linear_prediction_is_leave_one_out_to_first_order(run):
    """With every embedding row shrunk towards the table's mean (so δ_t = ē − e_t is 10⁻³ of its size), the
    first-order prediction −⟨∂φ/∂e_t, δ_t⟩ matches the exact shift of masking t (float64 tiny model)."""
    _, folder, rows, _ = run
    m = wm.load_model("tiny", QUICK["window"])
    emb = m.model.get_input_embeddings().weight
    with torch.no_grad():
        mean = emb.mean(0, keepdim=True)
        emb.copy_(mean + 1e-3 * (emb - mean))
    data = json.loads((folder / "rows.json").read_text())[:1]
    prep = prepared(m, data)
    g = wm.geometry(prep.batch, QUICK["window"], QUICK["window"] // 4)
    scores = {n: np.asarray(rows[0]["scores"][n]) for n in wm.COMPARED}
    got = wm.leave_one_out_vs_linear(m, prep.batch, scores, g, 4, np.random.default_rng(0), PassLimits(8192))
    for name, e in got.items():
        exact, linear = np.asarray(e["exact_logp"]), np.asarray(e["linear_logp"])
        assert np.abs(exact).min() > 0, name
        np.testing.assert_allclose(linear, exact, rtol=0.02, err_msg=name)
        assert e["logp_vs_linear"]["sign_agreement"] == 1.0


def test_geometry_helpers_by_hand():
    g = wm.Geometry(first=5, reasoning=20, answer=23, edge=7, half=2)
    assert g.band().tolist() == [5, 6, 7, 8]
    scores = np.zeros(20)
    scores[[6, 7]] = 1.0
    scores[15] = 1.5
    assert wm.share(scores, g.band()) == pytest.approx(2 / 3.5)
    assert wm.peak(scores, 2) == 6  # the densest 4-token window, [4, 8), holds both ones
    loc = wm.location(scores, g)
    assert loc["argmax_distance"] == 23 - 15 and loc["peak_distance"] == 23 - 6
    assert loc["last_quarter"] == pytest.approx(1.5 / 3.5) and loc["edge_band"] == pytest.approx(2 / 3.5)
    assert wm.deletion_set(np.arange(20.0)[::-1], g, 3).tolist() == [17, 18, 19]
    with pytest.raises(ValueError, match="--delete"):
        wm.deletion_set(scores, g, 12)
