"""Token heatmap: a recorded dump rendered to HTML, checked as parsed HTML and as rendered by headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from html.parser import HTMLParser

import pytest

from oar_verl.viz import heatmap

FIXTURES = Path(__file__).parent / "fixtures"

BOOST = "rgb({}, {}, {})".format(*heatmap.BOOST_RGB)
SUPPRESS = "rgb({}, {}, {})".format(*heatmap.SUPPRESS_RGB)


class _Tokens(HTMLParser):
    """Collects (classes, style, title, text) of every token span and the number of rollout cards per column."""

    def __init__(self):
        super().__init__()
        self.tokens, self.stack, self.columns = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "")
        if tag == "span" and "tok" in cls.split() and a.get("title"):
            self.tokens.append({"cls": cls.split(), "style": a.get("style", ""), "title": a["title"], "text": ""})
            self.stack.append(True)
        else:
            self.stack.append(False)
        if "colhead" in cls.split():
            self.columns.append(cls.split()[-1])

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1]:
            self.tokens[-1]["text"] += data


def parse(html_text: str) -> _Tokens:
    p = _Tokens()
    p.feed(html_text)
    return p


def test_weight_colour_is_diverging():
    assert heatmap.weight_colour(1.0, 0.1, 3.0) == (255, 255, 255)
    assert heatmap.weight_colour(3.0, 0.1, 3.0) == heatmap.BOOST_RGB
    assert heatmap.weight_colour(0.1, 0.1, 3.0) == heatmap.SUPPRESS_RGB
    mid = heatmap.weight_colour(2.0, 0.1, 3.0)
    assert mid[0] > mid[1] and 255 > mid[1] > heatmap.BOOST_RGB[1]  # reddish, lighter than the maximum


def test_render_fixture(tmp_path):
    records = heatmap.load_dump(FIXTURES)  # the folder: step_4.jsonl
    assert len(records) == 8
    page = parse(heatmap.render_html(records))
    assert len(page.tokens) == sum(len(r["tokens"]) for r in records)
    # correct and incorrect columns for both prompt groups
    assert page.columns == ["ok", "bad", "ok", "bad"]
    by_text = {}
    for t in page.tokens:
        by_text.setdefault(t["text"], []).append(t)
    # the boosted maximum (" ×", w=3) and the floor minimum (" bags", w=0.1) of sample 0 get the scale's end colours
    assert any(BOOST in t["style"] and "w=3.000" in t["title"] for t in by_text[" ×"])
    assert any(SUPPRESS in t["style"] and "w=0.100" in t["title"] for t in by_text[" bags"])
    # answer span marked, marker / EOS drawn as outside the reasoning (no weight colour), HTML escaped
    answers = [t for t in page.tokens if "ans" in t["cls"]]
    assert {t["text"] for t in answers} >= {"12", "7", "3", "\\sqrt{2}"}
    assert all("nr" in t["cls"] and not t["style"] for t in answers)
    assert all("nr" in t["cls"] for t in by_text["####"] + by_text["<|im_end|>"])
    assert "importance=" in page.tokens[0]["title"]
    assert by_text[".↵\n"]  # newline token visible
    # an index links to the groups that have both outcomes (here: both)
    assert 'href="#g-4-grp-apples"' in heatmap.render_html(records) and 'id="g-4-grp-sqrt"' in heatmap.render_html(
        records)


def test_a_dump_passed_on_names_its_due_step():
    records = heatmap.load_dump(FIXTURES)
    assert '<h2 id="step-4">step 4</h2>' in heatmap.render_html(records)
    passed_on = [{**r, "due_step": 2} for r in records]
    assert '<h2 id="step-4">step 4 (the dump due at step 2)</h2>' in heatmap.render_html(passed_on)


def test_mismatched_arrays_are_rejected(tmp_path):
    record = json.loads((FIXTURES / "step_4.jsonl").read_text().splitlines()[0])
    record["weight"] = record["weight"][:-1]
    bad = tmp_path / "step_1.jsonl"
    bad.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="len\\(weight\\)"):
        heatmap.load_dump(bad)


def test_cli_on_a_recorded_cpu_run_dump(tmp_path):
    """The trainer's own dump from the CPU e2e run (random tiny model: control characters, no answer span)."""
    out = tmp_path / "cpu.html"
    proc = subprocess.run([sys.executable, "-m", "oar_verl.viz.heatmap", str(FIXTURES / "cpu_run_dump"), "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text(encoding="utf-8")
    assert "\x00" not in text and "␀" in text
    assert "step 2" in text and "no answer span" in text
    missing = subprocess.run([sys.executable, "-m", "oar_verl.viz.heatmap", str(tmp_path / "nothing"), "--out",
                              str(tmp_path / "x.html")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no step_<N>.jsonl dumps" in missing.stderr


def _pixels_near(image, rgb, tol=6) -> int:
    import numpy as np

    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    return int((np.abs(pixels - np.array(rgb, dtype=np.int16)) <= tol).all(-1).sum())


def test_heatmap_in_headless_chromium(tmp_path, chromium):
    page = heatmap.write_heatmap(FIXTURES / "step_4.jsonl", tmp_path / "heatmap.html")
    dom = chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html_dom = dom.stdout
    for token in ("apples", "####", "&lt;|im_end|&gt;", "√", "18", "\\boxed{", "\\sqrt{2}", " &amp; more"):
        assert token in html_dom, token
    assert re.search(r'style="background:\s*' + re.escape(BOOST) + r'[^"]*"[^>]*>\s×<', html_dom)
    assert re.search(r'style="background:\s*' + re.escape(SUPPRESS) + r'[^"]*"[^>]*>\sbags<', html_dom)
    assert html_dom.count('class="tok nr ans"') == 8 + 1  # 8 answer tokens + the legend's sample

    from PIL import Image

    shot = tmp_path / "heatmap.png"
    proc = chromium(page, f"--screenshot={shot}", "--window-size=1400,1100")
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1100)
    # token backgrounds at the two ends of the scale are painted: the legend's gradient alone has ~56 such pixels at
    # this window size, the one boosted maximum token (" ×") ~230, the suppressed tokens together over a thousand
    assert _pixels_near(image, heatmap.BOOST_RGB) > 150
    assert _pixels_near(image, heatmap.SUPPRESS_RGB) > 500


def test_multi_turn_rows_mark_tool_outputs_and_turns(tmp_path):
    """A multi-turn record (docs/multi_turn.md): its tool output boxed as context (never coloured by a weight), a
    marker where the second turn starts, the card naming turns and tool outputs; a single-turn record unchanged."""
    tokens = ["<call>", "3+4", "<|im_end|>", "\n<tool>", "7", "</tool>\n", "The answer is ", "7", "<|im_end|>"]
    record = {"step": 1, "uid": "u", "sample": 0, "reward": 1.0, "advantage": 0.5, "tokens": tokens,
              "importance": [0.2, 0.9, 0, 0, 0, 0, 0.1, 0, 0], "weight": [0.5, 1.5, 1, 1, 1, 1, 1.0, 1, 1],
              "reasoning": [1, 1, 0, 0, 0, 0, 1, 0, 0], "answer": [0, 0, 0, 0, 0, 0, 0, 1, 0],
              "span_found": True, "turn": [0, 0, 0, -1, -1, -1, 1, 1, 1]}
    path = tmp_path / "step_1.jsonl"
    path.write_text(json.dumps(record) + "\n")
    page = heatmap.render_html(heatmap.load_dump(path))
    toks = parse(page).tokens
    context = [t for t in toks if "ctx" in t["cls"]]
    assert [t["text"] for t in context] == ["↵\n<tool>", "7", "</tool>↵\n"]
    assert all(not t["style"] and "context" in t["title"] for t in context)
    assert page.count('<span class="turn">') == 2  # one marker in the row, one in the legend
    assert "answer span found (final turn) · 2 turns · 1 tool rounds" in page
    earlier = dict(record, answer=[0, 1, 0, 0, 0, 0, 0, 0, 0])  # answered in the first turn
    path.write_text(json.dumps(earlier) + "\n")
    assert "answer span found (turn 1) · 2 turns" in heatmap.render_html(heatmap.load_dump(path))
    path.write_text(json.dumps(record) + "\n")
    bad = dict(record, turn=[0])
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="len\\(turn\\)"):
        heatmap.load_dump(path)
    single = {k: v for k, v in record.items() if k != "turn"}
    path.write_text(json.dumps(single) + "\n")
    page = heatmap.render_html(heatmap.load_dump(path))
    assert '<span class="turn">' not in page and not any("ctx" in t["cls"] for t in parse(page).tokens)
