"""The verl-worker part's figures without torch (issue #68 item 8): the names of its calls, the steady peak ratio and
its markdown, read by ``python -m research.tables`` (which must run where torch is not installed) as well as by
:mod:`research.verl_worker` and :mod:`research.gpu_check`, which measure them."""

from __future__ import annotations

# read from the old-log-prob pass (algorithm.oar.shared_forward), in order: fisher's and conservative's scores, OAR-G's
# clean teachers (its noisy passes right after the pass, in the same call)
SHARED_MODES = ("fisher", "conservative", "gradient")


def shared_call(mode: str) -> str:
    """The name of the old-log-prob pass with ``mode`` read from it, among the step's calls."""
    return f"{mode}-shared"


def steady_peak_ratio(e: dict, update: dict) -> float:
    """``e``'s peak as it stands in every step after the first, × the update's: the call's rise above its start on the
    memory the update starts from (the weights and the optimizer's state, which the first update allocates: the first
    step's attribution calls ran before it, so their absolute peaks would flatter them)."""
    base = update["absolute_peak_bytes"] - update["peak_bytes"]
    return (e["peak_bytes"] + base) / max(update["absolute_peak_bytes"], 1)


def verl_worker_markdown(rows: list[dict]) -> list[str]:
    """The verl-worker part's markdown: per variant its calls (seconds, × update_actor, peaks), the worker's scores
    against the core's, and what reading each mode from the old-log-prob pass adds."""
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "–"  # noqa: E731
    lines = []
    for p in rows:
        if "error" in p:
            lines += ["", f"verl-worker {p['length']}: {p['error']}"]
            continue
        calls = p["calls"]
        lines += ["", f"verl's FSDP2 worker group with OAR's worker ({p['device_name']}), FSDP2 mixed precision "
                      f"param_dtype={p['param_dtype']}, {p['shape']}, responses of {p['response_lengths']} tokens, "
                      f"dynamic batch sizes with {p['budget']} tokens a pass, gradient checkpointing; seconds: the median "
                      f"of the calls after the first of {p['repeats']} (the segment policy: 2), host syncs counted in "
                      "the first:", "",
                  "| call | seconds | × update_actor | × old log-probs | peak GiB | above its start | × update's peak "
                  "(later steps) | host syncs |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name in ("compute_log_prob", "gradient", "fisher", "conservative", "segment",
                     *map(shared_call, SHARED_MODES), "update_actor"):
            if name not in calls:
                continue
            c = calls[name]
            syncs = "–" if c.get("syncs") is None else str(sum(c["syncs"].values()))
            ratio = lambda key: f"{c[key]:.2f}" if key in c else "–"  # noqa: E731
            lines.append(f"| {name} | {c['seconds']:.3f} | {ratio('vs_update_time')} | {ratio('vs_log_prob_time')} | "
                         f"{gib(c.get('absolute_peak_bytes'))} | {gib(c['peak_bytes'])} | {ratio('vs_update_peak')} | "
                         f"{syncs} |")
        lines += ["", "| mode | worker vs core: worst row max rel. diff | worst row Spearman | Σw − R (max) |",
                  "|---|---:|---:|---:|"]
        for mode, a in p["agreement"].items():
            lines.append(f"| {mode} | {max(a['max_rel_diff']):.2e} | {min(a['spearman']):.4f} | "
                         f"{p['estimator'][mode]['max_sum_error']:.2e} |")
        for mode, sh in p.get("shared", {}).items():
            name = shared_call(mode)
            added = calls.get(name, {}).get("added_vs_update_time")
            lines += ["", f"{name}: the old-log-prob pass with {mode} read from it adds "
                      f"{added:.2f}× update_actor to the pass alone; its log-probs against the pass alone: max |Δ| "
                      f"{sh['log_probs_max_abs_diff']:.1e} (bitwise equal: {sh['log_probs_equal']}); its scores against "
                      f"the {mode} call: worst row max rel. diff {max(sh['agreement']['max_rel_diff']):.2e}, worst "
                      f"row Spearman {min(sh['agreement']['spearman']):.4f}; recomputed share "
                      f"{sum(sh['recomputed']) / max(len(sh['recomputed']), 1):.2f}"]
        syncs = {site: n for mode in ("gradient", "fisher", "segment") for site, n in
                 (calls[mode].get("syncs") or {}).items()}
        if syncs:
            lines += ["", "Host syncs in attribution (the warm call of each mode), by site: "
                      + "; ".join(f"`{site}` {n}" for site, n in sorted(syncs.items(), key=lambda kv: -kv[1]))]
        bad = [k for k, c in p["checks"].items() if not c["ok"]]
        lines += ["", "Checks: " + ("all passed" if not bad else "FAILED: " + "; ".join(bad))]
    return lines
