"""Benchmarks of oar_verl, run from the repository root as modules (``python -m research.<name>``): attribution
speed and memory, trainer overhead, attribution fidelity and a GRPO-vs-OAR learning study (README, research/docs/evidence.md)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
