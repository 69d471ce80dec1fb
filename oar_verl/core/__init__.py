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
probes), ``preprocess`` (rows → attribution inputs), ``backend`` (the interface methods are written on), ``methods``
(their contract and registry), ``perturbation`` (OAR-P) with ``policies`` (exact, segment, hierarchical, auto),
``gradient`` (OAR-G), ``fisher``, the backends ``backend_hf`` (a plain or FSDP module) and ``backend_ulysses``
(sequence-sharded), ``attribution`` (the one entry point), ``selection``, ``gating`` and ``reshape`` (importance →
weights → advantages, for every integration), ``metrics``, ``collectives``; ``reference`` is the plain per-position
specification the fast paths are tested against.

Public API: :func:`run_attribution` on a backend (:func:`module_backend` of a Hugging Face module), or
:func:`response_importance` on verl's padded layout; :func:`reshape_advantages` turns importance into advantages.
"""

from oar_verl.core.methods.attribution import module_backend, probe_kinds, response_importance, run_attribution
from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.reshaping.gating import TokenWeights, oar_token_weights
from oar_verl.core.methods.gradient import sequence_seeds
from oar_verl.core.batch.layout import AttributionBatch, build_attribution_batch
from oar_verl.core.methods.contract import AttributionResult
from oar_verl.core.reshaping.metrics import oar_metrics
from oar_verl.core.preprocess import PreparedAttribution, prepare_attribution
from oar_verl.core.batch.probes import ProbeKind
from oar_verl.core.reshaping.reshape import Reshaped, attribution_rows, reshape_advantages

__all__ = [
    "AttributionBatch", "AttributionResult", "OARConfig", "OARConfigError", "PreparedAttribution", "ProbeKind",
    "Reshaped", "TokenWeights", "attribution_rows", "build_attribution_batch", "module_backend", "oar_metrics",
    "oar_token_weights", "prepare_attribution", "probe_kinds", "reshape_advantages", "response_importance",
    "run_attribution", "sequence_seeds",
]
