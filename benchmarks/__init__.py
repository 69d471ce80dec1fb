"""Benchmarks of oar_verl: attribution fidelity and a GRPO-vs-OAR learning study (see docs/evidence.md)."""
