"""The CPU quickstart (``python -m oar_verl.quickstart``): verl's real trainer with OAR on a tiny offline model, and
what it needs to run on CPU — the verl ``cpu`` platform, the launcher's settings, the tiny assets and the last-digit
task. Never imported by the glue that runs on GPU clusters (a test guards it)."""
