"""The thin verl layer of oar_verl: estimator registration, the actor-worker attribution hook, trainer glue and config.

This is the only part of the package that imports verl. verl imports :mod:`oar_verl.integration.plugin` in every
process through the ``verl.plugins`` entry point.
"""
