"""The thin verl layer of oar_verl: estimator registration, the actor-worker attribution hook, trainer glue and config.

This is the only part of the package that imports verl. verl imports :mod:`oar_verl.integration.plugin` in every
process through the ``verl.plugins`` entry point.
"""

# verl first: ``import verl`` loads our plugin, which imports the trainer modules, which import one another. Were verl
# first imported from inside one of those modules, the plugin would meet it half-loaded (an import cycle, "plugin
# failed to load"); imported here, before any module of this package runs, the plugin always loads whole.
import verl  # noqa: E402,F401
