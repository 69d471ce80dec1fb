"""The verl-free core of oar_verl: the method's maths (docs/method.md) on any Hugging Face causal LM or backend.

    text/        answer spans and reasoning segments of token rows
    batch/       the attribution batch, outcome probes, seeds, row selection
    backends/    the pass interface and its runtimes (plain/FSDP module, Ulysses), budgets, collectives
    methods/     OAR-G, OAR-P (policies, mask operators), fisher, path; run_attribution runs the configured one
    reshaping/   importance -> gated weights -> advantages; the oar/* metrics
    fidelity/    the deletion-metric fidelity (offline report, in-step)
    checks/      start-up checks (sliding window, mask token)

The one way in (:mod:`oar_verl.core.pipeline`): :func:`oar_advantages`, or :func:`attribute` then :func:`reshape`.
Shapes in docstrings: B rows, P prompt / T response / L = P + T columns, N copies or selected rows, R reasoning
tokens, V vocabulary, H hidden size, K kept logit positions. Nothing here imports verl (a test guards it).
"""

from oar_verl.core.config import OARConfig, OARConfigError
from oar_verl.core.methods.attribution import module_backend, run_attribution
from oar_verl.core.pipeline import RowAttribution, attribute, oar_advantages, reshape
from oar_verl.core.preprocess import prepare_attribution
from oar_verl.core.reshaping.reshape import Reshaped

__all__ = ["OARConfig", "OARConfigError", "Reshaped", "RowAttribution", "attribute", "module_backend",
           "oar_advantages", "prepare_attribution", "reshape", "run_attribution"]
