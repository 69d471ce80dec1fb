"""The verl-free core of oar_verl: answer spans, outcome probes, OAR-P, OAR-G, gating and metrics.

Nothing under this package imports verl; the attribution functions take any Hugging Face causal LM.
"""

from oar_verl.core.attribution import collective_rounds, probe_kinds, response_importance, run_attribution
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.gating import TokenWeights, oar_token_weights
from oar_verl.core.gradient import oar_g_importance, sequence_seeds
from oar_verl.core.layout import AttributionBatch, build_attribution_batch
from oar_verl.core.metrics import oar_metrics
from oar_verl.core.perturbation import oar_p_importance

__all__ = [
    "AttributionBatch", "OARConfig", "OARConfigError", "TokenWeights", "build_attribution_batch",
    "collective_rounds", "oar_g_importance", "oar_metrics", "oar_p_importance", "oar_token_weights",
    "probe_kinds", "response_importance", "run_attribution", "sequence_seeds",
]
