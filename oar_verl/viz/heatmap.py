"""Token heatmaps of OAR weights as one self-contained HTML page (inline CSS, no scripts, no external resources).

usage::

    python -m oar_verl.viz.heatmap DUMP_DIR_OR_FILE --out page.html [--max-steps 10] [--correct-threshold 0.5]

Input: the trainer's token dumps (``algorithm.oar.dump_every=K``: ``step_<N>.jsonl``, one JSON object per rollout in
the format of :mod:`oar_verl.core.dumps`; an optional ``"prompt"`` is shown above its group, a ``"due_step"`` beside its
step). Per step and prompt group, the correct rollouts on the left and the incorrect ones on the right, each reasoning
token coloured by
its weight (blue < 1 < red), the rest grey. Multi-turn rows (an optional per-token ``"turn"``: the assistant turn
of each of the model's tokens, -1 on context; docs/multi_turn.md) show tool outputs and user turns boxed as context
and a marker where each later turn starts. Layout and colours: docs/verl.md, "Token dumps and heatmaps".
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
from collections import OrderedDict
from pathlib import Path

__all__ = ["BOOST_RGB", "SUPPRESS_RGB", "ANSWER_RGB", "load_dump", "render_html", "weight_colour", "write_heatmap"]

SUPPRESS_RGB = (44, 123, 182)  # w at the page minimum
BOOST_RGB = (215, 25, 28)  # w at the page maximum
ANSWER_RGB = (26, 127, 55)  # answer-span border

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")


def _dump_files(source: Path, max_steps: int | None) -> list[Path]:
    if source.is_file():
        return [source]
    files = sorted((p for p in source.glob("*.jsonl") if _STEP_FILE.search(p.name)),
                   key=lambda p: int(_STEP_FILE.search(p.name).group(1)))
    if not files:
        raise FileNotFoundError(f"no step_<N>.jsonl dumps in {source}")
    return files[-max_steps:] if max_steps else files


def load_dump(source: str | os.PathLike, max_steps: int | None = None) -> list[dict]:
    """Rollout records of one dump file, or of the last ``max_steps`` ``step_<N>.jsonl`` files of a folder.

    Raises:
        ValueError: a record whose per-token arrays differ in length from ``tokens``.
    """
    records = []
    for path in _dump_files(Path(source), max_steps):
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            n = len(record["tokens"])
            for key in ("importance", "weight", "reasoning", "answer", *(("turn",) if "turn" in record else ())):
                if len(record[key]) != n:
                    raise ValueError(f"{path}:{line_no}: len({key})={len(record[key])} != len(tokens)={n}")
            records.append(record)
    return records


def _mix(rgb: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    """White blended towards ``rgb`` by ``t`` in [0, 1]."""
    t = min(max(t, 0.0), 1.0)
    return tuple(round(255 + (c - 255) * t) for c in rgb)


def weight_colour(w: float, w_min: float, w_max: float) -> tuple[int, int, int]:
    """Diverging colour of weight ``w``: white at 1, ``SUPPRESS_RGB`` at ``w_min`` (< 1), ``BOOST_RGB`` at ``w_max``."""
    if w < 1.0:
        return _mix(SUPPRESS_RGB, (1.0 - w) / max(1.0 - w_min, 1e-9))
    return _mix(BOOST_RGB, (w - 1.0) / max(w_max - 1.0, 1e-9))


def _rgb(c: tuple[int, int, int]) -> str:
    return f"rgb({c[0]}, {c[1]}, {c[2]})"


# C0 control characters (a random model samples them) as their visible Unicode pictures (U+2400..), DEL as U+2421
_CONTROL_PICTURES = {c: chr(0x2400 + c) for c in range(32) if chr(c) not in "\n\t"} | {0x7F: "\u2421"}


def _token_text(token: str) -> str:
    """Escaped token text; newlines shown as ↵ (and kept as line breaks), control characters as ␀-style pictures,
    empty tokens as ∅."""
    if token == "":
        return "∅"
    return html.escape(token.translate(_CONTROL_PICTURES)).replace("\n", "↵\n")


def _render_tokens(record: dict, w_min: float, w_max: float) -> str:
    spans = []
    turns = record.get("turn") or [0] * len(record["tokens"])  # single-turn dumps hold no "turn"
    last_turn = 0
    for tok, w, imp, r, a, turn in zip(record["tokens"], record["weight"], record["importance"], record["reasoning"],
                                       record["answer"], turns):
        if turn > last_turn:  # a later assistant turn starts here
            spans.append(f'<span class="turn">▸ turn {turn + 1}</span>')
            last_turn = turn
        role = "reasoning" if r else ("answer" if a else ("context: tool output / user turn" if turn < 0
                                                            else "outside reasoning"))
        tip = f"{tok!r}  w={w:.3f}  importance={imp:.3g}  ({role})"
        classes = ["tok", "r" if r else "nr"] + (["ans"] if a else []) + (["ctx"] if turn < 0 else [])
        style = ""
        if r:
            bg = weight_colour(float(w), w_min, w_max)
            dark = sum(bg) < 420
            style = f' style="background:{_rgb(bg)}{";color:#fff" if dark else ""}"'
        spans.append(f'<span class="{" ".join(classes)}"{style} data-w="{float(w):.4g}" '
                     f'title="{html.escape(tip, quote=True)}">{_token_text(tok)}</span>')
    return "".join(spans)


def _rollout_card(record: dict, w_min: float, w_max: float, correct: bool) -> str:
    reasoning_w = [w for w, r in zip(record["weight"], record["reasoning"]) if r]
    w_range = f"w {min(reasoning_w):.2f}–{max(reasoning_w):.2f} over {len(reasoning_w)} reasoning tokens" \
        if reasoning_w else "no reasoning tokens"
    span = "answer span found" if record.get("span_found") else "no answer span"
    if record.get("turn"):  # multi-turn: turns and context runs (rounds of tool outputs)
        t = record["turn"]
        runs = sum(1 for i, x in enumerate(t) if x < 0 and (i == 0 or t[i - 1] >= 0))
        where = [x for x, a in zip(t, record.get("answer", [])) if a]
        if where:
            span += " (final turn)" if max(where) == max(t) else f" (turn {max(where) + 1})"
        span += f" · {max(t) + 1} turns · {runs} tool rounds"
    head = (f'<div class="head"><b>#{record["sample"]}</b> · reward <b>{record["reward"]:.2f}</b> · '
            f'advantage <b>{record["advantage"]:+.3f}</b> · {span} · {w_range}</div>')
    return (f'<div class="rollout {"ok" if correct else "bad"}">{head}'
            f'<div class="text">{_render_tokens(record, w_min, w_max)}</div></div>')


_CSS = f"""
body {{ font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 20px; color: #222; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} h2 {{ font-size: 17px; margin: 26px 0 8px; border-bottom: 1px solid #ccc; }}
.meta {{ color: #666; margin-bottom: 10px; }} .meta a {{ color: #1a5fb4; }}
.legend {{ display: flex; flex-wrap: wrap; gap: 18px; align-items: center; padding: 10px 12px; background: #f7f7f7;
  border: 1px solid #ddd; border-radius: 6px; }}
.bar {{ width: 260px; height: 14px; border: 1px solid #999;
  background: linear-gradient(to right, {_rgb(SUPPRESS_RGB)}, #fff, {_rgb(BOOST_RGB)}); }}
.barlabels {{ display: flex; justify-content: space-between; width: 262px; font-size: 12px; color: #444; }}
.group {{ margin: 14px 0; padding: 10px; border: 1px solid #ddd; border-radius: 6px; }}
.ghead {{ font-weight: 600; margin-bottom: 6px; }} .prompt {{ color: #444; margin-bottom: 8px; white-space: pre-wrap; }}
.cols {{ display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }}
.colhead {{ font-weight: 600; margin-bottom: 4px; }} .colhead.ok {{ color: {_rgb(ANSWER_RGB)}; }}
.colhead.bad {{ color: #b00; }}
.rollout {{ border: 1px solid #ddd; border-left: 4px solid #ccc; border-radius: 4px; padding: 6px 8px;
  margin-bottom: 8px; background: #fff; }}
.rollout.ok {{ border-left-color: {_rgb(ANSWER_RGB)}; }} .rollout.bad {{ border-left-color: #b00; }}
.head {{ font-size: 12px; color: #555; margin-bottom: 4px; }}
.text {{ font: 13px/1.9 "DejaVu Sans Mono", Menlo, Consolas, monospace; white-space: pre-wrap;
  word-break: break-word; }}
.tok {{ border-radius: 2px; padding: 1px 0; }}
.tok.nr {{ color: #888; background: #eee; font-style: italic; }}
.tok.ans {{ outline: 2px solid {_rgb(ANSWER_RGB)}; outline-offset: -1px; text-decoration: underline;
  color: #111; font-weight: 700; font-style: normal; }}
.tok.ctx {{ color: #345; background: #e8eef5; font-style: normal; border: 1px dashed #9ab; }}
.turn {{ display: inline-block; margin: 0 4px; padding: 0 4px; font-size: 11px; color: #fff; background: #567;
  border-radius: 3px; }}
.none {{ color: #999; font-style: italic; }}
"""


def render_html(records: list[dict], *, title: str = "OAR token weights", correct_threshold: float = 0.5,
                source: str = "") -> str:
    """The page for ``records`` (see the module docstring). Colours are scaled to the page's weight range."""
    reasoning_w = [float(w) for r in records for w, m in zip(r["weight"], r["reasoning"]) if m]
    w_min = min([*reasoning_w, 1.0])
    w_max = max([*reasoning_w, 1.0])
    steps: OrderedDict[int, OrderedDict[str, list[dict]]] = OrderedDict()
    for r in sorted(records, key=lambda r: (r["step"], r["sample"])):
        steps.setdefault(r["step"], OrderedDict()).setdefault(str(r["uid"]), []).append(r)

    legend = (
        '<div class="legend"><div><div class="bar"></div><div class="barlabels">'
        f'<span>{w_min:.2f} suppressed</span><span>1</span><span>boosted {w_max:.2f}</span></div></div>'
        '<div><span class="tok r" style="background:#fff;border:1px solid #ccc">reasoning token</span> '
        'coloured by weight w</div>'
        '<div><span class="tok nr">outside reasoning</span> marker / EOS / after answer: w = 1</div>'
        '<div><span class="tok nr ans">42</span> answer span</div>'
        + ('<div><span class="tok nr ctx">tool output</span> context (multi-turn): never weighted '
           '<span class="turn">▸ turn 2</span> a later assistant turn</div>' if any(r.get("turn") for r in records)
           else '')
        + '<div>hover a token: weight and importance</div></div>')
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f'<div class="meta">{len(records)} rollouts · {sum(len(g) for g in steps.values())} prompt groups · '
             f'steps {", ".join(map(str, steps)) or "none"} · correct = reward ≥ {correct_threshold:g}'
             f'{" · " + html.escape(source) if source else ""}</div>', legend]
    def mixed(rows: list[dict]) -> bool:
        return any(r["reward"] >= correct_threshold for r in rows) and any(r["reward"] < correct_threshold
                                                                            for r in rows)

    links = [f'<a href="#g-{step}-{html.escape(uid, quote=True)}">step {step} · {html.escape(uid[:8])}</a>'
             for step, groups in steps.items() for uid, rows in groups.items() if mixed(rows)]
    parts.append(f'<div class="meta">groups with both correct and incorrect rollouts: '
                 f'{" · ".join(links) if links else "none"}</div>')
    for step, groups in steps.items():
        due = sorted({r["due_step"] for rows in groups.values() for r in rows if "due_step" in r})
        stood_in = f' (the dump due at step {", ".join(map(str, due))})' if due else ""
        parts.append(f'<h2 id="step-{step}">step {step}{stood_in}</h2>')
        # groups with both correct and incorrect rollouts first: those are the comparisons worth reading
        for uid, rows in sorted(groups.items(), key=lambda kv: not mixed(kv[1])):
            good = [r for r in rows if r["reward"] >= correct_threshold]
            bad = [r for r in rows if r["reward"] < correct_threshold]
            mean = sum(r["reward"] for r in rows) / len(rows)
            anchor = f"g-{step}-{html.escape(uid, quote=True)}"
            parts.append(f'<div class="group" id="{anchor}"><div class="ghead">prompt group {html.escape(uid)} · '
                         f'{len(rows)} rollouts · {len(good)} correct · mean reward {mean:.2f}</div>')
            prompt = rows[0].get("prompt")
            if prompt:
                parts.append(f'<div class="prompt">{html.escape(str(prompt))}</div>')
            parts.append('<div class="cols">')
            for label, cls, subset, ok in (("correct", "ok", good, True), ("incorrect", "bad", bad, False)):
                cards = "".join(_rollout_card(r, w_min, w_max, ok) for r in subset) or \
                    f'<div class="none">no {label} rollouts</div>'
                parts.append(f'<div><div class="colhead {cls}">{label} ({len(subset)})</div>{cards}</div>')
            parts.append("</div></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_heatmap(source: str | os.PathLike, out: str | os.PathLike, *, max_steps: int | None = 10,
                  correct_threshold: float = 0.5, title: str = "OAR token weights") -> Path:
    """Render the dumps at ``source`` (a ``step_<N>.jsonl`` file or a folder of them) to the HTML file ``out``."""
    records = load_dump(source, max_steps)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(records, title=title, correct_threshold=correct_threshold, source=str(source)),
                   encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a step_<N>.jsonl dump or a folder of them")
    parser.add_argument("--out", required=True, help="HTML file to write")
    parser.add_argument("--max-steps", type=int, default=10, help="render the last N dumps of a folder (0 = all)")
    parser.add_argument("--correct-threshold", type=float, default=0.5, help="reward >= this counts as correct")
    parser.add_argument("--title", default="OAR token weights")
    args = parser.parse_args(argv)
    try:
        out = write_heatmap(args.source, args.out, max_steps=args.max_steps or None,
                            correct_threshold=args.correct_threshold, title=args.title)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"[heatmap] error: {exc}", file=sys.stderr)
        return 1
    print(f"[heatmap] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
