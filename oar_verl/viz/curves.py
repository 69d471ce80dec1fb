"""Reward and OAR metric curves from verl's ``file`` logger JSONL, as one PNG (matplotlib, Agg backend).

usage::

    python -m oar_verl.viz.curves METRICS.jsonl [MORE.jsonl ...] --out curves.png

Input: ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``, one ``{"step": n, "data": {metric: value}}`` per line
(several files are overlaid, labelled by file name: e.g. a GRPO baseline next to OAR-G). Panels: training reward
(``critic/score/mean``, with validation ``val-core/<source>/<acc|reward>/mean@N`` as markers when logged),
``actor/entropy``, ``oar/weight_std``, ``oar/ess_ratio`` (1 = plain GRPO), ``oar/frac_floor`` / ``oar/frac_boosted``
and the share of the step time spent on attribution (``timing_s/oar_total / timing_s/step``: attribution wherever it
ran, inside verl's old-log-prob call included; ``timing_s/oar`` for logs written before that key). A panel whose metrics a run
did not log says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from oar_verl.viz.metrics_log import read_metrics

__all__ = ["PANELS", "plot_curves"]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _oar_share(rows: list[dict]) -> tuple[list[int], list[float]]:
    def cost(r: dict):
        total = r.get("timing_s/oar_total")
        return total if isinstance(total, (int, float)) else r.get("timing_s/oar")

    pts = [(r["step"], cost(r) / r["timing_s/step"]) for r in rows
           if isinstance(cost(r), (int, float)) and r.get("timing_s/step")]
    return [p[0] for p in pts], [100.0 * p[1] for p in pts]


# (title, y label, [(legend suffix, series function)])
PANELS: list[tuple[str, str, list[tuple[str, Callable[[list[dict]], tuple[list[int], list[float]]]]]]] = [
    ("reward", "critic/score/mean", [("", lambda rows: _series(rows, "critic/score/mean"))]),
    ("entropy", "actor/entropy", [("", lambda rows: _series(rows, "actor/entropy"))]),
    ("weight spread", "oar/weight_std", [("", lambda rows: _series(rows, "oar/weight_std"))]),
    ("effective sample size", "oar/ess_ratio (1 = GRPO)", [("", lambda rows: _series(rows, "oar/ess_ratio"))]),
    ("suppressed / boosted tokens", "fraction of reasoning tokens",
     [("floor", lambda rows: _series(rows, "oar/frac_floor")),
      ("boosted", lambda rows: _series(rows, "oar/frac_boosted"))]),
    ("attribution cost", "timing_s/oar_total / timing_s/step (%)", [("", _oar_share)]),
]


def plot_curves(metrics_files: Sequence[str | os.PathLike], out: str | os.PathLike,
                labels: Sequence[str] | None = None) -> dict[str, int]:
    """Plot the panels for each run into the PNG ``out``.

    Returns:
        ``{panel title: number of points drawn}`` (0 = nothing logged for it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [(Path(f), read_metrics(f)) for f in metrics_files]
    for path, rows in runs:
        if not rows:
            raise ValueError(f"{path}: no metrics (missing or empty file)")
    labels = list(labels) if labels else [p.stem for p, _ in runs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    drawn: dict[str, int] = {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, series) in zip(axes.flat, PANELS):
        count = 0
        for run_index, ((_, rows), label) in enumerate(zip(runs, labels)):
            colour = colours[run_index % len(colours)]
            for series_index, (suffix, fn) in enumerate(series):
                xs, ys = fn(rows)
                if xs:
                    name = f"{label} {suffix}".strip() if len(runs) > 1 or suffix else label
                    ax.plot(xs, ys, marker="o", markersize=3, color=colour, linestyle=("-", "--")[series_index % 2],
                            label=name)
                    count += len(xs)
            if title == "reward":  # validation scores, when the run validated
                for key in sorted({k for r in rows for k in r if k.startswith("val-core/") and "/mean@" in k}):
                    xs, ys = _series(rows, key)
                    if xs:
                        ax.plot(xs, ys, marker="s", linestyle=":", color=colour,
                                label=f"{label} {key.removeprefix('val-core/').rsplit('/', 2)[0]} (val)")
                        count += len(xs)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if count:
            handles, names = ax.get_legend_handles_labels()
            unique = dict(zip(names, handles))
            ax.legend(unique.values(), unique.keys(), fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="#888")
        drawn[title] = count
    fig.suptitle("OAR training curves: " + ", ".join(labels))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="verl file-logger JSONL file(s)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--labels", nargs="*", help="legend names, one per file (default: file names)")
    args = parser.parse_args(argv)
    try:
        drawn = plot_curves(args.metrics, args.out, args.labels)
    except (FileNotFoundError, ValueError) as exc:
        print(f"[curves] error: {exc}", file=sys.stderr)
        return 1
    empty = [t for t, n in drawn.items() if not n]
    print(f"[curves] wrote {args.out}" + (f" (not logged: {', '.join(empty)})" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
