"""``algorithm.oar.mode=auto``: the run scores candidate attributions against free controls on its own rows and
attributes with the cheapest one that beats them (docs/auto.md). No verl here: the integrations feed the selector."""

from oar_verl.core.auto.evidence import Evidence, candidate_metrics
from oar_verl.core.auto.rule import BANDS, DEFAULT_CONTROLS, Decision, bands_of, decide, gains
from oar_verl.core.auto.selector import FALLBACKS, UNIFORM, AutoSelector, AutoSettings

__all__ = ["BANDS", "DEFAULT_CONTROLS", "FALLBACKS", "UNIFORM", "AutoSelector", "AutoSettings", "Decision", "Evidence",
           "bands_of", "candidate_metrics", "decide", "gains"]
