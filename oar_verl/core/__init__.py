"""The verl-free core of oar_verl: the method's maths (docs/method.md), on any Hugging Face causal LM.

Nothing under this package imports verl (a test guards it). Every function works on padded batches with masks; the
shapes in docstrings use one notation:

    B  rows (sequences) in a batch            N  masked copies (OAR-P) or selected rows
    P  prompt columns (left-padded)           T  response columns (right-padded)
    L  full-sequence columns, L = P + T       R  reasoning tokens of a sequence
    V  vocabulary size                        H  hidden size
    K  kept logit positions (probe positions of a forward)

Modules, in the order a step uses them: ``config`` (OARConfig), ``token_bytes`` / ``answer_patterns`` / ``spans``
(answer spans by byte offsets), ``layout`` (verl's padded layout → attribution batch), ``probes`` (the outcome
probes), ``preprocess`` (rows → attribution inputs), ``engine`` (the backend interface methods are written on),
``perturbation`` (OAR-P) with ``policies`` (exact, segment, hierarchical, auto), ``gradient`` (OAR-G), the backends
``backend_hf`` (a plain or FSDP module) and ``backend_ulysses`` (sequence-sharded), ``attribution`` (one entry point
for every method and backend), ``gating`` (importance → weights), ``metrics``; ``reference`` is the plain
per-position specification the fast paths are tested against.
"""

from oar_verl.core.attribution import collective_rounds, probe_kinds, response_importance, run_attribution
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.gating import TokenWeights, oar_token_weights
from oar_verl.core.gradient import oar_g_importance, sequence_seeds
from oar_verl.core.layout import AttributionBatch, build_attribution_batch
from oar_verl.core.metrics import oar_metrics
from oar_verl.core.perturbation import oar_p_importance
from oar_verl.core.preprocess import PreparedAttribution, prepare_attribution
from oar_verl.core.probes import ProbeKind

__all__ = [
    "AttributionBatch", "OARConfig", "OARConfigError", "PreparedAttribution", "ProbeKind", "TokenWeights",
    "build_attribution_batch", "collective_rounds", "oar_g_importance", "oar_metrics", "oar_p_importance",
    "oar_token_weights", "prepare_attribution", "probe_kinds", "response_importance", "run_attribution",
    "sequence_seeds",
]
