"""oar_verl: Outcome-grounded Advantage Reshaping (OAR, arXiv 2601.07408) for verl.

``oar_verl.core`` holds the maths and imports no verl; ``oar_verl.integration`` is the thin verl layer (estimator,
worker hook, trainers, config), loaded by verl through the ``verl.plugins`` entry point.
"""

__version__ = "0.1.0"
